"""``DataPlane``: a worker's run manager. Blocks run when their inputs arrive; outputs go
straight to the workers of the blocks that read them, and to the caller that collects them.

Every message names (model, plan version, request, block) and shows the model's
*ticket* (a secret the scheduler plugin gives the deploying client and the
workers): a message for an older plan than the worker holds is refused
(``StaleRun``), a repeated one changes nothing, and one for a run that failed or
was forgotten is dropped. A failure (a block raised, a peer could not be reached)
fails the run here and at every worker downstream, so the caller hears of it at
once and sends the request again under a new id. Runs in flight are bounded
(``seabiscuit.runtime.data-plane-runs``; the oldest is failed past it).

It runs on the worker's event loop and is plain asyncio over injected callables,
so tests drive it without a cluster: ``compute`` runs a block (in ``executor``),
``spec_of`` finds a block's spec (``load_spec`` loads it off the loop), ``send``
delivers a one-way message to another worker (``push``, ``feed`` or ``fail``; on a
cluster down the stream to that peer, ``streams``, which ``receive`` reads), ``check``
verifies a ticket, ``ready`` says whether a block of a run that follows another (a prompt's
chunk after the one before it, ``feed(after=...)``) finds the cache writes it reads done here.

A prompt prefilled in chunks is sent chunk after chunk without waiting, so one chunk runs on
a stage while the one before runs on the next; each chunk's blocks here are held until the
chunk before has cached what they read (never by blocking a compute thread), and fail when
that chunk ended first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from ...errors import (
    AccessDenied,
    BadCheckpoint,
    BadInput,
    BudgetTooSmall,
    ClusterTooSmall,
    RunFailed,
    SeaBiscuitError,
    StaleRun,
)
from ...lower.blocks import BlockSpec, split_block
from ...lower.kvcache import CacheLost
from ..watch import seconds
from .chain import Chain
from .runs import DONE, RUNNING, WAITING, BlockRun, Loop, Run, greedy
from .wire import Tensors, nbytes

logger = logging.getLogger(__name__)

Imports = Mapping[str, torch.Tensor]
Compute = Callable[[str, int, int, int, Imports], tuple[dict[str, torch.Tensor], dict[str, Any]]]
Send = Callable[..., Awaitable[Any]]
RunKey = tuple[str, int]

# NOTE: failures a peer may name by class (data, read from a message), so the caller acts on what
# happened: those running the request again cannot cure, and a session's cache lost with a worker
# (the caller replays the session at once, on the plan it holds); a run a worker's sync retired
# (the caller sends it again on the current plan). Any other arrives as RunFailed, which the caller
# retries under a new id once a newer plan comes.
KINDS: dict[str, type[SeaBiscuitError]] = {c.__name__: c for c in (ClusterTooSmall, BudgetTooSmall, BadInput,
                                                                    BadCheckpoint, CacheLost, StaleRun)}
REMEMBERED = 4096      # NOTE: blocks run and runs ended, kept to refuse repeats and late messages
INLINE_S = 2e-4        # NOTE: blocks quicker than this run on the event loop, not a compute thread
ALONE_S = 0.1          # NOTE: the longest block that runs on the event loop as the worker's only work
MAX_TOKEN_DELAY_S = 0.1    # NOTE: the most ``token_delay`` may hold a decode step's tokens back


class DataPlane:
    """The data plane of one worker (see module doc)."""

    def __init__(self, address: str, *, compute: Compute,
                 spec_of: Callable[[str, int, int], BlockSpec | None],
                 load_spec: Callable[[str, int, int], BlockSpec], version_of: Callable[[str], int],
                 send: Send, check: Callable[[str, Any], Awaitable[str]], executor: Executor,
                 max_runs: int = 256, describe: Callable[[str, int, int], BlockSpec] | None = None,
                 forward: Callable[[str, dict[str, Any]], Awaitable[Any]] | None = None,
                 ready: Callable[[str, int, int, Imports], bool] | None = None,
                 token_delay: float | None = None) -> None:
        self.address = address
        # NOTE: how a message this worker relays goes on (down its own link, never relayed again),
        # and the (sender, receiver) pairs the scheduler has it relay for (``streams.Links.routes``)
        self.forward = forward
        self.relaying: set[tuple[str, str]] = set()
        # NOTE: a block's spec without loading it (where its outputs go): how a block whose load
        # failed tells the blocks downstream of it, which would otherwise wait for it forever
        self.describe = describe
        self.compute, self.spec_of, self.load_spec, self.version_of = compute, spec_of, load_spec, version_of
        self.send, self.check, self.executor, self.max_runs = send, check, executor, max_runs
        self.ready = ready
        # NOTE: a decode loop's caller hears of a step's tokens this long after the next step
        # went on to the next worker: on a machine with few cores the caller waking at once
        # would take the core that worker wakes on (0.6 ms of each hop on 2 cores)
        self.token_delay = token_delay_s() if token_delay is None else token_delay
        self.held: dict[RunKey, tuple[Run, str]] = {}     # runs with blocks held behind the run they follow
        self.runs: dict[RunKey, Run] = {}
        # NOTE: model -> the plan version its last sync retired the runs below (``retire``): a run of
        # an older one is refused from then on, before the blocks of the new one are loaded
        self.floors: dict[str, int] = {}
        self.ran: OrderedDict[tuple[str, int, int], None] = OrderedDict()     # (model, request, block)
        self.ended: OrderedDict[RunKey, BaseException] = OrderedDict()       # failed or forgotten runs
        self.done: OrderedDict[RunKey, None] = OrderedDict()                 # runs that finished here
        self.passed: OrderedDict[tuple[str, int, int], None] = OrderedDict()  # failures passed on, by block
        self.records: list[dict[str, Any]] = []                               # block runs to report
        self.counters = {"messages": 0, "repeats": 0, "stale": 0, "runs_failed": 0, "bytes_in": 0,
                         "loop_steps": 0, "relayed": 0, "relays_refused": 0, "probes": 0,
                         "chained": 0}
        self._telling: set[Any] = set()            # failures and loop steps being sent to peers
        self.loops: dict[RunKey, Loop] = {}         # (model, request) -> the decode loop that follows it
        self.chains: dict[RunKey, Chain] = {}       # (model, request) -> its logits block, chained
        self.last_s: dict[tuple[str, int], float] = {}     # (model, block) -> its last run's seconds
        # NOTE: the only messages a peer's stream may carry (``receive``)
        self._stream_ops: dict[str, Callable[..., Awaitable[Any]]] = {"push": self.push, "feed": self.feed,
                                                                      "fail": self.fail, "probe": self.probe}

    # --- handlers ------------------------------------------------------------------------------
    async def feed(self, model: str, ticket: Any, version: int, request: int,
                   inputs: Mapping[int, Mapping[str, torch.Tensor]], collect: Sequence[int] = (),
                   timed: bool = False, loop: Loop | None = None, after: int = -1) -> dict[int, Tensors]:
        """The caller's inputs of this worker's blocks (a block with no inputs starts with ``{}``);
        with ``collect``, waits for those blocks' outputs and returns them; ``timed``: report
        the time from here to the outputs as the request's latency; ``loop``: the decode steps
        that follow this one, fed from here (this worker makes ``loop.logits``); ``after``: the
        request whose cache writes this one's blocks here read (the chunk of its prompt before)."""
        t0 = time.time()
        ticket = await self.check(model, ticket)
        run = self._run(model, int(version), int(request))
        if run is not None and int(after) >= 0:
            run.after = int(after)
        if run is not None and loop is not None and loop.requests:
            self.loops[(model, int(request))] = loop
            made = next((out for out in run.outputs.values() if loop.logits in out), None)
            if made is not None:         # NOTE: the step ran before its loop arrived
                self._advance(run, made[loop.logits], ticket)
        if run is not None:
            for b, ts in inputs.items():
                self.counters["bytes_in"] += nbytes(ts)
                self._deliver(run, int(b), ts, ticket)
        if not collect:
            return {}
        out = await self._collect(model, int(version), int(request), [int(b) for b in collect])
        if timed:
            self.records.append({"model": model, "version": int(version), "request": int(request),
                                 "program": split_block(int(collect[0]))[0], "latency_s": time.time() - t0})
        return out

    async def push(self, model: str, ticket: Any, version: int, request: int, block: int,
                   tensors: Mapping[str, torch.Tensor],
                   inputs: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> bool:
        """Another worker's outputs that ``block`` reads; False for a repeat or a dropped run.
        ``inputs``: a decode step's inputs of blocks here that came with it (``_advance``), as a
        feed's, delivered first."""
        ticket = await self.check(model, ticket)
        run = self._run(model, int(version), int(request))
        if run is None:
            ended = self.ended.get((model, int(request)))
            if isinstance(ended, StaleRun):
                # NOTE: a sync retired the run here before this came: the blocks after ``block``,
                # here and on peers, would wait for it till their caller's progress bound (told in
                # the background: the stream this came on reads on meanwhile)
                self._tell(self._pass_on(model, int(version), int(request), int(block), ticket,
                                         str(ended)[:2000], type(ended).__name__))
            return False
        own: Mapping[str, torch.Tensor] = {}
        for b, ts in (inputs or {}).items():
            self.counters["bytes_in"] += nbytes(ts)
            if int(b) == int(block):
                own = ts            # NOTE: delivered with the push's own tensors: the block starts once
                continue
            self._deliver(run, int(b), ts, ticket)
        self.counters["bytes_in"] += nbytes(tensors)
        return self._deliver(run, int(block), {**own, **tensors} if own else tensors, ticket)

    async def collect(self, model: str, ticket: Any, version: int, request: int,
                      blocks: Sequence[int], tokens: str = "") -> dict[int, Tensors]:
        """The outputs of ``blocks`` once made; ``tokens``: an output tile of logits that is sent as
        the greedy tokens of its last position instead (a decode loop's caller reads no more)."""
        await self.check(model, ticket)
        return await self._collect(model, int(version), int(request), [int(b) for b in blocks], str(tokens))

    async def follow(self, model: str, ticket: Any, version: int, requests: Sequence[int],
                     blocks: Sequence[int], tokens: str,
                     write: Callable[[int, dict[int, Tensors] | None, BaseException | None], Awaitable[None]]
                     ) -> None:
        """``collect`` of each of ``requests`` in turn (a decode loop's steps), each handed to
        ``write`` (request, outputs, None) as it is made: the caller reads a loop's steps down one
        comm as they come, with no call per step. A step that fails is written as its error
        (request, None, error) and ends it; so does ``write`` raising (the caller went)."""
        try:
            await self.check(model, ticket)         # NOTE: once: a follow is one caller's
        except Exception as e:  # noqa: BLE001 - the caller hears of it
            await write(int(requests[0]) if requests else -1, None, e)
            return
        wanted = [int(b) for b in blocks]
        for r in requests:
            try:
                out = await self._collect(model, int(version), int(r), wanted, str(tokens))
            except Exception as e:  # noqa: BLE001 - the caller hears of it, as from a collect
                await write(int(r), None, e)
                return
            await write(int(r), out, None)

    async def fail(self, model: str, ticket: Any, version: int, request: int, reason: str = "",
                   block: int = -1, kind: str = "") -> bool:
        """A peer failed the run, which ``block`` here waited on: fail it here too, and downstream
        of ``block`` (whose spec says where). ``kind``: the error's class when it is one that
        the caller acts on (``KINDS``), so it gets it as it was; else ``RunFailed``."""
        ticket = await self.check(model, ticket)
        # NOTE: the run held here fails, of whichever plan: it cannot finish without the peer's part
        run = self.runs.get((model, int(request)))
        if run is None:
            try:
                run = self._run(model, int(version), int(request))
            except StaleRun:
                run = None        # NOTE: of an older plan than this worker holds, and never held here
        else:
            self.counters["messages"] += 1
        if run is None:
            # NOTE: ended here already, when only the blocks it had heard of were told, or never held:
            # the blocks after ``block`` (on peers reached through other workers) would wait forever
            if int(block) >= 0:
                await self._pass_on(model, int(version), int(request), int(block), ticket, str(reason)[:2000],
                                    str(kind))
            return False
        if int(block) >= 0:
            br = run.block(int(block))
            if br.spec is None:
                try:
                    br.spec = self.spec_of(model, run.version, br.block) or await asyncio.get_running_loop(
                    ).run_in_executor(self.executor, self.describe or self.load_spec, model, run.version,
                                      br.block)
                except Exception as e:  # noqa: BLE001 - then downstream of it hears from its caller
                    logger.info("seabiscuit: block b%s of %s not known: %s", block, run.where(), e)
        self._fail(run, KINDS.get(str(kind), RunFailed)(str(reason)[:2000]), ticket)
        return True

    async def _pass_on(self, model: str, version: int, request: int, block: int, ticket: str, reason: str,
                       kind: str) -> None:
        """Tell the blocks downstream of ``block`` (of a run that ended here) that it failed, once
        per block (a diamond of blocks would tell its join twice)."""
        if (model, request, block) in self.passed:
            return
        self._remember(self.passed, (model, request, block), None)
        spec = self.spec_of(model, version, block)
        if spec is None and self.describe is not None:
            try:
                spec = await asyncio.get_running_loop().run_in_executor(self.executor, self.describe, model,
                                                                        version, block)
            except Exception as e:  # noqa: BLE001 - then downstream of it hears from its caller
                logger.info("seabiscuit: block b%s of request %s of %s not known: %s", block, request,
                            model, e)
        for c, addr in self._downstream(model, version, [spec] if spec is not None else []):
            self._tell(self._tell_failed(addr, model, version, request, ticket, reason, c, kind=kind))

    async def status(self, model: str, ticket: Any, request: int) -> list[int]:
        """What this worker holds of a run, for a caller that waited past its bound: blocks
        running (or queued to, or loading their spec), blocks done, tensors received and
        outputs not yet taken; all zero when it holds none. A run no worker holds anything of
        that moves (``runs.progress``) is lost."""
        await self.check(model, ticket)
        run = self.runs.get((model, int(request)))
        if run is None or run.error is not None:
            return [0, 0, 0, 0]
        return run.progress()

    async def probe(self, **msg: Any) -> None:
        """A peer timing its link to this worker (``streams.Links.idle``): its bytes are dropped."""
        self.counters["probes"] += 1

    async def forget(self, model: str, ticket: Any, requests: Sequence[int]) -> int:
        """The caller is done with these runs (answered, failed or abandoned): drop what is left."""
        await self.check(model, ticket)
        n = 0
        gone = {int(r) for r in requests}
        for (m, _), chain in self.chains.items():
            if m == model and chain.request in gone:
                chain.stopped = True
        for r in requests:
            key = (model, int(r))
            self.loops.pop(key, None)
            run = self.runs.pop(key, None)
            if run is not None:
                n += 1
                run.fail(RunFailed(f"{run.where()} was ended by its caller"))
                for t in run.tasks:
                    t.cancel()
            self._remember_end(key, RunFailed(f"request {r} of model {model} was ended by its caller"))
        return n

    async def receive(self, msg: Any) -> None:
        """One message of a peer's stream (``streams``): a push, a feed or a fail. A push or feed
        that is refused (a stale plan, a tensor the block does not read) goes back to its sender
        as a fail of the run; a message that is not one of these three is dropped with a log line.
        A message for another worker (``to``) is relayed (``_relay``)."""
        try:
            msg = dict(msg)
            op, sender = str(msg.pop("op")), str(msg.pop("sender", ""))
            handler = self._stream_ops[op]
            to = msg.pop("to", None)
            if to is not None and str(to) != self.address:
                await self._relay(op, sender, str(to), msg)
                return
            if op == "feed" or (op == "push" and "inputs" in msg):
                msg["inputs"] = {int(b): ts for b, ts in msg.get("inputs") or ()}
        except (KeyError, TypeError, ValueError) as e:
            logger.info("seabiscuit: a data-plane stream message dropped (%s: %s)", type(e).__name__, e)
            return
        try:
            await handler(**msg)
        except AccessDenied as e:
            logger.info("seabiscuit: refused a data-plane %s from %s: %s", op, sender, e)
        except SeaBiscuitError as e:
            logger.info("seabiscuit: refused a data-plane %s from %s: %s: %s", op, sender,
                        type(e).__name__, e)
            if op != "fail" and sender:
                self._tell(self._tell_failed(sender, str(msg.get("model")), int(msg.get("version", 0)),
                                             int(msg.get("request", 0)), str(msg.get("ticket")), str(e),
                                             kind=type(e).__name__))
        except Exception as e:  # noqa: BLE001 - fields missing or of the wrong kind: the stream goes on
            logger.info("seabiscuit: a malformed data-plane %s from %s dropped: %s: %s", op, sender,
                        type(e).__name__, e)

    async def _relay(self, op: str, sender: str, to: str, msg: dict[str, Any]) -> None:
        """Forward a message down this worker's own link to ``to``: only for a pair the scheduler
        has it relay for, only with its model's ticket. One that cannot go on fails its run at
        the sender, as a push that cannot land does."""
        model = str(msg.get("model"))
        try:
            if (sender, to) not in self.relaying or self.forward is None:
                raise AccessDenied(f"worker {self.address} relays nothing from {sender} to {to}")
            ticket = await self.check(model, msg.get("ticket"))
        except AccessDenied as e:
            self.counters["relays_refused"] += 1
            logger.info("seabiscuit: a data-plane %s not relayed: %s", op, e)
            return
        try:
            await self.forward(to, {"op": op, "sender": sender, **msg})
            self.counters["relayed"] += 1
        except BaseException as e:  # noqa: BLE001 - the run fails at its sender
            if op != "fail":
                why = f"worker {self.address} could not relay a {op} to {to}: {type(e).__name__}: {e}"
                self._tell(self._tell_failed(sender, model, int(msg.get("version", 0)),
                                             int(msg.get("request", 0)), ticket, why))

    def retire(self, model: str, version: int | None = None) -> int:
        """Fail the runs of ``model`` older than ``version`` (every run, for None: released), at every
        worker that waits on their blocks here too (one that never syncs, its blocks unmoved, would
        wait for them till its caller's progress bound); from now on a message of a run older than
        ``version`` is refused, though the blocks of ``version`` may still be loading."""
        if version is not None:
            self.floors[model] = max(self.floors.get(model, -1), int(version))
        doomed = [run for (m, _), run in self.runs.items() if m == model
                  and (version is None or run.version < version)]
        for key in [k for k in self.loops if k[0] == model]:
            if version is None or (key in self.runs and self.runs[key].version < version):
                del self.loops[key]
        for key in [k for k in self.last_s if k[0] == model]:
            del self.last_s[key]
        for (m, _), chain in self.chains.items():
            if m == model:
                chain.stopped = True
        for run in doomed:
            why = "was released" if version is None else f"moved to plan v{version}"
            self._fail(run, StaleRun(f"{run.where()} cannot finish: the model {why} while it ran; "
                                     "it runs again on the current plan"), run.ticket)
        return len(doomed)

    # --- runs ----------------------------------------------------------------------------------
    def _run(self, model: str, version: int, request: int) -> Run | None:
        key = (model, request)
        self.counters["messages"] += 1
        if key in self.ended:
            self.counters["repeats"] += 1
            return None
        held = max(self.version_of(model), self.floors.get(model, -1))
        if version < held:
            self.counters["stale"] += 1
            raise StaleRun(f"request {request} of model {model} names plan v{version}; worker {self.address} "
                           f"holds v{held}: the request runs again on the current plan")
        run = self.runs.get(key)
        if run is None:
            self._make_room()
            run = self.runs[key] = Run(model, version, request)
        elif run.version != version:
            raise SeaBiscuitError(f"request {request} of model {model} runs under plan v{run.version} here; "
                                  f"a message names v{version}")
        return run

    def _make_room(self) -> None:
        while len(self.runs) >= self.max_runs:
            oldest = min(self.runs.values(), key=lambda r: r.created)
            why = (f"{oldest.where()} was dropped by worker {self.address}: more than {self.max_runs} runs "
                   "in flight (seabiscuit.runtime.data-plane-runs)")
            self._fail(oldest, RunFailed(why), oldest.ticket)

    def _deliver(self, run: Run, block: int, tensors: Mapping[str, torch.Tensor], ticket: str) -> bool:
        if (run.model, run.request, block) in self.ran:
            self.counters["repeats"] += 1
            return False
        run.ticket = run.ticket or ticket
        br = run.block(block)
        new = {t: x for t, x in tensors.items() if t not in br.imports}
        if br.state != "waiting" or (tensors and not new):
            self.counters["repeats"] += 1
            return False
        br.imports.update(new)
        if br.spec is None and not br.resolving:
            br.spec = self.spec_of(run.model, run.version, block)
            if br.spec is None:
                br.resolving = True
                self._spawn(run, self._resolve(run, br, ticket))
        if br.spec is not None:
            self._check_imports(run, br)
            self._start(run, br, ticket)
        return True

    def _start(self, run: Run, br: BlockRun, ticket: str) -> None:
        if not br.ready or self._held(run, br, ticket):
            return
        br.state = RUNNING      # NOTE: at once, so a repeat that comes meanwhile starts nothing
        args = (run.model, run.version, run.request, br.block, br.imports)
        # NOTE: a resident block whose last run took less than INLINE_S runs on the event loop:
        # the two hand-offs to a compute thread would cost more than the block; so does one that is
        # the worker's only work (``_alone``). Any other is handed to a compute thread now, before
        # the loop writes replies or sends anything
        if (self.last_s.get((run.model, br.block), INLINE_S) < INLINE_S and self._inline(run, br.block)) \
                or self._alone(run, br):
            self._here(run, br, ticket)
            return
        chain = self._chain(run, br, args)
        if chain is None:
            self._spawn(run, self._compute(run, br, ticket, self._submit(run, args)))
            return
        self.chains[(run.model, run.request)] = chain
        made = self.executor.submit_ordered(run.created, chain)      # type: ignore[attr-defined]
        self._spawn(run, self._compute(run, br, ticket, asyncio.wrap_future(made), chain))

    def _here(self, run: Run, br: BlockRun, ticket: str) -> None:
        """Run ``br`` on the event loop now, not in a task a loop turn later (0.1 ms a block on 2
        cores): its outputs go out before this returns; ``br.task`` waits for their sending."""
        try:
            out, record = self.compute(run.model, run.version, run.request, br.block, br.imports)
        except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
            self._fail(run, e, ticket)
            return
        br.task = self._spawn(run, self._settle(run, *self._finish(run, br, ticket, out, record)))

    def _held(self, run: Run, br: BlockRun, ticket: str) -> bool:
        """Whether ``br`` waits for the run ``run`` follows to cache what it reads here (a
        prompt's chunk before); a run whose predecessor ended first fails (it could never start)."""
        br.deferred = False
        if run.after < 0 or self.ready is None:
            return False
        try:
            if self.ready(run.model, run.version, br.block, br.imports):
                return False
        except Exception as e:  # noqa: BLE001 - then the kernel's own check (CacheLost) has the last word
            logger.warning("seabiscuit: block b%s of %s not checked for its cache: %s", br.block,
                           run.where(), e)
            return False
        before = (run.model, run.after)
        if before in self.ended or (before in self.done and before not in self.runs):
            why = (f"{run.where()} follows request {run.after}, which ended before it cached what block "
                   f"b{br.block} reads on worker {self.address}")
            self._fail(run, RunFailed(why), ticket)
            return True
        br.deferred = True
        self.held[(run.model, run.request)] = (run, ticket)
        return True

    def _wake(self, model: str) -> None:
        """Start the held blocks of ``model``'s runs whose predecessors have now cached what they
        read (a block ran or a run ended here)."""
        for key, (run, ticket) in list(self.held.items()):
            if key[0] != model or key not in self.held:
                continue
            waiting = [br for br in run.blocks.values() if br.deferred]
            if self.runs.get(key) is not run or run.error is not None or not waiting:
                del self.held[key]
                continue
            for br in waiting:
                self._start(run, br, ticket)
            if key in self.held and not any(br.deferred for br in run.blocks.values()):
                del self.held[key]

    def _alone(self, run: Run, br: BlockRun) -> bool:
        """Whether ``br`` runs on the event loop as this worker's only work: its compute threads idle,
        no other block here waits or runs, its last run under ``ALONE_S``, resident with no check
        due (``_inline``). A decode step is such a block on each worker in turn: handed to a thread
        it waits for the thread to wake and for the GIL the loop holds (0.3 ms on 2 cores), and the
        loop waits to wake for its outputs (0.3 ms more); on the loop, its outputs go at once.
        Messages that come meanwhile wait for it, as they would for the compute thread."""
        idle = getattr(self.executor, "idle", None)
        if idle is None or not idle() or self.last_s.get((run.model, br.block), ALONE_S) >= ALONE_S \
                or not self._inline(run, br.block):
            return False
        return all(b is br or b.state == DONE for r in self.runs.values() for b in r.blocks.values())

    def _chain(self, run: Run, br: BlockRun, args: tuple[Any, ...]) -> Chain | None:
        """A ``Chain`` of ``br`` and the next decode step's blocks here, where ``br`` makes the
        logits of a loop that goes on and each of those blocks is resident and reads only the
        step's inputs; else None."""
        loop = self.loops.get((run.model, run.request))
        pending = getattr(self.executor, "pending", None)
        if loop is None or not loop.requests or pending is None or br.spec is None \
                or loop.logits not in br.spec.exports:
            return None
        feeds = [(b, names) for address, fs in loop.route if address == self.address for b, names in fs]
        for b, names in feeds:
            spec = self.spec_of(run.model, run.version, b)
            if spec is None or not set(spec.imports) <= set(names) or not self._inline(run, b):
                return None
        return Chain(self.compute, args, loop, feeds, lambda: pending() == 0) if feeds else None

    def _submit(self, run: Run, args: tuple[Any, ...]) -> Awaitable[Any]:
        """The block on a compute thread; the oldest run's blocks first (``ordered``): a stage hands
        a request on down the pipeline before it starts the next one."""
        ordered = getattr(self.executor, "submit_ordered", None)
        if ordered is not None:
            running = asyncio.wrap_future(ordered(run.created, self.compute, *args))
        else:
            running = asyncio.get_running_loop().run_in_executor(self.executor, self.compute, *args)
        # NOTE: a run forgotten before its task awaited this leaves a failure nobody reads: not an
        # error to log (the task awaiting it, when it does, still gets it)
        running.add_done_callback(lambda f: f.cancelled() or f.exception())
        return running

    def _inline(self, run: Run, block: int) -> bool:
        """Whether the block may run on the event loop now: resident at the run's plan, with no tile
        check or checkpoint due (either could read files, or fetch its spec from the scheduler by an
        RPC the blocked loop could never answer)."""
        spec = self.spec_of(run.model, run.version, block)
        return spec is not None and spec.verify_every <= 0 and not spec.checkpoint_dir

    def _check_imports(self, run: Run, br: BlockRun) -> None:
        assert br.spec is not None
        extra = [t for t in br.imports if t not in br.spec.imports]
        if extra:
            raise SeaBiscuitError(f"block b{br.block} of {run.where()} reads no tensor {extra[0]!r} "
                                  f"(it reads {list(br.spec.imports)[:5]})")

    def _spawn(self, run: Run, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)
        return task

    async def _resolve(self, run: Run, br: BlockRun, ticket: str) -> None:
        try:
            br.spec = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.load_spec, run.model, run.version, br.block)
            br.resolving = False        # NOTE: else ``status`` says it runs while the run waits on others
            self._check_imports(run, br)
        except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
            br.resolving = False
            if br.spec is None and self.describe is not None:
                try:
                    br.spec = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self.describe, run.model, run.version, br.block)
                except Exception as why:  # noqa: BLE001 - then only what is known hears of it
                    logger.warning("seabiscuit: the blocks after b%s of %s are not told it failed: %s",
                                   br.block, run.where(), why)
            self._fail(run, e, ticket)
            return
        self._start(run, br, ticket)

    async def _compute(self, run: Run, br: BlockRun, ticket: str, running: Awaitable[Any],
                       chain: Chain | None = None) -> None:
        """The block's outputs, from ``running`` (its compute thread); ``chain``: the block makes a
        loop's logits, and its next step may be running already."""
        try:
            out, record = await running
        except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
            self._fail(run, e, ticket)
            return
        finally:
            if chain is not None and self.chains.get((run.model, run.request)) is chain:
                del self.chains[(run.model, run.request)]
        await self._settle(run, *self._finish(run, br, ticket, out, record, chain))

    def _finish(self, run: Run, br: BlockRun, ticket: str, out: dict[str, torch.Tensor],
                record: dict[str, Any], chain: Chain | None = None) -> tuple[list[Any], list[Any]]:
        """A block ran: the next decode step starts, the blocks that read its outputs are sent them,
        the caller's copy of them is kept; in that order (the critical path first). Returns the
        sends, and those of the next step's blocks that ran chained (``ahead``): while any is on
        its way the caller is not yet told of these outputs."""
        spec = br.spec
        assert spec is not None
        self.last_s[(run.model, br.block)] = float(record.get("compute_s", INLINE_S))
        br.imports, br.state = {}, DONE
        self._remember(self.ran, (run.model, run.request, br.block), None)
        self.records.append(record)
        ahead: list[Any] = []
        follows = self.loops.get((run.model, run.request))
        if follows is not None and follows.logits in out:
            ahead = self._advance(run, out[follows.logits], ticket, chain)
        # NOTE: started now, so they go before anything this wakes (the caller's collect)
        sends = [self._send(run, c, addr, {t: out[t] for t in ts}, ticket) for c, addr, ts in spec.sends]
        if spec.outputs:
            run.outputs[br.block] = {t: out[t] for t in spec.outputs}
            if not ahead:
                run.notify()
        if self.held:
            self._wake(run.model)
        return sends, ahead

    async def _settle(self, run: Run, sends: Sequence[Awaitable[Any]], ahead: Sequence[Any] = ()) -> None:
        """Wait for a block's sends; with ``ahead`` (``_finish``), tell the caller of its outputs
        ``token_delay`` after those are on their way (a caller that asks later has them at once)."""
        if ahead:
            await asyncio.wait(ahead)
            if self.token_delay > 0:
                # NOTE: the caller's wake-up then waits for the next worker's (see __init__)
                asyncio.get_running_loop().call_later(self.token_delay, run.notify)
            else:
                run.notify()
        await asyncio.gather(*sends)
        self._tidy(run)

    def _advance(self, run: Run, logits: torch.Tensor, ticket: str,
                 chain: Chain | None = None) -> list[Any]:
        """Feed the next step of the decode loop that follows ``run`` from its greedy tokens; with
        a ``chain`` that picked them (and may run the step's blocks here), from its pick. Returns
        the sends of the next step's blocks that ran chained."""
        loop = self.loops.pop((run.model, run.request), None)
        if loop is None or not loop.requests or (run.model, loop.requests[0]) in self.ended:
            return []       # NOTE: the caller stopped the loop (forgot its next step)
        if chain is not None and chain.loop is loop and chain.step is not None:
            inputs, after = chain.step
        else:
            inputs, after = loop.following(logits)
            chain = None
        request = loop.requests[0]
        nxt = self._run(run.model, run.version, request)
        if nxt is None:
            return []
        if after.requests:
            self.loops[(run.model, request)] = after
            # NOTE: once this step is on its way, not on the path of the next one's tokens
            asyncio.get_running_loop().call_soon(after.prepare)
        self.counters["loop_steps"] += 1
        ahead: list[Any] = []
        # NOTE: the peers' step inputs are dealt with before the blocks here start: each goes with
        # the push of the block here that its blocks read (``_carrier``: one message, and nothing
        # between the logits and the next step), else out now
        route = sorted(loop.route, key=lambda r: r[0] == self.address)
        here = [b for address, feeds in loop.route if address == self.address for b, _ in feeds]
        for address, feeds in route:
            mine = [(b, {t: inputs[t] for t in names}) for b, names in feeds]
            if address == self.address:
                for b, ts in mine:
                    if chain is not None and chain.ran:
                        ahead += self._adopt(nxt, b, ts, chain.next[b], ticket)
                    elif self._deliver(nxt, b, ts, ticket) and nxt.block(b).task is not None:
                        ahead.append(nxt.block(b).task)     # NOTE: it runs on the loop: tokens after it
            elif self._carrier(nxt, here, address, [b for b, _ in feeds]):
                nxt.riders.setdefault(address, []).extend(mine)
            else:
                self._feed_peer(nxt, address, mine, ticket)
        return ahead

    def _carrier(self, run: Run, here: list[int], address: str, blocks: list[int]) -> bool:
        """Whether a block of ``run`` fed here, not yet started, sends to every one of ``blocks`` at
        ``address``: their step inputs can go with its push. They need its outputs anyway, and if it
        fails they hear of that as its downstream."""
        for b in here:
            spec = self.spec_of(run.model, run.version, b)
            br = run.blocks.get(b)
            if spec is None or (br is not None and (br.state != WAITING or br.imports)):
                continue
            if set(blocks) <= {c for c, a, _ in spec.sends if a == address}:
                return True
        return False

    def _adopt(self, run: Run, block: int, tensors: Mapping[str, torch.Tensor],
               running: concurrent.futures.Future[Any], ticket: str) -> list[Any]:
        """``block`` of ``run``, which a ``Chain`` ran with ``tensors`` (its outcome in ``running``):
        it goes on from here as if it ran here; returns its sends. A repeat (the block ran or
        runs already) is dropped."""
        br = run.block(block)
        if (run.model, run.request, block) in self.ran or br.state != WAITING or br.imports:
            self.counters["repeats"] += 1
            return []
        br.imports.update(tensors)
        br.spec = br.spec or self.spec_of(run.model, run.version, block)
        br.state = RUNNING
        if br.spec is None:         # NOTE: its plan was retired here meanwhile: where would it send?
            self._fail(run, StaleRun(f"block b{block} of {run.where()} is no longer held by worker "
                                     f"{self.address}: the step runs again on the current plan"), ticket)
            return []
        self.counters["chained"] += 1
        if not running.done() or running.cancelled() or running.exception() is not None:
            self._spawn(run, self._compute(run, br, ticket, asyncio.wrap_future(running)))
            return []
        task = asyncio.ensure_future(self._settle(run, *self._finish(run, br, ticket, *running.result())))
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)
        return [task]

    def _feed_peer(self, run: Run, address: str, feeds: list[tuple[int, dict[str, torch.Tensor]]],
                   ticket: str) -> asyncio.Future[Any]:
        return self._post(run, address, "seabiscuit_dp_feed", ticket, "feed the next decode step to",
                          inputs=[(b, Tensors(ts)) for b, ts in feeds])

    def _send(self, run: Run, block: int, address: str, tensors: dict[str, torch.Tensor],
              ticket: str) -> asyncio.Future[Any]:
        if address == self.address:
            return self._tell(self._local(run, block, tensors, ticket))
        riders = run.riders.pop(address, None)
        extra = {"inputs": [(b, Tensors(ts)) for b, ts in riders]} if riders else {}
        return self._post(run, address, "seabiscuit_dp_push", ticket, f"send the inputs of block b{block} to",
                          block=block, tensors=Tensors(tensors), **extra)

    async def _local(self, run: Run, block: int, tensors: dict[str, torch.Tensor], ticket: str) -> None:
        if (run.model, run.request) in self.runs:
            self._deliver(run, block, tensors, ticket)

    def _post(self, run: Run, address: str, op: str, ticket: str, what: str,
              **msg: Any) -> asyncio.Future[Any]:
        """Send ``op`` of ``run`` to ``address`` now: down an idle stream it is written before this
        returns, not a loop turn later behind whatever else the loop has queued (a decode step's
        hop waits on it). The future of its sending, held here (``_tell``); if it cannot be sent
        the run fails, everywhere (``what``: what could not be done)."""
        try:
            sent = self.send(address, op, model=run.model, ticket=ticket, version=run.version,
                             request=run.request, **msg)
        except BaseException as e:  # noqa: BLE001 - the run fails below, as for a send that fails later
            sent = asyncio.get_running_loop().create_future()
            sent.set_exception(e)

        async def sending() -> None:
            try:
                await sent
            except BaseException as e:  # noqa: BLE001 - the run fails, everywhere
                self._fail(run, RunFailed(f"{run.where()}: worker {self.address} could not {what} {address}: "
                                          f"{type(e).__name__}: {e}"), ticket)
        return self._tell(sending())

    async def _collect(self, model: str, version: int, request: int, blocks: list[int],
                       tokens: str = "") -> dict[int, Tensors]:
        key = (model, request)
        while True:
            run = self.runs.get(key)
            if run is None:
                ended = self.ended.get(key)
                if ended is not None:
                    raise ended
                run = self._run(model, version, request)
                assert run is not None
            if run.error is not None:
                raise run.error
            if all(b in run.outputs for b in blocks):
                break
            run.wanted.update(blocks)       # NOTE: the run stays here while a caller waits on it
            await run.changed.wait()
        out = {b: Tensors({t: greedy(x) if t == tokens else x for t, x in run.outputs.pop(b).items()})
               for b in blocks}
        run.wanted.difference_update(blocks)
        self._tidy(run)
        return out

    def _tidy(self, run: Run) -> None:
        if run.finished and run.error is None and self.runs.get((run.model, run.request)) is run:
            del self.runs[(run.model, run.request)]
            self._remember(self.done, (run.model, run.request), None)
            if self.held:         # NOTE: a run that follows it and still finds its cache short never will
                self._wake(run.model)

    def _fail(self, run: Run, error: BaseException, ticket: str, spread: bool = True) -> None:
        """Fail ``run`` here; with ``spread``, at the workers of every block downstream of it too."""
        if run.error is not None:
            return
        if not isinstance(error, SeaBiscuitError):      # NOTE: the block itself failed: no retry cures it
            error = SeaBiscuitError(f"{run.where()} failed in a block on worker {self.address}: "
                                    f"{type(error).__name__}: {error}")
        self.counters["runs_failed"] += 1
        run.fail(error)
        key = (run.model, run.request)
        if key in self.chains:
            self.chains[key].stopped = True
        if self.runs.get(key) is run:
            del self.runs[key]
        self._remember_end(key, error)
        if spread and ticket:
            kind = type(error).__name__
            for block, addr in self._downstream(run.model, run.version,
                                                [b.spec for b in run.blocks.values() if b.spec is not None]):
                self._tell(self._tell_failed(addr, run.model, run.version, run.request, ticket, str(error),
                                             block, kind=kind))
            for b in run.blocks.values():
                if b.spec is None:          # NOTE: its spec still loading: where its outputs go is asked
                    self._tell(self._pass_on(run.model, run.version, run.request, b.block, ticket,
                                             str(error)[:2000], kind))

    def _downstream(self, model: str, version: int, specs: list[BlockSpec]) -> set[tuple[int, str]]:
        """The blocks on other workers that wait, directly or through blocks here, on ``specs``."""
        out: set[tuple[int, str]] = set()
        todo = list(specs)
        seen: set[int] = set()
        while todo:
            spec = todo.pop()
            for c, addr, _ in spec.sends:
                if addr != self.address:
                    out.add((c, addr))
                elif c not in seen:
                    seen.add(c)
                    local = self.spec_of(model, version, c)
                    if local is not None:
                        todo.append(local)
        return out

    def _tell(self, coro: Any) -> asyncio.Future[Any]:
        """Send a message, held here until sent (a run forgotten meanwhile does not cancel it)."""
        task = asyncio.ensure_future(coro)
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)
        return task

    async def _tell_failed(self, address: str, model: str, version: int, request: int, ticket: str,
                           reason: str, block: int = -1, kind: str = "") -> None:
        try:
            await self.send(address, "seabiscuit_dp_fail", model=model, ticket=ticket,
                            version=version, request=request, reason=reason, block=block,
                            kind=kind if kind in KINDS else "")
        except Exception as e:  # noqa: BLE001 - a peer gone has nothing to fail
            logger.debug("seabiscuit: %s not told of the failure of request %s: %s", address, request, e)

    def _remember_end(self, key: RunKey, error: BaseException) -> None:
        self._remember(self.ended, key, error)
        if self.held:
            self._wake(key[0])

    @staticmethod
    def _remember(d: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        d[key] = value
        while len(d) > REMEMBERED:
            d.popitem(last=False)

    def take_records(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out

    def held_bytes(self) -> int:
        return sum(r.held_bytes for r in list(self.runs.values()))


def token_delay_s() -> float:
    """Setting ``seabiscuit.generate.token-delay`` in seconds, refused past ``MAX_TOKEN_DELAY_S``."""
    try:
        delay = seconds("generate.token-delay")
    except (KeyError, TypeError, ValueError) as e:
        raise SeaBiscuitError("seabiscuit.generate.token-delay must be a duration such as '2ms' "
                              f"({e})") from None
    if not 0.0 <= delay <= MAX_TOKEN_DELAY_S:
        raise SeaBiscuitError(f"seabiscuit.generate.token-delay is {delay * 1e3:g} ms: it must be from 0 "
                              f"to {MAX_TOKEN_DELAY_S * 1e3:g} ms (each token reaches its caller that much "
                              "later; 2ms keeps the caller's wake-up off the next worker's core)")
    return delay


def timed(compute: Callable[..., tuple[dict[str, torch.Tensor], str]], address: str) -> Compute:
    """``compute`` (``ResidentBlocks.run``-like: outputs and how) with the record of each run."""
    def run(model: str, version: int, request: int, block: int,
            imports: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        started, t0 = time.time(), time.perf_counter()
        out, how = compute(model, version, request, block, imports)
        return out, {"model": model, "version": version, "request": request, "block": block, "how": how,
                     "compute_s": time.perf_counter() - t0, "start": started, "worker": address}
    return run
