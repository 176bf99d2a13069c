"""Text generation: sessions over a KV cache, continuous batching, streaming, replay.

``Engine`` turns generate calls into steps of the model's step programs
(``trace.decoder``): each prompt is one session whose tokens are cached on the
workers that own its attention blocks; a prompt is prefilled in chunks of a few
bucketed lengths (``seabiscuit.generate.prefill-buckets``), so any prompt length
reuses a handful of programs; then the live sessions of every call decode
together, one step a token, batched into the same block tasks (rows padded to a
bucket of ``seabiscuit.generate.batch-buckets``). A call admitted while others
decode joins at the next step.

A step that finds a session's cache missing (its worker was lost and the blocks
moved) raises ``CacheLost``; the engine waits for the new plan, replays the
session's tokens (cached slots are read, missing ones rebuilt) and runs the step
again, so the answer is the one an undisturbed run gives.

The engine is independent of Dask: a ``Runner`` runs one step program (locally
in tests, on the cluster for a ``DistributedModel``).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .. import config
from ..errors import STALE_TRIES, BadInput, Busy, ModelClosed, SessionClosed, StaleRun, WorkerLost, restless
from ..lower.kvcache import CacheLost

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine needs of a deployment."""

    def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits (batch, vocab) of the last position of each row."""

    def end_sessions(self, sessions: Sequence[int], renamed: Sequence[tuple[int, int, int]] = ()) -> None:
        """Free the cache of ``sessions`` everywhere, and rename those of ``renamed`` ((old, new,
        slots kept) each, ``KVStore.rename``)."""

    def recover(self, error: BaseException) -> None:
        """Return once a step may be tried again after ``error`` (a worker loss), else raise."""


class QueueingRunner(Runner, Protocol):
    """A runner that can queue a step behind another (``DistributedModel``): see ``Engine._decode``."""

    def submit_step(self, batch: int, length: int, feed: Callable[[], dict[str, torch.Tensor]],
                    after: Any = None, steps: int = 1) -> Any:
        """Submit a step of the inputs ``feed()`` makes (called only where the step is sent: the next
        step of a decode loop on the workers is running already); with ``after``, its input_ids
        are the greedy tokens of that step (None: no step can follow it so); ``steps``: greedy
        steps the caller will take at least (a runner may start them all at once)."""

    def step_result(self, handle: Any) -> torch.Tensor:
        """The logits of a submitted step."""

    def step_tokens(self, handle: Any) -> torch.Tensor:
        """The greedy tokens (rows,) of a submitted step (all a queued greedy step is read for)."""

    def discard(self, handle: Any) -> None:
        """Let go of a submitted step."""

    def submit_chunk(self, length: int, feed: dict[str, torch.Tensor], follows: Any = None) -> Any:
        """Submit one prefill chunk of one session; ``follows``: the chunk before it, which may
        still run (a runner whose ``pipelines_prefill`` is true orders their cache writes)."""


def buckets(key: str, default: Sequence[int]) -> tuple[int, ...]:
    value = config.get(f"generate.{key}", None) or default
    out = tuple(sorted({int(v) for v in value}))
    if not out or out[0] < 1:
        raise BadInput(f"seabiscuit.generate.{key} must list positive sizes, got {value!r}")
    return out


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest size that holds ``n``, else the largest."""
    return next((s for s in sizes if s >= n), sizes[-1])


def group_size(sessions: int, top: int, pipeline: int) -> int:
    """Rows per group when ``sessions`` decode together: ``pipeline`` groups at least (when there
    are that many sessions), none over ``top`` rows."""
    n = max(-(-sessions // top), min(pipeline, sessions))
    return -(-sessions // max(1, n))


def decode_rows(sessions: int) -> int:
    """The rows a decode step multiplies when ``sessions`` decode together (a batch bucket)."""
    sizes = buckets("batch-buckets", (1, 2, 4, 8))
    pipeline = max(1, int(config.get("generate.pipeline", 2)))
    return bucket(group_size(max(1, sessions), sizes[-1], pipeline), sizes)


# --- sampling ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """How a call picks its next tokens: greedy, or sampled after temperature, top-k and top-p."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not 0 < self.temperature < float("inf"):
            raise BadInput(f"temperature must be a finite number > 0 to sample, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadInput(f"top_k must be >= 0 (0: off), got {self.top_k}")

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) float logits -> (rows,) token ids."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, idx = torch.sort(scores, descending=False, dim=-1)
            cum = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - self.top_p)
            drop[:, -1] = False                   # NOTE: the likeliest token always stays
            scores = scores.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)


# --- sessions and calls --------------------------------------------------------------------
@dataclass(eq=False)
class Session:
    """One sequence: its tokens so far, and how many of them are cached on the workers."""

    sid: int
    tokens: list[int]
    cached: int = 0
    done: bool = False
    call: Call | None = None     # the call answering it now (a kept session's turn)
    closed: bool = False         # a kept session its caller closed


@dataclass(eq=False)
class Call:
    """One generate call: its sessions (rows), how to pick tokens, and where they go."""

    sessions: list[Session]
    max_new: int
    sampling: Sampling
    eos: frozenset[int]
    pad: int
    out: queue.Queue[Any] = field(default_factory=queue.Queue)
    produced: int = 0
    keep: bool = False          # a caller-held session stays cached after the call
    cancelled: bool = False     # the caller stopped reading: end at the next step
    closing: BaseException | None = None    # the deployment closes: end at the next step with it
    seen: int | None = None     # rows the caller read before it stopped (a cancelled call)
    finished: bool = False      # the engine is done with it (under the engine's lock)
    ended: threading.Event = field(default_factory=threading.Event)     # and its caller was told
    before: list[int] = field(default_factory=list)   # each kept session's tokens before this turn
    base: list[int] = field(default_factory=list)     # and with its prompt: where the answer starts

    @property
    def live(self) -> list[Session]:
        return [s for s in self.sessions if not s.done]


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

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


class Engine:
    """Runs the generate calls of one deployment on a background thread (see module doc)."""

    def __init__(self, runner: Runner, *, max_sessions: int | None = None, context: int | None = None,
                 max_chunk: int | None = None, name: str = "model") -> None:
        self.runner = runner
        self.name = name
        self.max_sessions = int(max_sessions if max_sessions is not None
                                else config.get("generate.max-sessions", 16))
        self.context = context
        sizes = buckets("prefill-buckets", PREFILL_BUCKETS)
        # NOTE: chunks no longer than the deployment's own input: its weight tiles fit them too,
        # so every step program reads the tiles the workers already hold
        fit = tuple(b for b in sizes if max_chunk is None or b <= max_chunk)
        self.prefill_sizes = fit or (max(1, int(max_chunk or 1)),)
        self.batch_sizes = buckets("batch-buckets", (1, 2, 4, 8))
        self.pipeline = max(1, int(config.get("generate.pipeline", 2)))
        # NOTE: greedy groups queue their next step behind the current one (see ``_decode``)
        self.lookahead = bool(config.get("generate.lookahead", True)) and bool(getattr(runner, "chains_steps",
                                                                                      False))
        self._queueing: QueueingRunner = runner  # type: ignore[assignment]   # NOTE: used if lookahead
        self.loop_steps = max(1, int(config.get("generate.loop-steps", 1) or 1))
        self._ahead: dict[tuple[int, ...], tuple[Any, tuple[int, ...]]] = {}
        self._ahead_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, self.pipeline - 1), thread_name_prefix="seabiscuit-step")
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._pending: list[Call] = []
        self._active: list[Call] = []
        self._admitting: list[Call] = []       # taken from _pending, being prefilled
        self._prefilling = 1                   # prompts being prefilled at once (``chunking``)
        self._unfreed: list[int] = []          # sessions dropped by their callers, caches to free
        self._open = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- calls --------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], max_new: int, sampling: Sampling,
               eos: Sequence[int], pad: int, sessions: Sequence[Session] | None = None) -> Call:
        """Queue a call; its ``out`` queue gets a (rows,) tensor per step, then None (or an error)."""
        if max_new < 1:
            raise BadInput(f"max_new_tokens must be >= 1, got {max_new}")
        if sessions is None:
            longest = max(len(p) for p in prompts)
            if self.context is not None and longest + max_new > self.context:
                raise BadInput(f"{self.name}: a prompt of {longest} tokens plus max_new_tokens={max_new} "
                               f"exceeds the context of {self.context} tokens; shorten the prompt or "
                               "ask for fewer tokens")
            if len(prompts) > self.max_sessions:
                raise BadInput(f"{self.name}: this call asks for {len(prompts)} sessions (rows) at once and "
                               f"the deployment serves at most {self.max_sessions}; send fewer rows or "
                               "deploy with more sessions")
            with self._cond:
                if self._open + len(prompts) > self.max_sessions:
                    raise Busy(f"{self.name} has {self._open} session(s) open and this call asks for "
                               f"{len(prompts)} more; the limit is {self.max_sessions} "
                               "(seabiscuit.generate.max-sessions): wait for calls to finish or "
                               "raise the limit")
                self._open += len(prompts)
            sessions = [Session(next(self._ids), list(p)) for p in prompts]
            call = Call(sessions, max_new, sampling, frozenset(eos), pad)
        else:
            for s in sessions:
                self._after_turn(s)
            for s, p in zip(sessions, prompts):
                if self.context is not None and len(s.tokens) + len(p) + max_new > self.context:
                    raise BadInput(f"{self.name}: session {s.sid} would hold "
                                   f"{len(s.tokens) + len(p) + max_new} tokens, more than the context of "
                                   f"{self.context}")
            before = [len(s.tokens) for s in sessions]
            for s, p in zip(sessions, prompts):
                s.tokens.extend(p)
                s.done = False
            call = Call(list(sessions), max_new, sampling, frozenset(eos), pad, keep=True, before=before,
                        base=[len(s.tokens) for s in sessions])
            for s in sessions:
                s.call = call
        with self._cond:
            if self._closed:
                raise ModelClosed(f"{self.name} is closed: it takes no more generate calls")
            self._pending.append(call)
            self._cond.notify()
            self._start_thread()
        return call

    def _after_turn(self, s: Session) -> None:
        """Wait for the call that answers kept session ``s`` (its last turn) to end: one its caller
        stopped reading ends at the engine's next step; one still being read is an error."""
        if s.closed:
            raise SessionClosed(f"{self.name}: session {s.sid} is closed; open another (dm.session())")
        prev = s.call
        if prev is None or prev.ended.is_set():
            return
        if not prev.cancelled:
            raise Busy(f"{self.name}: session {s.sid} is still answering its last turn ({prev.produced} of "
                       f"{prev.max_new} new tokens); read its stream to the end or close it first")
        if not prev.ended.wait(TURN_WAIT_S):
            raise Busy(f"{self.name}: session {s.sid}'s last turn, whose stream was closed, did not end "
                       f"within {TURN_WAIT_S:.0f} s; try the next turn again later")

    def open_session(self) -> Session:
        """A session kept across calls (``DistributedModel.session``); counted until ``close_session``."""
        with self._cond:
            if self._open + 1 > self.max_sessions:
                raise Busy(f"{self.name} has {self._open} session(s) open; the limit is "
                               f"{self.max_sessions} (seabiscuit.generate.max-sessions)")
            self._open += 1
        return Session(next(self._ids), [])

    def close_session(self, session: Session, wait: bool = True) -> None:
        """Free a kept session's caches; a turn of it still running ends at its next step with
        ``SessionClosed`` and frees them as it ends (its steps would rebuild what is freed now).
        ``wait=False`` (a session its caller dropped, from a finalizer on any thread): the
        engine's thread frees them."""
        with self._cond:
            if session.closed:
                return
            self._open -= 1
            session.closed = True
            call = session.call
            running = call is not None and not call.finished
            if running and call is not None and call.closing is None:
                call.closing = SessionClosed(f"{self.name}: session {session.sid} was closed after "
                                             f"{call.produced} of {call.max_new} new tokens of its turn")
                self._cond.notify()
            if not running and not wait:
                self._unfreed.append(session.sid)
                self._cond.notify()
                self._start_thread()
        if not running and wait:
            self.runner.end_sessions([session.sid])

    def _start_thread(self) -> None:
        """The engine's thread, started once (lock held)."""
        if self._thread is None and not self._closed and not EXITING.is_set():
            self._thread = threading.Thread(target=self._loop, name="seabiscuit-generate", daemon=True)
            _THREADS[self._thread] = weakref.ref(self)
            self._thread.start()

    @staticmethod
    def results(call: Call) -> Iterator[torch.Tensor]:
        """The call's tokens, a (rows,) tensor per step, as they come."""
        while True:
            item = call.out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking calls, end those running at their next step, and wait for the loop."""
        with self._cond:
            self._closed = True
            for call in self._pending + self._active + self._admitting:
                call.closing = ModelClosed(f"{self.name} was closed after {call.produced} of "
                                           f"{call.max_new} new tokens of this call: it did not finish")
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._drop_ahead()
        self._pool.shutdown(wait=False)

    # --- the loop -------------------------------------------------------------------------
    def _has_work(self) -> bool:
        """Whether the loop has calls to run, caches to free, or its close to finish (lock held)."""
        return bool(self._pending or self._active or self._closed or self._unfreed)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._has_work() or EXITING.is_set()):
                    # NOTE: idle, the thread ends (and starts again with the next call): a model
                    # its caller dropped is not kept alive by it
                    if not self._cond.wait(IDLE_EXIT_S):
                        break
                if EXITING.is_set() or not self._has_work():    # NOTE: exiting: ``end_threads``
                    self._thread = None
                    return
                unfreed, self._unfreed = self._unfreed, []
                if self._closed and not (self._pending or self._active):
                    return
                new, self._pending = self._pending, []
                self._admitting = list(new)
            self._free(unfreed)
            self._admit_all(new)
            with self._cond:
                self._admitting = []
            if self._active:
                self._decode_round()
            if not self._active:
                self._drop_ahead()

    def _guard(self, call: Call, fn: Any) -> None:
        try:
            fn(call)
        except BaseException as e:  # noqa: BLE001 - the caller gets it; other calls go on
            self._finish(call, call.closing or e)

    def _admit_all(self, calls: list[Call]) -> None:
        """Prefill the calls that arrived, ``pipeline`` at a time (sessions share no cache, so
        one prompt runs on a stage while another runs on the next); they join in arrival order."""
        todo = []
        for c in calls:
            if c.cancelled or c.closing:
                self._finish(c, c.closing)
            else:
                todo.append(c)
        picked: dict[int, list[int] | BaseException] = {}

        def admit(call: Call) -> None:
            try:
                picked[id(call)] = self._admit(call)
            except BaseException as e:  # noqa: BLE001 - the caller gets it; other calls go on
                picked[id(call)] = call.closing or e

        queue_ = iter(todo)
        lock = threading.Lock()

        def admit_next() -> None:
            while True:
                with lock:
                    call = next(queue_, None)
                if call is None:
                    return
                admit(call)

        self._prefilling = max(1, min(self.pipeline, len(todo)))
        try:
            helpers = [self._pool.submit(admit_next) for _ in range(self._prefilling - 1)]
            admit_next()
            for h in helpers:
                h.result()
        finally:
            self._prefilling = 1
        for call in todo:
            got = picked[id(call)]
            if isinstance(got, BaseException):
                self._finish(call, got)
                continue
            self._guard(call, lambda c, got=got: self._emit(c, got))
            if call.live:
                self._active.append(call)

    def _admit(self, call: Call) -> list[int]:
        """Prefill the sessions of ``call``: the first new token of each."""
        logits = []
        for s in call.sessions:
            logits.append(self._prefill(s))
        return call.sampling.pick(torch.stack(logits)).tolist()

    def _decode_round(self) -> None:
        for c in [c for c in self._active if c.cancelled or c.closing]:
            self._finish(c, c.closing)
        rows = [(c, s) for c in self._active for s in c.live]
        got: dict[int, torch.Tensor] = {}
        failed: dict[int, BaseException] = {}
        parts = self._groups(rows)
        self._drop_ahead(keep={tuple(s.sid for _, s in part) for part in parts})
        t0 = time.perf_counter()
        # NOTE: groups in flight together fill the pipeline: one runs on a stage while another
        # runs on the next (each session stays in one group, so its tokens stay in order)
        greedy = [all(not c.sampling.do_sample and not c.cancelled for c, _ in part) for part in parts]
        # NOTE: no step is queued behind a group's last one (a call that ends frees its caches)
        more = [all(c.produced + 1 < c.max_new for c, _ in part) for part in parts]
        left = [min(c.max_new - c.produced for c, _ in part) for part in parts]
        runs = [self._pool.submit(self._decode, [s for _, s in part], g, m, n)
                for part, g, m, n in zip(parts[1:], greedy[1:], more[1:], left[1:])]
        results: list[Any] = []
        for part, g, m, n, fut in zip(parts, greedy, more, left, [None, *runs]):
            try:
                results.append(self._decode([s for _, s in part], g, m, n) if fut is None else fut.result())
            except BaseException as e:  # noqa: BLE001 - fails the calls of these rows only
                results.append(e)
        for part, res in zip(parts, results):
            if isinstance(res, BaseException):
                for c, _ in part:
                    failed[id(c)] = c.closing or res
                continue
            for (_, s), row in zip(part, res):
                got[s.sid] = row
            self.stats.decode_steps += 1
            self.stats.rows += len(part)
        self.stats.decode_s += time.perf_counter() - t0
        for c in list(self._active):
            if c.closing is not None:     # NOTE: a token computed as the model closed is not emitted
                self._finish(c, c.closing)
                continue
            if id(c) in failed:
                self._finish(c, failed[id(c)])
                continue
            self._guard(c, lambda c: self._emit(c, _picked(c, [got[s.sid] for s in c.live])))

    # --- steps -----------------------------------------------------------------------------
    def _prefill(self, s: Session) -> torch.Tensor:
        """Cache the session's uncached tokens in bucketed chunks; logits of its last token."""
        todo = s.tokens[s.cached:]
        if not todo:
            raise BadInput(f"session {s.sid}: nothing to prefill (an empty prompt?)")
        for _, length in self.chunking(len(todo)):
            self._prepare(1, length)
        t0 = time.perf_counter()
        logits = self._chunks(s, s.cached, todo)
        s.cached = len(s.tokens)
        self.stats.prefill_s += time.perf_counter() - t0
        return logits

    def chunking(self, n: int, alone: bool | None = None) -> list[tuple[int, int]]:
        """(tokens, program length) of the chunks ``n`` tokens are prefilled in (see ``chunking``):
        a prompt prefilled ``alone`` (by default, unless others are being prefilled with it now)
        on a runner that pipelines a prompt's chunks is cut for its stages; prompts prefilled
        together already fill the pipeline, one prompt a stage."""
        together = self._prefilling if alone is None else 1 if alone else self.pipeline
        stages = int(getattr(self.runner, "prefill_stages", 1)) \
            if getattr(self.runner, "pipelines_prefill", False) else 1
        return chunking(n, self.prefill_sizes, max(1, stages // max(1, together)))

    def _prepare(self, batch: int, length: int) -> None:
        """Build the step program of this shape now, so step times leave its one-off cost out."""
        prepare = getattr(self.runner, "prepare", None)
        if prepare is not None:
            prepare(batch, length)

    def _chunks(self, s: Session, start: int, todo: list[int], replay: bool = False) -> torch.Tensor:
        """Cache ``todo`` at slots ``start``.. in prefill chunks; the logits of its last token.
        A ``replay`` is part of a recovery already, so its steps are not retried. Where the
        runner pipelines them (the data plane), a prompt's chunks (a replay's too) are sent all
        at once (``_pipelined``); if that fails, they run again one by one, each retried as any
        step (slots cached meanwhile are only read)."""
        chunks = self.chunking(len(todo))
        lost: WorkerLost | None = None
        if len(chunks) > 1 and getattr(self.runner, "pipelines_prefill", False):
            try:
                logits = self._pipelined(s, start, todo, sorted(chunks))     # NOTE: smallest first
                self.stats.prefill_steps += 0 if replay else len(chunks)
                self.stats.prefill_ahead += len(chunks) - 1
                return logits
            except WorkerLost as e:
                if isinstance(e, StaleRun):
                    self.runner.recover(e)
                elif replay:          # NOTE: the recovery that replays counts it as one of its tries
                    raise
                else:
                    lost = e
        logits = torch.empty(0)
        for length, feed in _chunk_feeds(s, start, todo, chunks):
            out = self._step(1, length, feed) if replay else self._run([s], 1, length, feed, lost=lost)
            logits = out[0]
            lost = None
            self.stats.prefill_steps += not replay
        return logits

    def _pipelined(self, s: Session, start: int, todo: list[int],
                   chunks: list[tuple[int, int]]) -> torch.Tensor:
        """Send a prompt's chunks at once (``CHUNKS_IN_FLIGHT`` at most), each to follow the one
        before: one chunk runs on a stage while the one before runs on the next. The logits of
        the last chunk's last token. The caller sends the smallest chunk first: the pipeline
        fills sooner where a later stage is the slowest, as in a causal LM's plan balanced for
        decode, whose first worker also holds the LM head that a prefill chunk runs for one row
        only (SmolLM2, 400 tokens as 144 + 256: first token 1.30x sooner than one by one,
        against 1.18x as 256 + 144)."""
        runner = self._queueing
        handles: list[Any] = []
        read = 0
        try:
            for length, feed in _chunk_feeds(s, start, todo, chunks):
                if len(handles) - read >= CHUNKS_IN_FLIGHT:
                    runner.step_result(handles[read])
                    read += 1
                handles.append(runner.submit_chunk(length, feed, follows=handles[-1] if handles else None))
            for h in handles[read:-1]:
                runner.step_result(h)
            return runner.step_result(handles[-1])[0]
        except BaseException:
            for h in handles:
                runner.discard(h)
            raise

    def _decode(self, sessions: list[Session], greedy: bool = False, more: bool = True,
                left: int = 1) -> torch.Tensor:
        """One decode step of ``sessions``: the logits (rows, vocab) of each, or for a ``greedy``
        group queued ahead, its greedy tokens (rows,). A greedy group with the same sessions as
        last step finds this step queued already, and queues the next one behind it (unless this
        is its last, ``more=False``): its tokens are picked on the worker from this step's logits,
        as ``pick`` picks them here. A group that starts anew may start all its ``left`` steps at
        once (a decode loop on the workers, ``seabiscuit.generate.loop-steps`` at most)."""
        batch = bucket(len(sessions), self.batch_sizes)
        self._prepare(batch, 1)

        # NOTE: the step's inputs, made only where they are sent: a step of a decode loop on the
        # workers was fed there (ten cold torch calls each, 0.2-0.3 ms of the engine's time a token)
        def feed() -> dict[str, torch.Tensor]:
            return _feed([(s.sid, s.cached, s.tokens[s.cached:]) for s in sessions], batch, 1)

        def nxt() -> dict[str, torch.Tensor]:
            return _feed([(s.sid, s.cached + 1, [0]) for s in sessions], batch, 1)

        key, starts = tuple(s.sid for s in sessions), tuple(s.cached for s in sessions)
        with self._ahead_lock:
            ahead = self._ahead.pop(key, None)
        if not (self.lookahead and greedy):
            if ahead is not None:
                self._queueing.discard(ahead[0])
            out = self._run(sessions, batch, 1, feed())
        else:
            handle = ahead[0] if ahead is not None and ahead[1] == starts else None
            if handle is None:
                if ahead is not None:
                    self._queueing.discard(ahead[0])
                handle = self._queueing.submit_step(batch, 1, feed, steps=min(left, self.loop_steps))
            if more:
                queued = self._queueing.submit_step(batch, 1, nxt, after=handle)
                if queued is not None:
                    with self._ahead_lock:
                        self._ahead[key] = (queued, tuple(n + 1 for n in starts))
            try:
                out = self._queueing.step_tokens(handle)
            except WorkerLost as e:
                self._drop_ahead()
                if isinstance(e, StaleRun):   # NOTE: a cache that moved says so in the step again
                    self.runner.recover(e)
                out = self._run(sessions, batch, 1, feed(), lost=None if isinstance(e, StaleRun) else e
                                ).argmax(dim=-1)
        for s in sessions:
            s.cached = len(s.tokens)
        return out[:len(sessions)]

    def _drop_ahead(self, keep: set[tuple[int, ...]] | None = None) -> None:
        """Let go of the queued steps of groups that changed (their work was never needed)."""
        with self._ahead_lock:
            gone = [k for k in self._ahead if keep is None or k not in keep]
            handles = [self._ahead.pop(k)[0] for k in gone]
        for h in handles:
            self._queueing.discard(h)

    def _groups(self, rows: list[Any]) -> list[list[Any]]:
        """Rows in ``pipeline`` groups at least (when there are that many), none over the largest batch."""
        if not rows:
            return []
        size = group_size(len(rows), self.batch_sizes[-1], self.pipeline)
        return [rows[i:i + size] for i in range(0, len(rows), size)]

    def _run(self, sessions: list[Session], batch: int, length: int, feed: dict[str, torch.Tensor],
             tries: int = 4, lost: WorkerLost | None = None) -> torch.Tensor:
        """One step; after a worker loss (``lost``: one met already), replay the sessions' cached
        tokens and try again. A recovery that meets a loss itself (a replay sent before the
        scheduler repaired the plan around a dead worker) counts as a try, and the next one
        waits for the repaired plan."""
        error = lost
        for _ in range(tries):
            try:
                if error is not None:
                    self._recover(error, sessions, feed["sb_start"][:len(sessions)].tolist())
                return self._step(batch, length, feed)
            except StaleRun:
                raise               # NOTE: ``_step`` sent it again while it could: the plan never settled
            except WorkerLost as e:
                error = e
        assert error is not None
        if isinstance(error, CacheLost):    # NOTE: replayed each time, and the plan moved the cache again
            raise restless("a generation step", tries, error) from error
        raise error

    def _step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
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

    def _recover(self, error: WorkerLost, sessions: list[Session], starts: Sequence[int]) -> None:
        """Wait for the repaired plan, then rebuild what workers lost of each session's cache:
        its tokens before the step that failed, replayed (slots still cached are only read)."""
        self.runner.recover(error)
        for s, upto in zip(sessions, starts):
            if upto > 0:
                self.stats.replays += 1
                self._chunks(s, 0, s.tokens[:upto], replay=True)

    # --- results ---------------------------------------------------------------------------
    def _emit(self, call: Call, picked: list[int]) -> None:
        """Hand the next token of every live row of ``call`` (``picked``) to its caller."""
        live = call.live
        row = torch.full((len(call.sessions),), call.pad, dtype=torch.long)
        for s, t in zip(live, picked):
            s.tokens.append(int(t))
            row[call.sessions.index(s)] = int(t)
            if int(t) in call.eos:
                s.done = True
        call.produced += 1
        self.stats.tokens += len(live)
        if call.produced >= call.max_new:
            for s in call.sessions:
                s.done = True
        call.out.put(row)
        if not call.live:
            self._finish(call, None)

    def _finish(self, call: Call, error: BaseException | None) -> None:
        if call in self._active:
            self._active.remove(call)
        for s in call.sessions:
            s.done = True
        ended = {s.sid for s in call.sessions}
        with self._ahead_lock:     # NOTE: a step queued for these sessions is never needed now
            gone = [k for k in self._ahead if ended.intersection(k)]
            queued = [self._ahead.pop(k)[0] for k in gone]
        for h in queued:
            self._queueing.discard(h)
        with self._cond:
            call.finished = True
            seen = call.seen
            if not call.keep:
                self._open -= len(call.sessions)
        freed = [s.sid for s in call.sessions if not call.keep or s.closed]    # NOTE: closed as it ran
        moved: list[tuple[int, int, int]] = []
        if call.keep:
            # NOTE: a turn its caller stopped, or one whose decode loop may have run on past its EOS
            ahead = self.loop_steps > 1 and call.produced < call.max_new
            if error is not None and not isinstance(error, ModelClosed):
                moved = self._rewind(call, call.before)     # NOTE: undone whole: sent again, it fits
            elif seen is not None or ahead:
                moved = self._rewind(call, [b + (call.produced if seen is None else seen) for b in call.base])
        self._free(freed, moved)
        call.out.put(error if error is not None else None)
        call.ended.set()

    def stopped(self, call: Call, seen: int) -> None:
        """The caller of ``call`` stopped reading it after ``seen`` rows (or read them all): it ends
        at the next step; a kept session's conversation keeps the tokens read (``_rewind``)."""
        with self._cond:
            call.cancelled = True
            if not call.finished:
                call.seen = seen
                return
        if call.keep and seen < call.produced:      # NOTE: it ended as the caller stopped
            self._free([], self._rewind(call, [b + seen for b in call.base]))

    def _free(self, sids: list[int], moved: Sequence[tuple[int, int, int]] = ()) -> None:
        if sids or moved:
            try:
                self.runner.end_sessions(sids, moved)
            except Exception as e:  # noqa: BLE001 - best effort: a cache not cut back is replayed
                logger.warning("%s: caches of sessions %s not freed, nor %s cut back: %s", self.name, sids,
                               moved, e)

    def _rewind(self, call: Call, keep: list[int]) -> list[tuple[int, int, int]]:
        """Cut each open kept session of ``call`` back to its first ``keep`` tokens: a turn's answer
        to the tokens its caller read (not the ones made meanwhile, nor what steps that ran ahead
        cached on the workers), or a failed turn away whole. Each goes on under a new id, its
        caches renamed and cut to as many slots (``KVStore.rename``), so a step of this call
        still running finds nothing to write to, and the next turn starts from what is kept.
        Returns the (old id, new id, slots kept) of each."""
        moved = []
        for s, n in zip(call.sessions, keep):
            if s.closed:
                continue
            del s.tokens[n:]
            new = next(self._ids)
            moved.append((s.sid, new, n))
            s.sid, s.cached = new, min(s.cached, n)
        return moved


IDLE_EXIT_S = 2.0    # NOTE: how long the engine's thread waits for work before it ends
EXIT_JOIN_S = 5.0    # NOTE: how long the interpreter's exit waits for the engines' threads, in all
EXITING = threading.Event()         # NOTE: set as the interpreter exits (``end_threads``)
# NOTE: each engine's thread, while it lives, and its engine (neither kept alive by this)
_THREADS: weakref.WeakKeyDictionary[threading.Thread, weakref.ref[Engine]] = weakref.WeakKeyDictionary()
TURN_WAIT_S = 120.0  # NOTE: how long a kept session's next turn waits for its last one to end
CHUNKS_IN_FLIGHT = 8    # NOTE: a prompt's chunks sent and not yet answered: a pipeline of a few stages
#                         stays full, and a huge prompt holds the activations of only so many
STEP_TOKENS = 48     # NOTE: a step's fixed cost (every weight read once) in tokens' worth of compute
# NOTE: each length at most 1.25x the one before from 32 on (a prompt up to 256 tokens computes 6.5% more
# than its own length on average, step cost included, 7.1% without 40 and 56, 10% with 96, 160 and 192
# after 64 as well; a SmolLM2 145-token prompt's first token came 3% sooner in 152 than in 160, a 37-token
# chat prompt's 10% sooner in 40 than in 48); each is one program to build
PREFILL_BUCKETS = (16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 152, 176, 208, 256)


@atexit.register
def end_threads() -> None:
    """End the engines' threads while the interpreter still runs (at its exit): a daemon thread
    that ends as it finalises (an idle engine's, 2 s after its last call) drops the last
    reference to its engine there, and freeing the engine's tensors without a GIL to take aborts
    the process ("terminate called without an active exception") after its work was done. A
    thread mid-step ends at its next step, or is left after ``EXIT_JOIN_S`` in all."""
    EXITING.set()
    threads = list(_THREADS.items())
    for _, ref in threads:
        engine = ref()
        if engine is not None:
            with engine._cond:
                engine._cond.notify_all()
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread, _ in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


@functools.lru_cache(maxsize=1024)
def chunking(n: int, sizes: tuple[int, ...], stages: int = 1) -> list[tuple[int, int]]:
    """(tokens, program length) of the chunks ``n`` tokens are prefilled in, programs of
    ``sizes`` tokens: the fewest tokens computed, padding included, plus ``STEP_TOKENS`` a
    chunk (so 145 tokens go in one chunk of 160, not in 128 and 17 padded to 32). Full chunks
    come first.

    ``stages``: the workers a prompt's chunks flow through at once (a pipelined prefill, each
    chunk following the one before): a chunk then runs on one stage while the one before runs
    on the next, and the prompt takes about ``work / stages + (stages - 1) / stages`` of its
    largest chunk's work, which this minimises over the largest chunk allowed (SmolLM2 on 2
    workers: 200 tokens as 112 + 88 first token 7% sooner than as one chunk, 250 as 128 + 122
    12%, 400 as 152 + 152 + 96 4% sooner than as 256 + 144; one stage is the sum alone)."""
    stages = max(1, int(stages))
    best: tuple[float, int, list[tuple[int, int]]] | None = None
    for top in sorted(sizes, reverse=True) if stages > 1 else [max(sizes)]:
        out = _fewest(n, tuple(s for s in sizes if s <= top))
        work = sum(STEP_TOKENS + size for _, size in out)
        largest = max(size for _, size in out)
        took = work / stages + (stages - 1) / stages * (STEP_TOKENS + largest)
        if best is None or (took, len(out)) < best[:2]:
            best = (took, len(out), out)
    assert best is not None
    return sorted(best[2], key=lambda c: -c[0])


def _fewest(n: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """The chunks of ``n`` tokens in programs of ``sizes`` that compute the fewest tokens, a step's
    fixed cost included: full chunks of the largest size, then the best cut of the last few."""
    top = max(sizes)
    full = max(0, (n - 2 * top) // top)        # NOTE: the largest chunk costs least a token
    rest = n - full * top
    cost = [(0, 0)] * (rest + 1)               # tokens left -> (cost, size of the next chunk)
    for left in range(1, rest + 1):
        cost[left] = min((STEP_TOKENS + s + cost[max(0, left - s)][0], -s) for s in sizes)
    out = [(top, top)] * full
    while rest > 0:
        size = -cost[rest][1]
        out.append((min(rest, size), size))
        rest -= size
    return out


def _picked(call: Call, rows: list[torch.Tensor]) -> list[int]:
    """The next token of each of ``call``'s live rows from its step's result: a token picked
    already (a greedy group's), or its logits, picked here as the call picks."""
    if all(r.dim() == 0 for r in rows):
        return [int(r) for r in rows]
    if call.sampling.do_sample:         # NOTE: a sampling call's groups always return logits
        return call.sampling.pick(torch.stack(rows)).tolist()
    return [int(r if r.dim() == 0 else r.argmax(dim=-1)) for r in rows]


def _chunk_feeds(s: Session, start: int, todo: list[int],
                 chunks: list[tuple[int, int]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(program length, step inputs) of each of ``chunks`` ((tokens, program length), in order) of
    ``todo``, session ``s``'s tokens cached from slot ``start`` on."""
    for n, length in chunks:
        yield length, _feed([(s.sid, start, todo[:n])], 1, length)
        todo, start = todo[n:], start + n


def _feed(rows: list[tuple[int, int, list[int]]], batch: int, length: int) -> dict[str, torch.Tensor]:
    """Step inputs for ``rows`` of (session, first slot, new tokens), left-padded to ``length``."""
    ids = torch.zeros((batch, length), dtype=torch.long)
    pos = torch.zeros((batch, length), dtype=torch.long)
    valid = torch.zeros((batch, length), dtype=torch.bool)
    sessions = torch.full((batch,), -1, dtype=torch.long)
    start = torch.zeros((batch,), dtype=torch.long)
    for b, (sid, first, toks) in enumerate(rows):
        n = len(toks)
        if n > length:
            raise BadInput(f"{n} tokens do not fit a step of {length}")
        ids[b, length - n:] = torch.tensor(toks, dtype=torch.long)
        pos[b, length - n:] = torch.arange(first, first + n)
        valid[b, length - n:] = True
        sessions[b], start[b] = sid, first
    return {"input_ids": ids, "position_ids": pos, "sb_sessions": sessions, "sb_start": start,
            "sb_valid": valid}


# --- the Hugging Face face ---------------------------------------------------------------------
def prompts_of(input_ids: Any, attention_mask: Any = None) -> list[list[int]]:
    """The real tokens of each row (those the mask keeps; every token without a mask)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        shape, dtype = getattr(input_ids, "shape", ""), getattr(input_ids, "dtype", "")
        got = f"{type(input_ids).__name__} {shape} {dtype}"
        raise BadInput(f"input_ids must be a (batch, length) LongTensor, got {got.strip()}")
    if attention_mask is None:
        rows = [r.tolist() for r in input_ids]
    else:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise BadInput(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                           f"{tuple(input_ids.shape)}: they must match")
        rows = [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise BadInput(f"row(s) {empty} of input_ids have no tokens the attention mask keeps")
    return rows


@dataclass(frozen=True)
class GenerateArgs:
    """A generate call's settings, with Hugging Face's defaults from the model's generation config."""

    max_new: int
    sampling: Sampling
    eos: tuple[int, ...]
    pad: int

    @classmethod
    def make(cls, gen_config: Any, length: int, max_new_tokens: int | None = None,
             do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None) -> GenerateArgs:
        def pick(value: Any, name: str, default: Any) -> Any:
            if value is not None:
                return value
            got = getattr(gen_config, name, None) if gen_config is not None else None
            return default if got is None else got

        if max_new_tokens is None:
            max_new_tokens = pick(None, "max_new_tokens", None)
            if max_new_tokens is None:
                max_new_tokens = max(1, int(pick(None, "max_length", 20)) - length)
        eos = pick(eos_token_id, "eos_token_id", ())
        eos_t = tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        pad = pick(pad_token_id, "pad_token_id", None)
        pad = int(pad) if pad is not None else (eos_t[0] if eos_t else 0)
        sampling = Sampling(bool(pick(do_sample, "do_sample", False)),
                            float(pick(temperature, "temperature", 1.0)), int(pick(top_k, "top_k", 50) or 0),
                            float(pick(top_p, "top_p", 1.0)), generator)
        return cls(int(max_new_tokens), sampling, eos_t, pad)


def stream_tokens(engine: Engine, input_ids: torch.Tensor, args: GenerateArgs, attention_mask: Any = None,
                  streamer: Any = None, session: Session | None = None) -> Iterator[torch.Tensor]:
    """The tokens of one call, a (batch,) tensor per step, as they come; ``streamer`` is fed too."""
    prompts = prompts_of(input_ids, attention_mask)
    call = engine.submit(prompts, args.max_new, args.sampling, args.eos, args.pad,
                         sessions=[session] if session is not None else None)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    seen = 0
    try:
        for row in engine.results(call):
            if streamer is not None:
                streamer.put(row)
            seen += 1
            yield row
    finally:
        engine.stopped(call, seen)     # NOTE: a caller that stops reading frees its sessions
        if streamer is not None:
            streamer.end()


def generate_tokens(engine: Engine, input_ids: torch.Tensor, args: GenerateArgs, attention_mask: Any = None,
                    streamer: Any = None, session: Session | None = None) -> torch.Tensor:
    """What Hugging Face ``generate`` returns: the prompt then the new tokens (``pad`` after EOS)."""
    rows = list(stream_tokens(engine, input_ids, args, attention_mask, streamer, session))
    return torch.cat([input_ids.cpu(), torch.stack(rows, dim=1)], dim=1)


class LocalRunner:
    """Step programs run in this process, with a KV store of its own: the reference of a
    distributed run, and what ``bench_generate`` compares Dask's cost with."""

    def __init__(self, model: Any, budget: int | str | None = None) -> None:
        from ..lower.kvcache import KVStore

        self.model = model
        self.budget = budget
        self.store = KVStore()
        self.programs: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()           # NOTE: torch.export is not thread-safe

    def program(self, batch: int, length: int) -> Any:
        from ..decompose import decompose
        from ..trace.decoder import trace_step

        key = (batch, length)
        with self._lock:
            if key not in self.programs:
                self.programs[key] = decompose(trace_step(self.model, batch, length), self.budget)
            return self.programs[key]

    def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        from ..lower.kvcache import using
        from .local import run_local

        graph = self.program(batch, length)
        with using(self.store, "local"):
            out = run_local(graph, *[feed[n] for n in graph.inputs], weights=self.model)
        return out[:, -1]

    def end_sessions(self, sessions: Sequence[int], renamed: Sequence[tuple[int, int, int]] = ()) -> None:
        for old, new, keep in renamed:
            self.store.rename("local", old, new, keep)
        self.store.drop("local", set(sessions))

    def recover(self, error: BaseException) -> None:
        raise error
