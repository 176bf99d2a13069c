"""The executor: carries out a step's record through the runner, and nothing more.

It decides nothing: the calls admitted, their chunks, the decode groups and which of
them are queued all come in the record (``output.py``). What it owns is the doing:
the threads that run prompts and groups side by side, the steps a queued group has in
flight (``_ahead``: a group with the same sessions next step finds its step there),
and the retries a worker loss asks for: a step that finds a session's cache missing
(its worker was lost and the blocks moved) waits for the new plan, replays the
session's tokens (the scheduler cuts the replay, ``Scheduler.replay``; cached slots
are read, missing ones rebuilt) and runs again, so the answer is an undisturbed run's.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import STALE_TRIES, BadInput, LaneStopped, StaleRun, WorkerLost, restless
from ...lower.kvcache import CacheLost
from ..dataplane.loops import Edit, picked_here
from .inputs import SESSIONS, lane_inputs, step_inputs
from .output import Chunk, DecodeGroup, LaneStep, Prefill, PrefillGroup, SchedulerOutput
from .runner import Handle, Runner, StepFeed
from .sampling import RowPick, greedy

CHUNKS_IN_FLIGHT = 8    # NOTE: a prompt's chunks sent and not yet answered: a pipeline of a few stages
#                         stays full, and a huge prompt holds the activations of only so many
STEP_TRIES = 4          # NOTE: a step's tries after worker losses, each after a replay
Replay = Callable[[int, int, int], Prefill]      # (session, up to slot, prompts at once) -> its chunks
Result = torch.Tensor | BaseException
# NOTE: (tokens, sessions, sessions gone for good, the log-probabilities its rows asked for:
# ``dataplane.loops.pick_rows``) of a lane's step, the error that ended it, None (its loop stopped),
# or ``NOT_READ`` (its step is not ready yet)
class NotRead:
    """A lane's step not read this round (it was not ready)."""


NOT_READ = NotRead()
LaneRead = tuple[torch.Tensor, torch.Tensor, set[int], dict[str, torch.Tensor]]
LaneResult = LaneRead | NotRead | BaseException | None
LANE_WAIT_S = 1.0       # NOTE: how long a round waits for any lane's step before it reads the first's


@dataclass(eq=False)
class _LaneLoop:
    """A lane's loop on the workers: the next step to read (None: it ran all its steps), its rows,
    the sessions of its first step (fed from here), the edits sent not yet known to be taken
    (each sent after the one before), and the sessions whose rows an edit empties."""

    handle: Handle | None
    batch: int
    fed: torch.Tensor
    picks: list[RowPick | None] = field(default_factory=list)    # its first step's rows' picks
    edits: list[Any] = field(default_factory=list)
    leaving: dict[int, Any] = field(default_factory=dict)    # session -> the edit that empties its row
    gone: set[int] = field(default_factory=set)      # sessions gone as it started, told with its first read


def _took(f: Any) -> bool:
    """Whether a lane took an edit (a done future's answer: the count of edit messages it took)."""
    return not f.cancelled() and f.exception() is None and int(f.result()) > 0


@dataclass
class EngineStats:
    """What the engine did: steps by kind, replays, tokens and rows produced, seconds in steps."""

    prefill_steps: int = 0
    prefill_ahead: int = 0        # prompt chunks sent while the chunk before still ran (``_pipelined``)
    decode_steps: int = 0
    replays: int = 0
    tokens: int = 0
    rows: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    prefill_groups: int = 0       # steps that prefilled several prompts together (``PrefillGroup``)
    new_sessions: int = 0         # sessions of new calls (not kept sessions' turns)
    prefix_hits: int = 0          # new sessions that started from a kept cache (``prefix``) or a twin's
    prefix_tokens: int = 0        # and the tokens they did not prefill again
    step_tokens: int = 0          # tokens the steps computed, padding included (rows x length each)
    lane_starts: int = 0          # lanes' loops started (a lane's first step, a growth, a loop run out)
    lane_edits: int = 0           # rows joined or emptied in a running loop, in messages sent
    preemptions: int = 0          # calls preempted where the KV room ran out (``Engine._preempt``)

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


class Executor:
    """Carries out records through ``runner``: ``admit`` and ``decode`` return each call's or
    group's result, or the error that ended it; ``replay`` cuts a lost session's replay."""

    def __init__(self, runner: Runner, replay: Replay, stats: EngineStats, pipeline: int = 1,
                 lane_steps: int = 256) -> None:
        self.runner = runner
        self.replay = replay
        self.stats = stats
        self._ahead: dict[tuple[int, ...], tuple[Handle, tuple[int, ...]]] = {}
        self._ahead_lock = threading.Lock()
        self._lanes: dict[int, _LaneLoop] = {}       # lane -> its loop on the workers (the engine's thread's)
        self._loops = True                           # whether the deployment's decode program loops
        self.lane_steps = lane_steps
        self._pool = ThreadPoolExecutor(max(1, pipeline - 1), thread_name_prefix="seabiscuit-step")
        # NOTE: prompts prefilled side by side on threads of their own: an admission that runs while
        # rows decode (``SchedulerSpec.overlap``) never holds a thread a decode group waits for
        self._prefill_pool = ThreadPoolExecutor(max(1, pipeline - 1), thread_name_prefix="seabiscuit-prefill")

    def close(self) -> None:
        self.drop_ahead()
        for lane in list(self._lanes):
            self.stop_lane(lane)
        self._pool.shutdown(wait=False)
        self._prefill_pool.shutdown(wait=False)

    # --- admissions --------------------------------------------------------------------------
    def admit(self, out: SchedulerOutput) -> dict[int, Result]:
        """Prefill the calls ``out`` admits, ``out.together`` at a time: per call, the logits
        (sessions, vocab) of its sessions' last tokens."""
        got: dict[int, Result] = {}
        rows = self._groups(out.prefill_groups, out.together)
        todo = iter(out.admitted)
        lock = threading.Lock()

        def logits(p: Prefill) -> torch.Tensor:
            if not p.grouped:
                return self._prefill(p, out.together)
            res = rows[p.session]
            if isinstance(res, BaseException):
                raise res
            return res

        def admit_next() -> None:
            while True:
                with lock:
                    a = next(todo, None)
                if a is None:
                    return
                try:
                    made: dict[int, torch.Tensor] = {}
                    for p in a.prefills:      # NOTE: a twin comes after the session it copies
                        made[p.session] = made[p.twin] if p.twin >= 0 else logits(p)
                    got[a.call] = torch.stack([made[p.session] for p in a.prefills])
                except BaseException as e:  # noqa: BLE001 - the caller gets it; other calls go on
                    got[a.call] = e

        helpers = [self._prefill_pool.submit(admit_next) for _ in range(out.together - 1)]
        admit_next()
        for h in helpers:
            h.result()
        return got

    def _groups(self, groups: Sequence[PrefillGroup], together: int) -> dict[int, Result]:
        """Run the prefill groups side by side; each session's last-token logits, or the error
        that ended its group."""
        if not groups:
            return {}
        t0 = time.perf_counter()

        def run(g: PrefillGroup) -> Result:
            feed = step_inputs([(r.session, r.start, r.tokens) for r in g.rows], len(g.rows), g.length)
            try:
                self.runner.prepare(len(g.rows), g.length)
                return self._run(g.rows, len(g.rows), g.length, feed, together)
            except BaseException as e:  # noqa: BLE001 - fails the calls of these rows only
                return e

        runs = [self._prefill_pool.submit(run, g) for g in groups[1:]]
        results = [run(groups[0]), *(f.result() for f in runs)]
        out: dict[int, Result] = {}
        for g, res in zip(groups, results):
            ok = not isinstance(res, BaseException)
            self.stats.prefill_steps += ok
            self.stats.prefill_groups += ok
            self.stats.step_tokens += g.tokens if ok else 0
            for i, r in enumerate(g.rows):
                out[r.session] = res if isinstance(res, BaseException) else res[i]
        self.stats.prefill_s += time.perf_counter() - t0
        return out

    def _prefill(self, p: Prefill, together: int) -> torch.Tensor:
        """Cache a session's uncached tokens (``p``); the logits of its last token."""
        if not p.chunks:
            raise BadInput(f"session {p.session}: nothing to prefill (an empty prompt?)")
        for c in p.chunks:
            self.runner.prepare(1, c.length)
        t0 = time.perf_counter()
        logits = self._chunks(p, together)
        self.stats.prefill_s += time.perf_counter() - t0
        return logits

    def _chunks(self, p: Prefill, together: int, replay: bool = False) -> torch.Tensor:
        """Run ``p``'s chunks; the logits of its last token. A ``replay`` is part of a recovery
        already, so its steps are not retried. Chunks to send at once (``p.ahead``) that fail run
        again one by one, each retried as any step (slots cached meanwhile are only read)."""
        lost: WorkerLost | None = None
        if p.ahead:
            try:
                logits = self._pipelined(p.ahead)
                self.stats.prefill_steps += 0 if replay else len(p.ahead)
                self.stats.step_tokens += 0 if replay else sum(c.length for c in p.ahead)
                self.stats.prefill_ahead += len(p.ahead) - 1
                return logits
            except WorkerLost as e:
                if isinstance(e, StaleRun):
                    self.runner.recover(e)
                elif replay:          # NOTE: the recovery that replays counts it as one of its tries
                    raise
                else:
                    lost = e
        logits = torch.empty(0)
        for c in p.chunks:
            feed = step_inputs([(c.session, c.start, c.tokens)], 1, c.length)
            out = self._step(1, c.length, feed) if replay else \
                self._run((c,), 1, c.length, feed, together, lost=lost)
            logits = out[0]
            lost = None
            self.stats.prefill_steps += not replay
            self.stats.step_tokens += 0 if replay else c.length
        return logits

    def _pipelined(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Send a prompt's chunks at once (``CHUNKS_IN_FLIGHT`` at most), each to follow the one
        before: one chunk runs on a stage while the one before runs on the next. The logits of
        the last chunk's last token. The scheduler sends the smallest chunk first: the pipeline
        fills sooner where a later stage is the slowest, as in a causal LM's plan balanced for
        decode, whose first worker also holds the LM head that a prefill chunk runs for one row
        only (SmolLM2, 400 tokens as 144 + 256: first token 1.30x sooner than one by one,
        against 1.18x as 256 + 144)."""
        handles: list[Handle] = []
        read = 0
        try:
            for c in chunks:
                if len(handles) - read >= CHUNKS_IN_FLIGHT:
                    self.runner.step_result(handles[read])
                    read += 1
                feed = step_inputs([(c.session, c.start, c.tokens)], 1, c.length)
                follows = handles[-1] if handles else None
                handles.append(self.runner.submit_chunk(c.length, feed, follows=follows))
            for h in handles[read:-1]:
                self.runner.step_result(h)
            return self.runner.step_result(handles[-1])[0]
        except BaseException:
            for h in handles:
                self.runner.discard(h)
            raise

    # --- decode steps ------------------------------------------------------------------------
    def decode(self, out: SchedulerOutput) -> list[Result]:
        """Run the decode groups of ``out`` side by side (one runs on a stage while another runs
        on the next); per group, the logits (rows, vocab) of each row, or for a queued group its
        greedy tokens (rows,)."""
        groups = out.decodes
        self.drop_ahead(keep={g.key for g in groups})
        t0 = time.perf_counter()
        runs = [self._pool.submit(self._decode, g) for g in groups[1:]]
        results: list[Result] = []
        for g, fut in zip(groups, [None, *runs]):
            try:
                results.append(self._decode(g) if fut is None else fut.result())
            except BaseException as e:  # noqa: BLE001 - fails the calls of these rows only
                results.append(e)
        for g, res in zip(groups, results):
            if not isinstance(res, BaseException):
                self.stats.decode_steps += 1
                self.stats.rows += len(g.rows)
                self.stats.step_tokens += g.batch
        self.stats.decode_s += time.perf_counter() - t0
        return results

    def _decode(self, g: DecodeGroup) -> torch.Tensor:
        """One decode step of group ``g``. A queued group with the same sessions as last step
        finds this step queued already, and queues the next one behind it (unless ``g.more`` is
        false): its tokens are picked on the worker from this step's logits, as ``greedy`` picks
        them here. A group that starts anew may start ``g.steps`` steps at once (a decode loop
        on the workers)."""
        self.runner.prepare(g.batch, 1)

        # NOTE: the step's inputs, made only where they are sent: a step of a decode loop on the
        # workers was fed there (ten cold torch calls each, 0.2-0.3 ms of the engine's time a token)
        def feed() -> StepFeed:
            return step_inputs([(r.session, r.start, r.tokens) for r in g.rows], g.batch, 1)

        def nxt() -> StepFeed:
            return step_inputs([(r.session, r.start + 1, (0,)) for r in g.rows], g.batch, 1)

        with self._ahead_lock:
            ahead = self._ahead.pop(g.key, None)
        if not g.queued:
            if ahead is not None:
                self.runner.discard(ahead[0])
            return self._run(g.rows, g.batch, 1, feed(), 1)[:len(g.rows)]
        handle = ahead[0] if ahead is not None and ahead[1] == g.starts else None
        if handle is None:
            if ahead is not None:
                self.runner.discard(ahead[0])
            handle = self.runner.submit_step(g.batch, 1, feed, steps=g.steps)
        if g.more:
            queued = self.runner.submit_step(g.batch, 1, nxt, after=handle)
            if queued is not None:
                with self._ahead_lock:
                    self._ahead[g.key] = (queued, tuple(n + 1 for n in g.starts))
        try:
            out = self.runner.step_tokens(handle)
        except WorkerLost as e:
            self.drop_ahead()
            stale = isinstance(e, StaleRun)
            if stale:     # NOTE: a cache that moved says so in the step again
                self.runner.recover(e)
            out = greedy(self._run(g.rows, g.batch, 1, feed(), 1, lost=None if stale else e))
        return out[:len(g.rows)]

    # --- lanes -------------------------------------------------------------------------------
    def lanes(self, out: SchedulerOutput, wake: Any = None) -> list[LaneResult]:
        """A step of each lane of ``out`` whose next step is ready (at least one: the first to be,
        waited for): its greedy tokens (batch,), the sessions it ran (batch,; -1 for an empty
        row) and the sessions that left the lane for good (no step of its loop runs them any
        more: their caches may go); ``NOT_READ`` for a lane whose step is not ready yet (its
        edits went all the same), None for a lane left empty (its loop stopped: every session
        that left it is gone), or the error that ended the step (its loop let go). A lane that
        runs ahead is read on without waiting for one that does not; none is waited for once
        ``wake`` (a future) is done."""
        t0 = time.perf_counter()
        results: list[LaneResult] = []
        ready: list[int] = []
        for i, ls in enumerate(out.lanes):
            try:
                results.append(self._send_lane(ls))
            except BaseException as e:  # noqa: BLE001 - fails the calls of this lane only
                self.stop_lane(ls.lane)
                results.append(e)
            if results[-1] is NOT_READ:
                ready.append(i)
        for i in self._ready(out.lanes, ready, wake):
            ls = out.lanes[i]
            try:
                results[i] = self._read_lane(ls)
            except BaseException as e:  # noqa: BLE001 - fails the calls of this lane only
                self.stop_lane(ls.lane)
                results[i] = e
        for ls, res in zip(out.lanes, results):
            if isinstance(res, tuple):
                self.stats.decode_steps += 1
                self.stats.rows += len(ls.sessions)
                self.stats.step_tokens += ls.batch
        self.stats.decode_s += time.perf_counter() - t0
        return results

    def _ready(self, lanes: Sequence[LaneStep], todo: list[int], wake: Any = None) -> list[int]:
        """Of the lanes ``todo`` (indices of ``lanes``), those whose next step can be read now, or
        the first to be (``LANE_WAIT_S`` at most, then the first: its read waits as any step does);
        none where ``wake`` (a future) is done first (the engine has other work: an admission
        landed, a call came)."""
        if not todo:
            return []
        futures: dict[Any, int] = {}
        for i in todo:
            loop = self._lanes[lanes[i].lane]
            f = self.runner.step_future(loop.handle)
            if f is None or f.done():
                futures.clear()
                break
            futures[f] = i
        if futures:
            concurrent.futures.wait([*futures, *([wake] if wake is not None else [])], timeout=LANE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            done = [i for f, i in futures.items() if f.done()]
            return done or ([] if wake is not None and wake.done() else todo[:1])
        return [i for i in todo if (f := self.runner.step_future(self._lanes[lanes[i].lane].handle)) is None
                or f.done()]

    def _send_lane(self, ls: LaneStep) -> LaneResult:
        """Lane ``ls``'s edits sent to its running loop, or the loop started anew (none runs, it ran
        out, refused an edit, or the lane grew): ``NOT_READ`` then, its step to read; None for a
        lane left empty (its loop let go); a step's result where the deployment cannot loop."""
        if not ls.sessions:
            self.stop_lane(ls.lane)
            return None
        loop = self._lanes.get(ls.lane)
        if loop is None or loop.handle is None or loop.batch != ls.batch \
                or any(f.done() and not _took(f) for f in loop.edits):
            gone = self.stop_lane(ls.lane) | {sid for _, sid in ls.leaves}
            loop = self._start_lane(ls)
            if loop is None:        # NOTE: this deployment's decode step cannot loop: one step from here
                return self._from_caller(ls, gone)
            loop.gone = gone
        elif ls.joins or ls.leaves:
            edits: list[Edit] = [(i, -1, 0, 0, 0) for i, _ in ls.leaves]
            for i in ls.joins:
                r = ls.rows[i]
                if r is not None:
                    edits.append((i, r.chunk.session, r.chunk.start, r.chunk.tokens[0], r.steps, r.pick))
            sent = self.runner.edit_lane(loop.handle, edits, loop.edits[-1] if loop.edits else None)
            loop.edits.append(sent)
            loop.leaving.update((sid, sent) for _, sid in ls.leaves)
            self.stats.lane_edits += 1
        return NOT_READ

    def _read_lane(self, ls: LaneStep) -> LaneResult:
        """Read the next step of lane ``ls``'s loop (started or edited by ``_send_lane``)."""
        loop = self._lanes[ls.lane]
        gone, loop.gone = loop.gone, set()
        for _ in range(2):
            handle = loop.handle
            assert handle is not None
            try:
                tokens, rows, applied, extra = self.runner.step_rows(handle, loop.picks)
            except LaneStopped:        # NOTE: its rows had all ended when a join came: anew
                gone |= self.stop_lane(ls.lane)
                started = self._start_lane(ls)
                if started is None:
                    raise
                loop = started
                continue
            except WorkerLost as e:
                gone |= self.stop_lane(ls.lane)
                stale = isinstance(e, StaleRun)
                if stale:
                    self.runner.recover(e)
                return self._from_caller(ls, gone, None if stale else e)
            loop.handle = handle.next
            # NOTE: a session left for good once a step was built after its leave (steps run in order)
            left = {sid for sid, f in loop.leaving.items() if f.done() and _took(f) and f.result() <= applied}
            for sid in left:
                del loop.leaving[sid]
            loop.edits = [f for f in loop.edits if not (f.done() and _took(f))]
            loop.picks = []         # NOTE: the rows' later picks are made where the logits are
            return tokens, loop.fed if rows is None else rows, gone | left, extra
        raise LaneStopped(f"lane {ls.lane}: its loop stopped twice as it started")

    def _from_caller(self, ls: LaneStep, gone: set[int], lost: WorkerLost | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, set[int], dict[str, torch.Tensor]]:
        """One step of lane ``ls``'s rows fed from here (no loop runs it), after ``lost`` as ``_run``
        recovers from one; its tokens picked here as the lane's worker would."""
        feed = self._lane_feed(ls)
        logits = self._run([r.chunk for r in ls.rows if r is not None], ls.batch, 1, feed, 1, lost=lost)
        tokens, extra = picked_here(logits, [r.pick if r is not None else None for r in ls.rows])
        return torch.from_numpy(tokens), feed[SESSIONS], gone, extra

    def _lane_feed(self, ls: LaneStep) -> StepFeed:
        return lane_inputs([(r.chunk.session, r.chunk.start, r.chunk.tokens) if r is not None else None
                            for r in ls.rows], ls.batch)

    def _start_lane(self, ls: LaneStep) -> _LaneLoop | None:
        """Start lane ``ls``'s loop anew from its rows (the one before let go); None where this
        deployment's decode program cannot loop on the workers."""
        self.stop_lane(ls.lane)
        if not self._loops:
            return None
        self.runner.prepare(ls.batch, 1)
        feed = self._lane_feed(ls)
        left = [r.steps if r is not None else 0 for r in ls.rows]
        picks = [r.pick if r is not None else None for r in ls.rows]
        handle = self.runner.start_lane(ls.batch, feed, self.lane_steps, left,
                                        picks if any(p is not None for p in picks) else None)
        if handle is None:
            self._loops = False         # NOTE: its decode program cannot loop: every lane step goes from here
            return None
        loop = self._lanes[ls.lane] = _LaneLoop(handle, ls.batch, feed[SESSIONS], picks)
        self.stats.lane_starts += 1
        return loop

    def stop_lane(self, lane: int) -> set[int]:
        """Let go of lane ``lane``'s loop, if one runs; the sessions that were leaving it (gone now)."""
        loop = self._lanes.pop(lane, None)
        if loop is None:
            return set()
        if loop.handle is not None:
            self.runner.discard(loop.handle)
        return set(loop.leaving)

    def drop_ahead(self, keep: set[tuple[int, ...]] | None = None) -> None:
        """Let go of the queued steps of groups not in ``keep`` (their work was never needed)."""
        with self._ahead_lock:
            gone = [k for k in self._ahead if keep is None or k not in keep]
            handles = [self._ahead.pop(k)[0] for k in gone]
        for h in handles:
            self.runner.discard(h)

    def forget(self, sessions: set[int]) -> None:
        """Let go of the queued steps of groups with any of ``sessions`` (they ended)."""
        with self._ahead_lock:
            gone = [k for k in self._ahead if sessions.intersection(k)]
            handles = [self._ahead.pop(k)[0] for k in gone]
        for h in handles:
            self.runner.discard(h)

    # --- retries -----------------------------------------------------------------------------
    def _run(self, rows: Sequence[Chunk], batch: int, length: int, feed: StepFeed, together: int,
             lost: WorkerLost | None = None) -> torch.Tensor:
        """One step of ``rows``; after a worker loss (``lost``: one met already), replay the rows'
        sessions' cached tokens and try again. A recovery that meets a loss itself (a replay sent
        before the scheduler repaired the plan around a dead worker) counts as a try, and the next
        one waits for the repaired plan."""
        error = lost
        for _ in range(STEP_TRIES):
            try:
                if error is not None:
                    self._recover(error, rows, together)
                return self._step(batch, length, feed)
            except StaleRun:
                raise               # NOTE: ``_step`` sent it again while it could: the plan never settled
            except WorkerLost as e:
                error = e
        assert error is not None
        if isinstance(error, CacheLost):    # NOTE: replayed each time, and the plan moved the cache again
            raise restless("a generation step", STEP_TRIES, error) from error
        raise error

    def _step(self, batch: int, length: int, feed: StepFeed) -> torch.Tensor:
        """One step, sent again (on the plan the runner then holds) while the plan changes under it,
        ``STALE_TRIES`` times at most (as ``DistributedModel.__call__`` sends a request)."""
        sent = 0
        while True:
            sent += 1
            try:
                return self.runner.run_step(batch, length, feed)
            except StaleRun as e:
                if sent > STALE_TRIES:
                    raise restless("a generation step", sent, e) from e
                self.runner.recover(e)

    def _recover(self, error: WorkerLost, rows: Sequence[Chunk], together: int) -> None:
        """Wait for the repaired plan, then rebuild what workers lost of each row's session's cache:
        its tokens before the step that failed, replayed (slots still cached are only read)."""
        self.runner.recover(error)
        for r in rows:
            if r.start > 0:
                self.stats.replays += 1
                self._chunks(self.replay(r.session, r.start, together), together, replay=True)
