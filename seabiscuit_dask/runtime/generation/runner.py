"""What the engine calls of a deployment (``Runner``), and ``LocalRunner``, the in-process one.

A runner runs step programs (``trace.decoder``) of a given shape on the inputs of
``inputs.step_inputs``: on the cluster for a ``DistributedModel``, in this process for
``LocalRunner`` (the reference of a distributed run, and what tests drive). Its
capabilities are attributes the engine reads, never probes: whether it queues a
step behind another (``chains_steps``), whether it sends a prompt's chunks at once
(``pipelines_prefill``) and through how many stages they flow (``prefill_stages``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...decompose import decompose
from ...errors import BadInput, LaneStopped
from ...ir import OpGraph
from ...lower.kvcache import KVStore, using
from ...quantize import quantize
from ...trace.decoder import trace_step
from ..dataplane.loops import Edit, Lane, Loop, picked_here
from ..local import run_local
from .sampling import RowPick, greedy

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

    @property
    def edits_loops(self) -> bool:
        """Whether ``start_lane`` starts decode loops whose rows change as they run."""

    def start_lane(self, batch: int, feed: StepFeed, steps: int, left: list[int],
                   picks: list[RowPick | None] | None = None) -> Handle:
        """Start a decode loop of ``steps`` steps whose rows change as it runs (a lane,
        ``dataplane.Lane``), fed ``feed``; ``left``: each row's steps, the first included (-1: no
        bound); ``picks``: each row's ``RowPick`` (None: greedy). Its first step's handle, each
        one's ``next`` the step after it (None: the last); None where it cannot."""

    def edit_lane(self, handle: Handle, edits: list[Edit], after: Any = None) -> Any:
        """Edit the rows of the lane ``handle`` is a step of (each (row, session or -1 to empty it,
        first slot, token, steps or -1, and its ``RowPick``'s message or None)), after the edits
        of ``after``; a future of the count of edit messages the lane took with these (0: it runs
        no more steps)."""

    def step_future(self, handle: Handle) -> Any:
        """A future that is done once a submitted step can be read without waiting (None: unknown)."""

    def step_rows(self, handle: Handle, picks: Sequence[RowPick | None] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor | None, int, dict[str, torch.Tensor]]:
        """The tokens (batch,) of a submitted step, and for a lane's later step the sessions it ran
        (batch,) and the edit messages it was built with (None and 0 where its caller fed it), and
        the log-probabilities its rows asked for (``dataplane.loops.pick_rows``); ``picks``, the
        rows' picks of a lane's first step, where it is picked here."""

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

    def __init__(self, model: Any, budget: int | str | None = None, lanes: bool = False,
                 quantize: str | None = None) -> None:
        self.model = model
        self.budget = budget
        self.quantize = quantize        # NOTE: its programs' weights as ``distribute(quantize=)`` holds them
        self.edits_loops = lanes        # NOTE: lanes run here as on the workers, a step as it is read
        self.store = KVStore()
        self.programs: dict[tuple[int, int], OpGraph] = {}
        self._lock = threading.Lock()           # NOTE: torch.export is not thread-safe

    def program(self, batch: int, length: int) -> OpGraph:
        key = (batch, length)
        with self._lock:
            if key not in self.programs:
                self.programs[key] = decompose(quantize(trace_step(self.model, batch, length), self.quantize),
                                               self.budget)
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

    def start_lane(self, batch: int, feed: StepFeed, steps: int, left: list[int],
                   picks: list[RowPick | None] | None = None) -> Handle:
        return _LocalLane(self, batch, feed, steps, left, picks or []).step(0)

    def edit_lane(self, handle: Handle, edits: list[Edit], after: Any = None) -> Any:
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(handle.lane.loop.lane.edit(edits))
        return done

    def step_future(self, handle: Handle) -> Any:
        return None         # NOTE: a step here runs as it is read

    def step_rows(self, handle: Handle, picks: Sequence[RowPick | None] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor | None, int, dict[str, torch.Tensor]]:
        if isinstance(handle, _LocalStep):
            return handle.lane.read(handle.index)
        tokens, extra = picked_here(self.step_result(handle), picks)
        return torch.from_numpy(tokens), None, 0, extra

    def end_sessions(self, sessions: Sequence[int], renamed: Sequence[tuple[int, int, int]] = (),
                     forked: Sequence[tuple[int, int, int]] = ()) -> None:
        for src, dst, keep in forked:
            self.store.fork("local", src, dst, keep)
        for old, new, keep in renamed:
            self.store.rename("local", old, new, keep)
        self.store.drop("local", set(sessions))

    def recover(self, error: BaseException) -> None:
        raise error


class _LocalLane:
    """A lane run in this process (``LocalRunner``): each step computed as it is read, and the step
    after it built right then, as the worker that makes a lane's logits builds it
    (``dataplane.Loop.following``, with the edits its ``Lane`` holds by then)."""

    def __init__(self, runner: LocalRunner, batch: int, feed: StepFeed, steps: int, left: list[int],
                 picks: list[RowPick | None]) -> None:
        self.runner, self.batch, self.steps = runner, batch, steps
        lane = Lane(0, [n - 1 if n > 0 else n for n in left], picks)       # NOTE: its first step runs as read
        self.loop = Loop(list(range(1, steps)), [], "", feed, lane=lane)
        self.at = 0
        self.next: StepFeed | None = feed
        self.applied = 0            # edit messages the next step was built with

    def step(self, index: int) -> _LocalStep:
        return _LocalStep(self, index)

    def read(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None, int, dict[str, torch.Tensor]]:
        if index != self.at:
            raise BadInput(f"a lane's steps are read in order: step {index} asked after {self.at}")
        inputs, applied = self.next, self.applied
        if inputs is None:
            raise LaneStopped("every row of the lane ended, or it ran its steps: its loop stopped")
        logits = self.runner.run_step(self.batch, 1, inputs)
        self.at += 1
        self.next = None
        lane = self.loop.lane
        tokens, extra = self.loop.pick(logits.unsqueeze(1))
        if self.loop.requests and lane is not None:
            request = self.loop.requests[0]
            nxt, self.loop = self.loop.following(logits.unsqueeze(1))
            self.applied = lane.applied_by(request)
            if bool((nxt["sb_sessions"] >= 0).any()):
                self.next = nxt
        if index == 0:
            return torch.from_numpy(tokens), None, 0, extra
        return torch.from_numpy(tokens), inputs["sb_sessions"], applied, extra


@dataclass(frozen=True)
class _LocalStep:
    lane: _LocalLane
    index: int

    @property
    def next(self) -> _LocalStep | None:
        return _LocalStep(self.lane, self.index + 1) if self.index + 1 < self.lane.steps else None
