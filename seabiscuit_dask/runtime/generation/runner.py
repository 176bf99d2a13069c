"""What the engine calls of a deployment (``Runner``), and ``LocalRunner``, the in-process one.

A runner runs step programs (``trace.decoder``) of a given shape on the inputs of
``inputs.step_inputs``: on the cluster for a ``DistributedModel``, in this process for
``LocalRunner`` (the reference of a distributed run, and what tests drive). Its
capabilities are attributes the engine reads, never probes: whether it queues a
step behind another (``chains_steps``), whether it sends a prompt's chunks at once
(``pipelines_prefill``) and through how many stages they flow (``prefill_stages``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ...decompose import decompose
from ...ir import OpGraph
from ...lower.kvcache import KVStore, using
from ...trace.decoder import trace_step
from ..local import run_local
from .sampling import greedy

StepFeed = dict[str, torch.Tensor]
Handle = Any      # NOTE: a step a runner has in flight: the engine only hands it back


class Runner(Protocol):
    """What the engine needs of a deployment."""

    @property
    def chains_steps(self) -> bool:
        """Whether ``submit_step(after=...)`` queues a step behind another (its tokens picked on
        the workers from the logits of the one before)."""

    @property
    def pipelines_prefill(self) -> bool:
        """Whether ``submit_chunk`` sends a prompt's next chunk before the one before has finished."""

    @property
    def prefill_stages(self) -> int:
        """The workers a pipelined prompt's chunks flow through, one after another."""

    @property
    def prefill_room(self) -> tuple[int, int]:
        """(tokens, rows) a prefill step of several prompts may hold with no program built for it
        (0 tokens: the scheduler prefills prompts one by one)."""

    def prepare(self, batch: int, length: int) -> Any:
        """Build the step program of this shape now, so step times leave its one-off cost out; it is
        returned, where one program serves several shapes (else None)."""

    def run_step(self, batch: int, length: int, feed: StepFeed) -> torch.Tensor:
        """Logits (batch, vocab) of the last position of each row."""

    def submit_step(self, batch: int, length: int, feed: Callable[[], StepFeed], after: Handle = None,
                    steps: int = 1) -> Handle:
        """Submit a step of the inputs ``feed()`` makes (called only where the step is sent: the next
        step of a decode loop on the workers is running already); with ``after``, its input_ids
        are the greedy tokens of that step (None: no step can follow it so); ``steps``: greedy
        steps the caller will take at least (a runner may start them all at once)."""

    def step_result(self, handle: Handle) -> torch.Tensor:
        """The logits (batch, vocab) of a submitted step."""

    def step_tokens(self, handle: Handle) -> torch.Tensor:
        """The greedy tokens (rows,) of a submitted step (all a queued greedy step is read for)."""

    def discard(self, handle: Handle) -> None:
        """Let go of a submitted step."""

    def submit_chunk(self, length: int, feed: StepFeed, follows: Handle = None) -> Handle:
        """Submit one prefill chunk of one session; ``follows``: the chunk before it, which may
        still run (the runner orders their cache writes)."""

    def end_sessions(self, sessions: Sequence[int], renamed: Sequence[tuple[int, int, int]] = (),
                     forked: Sequence[tuple[int, int, int]] = ()) -> None:
        """Free the cache of ``sessions`` everywhere, rename those of ``renamed`` ((old, new, slots
        kept) each, ``KVStore.rename``), and start those of ``forked`` ((source, new, slots) each,
        ``KVStore.fork``) with a copy of another's first slots."""

    def recover(self, error: BaseException) -> None:
        """Return once a step may be tried again after ``error`` (a worker loss), else raise."""


class LocalRunner:
    """Step programs run in this process, with a KV store of its own: the reference of a
    distributed run, and what ``bench_generate`` compares Dask's cost with. A step runs when it
    is submitted; none is queued behind another, and a prompt's chunks run one by one."""

    chains_steps = False
    pipelines_prefill = False
    prefill_stages = 1
    prefill_room = (0, 0)

    def __init__(self, model: Any, budget: int | str | None = None) -> None:
        self.model = model
        self.budget = budget
        self.store = KVStore()
        self.programs: dict[tuple[int, int], OpGraph] = {}
        self._lock = threading.Lock()           # NOTE: torch.export is not thread-safe

    def program(self, batch: int, length: int) -> OpGraph:
        key = (batch, length)
        with self._lock:
            if key not in self.programs:
                self.programs[key] = decompose(trace_step(self.model, batch, length), self.budget)
            return self.programs[key]

    def prepare(self, batch: int, length: int) -> None:
        """Nothing: a program is built as its first step runs (``program``)."""

    def run_step(self, batch: int, length: int, feed: StepFeed) -> torch.Tensor:
        graph = self.program(batch, length)
        with using(self.store, "local"):
            out = run_local(graph, *[feed[n] for n in graph.inputs], weights=self.model)
        return out[:, -1]

    def submit_step(self, batch: int, length: int, feed: Callable[[], StepFeed], after: Handle = None,
                    steps: int = 1) -> Handle:
        return None if after is not None else self.run_step(batch, length, feed())

    def step_result(self, handle: Handle) -> torch.Tensor:
        return handle

    def step_tokens(self, handle: Handle) -> torch.Tensor:
        return greedy(self.step_result(handle))

    def discard(self, handle: Handle) -> None:
        return None

    def submit_chunk(self, length: int, feed: StepFeed, follows: Handle = None) -> Handle:
        return self.run_step(1, length, feed)

    def end_sessions(self, sessions: Sequence[int], renamed: Sequence[tuple[int, int, int]] = (),
                     forked: Sequence[tuple[int, int, int]] = ()) -> None:
        for src, dst, keep in forked:
            self.store.fork("local", src, dst, keep)
        for old, new, keep in renamed:
            self.store.rename("local", old, new, keep)
        self.store.drop("local", set(sessions))

    def recover(self, error: BaseException) -> None:
        raise error
