"""The state of one request (a *run*) on one worker: which of its blocks have their inputs,
which ran, which outputs wait for the caller. Plain Python: ``DataPlane`` drives it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import SeaBiscuitError, WorkerLost
from ...lower.blocks import BlockSpec

WAITING, RUNNING, DONE = "waiting", "running", "done"


@dataclass(eq=False)
class BlockRun:
    """One block of one run here: its spec (once known), the imports received, its state."""

    block: int
    spec: BlockSpec | None = None
    imports: dict[str, torch.Tensor] = field(default_factory=dict)
    state: str = WAITING
    resolving: bool = False               # its spec is being loaded
    deferred: bool = False                # ready, held until the run it follows wrote its cache here
    task: asyncio.Task[Any] | None = None  # the task that runs it on the event loop, if it does

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
    after: int = -1                   # the request (a prompt's chunk before) whose cache writes it needs
    ticket: str = ""                  # the caller's, as its messages carried it: failures spread with it
    # NOTE: a decode step's inputs of a peer's blocks, to go with this run's first push to that peer
    riders: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = field(default_factory=dict)

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

    def progress(self) -> list[int]:
        """[blocks running or about to (or held behind the run they follow, which moves),
        blocks done, tensors received, outputs waiting]."""
        return [sum(b.state == RUNNING or b.resolving or b.deferred for b in self.blocks.values()),
                sum(b.state == DONE for b in self.blocks.values()),
                sum(len(b.imports) for b in self.blocks.values()), len(self.outputs)]

    @property
    def held_bytes(self) -> int:
        held = [t for b in self.blocks.values() for t in b.imports.values()]
        held += [t for out in self.outputs.values() for t in out.values()]
        held += [t for feeds in self.riders.values() for _, ts in feeds for t in ts.values()]
        return sum(int(t.numel() * t.element_size()) for t in held)

    def where(self) -> str:
        return f"request {self.request} of model {self.model} (plan v{self.version})"


@dataclass(eq=False)
class Loop:
    """A decode loop at the worker that makes a step's logits: the steps still to run after it,
    each fed from the greedy tokens of the one before (no caller in between)."""

    requests: list[int]                                   # the next steps' request ids, in order
    route: list[tuple[str, list[tuple[int, tuple[str, ...]]]]]   # worker -> its blocks and their inputs
    logits: str                                           # the output tile the tokens come from
    inputs: dict[str, torch.Tensor]                       # this step's inputs (positions, sessions, ...)
    ahead: tuple[Any, bool, dict[str, torch.Tensor]] | None = None   # ``prepare``'s

    def prepare(self) -> None:
        """Work out what the next step reads but its tokens: which rows are live (pad rows stay as
        they are) and their positions one on. ``following`` does it where it was not done before;
        the worker does it once the step that reads these inputs is on its way (idle time: the
        critical path of the next step then only picks tokens)."""
        if self.ahead is not None:
            return
        x = self.inputs
        # NOTE: in numpy: these few ops come right after a block that streamed its weights through
        # the caches, where each of torch's costs 10x its warm time (0.2 ms in all, numpy 0.15)
        step = (x["sb_sessions"].numpy() >= 0).astype(np.int64)    # NOTE: 1 for a live row, 0 for a pad
        self.ahead = (step, bool(step.all()), {
            "position_ids": torch.from_numpy(x["position_ids"].numpy() + step.reshape(-1, 1)),
            "sb_sessions": x["sb_sessions"], "sb_start": torch.from_numpy(x["sb_start"].numpy() + step),
            "sb_valid": x["sb_valid"]})

    def following(self, logits: torch.Tensor) -> tuple[dict[str, torch.Tensor], Loop]:
        """The next step's inputs (greedy tokens, positions one on; pad rows stay as they are) and
        the loop after it."""
        self.prepare()
        assert self.ahead is not None
        step, live, rest = self.ahead
        tokens = greedy_numpy(logits)
        nxt = {"input_ids": torch.from_numpy((tokens if live else tokens * step).reshape(-1, 1)), **rest}
        return nxt, Loop(self.requests[1:], self.route, self.logits, nxt)


FLOATS = (torch.float32, torch.float64)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(B, L, V) logits -> (B,) int64 tokens, the last position's argmax: what a decode loop feeds
    on, and what its caller collects in place of the logits."""
    if logits.is_cpu and logits.dtype in FLOATS:
        return torch.from_numpy(greedy_numpy(logits))
    if logits.dim() != 3 or not logits.is_floating_point():
        raise SeaBiscuitError(f"greedy tokens need (batch, length, vocab) float logits, got "
                              f"{tuple(logits.shape)} {logits.dtype}")
    return logits[:, -1].detach().argmax(dim=-1).to(torch.long)


def greedy_numpy(logits: torch.Tensor) -> np.ndarray:
    """``greedy`` as a (B,) int64 numpy array: where ``logits`` are float32 or float64 on the CPU,
    numpy's argmax straight on their memory (a row of SmolLM2's 49k logits: 6 against torch's
    45 us; each of the torch calls it saves a cold 10-40 us right after a block run). Both take the
    first of equal maxima."""
    if not (logits.is_cpu and logits.dtype in FLOATS):
        return greedy(logits).cpu().numpy()
    a = (logits.detach() if logits.requires_grad else logits).numpy()
    if a.ndim != 3:
        raise SeaBiscuitError(f"greedy tokens need (batch, length, vocab) float logits, got {a.shape} "
                              f"{logits.dtype}")
    return a[:, -1].argmax(axis=-1).astype(np.int64, copy=False)


def decode_loop(msg: Any) -> Loop | None:
    """A ``Loop`` from its message (``dataplane.client.start``); None for none. The worker
    feeds only blocks of the model's own plan (its route) and only these five step inputs."""
    if not msg:
        return None
    try:
        inputs = {str(k): v for k, v in dict(msg["inputs"]).items()}
        if set(inputs) != set(STEP_INPUTS) or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
            raise ValueError(f"inputs {sorted(inputs)}")
        route = [(str(a), [(int(b), tuple(str(t) for t in names)) for b, names in feeds])
                 for a, feeds in msg["route"]]
        if any(t not in STEP_INPUTS for _, feeds in route for _, names in feeds for t in names):
            raise ValueError("a route names other inputs")
        return Loop([int(r) for r in msg["requests"]][:4096], route, str(msg["logits"]), inputs)
    except (KeyError, TypeError, ValueError) as e:
        raise WorkerLost(f"a decode loop's message is malformed ({e}): the step runs once") from e


STEP_INPUTS = ("input_ids", "position_ids", "sb_sessions", "sb_start", "sb_valid")
