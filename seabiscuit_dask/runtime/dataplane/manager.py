"""``DataPlane``: a worker's run manager. It keeps the worker's runs (``runs.Run``) by id and
hands each data-plane message to its run; blocks run when their inputs arrive, and their
outputs go straight to the workers of the blocks that read them, and to the caller that
collects them.

Every message names (model, plan version, request, block) and shows the model's
*ticket* (a secret the scheduler plugin gives the deploying client and the
workers): a message for an older plan than the worker holds is refused
(``StaleRun``), a repeated one changes nothing, and one for a run that failed or
was forgotten is dropped. A failure (a block raised, a peer could not be reached)
fails the run here and at every worker downstream, so the caller hears of it at
once and sends the request again under a new id. Runs in flight are bounded
(``seabiscuit.runtime.data-plane-runs``; the oldest is failed past it).

It runs on the worker's event loop and is plain asyncio over one ``host.Host`` (the worker:
it runs blocks, finds their specs, sends messages to peers and checks tickets), so tests
drive it without a cluster. Its handlers are the worker's RPCs and stream messages, named
as they are (``feed``, ``push``, ``collect``, ``follow``, ``fail``, ``forget``, ``status``;
a peer's stream, ``receive``, carries ``push``, ``feed``, ``fail`` and ``probe``); each
checks the ticket, finds or makes the run and forwards to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from ... import config
from ...errors import AccessDenied, BadConfig, BadMessage, RunFailed, SeaBiscuitError, StaleRun
from ...lower.blocks import split_block
from ..watch import seconds
from .host import Host
from .loops import Edit, Loop
from .runs import DONE, KINDS, BlockRun, Memory, Run, RunKey, downstream, remember, tell_failed
from .wire import Tensors, nbytes

logger = logging.getLogger(__name__)

MAX_TOKEN_DELAY_S = 0.1    # NOTE: the most ``token_delay`` may hold a decode step's tokens back
Write = Callable[[int, dict[int, Tensors] | None, BaseException | None], Awaitable[None]]


class DataPlane:
    """The data plane of one worker (see module doc): ``host``, the worker it runs on;
    ``max_runs``: runs held at once (``seabiscuit.runtime.data-plane-runs``)."""

    def __init__(self, host: Host, *, max_runs: int | None = None, token_delay: float | None = None) -> None:
        self.host = host
        self.max_runs = int(config.get("runtime.data-plane-runs")) if max_runs is None else int(max_runs)
        # NOTE: a decode loop's caller hears of a step's tokens this long after the next step
        # went on to the next worker: on a machine with few cores the caller waking at once
        # would take the core that worker wakes on (0.6 ms of each hop on 2 cores)
        self.token_delay = token_delay_s() if token_delay is None else token_delay
        # NOTE: the (sender, receiver) pairs the scheduler has this worker relay for (``Links.routes``)
        self.relaying: set[tuple[str, str]] = set()
        self.runs: dict[RunKey, Run] = {}
        self.loops: dict[RunKey, Loop] = {}               # run -> the decode loop that follows it
        self.lanes: Memory = OrderedDict()                # (model, lane) -> a loop's ``Lane``
        self.lane_rows: Memory = OrderedDict()            # a lane's step -> the sessions it runs
        self.picked: Memory = OrderedDict()               # a lane's step -> its rows' picks
        self.held: dict[RunKey, tuple[Run, str]] = {}     # runs with blocks held behind the run they follow
        # NOTE: model -> the plan version its last sync retired the runs below (``retire``): a run of
        # an older one is refused from then on, before the blocks of the new one are loaded
        self.floors: dict[str, int] = {}
        self.ran: Memory = OrderedDict()         # (model, request, block)
        self.ended: Memory = OrderedDict()       # failed or forgotten runs -> their error
        self.done: Memory = OrderedDict()        # runs that finished here
        self.passed: Memory = OrderedDict()      # failures passed on, by (model, request, block)
        self.records: list[dict[str, Any]] = []  # block runs to report
        self.counters = {"messages": 0, "repeats": 0, "stale": 0, "runs_failed": 0, "bytes_in": 0,
                         "loop_steps": 0, "relayed": 0, "relays_refused": 0, "probes": 0,
                         "chained": 0}
        self._telling: set[asyncio.Future[Any]] = set()      # failures and loop steps being sent to peers
        self.last_s: dict[tuple[str, int], float] = {}      # (model, block) -> its last run's seconds
        # NOTE: the only messages a peer's stream may carry (``receive``)
        self._stream_ops: dict[str, Callable[..., Awaitable[Any]]] = {"push": self.push, "feed": self.feed,
                                                                      "fail": self.fail, "probe": self.probe}

    @property
    def address(self) -> str:
        return self.host.address

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
        ticket = await self.host.check(model, ticket)
        run = self.get(model, int(version), int(request))
        if run is not None and int(after) >= 0:
            run.after = int(after)
        if run is not None and loop is not None and loop.requests:
            if loop.lane is not None:
                if loop.lane.id != int(request):
                    raise BadMessage(f"a lane is named by the request that starts it ({request}), "
                                     f"not {loop.lane.id}")
                remember(self.lanes, (model, loop.lane.id), loop.lane)
            self.loops[run.key] = loop
            made = next((out for out in run.outputs.values() if loop.logits in out), None)
            if made is not None:         # NOTE: the step ran before its loop arrived
                run.advance(made[loop.logits], ticket)
        if run is not None:
            for b, ts in inputs.items():
                self.counters["bytes_in"] += nbytes(ts)
                run.deliver(int(b), ts, ticket)
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
        ``inputs``: a decode step's inputs of blocks here that came with it (``Run.advance``), as
        a feed's, delivered first."""
        ticket = await self.host.check(model, ticket)
        run = self.get(model, int(version), int(request))
        if run is None:
            ended = self.ended.get((model, int(request)))
            if isinstance(ended, StaleRun):
                # NOTE: a sync retired the run here before this came: the blocks after ``block``,
                # here and on peers, would wait for it till their caller's progress bound (told in
                # the background: the stream this came on reads on meanwhile)
                self.tell(self.pass_on(model, int(version), int(request), int(block), ticket,
                                       str(ended)[:2000], type(ended).__name__))
            return False
        own: Mapping[str, torch.Tensor] = {}
        for b, ts in (inputs or {}).items():
            self.counters["bytes_in"] += nbytes(ts)
            if int(b) == int(block):
                own = ts            # NOTE: delivered with the push's own tensors: the block starts once
                continue
            run.deliver(int(b), ts, ticket)
        self.counters["bytes_in"] += nbytes(tensors)
        return run.deliver(int(block), {**own, **tensors} if own else tensors, ticket)

    async def collect(self, model: str, ticket: Any, version: int, request: int,
                      blocks: Sequence[int], tokens: str = "") -> dict[int, Tensors]:
        """The outputs of ``blocks`` once made; ``tokens``: an output tile of logits that is sent as
        the greedy tokens of its last position instead (a decode loop's caller reads no more)."""
        await self.host.check(model, ticket)
        return await self._collect(model, int(version), int(request), [int(b) for b in blocks], str(tokens))

    async def follow(self, model: str, ticket: Any, version: int, requests: Sequence[int],
                     blocks: Sequence[int], tokens: str, write: Write) -> None:
        """``collect`` of each of ``requests`` in turn (a decode loop's steps), each handed to
        ``write`` (request, outputs, None) as it is made: the caller reads a loop's steps down one
        comm as they come, with no call per step. A step that fails is written as its error
        (request, None, error) and ends it; so does ``write`` raising (the caller went)."""
        try:
            await self.host.check(model, ticket)         # NOTE: once: a follow is one caller's
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

    async def edit(self, model: str, ticket: Any, lane: int, edits: Sequence[Edit]) -> int:
        """The caller's edits of a lane's rows (``loops.Lane``), applied to its next step built here:
        the count of edit messages the lane took with these (``Lane.edit``); 0 where this worker
        runs no such lane, or it runs no more steps (the caller starts its loop anew)."""
        await self.host.check(model, ticket)
        found = self.lanes.get((model, int(lane)))
        return found.edit(edits) if found is not None else 0

    async def fail(self, model: str, ticket: Any, version: int, request: int, reason: str = "",
                   block: int = -1, kind: str = "") -> bool:
        """A peer failed the run, which ``block`` here waited on: fail it here too, and downstream
        of ``block`` (whose spec says where). ``kind``: the error's class when it is one that
        the caller acts on (``runs.KINDS``), so it gets it as it was; else ``RunFailed``."""
        ticket = await self.host.check(model, ticket)
        # NOTE: the run held here fails, of whichever plan: it cannot finish without the peer's part
        run = self.runs.get((model, int(request)))
        if run is None:
            try:
                run = self.get(model, int(version), int(request))
            except StaleRun:
                run = None        # NOTE: of an older plan than this worker holds, and never held here
        else:
            self.counters["messages"] += 1
        if run is None:
            # NOTE: ended here already, when only the blocks it had heard of were told, or never held:
            # the blocks after ``block`` (on peers reached through other workers) would wait forever
            if int(block) >= 0:
                await self.pass_on(model, int(version), int(request), int(block), ticket, str(reason)[:2000],
                                   str(kind))
            return False
        if int(block) >= 0:
            await self._describe(run, run.block(int(block)))
        run.fail(KINDS.get(str(kind), RunFailed)(str(reason)[:2000]), ticket)
        return True

    async def status(self, model: str, ticket: Any, request: int) -> list[int]:
        """What this worker holds of a run, for a caller that waited past its bound: blocks
        running (or queued to, or loading their spec), blocks done, tensors received and
        outputs not yet taken; all zero when it holds none. A run no worker holds anything of
        that moves (``Run.progress``) is lost."""
        await self.host.check(model, ticket)
        run = self.runs.get((model, int(request)))
        if run is None or run.error is not None:
            return [0, 0, 0, 0]
        return run.progress()

    async def probe(self, **msg: Any) -> None:
        """A peer timing its link to this worker (``streams.Links.idle``): its bytes are dropped."""
        self.counters["probes"] += 1

    async def forget(self, model: str, ticket: Any, requests: Sequence[int]) -> int:
        """The caller is done with these runs (answered, failed or abandoned): drop what is left."""
        await self.host.check(model, ticket)
        n = 0
        gone = {int(r) for r in requests}
        for run in self.runs.values():
            if run.model == model and run.chain is not None and run.chain.request in gone:
                run.chain.stopped = True
        for r in requests:
            key = (model, int(r))
            error = RunFailed(f"request {r} of model {model} was ended by its caller")
            loop = self.loops.pop(key, None)
            self.lane_rows.pop(key, None)
            self.picked.pop(key, None)
            if loop is not None and loop.lane is not None:
                loop.lane.close()
            gone_run = self.runs.pop(key, None)
            if gone_run is not None:
                n += 1
                gone_run.forget(error)
            self._remember_end(key, error)
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
                self.tell(tell_failed(self.host, sender, str(msg.get("model")), int(msg.get("version", 0)),
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
            if (sender, to) not in self.relaying:
                raise AccessDenied(f"worker {self.address} relays nothing from {sender} to {to}")
            ticket = await self.host.check(model, msg.get("ticket"))
        except AccessDenied as e:
            self.counters["relays_refused"] += 1
            logger.info("seabiscuit: a data-plane %s not relayed: %s", op, e)
            return
        try:
            await self.host.forward(to, {"op": op, "sender": sender, **msg})
            self.counters["relayed"] += 1
        except BaseException as e:  # noqa: BLE001 - the run fails at its sender
            if op != "fail":
                why = f"worker {self.address} could not relay a {op} to {to}: {type(e).__name__}: {e}"
                self.tell(tell_failed(self.host, sender, model, int(msg.get("version", 0)),
                                      int(msg.get("request", 0)), ticket, why))

    def retire(self, model: str, version: int | None = None) -> int:
        """Fail the runs of ``model`` older than ``version`` (every run, for None: released), at every
        worker that waits on their blocks here too (one that never syncs, its blocks unmoved, would
        wait for them till its caller's progress bound); from now on a message of a run older than
        ``version`` is refused, though the blocks of ``version`` may still be loading."""
        if version is not None:
            self.floors[model] = max(self.floors.get(model, -1), int(version))
        mine = [run for run in self.runs.values() if run.model == model]
        doomed = [run for run in mine if version is None or run.version < version]
        for key in [k for k in self.last_s if k[0] == model]:
            del self.last_s[key]
        for run in mine:
            if run.chain is not None:
                run.chain.stopped = True
        for key in [k for k in self.loops if k[0] == model]:
            if version is None or (key in self.runs and self.runs[key].version < version):
                lane = self.loops.pop(key).lane
                if lane is not None:
                    lane.close()
        for run in doomed:
            why = "was released" if version is None else f"moved to plan v{version}"
            run.fail(StaleRun(f"{run.where()} cannot finish: the model {why} while it ran; "
                              "it runs again on the current plan"), run.ticket)
        return len(doomed)

    def take_records(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out

    def held_bytes(self) -> int:
        return sum(r.held_bytes for r in list(self.runs.values()))

    # --- the runs (``runs.Keeper``) ---------------------------------------------------------------
    def get(self, model: str, version: int, request: int) -> Run | None:
        key = (model, request)
        self.counters["messages"] += 1
        if key in self.ended:
            self.counters["repeats"] += 1
            return None
        held = max(self.host.version_of(model), self.floors.get(model, -1))
        if version < held:
            self.counters["stale"] += 1
            raise StaleRun(f"request {request} of model {model} names plan v{version}; worker {self.address} "
                           f"holds v{held}: the request runs again on the current plan")
        run = self.runs.get(key)
        if run is None:
            self._make_room()
            run = self.runs[key] = Run(self, model, version, request)
        elif run.version != version:
            raise BadMessage(f"request {request} of model {model} runs under plan v{run.version} here; "
                             f"a message names v{version}")
        return run

    def holds(self, key: RunKey) -> bool:
        return key in self.runs

    def drop(self, run: Run, error: BaseException | None) -> None:
        held = self.runs.get(run.key) is run
        if held:
            del self.runs[run.key]
        if error is not None:
            self._remember_end(run.key, error)      # NOTE: held or not: its late messages are refused
        elif held:
            remember(self.done, run.key)
            # NOTE: a run that follows it and still finds its cache short never will
            self.wake(run.model)

    def hold(self, run: Run, ticket: str) -> None:
        self.held[run.key] = (run, ticket)

    def wake(self, model: str) -> None:
        if not self.held:
            return
        for key, (run, ticket) in list(self.held.items()):
            if key[0] != model or key not in self.held:
                continue
            waiting = [br for br in run.blocks.values() if br.deferred]
            if self.runs.get(key) is not run or run.error is not None or not waiting:
                del self.held[key]
                continue
            for br in waiting:
                run.start(br, ticket)
            if key in self.held and not any(br.deferred for br in run.blocks.values()):
                del self.held[key]

    def alone(self, run: Run, br: BlockRun) -> bool:
        return all(b is br or b.state == DONE for r in self.runs.values() for b in r.blocks.values())

    def tell(self, coro: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)
        return task

    async def pass_on(self, model: str, version: int, request: int, block: int, ticket: str, reason: str,
                      kind: str) -> None:
        """Tell the blocks downstream of ``block`` (of a run that ended here) that it failed, once
        per block (a diamond of blocks would tell its join twice)."""
        if (model, request, block) in self.passed:
            return
        remember(self.passed, (model, request, block))
        spec = self.host.spec_of(model, version, block)
        if spec is None:
            try:
                spec = await asyncio.get_running_loop().run_in_executor(
                    self.host.executor, self.host.describe, model, version, block)
            except Exception as e:  # noqa: BLE001 - then downstream of it hears from its caller
                logger.info("seabiscuit: block b%s of request %s of %s not known: %s", block, request,
                            model, e)
        for c, addr in downstream(self.host, model, version, [spec] if spec is not None else []):
            self.tell(tell_failed(self.host, addr, model, version, request, ticket, reason, c, kind=kind))

    # --- helpers -------------------------------------------------------------------------------
    async def _collect(self, model: str, version: int, request: int, blocks: list[int],
                       tokens: str = "") -> dict[int, Tensors]:
        run = self.runs.get((model, request))
        if run is None:
            ended = self.ended.get((model, request))
            if ended is not None:
                raise ended
            run = self.get(model, version, request)
            assert run is not None
        return await run.collect(blocks, tokens)

    async def _describe(self, run: Run, br: BlockRun) -> None:
        """Find ``br``'s spec if it is not known yet (where its outputs go: a failure spreads there)."""
        if br.spec is not None:
            return
        try:
            br.spec = self.host.spec_of(run.model, run.version, br.block) or await asyncio.get_running_loop(
            ).run_in_executor(self.host.executor, self.host.describe, run.model, run.version, br.block)
        except Exception as e:  # noqa: BLE001 - then downstream of it hears from its caller
            logger.info("seabiscuit: block b%s of %s not known: %s", br.block, run.where(), e)

    def _make_room(self) -> None:
        while len(self.runs) >= self.max_runs:
            oldest = min(self.runs.values(), key=lambda r: r.created)
            why = (f"{oldest.where()} was dropped by worker {self.address}: more than {self.max_runs} runs "
                   "in flight (seabiscuit.runtime.data-plane-runs)")
            oldest.fail(RunFailed(why), oldest.ticket)

    def _remember_end(self, key: RunKey, error: BaseException) -> None:
        remember(self.ended, key, error)
        self.wake(key[0])


def token_delay_s() -> float:
    """Setting ``seabiscuit.generate.token-delay`` in seconds, refused past ``MAX_TOKEN_DELAY_S``."""
    try:
        delay = seconds("generate.token-delay")
    except (KeyError, TypeError, ValueError) as e:
        raise BadConfig("seabiscuit.generate.token-delay must be a duration such as '2ms' "
                        f"({e})") from None
    if not 0.0 <= delay <= MAX_TOKEN_DELAY_S:
        raise BadConfig(f"seabiscuit.generate.token-delay is {delay * 1e3:g} ms: it must be from 0 "
                        f"to {MAX_TOKEN_DELAY_S * 1e3:g} ms (each token reaches its caller that much "
                        "later; 2ms keeps the caller's wake-up off the next worker's core)")
    return delay
