"""The state of one request (a *run*) on one worker: which of its blocks have their inputs,
which ran, which outputs wait for the caller. Plain Python: ``DataPlane`` drives it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import WorkerLost
from ...lower.blocks import BlockSpec


class RunFailed(WorkerLost):
    """A request failed on the data plane (a peer could not be reached or failed it, a worker
    moved to a new plan): every participant drops it, and the caller runs it again under a
    new id."""


class StaleRun(RunFailed):
    """A data-plane message names a plan version older than the one the worker holds: the
    caller takes the current plan and sends the request again."""


WAITING, RUNNING, DONE = "waiting", "running", "done"


@dataclass(eq=False)
class BlockRun:
    """One block of one run here: its spec (once known), the imports received, its state."""

    block: int
    spec: BlockSpec | None = None
    imports: dict[str, torch.Tensor] = field(default_factory=dict)
    state: str = WAITING
    resolving: bool = False               # its spec is being loaded

    @property
    def ready(self) -> bool:
        return self.spec is not None and self.state == WAITING and all(t in self.imports
                                                                       for t in self.spec.imports)

    def missing(self) -> list[str]:
        return [t for t in (self.spec.imports if self.spec is not None else ()) if t not in self.imports]


@dataclass(eq=False)
class Run:
    """One request of one model on one worker (see module doc)."""

    model: str
    version: int
    request: int
    created: float = field(default_factory=time.monotonic)
    blocks: dict[int, BlockRun] = field(default_factory=dict)
    outputs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[Any] = field(default_factory=set)
    wanted: set[int] = field(default_factory=set)     # blocks a caller waits here for

    def block(self, b: int) -> BlockRun:
        br = self.blocks.get(b)
        if br is None:
            br = self.blocks[b] = BlockRun(b)
        return br

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.notify()

    @property
    def finished(self) -> bool:
        """Every block that was named here ran, and the caller took every output it waits for."""
        return all(b.state == DONE for b in self.blocks.values()) and not self.outputs and not self.wanted

    @property
    def held_bytes(self) -> int:
        held = [t for b in self.blocks.values() for t in b.imports.values()]
        held += [t for out in self.outputs.values() for t in out.values()]
        return sum(int(t.numel() * t.element_size()) for t in held)

    def where(self) -> str:
        return f"request {self.request} of model {self.model} (plan v{self.version})"
