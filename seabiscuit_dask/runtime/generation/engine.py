"""The engine: the loop that ties the scheduler, the executor, the sessions and their caches.

``Engine`` takes a deployment's generate calls and runs them on a thread of its own,
one step at a time: the ``Scheduler`` decides the step (a plain ``SchedulerOutput``),
the ``Executor`` carries it out through the ``Runner``, and the engine hands each call
its tokens and ends the calls that are done, freeing their caches (``KVLedger``) and
cutting kept sessions back to what their callers heard (``SessionTable.rewind``).
A call admitted while others decode joins them at the next step.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ... import config
from ...errors import BadInput, Busy, ModelClosed, QueueTimeout, SessionClosed
from ...lower.dims import Dims
from ..dataplane.loops import logprob_of_row
from ..watch import seconds
from .executor import EngineStats, Executor, LaneResult, NotRead, Result
from .inputs import step_inputs
from .kv import KVLedger
from .output import Prefill, SchedulerOutput
from .prefix import PrefixCache
from .runner import Runner
from .sampling import History, Sampling, TokenLogprob
from .scheduler import Scheduler, SchedulerSpec
from .sessions import Call, Session, SessionTable, after_turn

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 2.0    # NOTE: how long the engine's thread waits for work before it ends
EXIT_JOIN_S = 5.0    # NOTE: how long the interpreter's exit waits for the engines' threads, in all
EXITING = threading.Event()         # NOTE: set as the interpreter exits (``end_threads``)


def session_table(max_sessions: int | None, context: int | None, name: str = "model") -> SessionTable:
    """The sessions of a deployment that kept room for ``max_sessions`` of ``context`` tokens (None:
    the configured sessions, no room counted): a deployment that kept KV room counts it in tokens."""
    limit = max_sessions if max_sessions is not None else config.get("generate.max-sessions")
    return SessionTable(int(limit), name, int(config.get("generate.max-queued")),
                        context if max_sessions is not None else None, int(config.get("generate.max-rows")))


def step_shapes(max_sessions: int | None, context: int | None,
                max_chunk: int | None) -> tuple[tuple[Dims, Dims], list[tuple[int, int]]]:
    """What the engine of such a deployment asks its runner for: the shapes its general decode and
    prefill programs serve (``SchedulerSpec.dims``), and the (rows, tokens) ``warm`` builds."""
    rows = session_table(max_sessions, context).max_rows
    spec = SchedulerSpec.from_config(max_chunk=max_chunk)
    return spec.dims(rows), Scheduler(spec).shapes(None, None, rows)


class Engine:
    """Runs the generate calls of one deployment on a background thread (see module doc)."""

    def __init__(self, runner: Runner, *, max_sessions: int | None = None, context: int | None = None,
                 max_chunk: int | None = None, name: str = "model") -> None:
        self.runner = runner
        self.name = name
        self.sessions = session_table(max_sessions, context, name)
        self.queue_timeout_s = seconds("generate.queue-timeout")
        self.kv = KVLedger(runner, context, name)
        # NOTE: where the room is counted in tokens, a new session counts what it holds and ``headroom``
        # tokens more, a block more as it decodes; where the room runs out, the newest call running is
        # preempted and waits here to be recomputed, before any new call (``_grow_rooms``, ``_readmit``)
        self.on_demand = bool(self.sessions.max_tokens) and bool(config.get("generate.kv-on-demand"))
        self.headroom = max(0, int(config.get("generate.kv-headroom") or 0))
        self._preempted: deque[Call] = deque()
        # NOTE: finished sessions' caches kept for prompts that begin as theirs did, where the room
        # is counted in tokens (it bounds what is kept)
        self.prefixes = PrefixCache() if self.sessions.max_tokens and config.get("generate.prefix-caching") \
            else None
        self.spec = SchedulerSpec.from_config(max_chunk=max_chunk, chains_steps=runner.chains_steps,
                                              edits_loops=bool(getattr(runner, "edits_loops", False)))
        self.scheduler = Scheduler(self.spec, self._flow, lambda: runner.prefill_room)
        self.stats = EngineStats()
        self.executor = Executor(runner, self.scheduler.replay, self.stats, self.spec.pipeline,
                                 self.spec.lane_steps)
        # NOTE: lane -> calls that ended there before their last token (an EOS, a stop, an error) with
        # the error each ends with: its loop may write their rows till it hears they left, so their
        # room, caches and end wait till it did (``_unpark``); and the sessions known gone meanwhile
        self._parked: dict[int, list[tuple[Call, BaseException | None]]] = {}
        self._gone: dict[int, set[int]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        # NOTE: admissions that prefill while rows decode (``SchedulerSpec.overlap``): run on a thread of
        # their own, their results land here and are handed out on the engine's thread
        self._admitting = ThreadPoolExecutor(1, thread_name_prefix="seabiscuit-admit")
        self._landed: list[tuple[SchedulerOutput, dict[int, Result]]] = []
        # NOTE: done when work comes for the engine's thread (an admission landed, a call, a close):
        # a round that waits for its lanes' steps stops waiting
        self._wake: concurrent.futures.Future[None] = concurrent.futures.Future()

    def _poke(self) -> None:
        """Wake the engine's thread from a wait for its lanes' steps (lock held)."""
        if not self._wake.done():
            self._wake.set_result(None)

    def _flow(self) -> tuple[bool, int]:
        """Whether the runner sends a prompt's chunks at once now, and the stages they flow through."""
        pipelined = bool(self.runner.pipelines_prefill)
        return pipelined, int(self.runner.prefill_stages) if pipelined else 1

    # --- what callers read ---------------------------------------------------------------------
    @property
    def max_sessions(self) -> int:
        """Sessions open at once at most (rows: with KV room counted in tokens, more than the
        sessions the deployment kept room for, each shorter than its context)."""
        return self.sessions.max_rows

    @property
    def open_sessions(self) -> int:
        """Sessions open now: rows of calls running or waiting, and kept sessions."""
        return self.sessions.open

    _open = open_sessions       # NOTE: what ``serve``'s metrics read

    def load(self) -> dict[str, float]:
        """What the engine holds now and did so far: calls running and waiting to start, steps and
        the tokens they computed, kept caches and the prompts that reused one, the share of the KV
        room in use (figures of a moment, read without the lock)."""
        st, prefixes = self.stats, self.prefixes
        steps = st.prefill_steps + st.decode_steps
        lookups = st.new_sessions
        return {"running": len(self.scheduler.running) + len(self.scheduler.prefilling),
                "waiting": len(self.scheduler.waiting) + len(self.sessions.queue) + len(self._preempted),
                "steps": steps, "step_tokens": st.step_tokens,
                "tokens_per_step": st.step_tokens / steps if steps else 0.0,
                "prefix_kept": len(prefixes) if prefixes is not None else 0,
                "prefix_hits": st.prefix_hits, "prefix_tokens": st.prefix_tokens,
                "prefix_hit_rate": st.prefix_hits / lookups if lookups else 0.0, "prefix_queries": lookups,
                "kv_usage": self.sessions.usage, "preemptions": st.preemptions}

    @property
    def context(self) -> int | None:
        return self.kv.context

    @property
    def prefill_sizes(self) -> tuple[int, ...]:
        return self.spec.prefill_sizes

    def rename(self, name: str) -> None:
        """Name the deployment in messages as its caller knows it (a served model's name)."""
        self.name = self.sessions.name = self.kv.name = name

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.spec.batch_sizes

    @property
    def pipeline(self) -> int:
        return self.spec.pipeline

    def chunking(self, n: int, alone: bool | None = None) -> list[tuple[int, int]]:
        """(tokens, program length) of the chunks ``n`` tokens are prefilled in: a prompt prefilled
        alone (by default), or among others (``alone=False``: they fill the pipeline already)."""
        return self.scheduler.chunking(n, self.spec.pipeline if alone is False else 1)

    # --- calls ---------------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], max_new: int, sampling: Sampling,
               eos: Sequence[int], pad: int, sessions: Sequence[Session] | None = None) -> Call:
        """Queue a call; its ``out`` queue gets a (rows,) tensor per step, then None (or an error)."""
        if max_new < 1:
            raise BadInput(f"max_new_tokens must be >= 1, got {max_new}")
        if sessions is None:
            self.kv.check_call(prompts, max_new)
            # NOTE: a call must fit the room alone, whole; it counts what its sessions hold now
            self.sessions.check_rows(len(prompts), self.sessions.room([len(p) + max_new for p in prompts]))
            rooms = [self._counted(len(p), len(p) + max_new) for p in prompts]
            room = sum(rooms)
            with self._cond:
                self._make_room(len(prompts), room)
                self.sessions.wait(len(prompts), self._cond, self.queue_timeout_s, lambda: self._closed, room)
            call = self.sessions.call(prompts, max_new, sampling, eos, pad)
            call.room = room
            for s, r in zip(call.sessions, rooms):
                s.room = r
            self._reuse(call)
        else:
            for s in sessions:
                after_turn(s, self.name)
            for s, p in zip(sessions, prompts):
                self.kv.check_turn(s, p, max_new)
            call = self.sessions.turn(sessions, prompts, max_new, sampling, eos, pad)
        with self._cond:
            if self._closed:
                raise ModelClosed(f"{self.name} is closed: it takes no more generate calls")
            self.scheduler.add(call)
            self.stats.new_sessions += 0 if sessions is not None else len(call.sessions)
            self._cond.notify()
            self._poke()
            self._start_thread()
        return call

    def _counted(self, holds: int, most: int) -> int:
        """KV tokens a new session counts that holds ``holds`` tokens and may hold ``most``: the blocks
        of ``most`` where the room is counted whole at the start, else of ``holds`` and the headroom."""
        return self.sessions.room([min(holds + self.headroom, most) if self.on_demand else most])

    def _make_room(self, rows: int, room: int) -> None:
        """Let go of kept caches, oldest first, until a call of ``rows`` sessions and ``room`` KV
        tokens fits (lock held); their frees go from the engine's thread."""
        while self.prefixes is not None and not self.sessions.fits(rows, room):
            gone = self.prefixes.evict()
            if gone is None:
                return
            self.sessions.tokens -= gone[1]
            self.kv.drop_later(gone[0])
            self._cond.notify()
            self._start_thread()

    def _reuse(self, call: Call) -> None:
        """Start each new session of ``call`` whose prompt begins as a kept cache's tokens did with a
        copy of those slots: only the rest is prefilled (``prefix``)."""
        if self.prefixes is None:
            return
        with self._cond:
            hits = [(s, self.prefixes.match(s.tokens)) for s in call.sessions]
        forks = [(h[0], s.sid, h[1]) for s, h in hits if h is not None]
        if not forks:
            return
        try:
            self.kv.fork(forks)
            for s, h in hits:
                if h is not None:
                    s.cached = h[1]
            with self._cond:
                self.stats.prefix_hits += len(forks)
                self.stats.prefix_tokens += sum(n for _, _, n in forks)
        except Exception as e:  # noqa: BLE001 - the prompts are prefilled whole instead
            logger.warning("%s: kept caches not copied (%s); the prompts are prefilled whole", self.name, e)
        finally:
            with self._cond:
                for src, _, _ in forks:
                    self.prefixes.unpin(src)

    def _keep(self, call: Call, freed: list[int]) -> list[int]:
        """The sessions of ``freed`` (a finished call's) whose caches are let go: the others are kept
        for prompts that begin as theirs (``prefix``), where the room has space and no call waits."""
        if self.prefixes is None or call.keep:
            return freed
        kept = set()
        with self._cond:
            for s in call.sessions:
                room = self.sessions.room([s.cached])
                if s.sid in freed and not self.sessions.queue and not self.sessions.held \
                        and self.sessions.fits(0, room) \
                        and self.prefixes.keep(s.sid, s.tokens[:s.cached], room):
                    self.sessions.tokens += room
                    kept.add(s.sid)
        return [sid for sid in freed if sid not in kept]

    # --- KV room on demand: growth, preemption, recomputation ------------------------------------
    def _grow_rooms(self) -> None:
        """Count a block more for each running session whose tokens (and the headroom) pass what it
        counted, oldest call first; where the room lacks it (kept caches let go first), preempt the
        newest call running, this one last (``_preempt``), as vLLM's scheduler does."""
        if not self.on_demand:
            return
        calls = sorted((c for c in self.scheduler.running if not c.keep and not c.finished),
                       key=lambda c: (c.admitted or 0.0, c.cid))
        for call in calls:
            for s in (call.live if not call.finished else []):
                need = self._need(call, s)
                if need > s.room and not self._count(call, s, need - s.room, calls):
                    break

    def _count(self, call: Call, s: Session, more: int, calls: Sequence[Call]) -> bool:
        """Count ``more`` KV tokens for session ``s`` of ``call``, preempting calls of ``calls``
        (oldest first) from the newest while the room lacks them; False where ``call`` itself was."""
        while True:
            with self._cond:
                self._make_room(0, more)
                if self.sessions.grow(more):
                    s.room += more
                    call.room += more
                    return True
                # NOTE: a preempted call's rows still in a lane give its room back once they left it:
                # counted then (the next round), rather than preempting another call meanwhile
                coming = sum(c.room for parked in self._parked.values() for c, _ in parked
                             if c.preempted is not None)
                if coming >= more:
                    return True
            victim = next(c for c in reversed(calls) if not c.finished)
            self._preempt(victim)
            if victim is call:
                return False

    def _preempt(self, call: Call) -> None:
        """End ``call``'s rows where they are (its room given back and its caches freed once its rows
        left their lane), to be recomputed from its prompts and the tokens it gave so far before any
        call that waits (``_requeue``, ``_readmit``): its caller reads on, a pause the only sign."""
        with self._cond:
            call.preempted = {s.sid for s in call.live}
            call.waits_since = time.monotonic()
            self.sessions.held += len(call.sessions)
            self.stats.preemptions += 1
        logger.info("%s: the KV room is full: call %s preempted after %s of %s new tokens; it is "
                    "recomputed once room frees", self.name, call.cid, call.produced, call.max_new)
        try:
            self._finish(call, None)
        except BaseException:
            with self._cond:
                self.sessions.held -= len(call.sessions)
            call.preempted = None
            raise

    def _requeue(self, call: Call) -> None:
        """A preempted call whose caches were freed: its live rows start anew under new ids (a step of
        theirs still running finds nothing to write to), to wait for room (``_readmit``); where the
        deployment closed meanwhile, it ends."""
        with self._cond:
            closed = self._closed
            if closed:
                self.sessions.held -= len(call.sessions)
            else:
                for s in call.sessions:      # NOTE: every row's cache was freed, ended rows' too
                    if s.sid in (call.preempted or ()):
                        s.sid, s.done = self.sessions.next_id(), False
                    s.cached, s.room = 0, 0
                call.room = 0
                self._preempted.append(call)
                self._cond.notify_all()
                self._poke()
                self._start_thread()
        if closed:
            self._end_preempted(call)

    def _end_preempted(self, call: Call) -> None:
        """Tell the caller of a preempted call that will not be recomputed why it ended (its
        ``closing``, else the deployment closed)."""
        call.out.put(call.closing or ModelClosed(
            f"{self.name} was closed after {call.produced} of {call.max_new} new tokens of this call, "
            "while it waited to be recomputed: it did not finish"))
        call.ended.set()

    def _readmission(self, call: Call) -> list[int]:
        """KV tokens each live row of preempted ``call`` counts to be recomputed."""
        return [self._need(call, s) for s in call.live]

    def _need(self, call: Call, s: Session) -> int:
        """KV tokens session ``s`` of ``call`` counts now: what it holds (its answer may reach its
        prompt and ``max_new`` tokens at most)."""
        return self._counted(len(s.tokens), call.base[call.sessions.index(s)] + call.max_new)

    def _readmits(self) -> bool:
        """Whether the first preempted call goes on now: it fits the room (kept caches let go), or
        it ends (its caller stopped reading, it waited past ``generate.queue-timeout``, or nothing
        running could free the room it needs) (lock held)."""
        if not self._preempted:
            return False
        call = self._preempted[0]
        if call.stopping:
            return True
        need = sum(self._readmission(call))
        self._make_room(len(call.sessions), need)
        return self.sessions.fits(len(call.sessions), need) or self._cannot_wait(call, need) is not None

    def _cannot_wait(self, call: Call, need: int) -> BaseException | None:
        """Why preempted ``call`` cannot wait for room any longer: it waited past the queue's bound,
        or no call runs that could free room and what holds it is kept sessions (``dm.session()``),
        which free it only when closed (lock held)."""
        waited = time.monotonic() - (call.waits_since or time.monotonic())
        made = (f"this call was preempted after {call.produced} of {call.max_new} new tokens (the KV room "
                "ran out)")
        if waited > self.queue_timeout_s:
            return QueueTimeout(f"{self.name}: {made} and waited {waited:.0f} s to be recomputed "
                                "(seabiscuit.generate.queue-timeout); try again later")
        s = self.scheduler
        if s.running or s.prefilling or s.waiting or any(self._parked.values()):
            return None
        return Busy(f"{self.name}: {made} and needs {need} KV tokens to go on; {self.sessions.tokens} of "
                    f"{self.sessions.max_tokens} are held by sessions kept open (dm.session()), which free "
                    "them only when closed: close sessions, ask for fewer tokens, or deploy with more room")

    def _readmit(self) -> None:
        """Admit the preempted calls again, first preempted first, while the room holds them (kept
        caches let go first), before any call that waits; a call its caller stopped reading goes
        too, to end at its admission; one that cannot wait longer (``_cannot_wait``) ends with why
        (lock held)."""
        while self._preempted:
            call = self._preempted[0]
            rooms = [0] * len(call.live) if call.stopping else self._readmission(call)
            self._make_room(len(call.sessions), sum(rooms))
            if not call.stopping and not self.sessions.fits(len(call.sessions), sum(rooms)):
                error = self._cannot_wait(call, sum(rooms))
                if error is None:
                    return
                self._preempted.popleft()
                self.sessions.held -= len(call.sessions)
                call.closing, call.finished = error, True
                self._end_preempted(call)
                self._cond.notify_all()
                continue
            self._preempted.popleft()
            self.sessions.held -= len(call.sessions)
            self.sessions.open += len(call.sessions)
            self.sessions.tokens += sum(rooms)
            for s, r in zip(call.live, rooms):
                s.room = r
            call.room, call.preempted, call.finished = sum(rooms), None, False
            self.scheduler.add(call, first=True)
            self._cond.notify_all()         # NOTE: calls waiting for room, held back while it waited

    def open_session(self) -> Session:
        """A session kept across calls (``DistributedModel.session``); counted until ``close_session``."""
        with self._cond:
            if self.sessions.held:
                raise Busy(f"{self.name}: a call preempted where the KV room ran out waits to be recomputed; "
                           "open the session once it has gone on")
            self._make_room(1, self.sessions.kept_room)
            return self.sessions.keep()

    def close_session(self, session: Session, wait: bool = True) -> None:
        """Free a kept session's caches; a turn of it still running ends at its next step with
        ``SessionClosed`` and frees them as it ends (its steps would rebuild what is freed now).
        ``wait=False`` (a session its caller dropped, from a finalizer on any thread): the
        engine's thread frees them."""
        with self._cond:
            if session.closed:
                return
            self.sessions.release(1, self.sessions.kept_room)
            self._cond.notify_all()             # NOTE: calls waiting for room
            session.closed = True
            call = session.call
            running = call is not None and not call.finished
            if running and call is not None and call.closing is None:
                call.closing = SessionClosed(f"{self.name}: session {session.sid} was closed after "
                                             f"{call.produced} of {call.max_new} new tokens of its turn")
                self._cond.notify()
            if not running and not wait:
                self.kv.drop_later(session.sid)
                self._cond.notify()
                self._start_thread()
        if not running and wait:
            self.kv.end([session.sid])

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
            for call in self.scheduler.waiting + self.scheduler.running + self.scheduler.prefilling:
                call.closing = ModelClosed(f"{self.name} was closed after {call.produced} of "
                                           f"{call.max_new} new tokens of this call: it did not finish")
            self._cond.notify_all()             # NOTE: the loop, and calls waiting for room
            self._poke()
            thread = self._thread
            preempted, self._preempted = list(self._preempted), deque()
            self.sessions.held -= sum(len(c.sessions) for c in preempted)
        for call in preempted:          # NOTE: no room counted, no caches: told at once
            self._end_preempted(call)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self.executor.close()
        if thread is None or not thread.is_alive():
            for lane in list(self._parked):         # NOTE: their loops are let go: the calls end
                self._unpark(lane, None)
        self.kv.flush()
        self._admitting.shutdown(wait=False)

    def warm(self, lengths: Sequence[int] | None = None, batches: Sequence[int] | None = None,
             progress: Callable[[str], None] | None = None) -> list[str]:
        """Build and run once the step programs generation asks for (``Scheduler.shapes``), each
        on sessions of its own whose caches go at once; the shapes ("batch x tokens") made ready
        (one of each program: a general one serves every shape of its kind, ``lower.dims``).
        Each program's first run (the workers load its blocks and run them) goes on while the
        next one is built here; the runs go one after another, in order."""
        runs: list[tuple[str, float, concurrent.futures.Future[None]]] = []
        seen: set[int] = set()
        with ThreadPoolExecutor(1, thread_name_prefix="seabiscuit-warm") as pool:
            for b, n in self.scheduler.shapes(lengths, batches, self.max_sessions):
                t0 = time.perf_counter()
                program = self.runner.prepare(b, n)
                if program is not None and id(program) in seen:
                    continue            # NOTE: a general program (any rows, any length) runs once
                seen.add(id(program))
                runs.append((f"{b}x{n}", t0, pool.submit(self._run_once, b, n)))
            for shape, t0, ran in runs:
                ran.result()
                if progress is not None:
                    progress(f"step program {shape} ready in {time.perf_counter() - t0:.2f} s")
        return [shape for shape, _, _ in runs]

    def _run_once(self, b: int, n: int) -> None:
        """One step of ``b`` rows of ``n`` tokens, each a first chunk at slot 0 of a session of its
        own, whose caches go at once."""
        sids = [self.sessions.next_id() for _ in range(b)]
        try:
            self.runner.run_step(b, n, step_inputs([(sid, 0, [0] * n) for sid in sids], b, n))
        finally:
            self.kv.end(sids)

    # --- the loop ------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        """Whether the loop has calls to run, caches to free, or its close to finish (lock held)."""
        return self.scheduler.has_calls or self._closed or self.kv.owed or bool(self._landed) \
            or bool(self._preempted)

    def _ready(self) -> bool:
        """Whether the loop has a step to take now, not only an admission in flight to wait for
        (lock held)."""
        s = self.scheduler
        idle = not s.prefilling         # NOTE: one admission in flight at a time
        return bool(self._landed or self.kv.owed or s.running or s.lanes_leaving
                    or ((s.waiting or self._closed) and idle) or self._readmits())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._ready() or EXITING.is_set()):
                    # NOTE: idle, the thread ends (and starts again with the next call): a model
                    # its caller dropped is not kept alive by it; an admission in flight is waited for
                    if not self._cond.wait(IDLE_EXIT_S) and not self._has_work():
                        break
                if EXITING.is_set() or not self._has_work():    # NOTE: exiting: ``end_threads``
                    self._thread = None
                    return
                owed = self.kv.take_owed()
                landed, self._landed = self._landed, []
                if self._wake.done():       # NOTE: what woke it is taken now; what comes later wakes anew
                    self._wake = concurrent.futures.Future()
                if self._closed and not self.scheduler.has_calls and not landed:
                    return
            self.kv.free_then(owed, (), lambda: None)
            for admission, got in landed:
                self._joined(admission, got)
            out = SchedulerOutput(-1)
            try:
                self._grow_rooms()
                with self._cond:
                    self._readmit()
                    out = self.scheduler.schedule()
                self.step(out)
            except Exception as e:  # noqa: BLE001 - a fault of the engine's own: its calls fail, none hangs
                self._fault(out, e)
            if not self.scheduler.running:
                self.executor.drop_ahead()

    def _fault(self, out: SchedulerOutput, error: Exception) -> None:
        """A step's bookkeeping raised (a fault here, not a step that failed: those fail their own
        calls): every call the step or the engine holds fails with it, so no caller waits forever."""
        logger.error("%s: a generation step failed in the engine (%s: %s); its calls fail", self.name,
                     type(error).__name__, error)
        calls = {c.cid: c for c in [*self.scheduler.running, *self.scheduler.prefilling]}
        for a in out.admitted:
            try:
                calls[a.call] = self.scheduler.call(a.call)
            except KeyError:
                pass            # NOTE: ended already
        for call in calls.values():
            if not call.finished:
                try:
                    self._finish(call, call.closing or error)
                except Exception as e:  # noqa: BLE001 - the others still end
                    logger.error("%s: call %s not ended cleanly: %s: %s", self.name, call.cid,
                                 type(e).__name__, e)

    def step(self, out: SchedulerOutput) -> None:
        """Carry out one step's record and hand its calls their tokens."""
        for cid in out.ended:
            call = self.scheduler.call(cid)
            self._finish(call, call.closing)
        if out.admitted and self.spec.overlap:
            self._admitting.submit(self._admit, out)
        elif out.admitted:
            self._admitted(out, self.executor.admit(out))
        if out.decodes or out.lanes:
            decoded = self.executor.decode(out) if out.decodes else []
            self._decoded(out, decoded, self.executor.lanes(out, self._wake) if out.lanes else [])

    def _admit(self, out: SchedulerOutput) -> None:
        """Prefill an admission while the running rows decode (on the admitting thread); its results
        land for the engine's thread to hand out (``_joined``)."""
        try:
            got = self.executor.admit(out)
        except BaseException as e:  # noqa: BLE001 - each call of the admission gets it
            got = {a.call: e for a in out.admitted}
        with self._cond:
            self._landed.append((out, got))
            self._cond.notify()
            self._poke()

    def _joined(self, out: SchedulerOutput, got: dict[int, Result]) -> None:
        """An admission that prefilled alongside the decoding: its first tokens out, its calls decode."""
        calls = [self.scheduler.call(a.call) for a in out.admitted]
        self._admitted(out, got)
        for call in calls:
            if not call.finished:
                self.scheduler.joined(call)

    def _admitted(self, out: SchedulerOutput, got: dict[int, Result]) -> None:
        """Each admitted call's first tokens, picked from its prompts' logits, to its caller."""
        for a in out.admitted:
            call, res = self.scheduler.call(a.call), got[a.call]
            if isinstance(res, BaseException):
                self._finish(call, call.closing or res)
                continue
            stop = {p.session: p.chunks[-1].stop for p in a.prefills if p.chunks}
            try:
                self._copy_twins(call, a.prefills, stop)
            except Exception as e:  # noqa: BLE001 - this call fails, the others go on
                self._finish(call, call.closing or e)
                continue
            for s, p in zip(call.live, a.prefills):       # NOTE: a preempted call prefills its live rows
                s.cached = stop[p.twin if p.twin >= 0 else p.session]
            self._guard(call, lambda c, res=res: self._pick(c, list(res)))

    def _copy_twins(self, call: Call, prefills: Sequence[Prefill], stop: dict[int, int]) -> None:
        """Start each twin of ``prefills`` (a row of ``call`` whose prompt another row of it
        prefilled) with a copy of that row's cache on every worker (``KVStore.fork``). A twin that
        started from a kept cache (``_reuse``) counted its hit then: only the tokens past it count."""
        forks = [(p.twin, p.session, stop[p.twin]) for p in prefills if p.twin >= 0]
        if not forks:
            return
        self.kv.fork(forks)
        had = {s.sid: s.cached for s in call.sessions}
        with self._cond:
            self.stats.prefix_hits += sum(1 for _, sid, _ in forks if not had[sid])
            self.stats.prefix_tokens += sum(n - had[sid] for _, sid, n in forks)

    def _decoded(self, out: SchedulerOutput, results: list[Result], lanes: Sequence[LaneResult] = ()) -> None:
        """Each running call's next tokens from its groups' and lanes' results, to its caller; a
        call of a group or lane that failed, or that the deployment's close ends, ends. A call in
        a lane whose step did not run its rows yet (it joined a loop that runs ahead) waits."""
        got: dict[int, torch.Tensor] = {}
        lps: dict[int, TokenLogprob | None] = {}       # NOTE: what a lane's worker sent of its rows' picks
        failed: dict[int, BaseException] = {}
        owner = {s.sid: (c, s) for c in self.scheduler.running for s in c.live}
        for g, res in zip(out.decodes, results):
            for i, r in enumerate(g.rows):
                c, s = owner[r.session]
                if isinstance(res, BaseException):
                    failed[c.cid] = c.closing or res
                else:
                    s.cached = r.stop
                    got[r.session] = res[i]
        for ls, lres in zip(out.lanes, lanes):
            if isinstance(lres, NotRead):
                continue                    # NOTE: its step was not ready: its calls wait a round
            if lres is None or isinstance(lres, BaseException):
                for sid in ls.sessions:
                    if sid in owner and lres is not None:
                        c, _ = owner[sid]
                        failed[c.cid] = c.closing or lres
                self._unpark(ls.lane, None)       # NOTE: its loop was let go
                continue
            tokens, rows, gone, extra = lres
            for i, sid in enumerate(rows.tolist()):
                if sid in owner and self.scheduler.in_lane(owner[sid][0]) == ls.lane:
                    s = owner[sid][1]
                    s.cached += 1
                    got[sid] = tokens[i]
                    if extra:
                        lps[sid] = logprob_of_row(extra, i)
            self._unpark(ls.lane, gone)
        for c in list(self.scheduler.running):
            if c.closing is not None:     # NOTE: a token computed as the model closed is not emitted
                self._finish(c, c.closing)
            elif c.cid in failed:
                self._finish(c, failed[c.cid])
            elif all(s.sid in got for s in c.live):
                self._guard(c, lambda c: self._pick(c, [got[s.sid] for s in c.live],
                                                    [lps.get(s.sid) for s in c.live]))

    def _unpark(self, lane: int, gone: set[int] | None) -> None:
        """End the parked calls of ``lane`` whose sessions left it for good (``gone``, with those known
        before; None: its loop was let go, so all did): their room, caches and end (``_release``)."""
        parked = self._parked.get(lane)
        if not parked:
            return
        known = self._gone.setdefault(lane, set())
        mine = {s.sid for call, _ in parked for s in call.sessions}
        known |= mine if gone is None else mine & gone
        done = [p for p in parked if all(s.sid in known for s in p[0].sessions)]
        if done:
            self._parked[lane] = [p for p in parked if p not in done]
            for call, error in done:
                known.difference_update(s.sid for s in call.sessions)
                self._release(call, error)

    def _guard(self, call: Call, fn: Callable[..., None]) -> None:
        try:
            fn(call)
        except BaseException as e:  # noqa: BLE001 - the caller gets it; other calls go on
            self._finish(call, call.closing or e)

    # --- results -------------------------------------------------------------------------------
    def _pick(self, call: Call, rows: list[torch.Tensor],
              picked: list[TokenLogprob | None] | None = None) -> None:
        """Pick the next token of every live row of ``call`` from its step's result (``rows``: a token
        picked on the workers, with ``picked``, the log-probabilities they sent; or logits) as the
        call asks, and hand them to its caller."""
        live = call.live
        at = [call.sessions.index(s) for s in live]
        rules = call.sampling.rules.active
        histories = [History(s.tokens, call.base[i]) for s, i in zip(live, at)] if rules else []
        grammar = call.sampling.grammar
        if grammar is not None and call.matchers is None:
            call.matchers = [grammar.matcher() for _ in call.sessions]
        matchers = [call.matchers[i] for i in at] if call.matchers else []
        for m, s, i in zip(matchers, live, at):
            # NOTE: a row's tokens picked on the workers (in a lane) reach its matcher here, before
            # it picks here again (after a preemption, or a step fed from here)
            for t in s.tokens[call.base[i] + m.fed:]:
                m.accept(t)
        draws = [(i, len(s.tokens) - call.base[i]) for s, i in zip(live, at)] if call.base else None
        tokens, logprobs = call.sampling.choose(rows, histories, call.eos, matchers, draws, picked)
        self._emit(call, tokens, logprobs)

    def _emit(self, call: Call, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Hand the next token of every live row of ``call`` (``tokens``) to its caller, and their
        log-probabilities (``call.logprobs``, read with the row) where the call asked for them."""
        live = call.live
        row = torch.full((len(call.sessions),), call.pad, dtype=torch.long)
        step: list[TokenLogprob | None] = [None] * len(call.sessions)
        for i, (s, t) in enumerate(zip(live, tokens)):
            s.tokens.append(int(t))
            at = call.sessions.index(s)
            row[at] = int(t)
            if logprobs is not None:
                step[at] = logprobs[i]
            if int(t) in call.eos:
                s.done = True
        call.produced += 1
        if call.sampling.logprobs is not None:
            call.logprobs.append(step)      # NOTE: before its row: the reader takes both together
        self.stats.tokens += len(live)
        if call.produced >= call.max_new:
            for s in call.sessions:
                s.done = True
        call.out.put(row)
        if not call.live:
            self._finish(call, None)

    def _finish(self, call: Call, error: BaseException | None) -> None:
        lane = self.scheduler.finish(call)
        for s in call.sessions:
            s.done = True
        self.executor.forget({s.sid for s in call.sessions})   # NOTE: a step queued for them is never needed
        if lane is not None and call.produced < call.max_new:
            # NOTE: its rows may still run (a call's rows stop by themselves after its last token only)
            with self._cond:
                call.finished = True
            self._parked.setdefault(lane, []).append((call, error))
            return
        self._release(call, error)

    def _release(self, call: Call, error: BaseException | None) -> None:
        """A finished call's room given back, its caches freed (or kept for a prompt that begins as
        its did), and its end told to its caller; a preempted call's caches freed, then it waits to
        be recomputed (``_requeue``)."""
        if call.preempted is not None:
            with self._cond:
                call.finished = True
                self.sessions.release(len(call.sessions), call.room)
                self._cond.notify_all()
            self.kv.free_then([s.sid for s in call.sessions], (), lambda: self._requeue(call))
            return
        with self._cond:
            call.finished = True
            seen = call.seen
            if not call.keep:
                self.sessions.release(len(call.sessions), call.room)
                self._cond.notify_all()         # NOTE: calls waiting for room
        freed = [s.sid for s in call.sessions if not call.keep or s.closed]    # NOTE: closed as it ran
        if error is None and not call.cancelled:        # NOTE: a caller that hung up will not resend
            freed = self._keep(call, freed)
        moved: list[tuple[int, int, int]] = []
        if call.keep:
            # NOTE: a turn its caller stopped, or one whose decode loop may have run on past its EOS
            ahead = self.spec.loop_steps > 1 and call.produced < call.max_new
            if error is not None and not isinstance(error, ModelClosed):
                moved = self.sessions.rewind(call, call.before)     # NOTE: undone whole: sent again, it fits
            elif seen is not None or ahead:
                moved = self.sessions.rewind(call, [b + (call.produced if seen is None else seen)
                                                    for b in call.base])
        def end() -> None:
            call.out.put(error if error is not None else None)
            call.ended.set()

        # NOTE: its caller hears of its end once its caches are freed, off the engine's thread
        self.kv.free_then(freed, moved, end)

    def stopped(self, call: Call, seen: int) -> None:
        """The caller of ``call`` stopped reading it after ``seen`` rows (or read them all): it ends
        at the next step; a kept session's conversation keeps the tokens read (``rewind``)."""
        with self._cond:
            call.cancelled = True
            if not call.finished:
                call.seen = seen
                return
        if call.keep and seen < call.produced:      # NOTE: it ended as the caller stopped
            self.kv.free([], self.sessions.rewind(call, [b + seen for b in call.base]))


# NOTE: each engine's thread, while it lives, and its engine (neither kept alive by this)
_THREADS: weakref.WeakKeyDictionary[threading.Thread, weakref.ref[Engine]] = weakref.WeakKeyDictionary()


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
