"""What the data plane asks of the worker it runs on (``Host``), in one place.

A run manager (``manager.DataPlane``) and its runs know nothing of Dask: the worker plugin
hands them one ``Host`` (``plugins.worker.WorkerHost``), and tests hand them one of plain
functions. Its calls are few and plain: run a block, find or load a block's spec, say which
plan a model is at, send a one-way message to a peer (or relay one down this worker's own
link), check a message's ticket, and say whether a prompt's later chunk finds its cache here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Protocol

import torch

from ...lower.blocks import BlockSpec

Imports = Mapping[str, torch.Tensor]
Outcome = tuple[dict[str, torch.Tensor], dict[str, Any]]      # a block's outputs, and the record of its run
ComputeArgs = tuple[str, int, int, int, Imports]              # model, version, request, block, its imports


class Host(Protocol):
    """The worker a data plane runs on (see module doc). ``executor``: its compute threads (an
    ``ordered.OrderedExecutor`` on a worker: the oldest run's blocks first)."""

    @property
    def address(self) -> str:
        """The worker's address."""

    @property
    def executor(self) -> Executor:
        """Its compute threads."""

    def compute(self, model: str, version: int, request: int, block: int, imports: Imports) -> Outcome:
        """Run a block (on a compute thread, or on the event loop for a quick one): its outputs
        and the record of its run (``timed``)."""

    def spec_of(self, model: str, version: int, block: int) -> BlockSpec | None:
        """The spec of a block resident here at ``version``, without loading anything; else None."""

    def load_spec(self, model: str, version: int, block: int) -> BlockSpec:
        """The spec of a block, loading the block (off the event loop: it may read files)."""

    def describe(self, model: str, version: int, block: int) -> BlockSpec:
        """The spec of a block without loading it (off the event loop): where its outputs go, so a
        block that failed to load tells the blocks after it."""

    def version_of(self, model: str) -> int:
        """The plan version of ``model`` held here (-1 for none)."""

    def ready(self, model: str, version: int, block: int, imports: Imports) -> bool:
        """Whether a block of a prompt's later chunk finds its sessions cached here up to its first
        slot (the run holds it until then)."""

    def send(self, address: str, op: str, **msg: Any) -> Awaitable[Any]:
        """A one-way message (``seabiscuit_dp_push|feed|fail``) to another worker: the future of its
        being on its way."""

    def forward(self, address: str, msg: dict[str, Any]) -> Awaitable[Any]:
        """A message this worker relays, down its own link to ``address`` (never relayed again)."""

    async def check(self, model: str, ticket: Any) -> str:
        """``ticket`` if it is ``model``'s, else ``AccessDenied``."""


def timed(compute: Callable[..., tuple[dict[str, torch.Tensor], str]], address: str
          ) -> Callable[[str, int, int, int, Imports], Outcome]:
    """``compute`` (``ResidentBlocks.run``-like: outputs and how) with the record of each run."""
    def run(model: str, version: int, request: int, block: int, imports: Imports) -> Outcome:
        started, t0 = time.time(), time.perf_counter()
        out, how = compute(model, version, request, block, imports)
        return out, {"model": model, "version": version, "request": request, "block": block, "how": how,
                     "compute_s": time.perf_counter() - t0, "start": started, "worker": address}
    return run
