"""``SeaBiscuitWorkerPlugin``: the resource agent on one worker, and the keeper of its blocks.

It measures the worker once at setup (``runtime.worker.agent``), publishes its figures
through ``worker.metrics["seabiscuit"]`` on every heartbeat, asks the scheduler to
move work away under memory or heat pressure, and wraps the worker's
``ResidentBlocks`` (``runtime.worker.resident``). Its RPCs: ``seabiscuit_sync`` (hold what
the scheduler says this worker owns of a model; any peer may ask, the answer comes
from the scheduler), ``seabiscuit_report`` (the agent's figures now) and
``seabiscuit_routes`` (the relays and links to probe, from the scheduler plugin only:
``docs/routing.md``). The data plane's RPCs (``seabiscuit_dp_*``) are handlers of the same
names, each forwarding to the worker's run manager (``runtime.dataplane.DataPlane``), which
calls back into the worker through one ``WorkerHost``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

import psutil
from distributed import WorkerPlugin
from distributed.comm import CommClosedError
from distributed.core import Status, error_message
from distributed.protocol import to_serialize

from .. import config
from ..errors import AccessDenied, BadInput, WorkerLost
from ..lower.blocks import BlockSpec
from ..runtime import access
from ..runtime.dataplane import DataPlane, Links, Tensors, decode_loop, timed
from ..runtime.dataplane.host import Imports, Outcome
from ..runtime.dataplane.loops import MAX_EDITS, row_pickers
from ..runtime.dataplane.ordered import OrderedExecutor
from ..runtime.dataplane.streams import Overrun, Receiving, admit, opener, serve
from ..runtime.dataplane.wire import inline
from ..runtime.watch import seconds
from ..runtime.worker import agent
from ..runtime.worker.resident import ResidentBlocks
from ..runtime.worker.tasks import PLUGIN_NAME, fetch_spec
from .refusing import refusing

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# NOTE: the data plane's RPCs, each a handler of the plugin of the same name
DP_RPCS = tuple(f"seabiscuit_dp_{op}" for op in ("feed", "push", "follow", "fail", "forget", "flush",
                                                  "stream", "status", "echo", "lane"))
MAX_FOLLOWED = 1 << 16          # NOTE: steps one follow of a decode loop may name
MAX_UNKNOWN = 4096              # NOTE: model ids refused lately that a worker remembers
MAX_ASKING = 16                 # NOTE: questions for tickets waiting at once; more are refused at once
MAX_LOGGED = 1024               # NOTE: peers whose refused streams a worker logs (once each)


class SeaBiscuitWorkerPlugin(WorkerPlugin):
    """Resource agent and resident-block keeper; installed by the scheduler plugin."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        import torch

        self.worker = worker
        agent.tune_malloc()
        torch.set_num_threads(max(1, int(worker.state.nthreads)))
        self.device = torch.device(self.choose_device(worker))
        props = torch.cuda.get_device_properties(0) if self.device.type == "cuda" else None
        self.memory_limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
        resources = dict(worker.state.total_resources)
        budget = agent.worker_budget(resources, self.memory_limit, props.total_memory if props else None)
        self.report = agent.static_report(int(worker.state.nthreads), self.memory_limit, self.device.type,
                                          str(getattr(props, "uuid", "") or "") or None)
        # NOTE: a GPU worker also runs models placed with device="cpu", in host memory
        host_budget = agent.worker_budget(resources, self.memory_limit, None) if props else None
        self.resident = ResidentBlocks(budget, self.device, worker.address, host_budget_bytes=host_budget)
        self.process = psutil.Process()
        self.process.cpu_percent()
        self.simulated: dict[str, float] = {}       # readings injected by tests and drills
        self.forecast = agent.AvailabilityForecast()
        self.pressure_sent: str | None = None
        self.secret = ""                             # what the scheduler plugin sent: shown in calls
        self.peer_key = ""                           # what the cluster's workers prove themselves with
        self.has_secret = threading.Event()
        worker.metrics[PLUGIN_NAME] = self.metrics
        worker.stream_handlers["seabiscuit_secret"] = self._set_secret
        worker.handlers["seabiscuit_routes"] = self.set_routes
        worker.handlers["seabiscuit_sync"] = self.sync
        worker.handlers["seabiscuit_report"] = self.report_now
        worker.handlers["seabiscuit_drop_sessions"] = refusing(self.drop_sessions)
        self._tickets: dict[str, str] = {}
        self._unknown: OrderedDict[str, float] = OrderedDict()   # NOTE: model -> refused without asking till
        self._asking: asyncio.Lock | None = None
        self._waiting = 0
        self.ticket_questions = 0                    # questions for tickets sent to the scheduler
        self._pool = OrderedExecutor(max(1, int(worker.state.nthreads)), "seabiscuit-dp")
        self._links = Links(opener(lambda: worker.connection_args, worker.address, self._prove))
        self.dataplane = DataPlane(WorkerHost(self))
        self._receiving: dict[str, Receiving] = {}      # NOTE: per peer: bytes read, not yet handed on
        self._streams: dict[str, Any] = {}              # NOTE: per peer: the comm of its stream here
        self._refused_peers: set[str] = set()
        for name in DP_RPCS:
            worker.handlers[name] = refusing(getattr(self, name))
        from tornado.ioloop import PeriodicCallback

        self._flush = PeriodicCallback(self._report_runs, 200)    # NOTE: a tick skips while one runs
        self._flush.start()
        self._probe = PeriodicCallback(self._probe_links, 1e3 * seconds("routing.probe-interval") / 2)
        self._probe.start()
        worker.loop.add_callback(self._hello)

    @staticmethod
    def choose_device(worker: Any = None) -> str:
        """The worker's own device: CUDA where it has it, unless config ``seabiscuit.device`` is
        ``cpu`` (an operator's ``DASK_SEABISCUIT__DEVICE=cpu``); ``cuda`` without CUDA warns."""
        import torch

        choice = config.device_choice()
        if choice == "cpu":
            return "cpu"
        if torch.cuda.is_available():
            return "cuda"
        if choice == "cuda":
            logger.warning("seabiscuit: worker %s is configured with device 'cuda' but has no CUDA "
                           "device: it runs models on its CPU", getattr(worker, "address", ""))
        return "cpu"

    async def _hello(self) -> None:
        """Tell the scheduler plugin this worker can be placed on (before any heartbeat carries it)."""
        w = self.worker
        try:
            await w.scheduler.seabiscuit_hello(address=w.address, report=self.metrics())
        except Exception as e:  # noqa: BLE001 - no SeaBiscuit scheduler plugin: the worker serves nothing
            logger.info("seabiscuit: scheduler of %s did not take the agent's report: %s", w.address, e)

    def teardown(self, worker: Any) -> None:
        # NOTE: a closing worker may still be sent routes or runs (another worker left first): they
        # are refused in one line, not with distributed's "no handler" traceback
        worker.metrics.pop(PLUGIN_NAME, None)
        stopped = _stopped(str(getattr(worker, "address", "")))
        for name in ("seabiscuit_sync", "seabiscuit_report", "seabiscuit_drop_sessions", "seabiscuit_routes",
                     *DP_RPCS):
            worker.handlers[name] = stopped
        worker.stream_handlers["seabiscuit_secret"] = lambda **kwargs: None
        self._flush.stop()
        self._probe.stop()
        self._links.close()
        self._pool.shutdown(wait=False)
        self.resident.clear()

    @property
    def budget_bytes(self) -> int:
        return self.resident.budget_bytes

    @property
    def resident_bytes(self) -> int:
        return self.resident.resident_bytes

    # --- reporting ------------------------------------------------------------------------
    def metrics(self, worker: Any = None) -> dict[str, Any]:
        live = {**agent.live_report(self.process, (self.report.get("gpu") or {}).get("index")),
                **self.simulated}
        self._check_pressure(live)
        r = self.resident
        self.forecast.update(memory_available_bytes=live["memory_available_bytes"],
                             host_cpu_idle=live["host_cpu_idle"])
        return {**self.report, **live, **self.forecast.report(),
                "budget_bytes": r.budget_bytes, "resident_bytes": r.resident_bytes,
                "weight_bytes": r.weight_bytes, "kv_cache_bytes": r.kv.nbytes, "kv_sessions": r.kv_sessions(),
                "blocks": len(r.programs), "models": dict(r.versions), **r.counters,
                "stream_held_bytes": sum(h.held_bytes for h in list(self._receiving.values())),
                **self._as_cpu()}

    def _as_cpu(self) -> dict[str, Any]:
        """What a model placed with device="cpu" gets on a GPU worker: host-side speeds and budget."""
        speeds = self.report.get("as_cpu")
        if not speeds:
            return {}
        return {"as_cpu": {**speeds, "budget_bytes": self.resident.host_budget_bytes}}

    def report_now(self, comm: Any = None) -> dict[str, Any]:
        return self.metrics()

    def _check_pressure(self, live: dict[str, Any]) -> None:
        """Ask the scheduler to move work away once memory or GPU heat crosses its limit."""
        reason = agent.pressure_reason(live, self.memory_limit or psutil.virtual_memory().total)
        if reason is None:
            self.pressure_sent = None
        elif self.pressure_sent is None and self.resident.versions:
            self.pressure_sent = reason
            w = self.worker
            w.loop.add_callback(w.scheduler.seabiscuit_pressure, address=w.address, reason=reason,
                                secret=self.secret)

    # --- RPC ------------------------------------------------------------------------------
    def _set_secret(self, secret: str = "", peers: str = "", **kwargs: Any) -> None:
        """Stream handler: the scheduler plugin's secret for this worker, and the key its workers prove
        themselves to each other with (only the scheduler writes there)."""
        self.secret = str(secret)
        self.peer_key = str(peers)
        self.has_secret.set()

    async def set_routes(self, comm: Any = None, routes: Any = (), watch: Any = (), secret: str = "") -> int:
        """The scheduler's relays, ``[from, to, via]`` worker addresses (it shows this worker's secret):
        where this worker's messages to a peer go through another, and whose it forwards; ``watch``:
        the links (``[from, to]``) a repair left, which their senders probe when idle."""
        await self._secret_known()
        if not access.same_token(self.secret, secret):
            raise AccessDenied(f"routes for {self.worker.address} come from the scheduler plugin only")
        me = self.worker.address
        table = [(str(a), str(b), str(c)) for a, b, c in routes or ()]
        self._links.routes = {b: c for a, b, c in table if a == me}
        self._links.watch = {str(b) for a, b in watch or () if a == me}
        self.dataplane.relaying = {(a, b) for a, b, c in table if c == me}
        return len(self._links.routes)

    async def _probe_links(self) -> None:
        """One message of ``seabiscuit.routing.probe-bytes`` down each watched link that was idle for
        ``seabiscuit.routing.probe-interval``: its acknowledgement times the link."""
        import torch

        nbytes = config.to_bytes(config.get("routing.probe-bytes"), "seabiscuit.routing.probe-bytes")
        for peer in self._links.idle(time.monotonic(), seconds("routing.probe-interval")):
            msg = {"op": "probe", "sender": self.worker.address,
                   "tensors": Tensors(x=torch.zeros(nbytes, dtype=torch.uint8))}
            try:
                await self._links.send(peer, msg, direct=True)
            except Exception as e:  # noqa: BLE001 - a peer gone is not probed
                logger.info("seabiscuit: link to %s not probed: %s", peer, e)

    async def drop_sessions(self, comm: Any = None, model: str = "", sessions: list[int] | None = None,
                            secret: str = "", renamed: Any = (), forked: Any = ()) -> int:
        """Free the KV caches of ``sessions`` of ``model`` here, rename the sessions of ``renamed``
        ((old, new, slots kept) each, ``KVStore.rename``) and start those of ``forked`` with a copy
        of another's first slots ((source, new, slots) each, ``KVStore.fork``, first of all);
        returns the bytes freed.
        A worker that just started waits for its secret first (the scheduler asks every worker)."""
        await self._secret_known()
        if not access.same_token(self.secret, secret):
            raise AccessDenied(f"dropping sessions of model {model!r} on {self.worker.address} needs the "
                               "scheduler plugin's secret: end sessions through the model's client")
        model = access.check_model_id(model)
        for src, dst, keep in forked or ():
            self.resident.kv.fork(model, int(src), int(dst), int(keep))
        for old, new, keep in renamed or ():
            self.resident.kv.rename(model, int(old), int(new), int(keep))
        return self.resident.kv.drop(model, {int(s) for s in sessions or ()})

    async def sync(self, comm: Any = None, model: str = "") -> int:
        """Hold what the scheduler says this worker owns of ``model``; loads run off the event loop.
        Data-plane runs of older plans fail here at once (their callers run them again)."""
        access.check_model_id(model)
        w = self.worker
        await self._secret_known()
        owned = await w.scheduler.seabiscuit_owned(model=model, address=w.address, secret=self.secret)
        self.dataplane.retire(model, None if owned.get("released") else int(owned["version"]))
        self._unknown.pop(model, None)
        if owned.get("released"):
            self._tickets.pop(model, None)
        elif isinstance(owned.get("ticket"), str):
            self._tickets[model] = owned["ticket"]
        return await asyncio.to_thread(self.resident.sync, owned, model)

    # --- the data plane (runtime.dataplane): each RPC forwarded to the run manager ----------------
    async def seabiscuit_dp_feed(self, comm: Any = None, model: str = "", ticket: str = "", version: int = 0,
                                 request: int = 0, inputs: Any = (), collect: Any = (), timed: bool = False,
                                 loop: Any = None, after: int = -1) -> list[Any]:
        fed = {int(b): ts for b, ts in inputs or ()}
        made = None
        if loop:
            # NOTE: a loop's rows' picks (a grammar to compile, a tokenizer to build) are read only for
            # a caller of this model, and off the event loop
            await self.dataplane.host.check(model, ticket)
            picks = isinstance(loop, dict) and any(p is not None for p in loop.get("picks") or ())
            made = await asyncio.to_thread(decode_loop, loop) if picks else decode_loop(loop)
        out = await self.dataplane.feed(model, ticket, version, request, fed, list(collect or ()), timed,
                                        made, int(after))
        return [[b, to_serialize(ts)] for b, ts in out.items()]

    async def seabiscuit_dp_push(self, comm: Any = None, model: str = "", ticket: str = "", version: int = 0,
                                 request: int = 0, block: int = 0, tensors: Any = None,
                                 inputs: Any = ()) -> bool:
        return await self.dataplane.push(model, ticket, version, request, block, tensors or {},
                                         {int(b): ts for b, ts in inputs or ()})

    async def seabiscuit_dp_follow(self, comm: Any = None, model: str = "", ticket: str = "",
                                   version: int = 0, requests: Any = (), blocks: Any = (),
                                   tokens: str = "") -> Any:
        """A decode loop's steps' outputs, written down ``comm`` one message each as they are made
        (``DataPlane.follow``), till the last, the first failure, or the caller's closing ``comm``."""
        async def write(request: int, out: dict[int, Tensors] | None, error: BaseException | None) -> None:
            if error is not None:
                logger.info("seabiscuit: step %s of a decode loop of %s (for %s) failed: %s: %s", request,
                            model, comm.peer_address, type(error).__name__, error)
                await comm.write({"request": request, **error_message(error)})
            else:
                await comm.write({"request": request, "status": "OK",
                                  "outputs": [[b, inline(ts)] for b, ts in (out or {}).items()]})

        try:
            try:
                steps, wanted = [int(r) for r in requests or ()], [int(b) for b in blocks or ()]
                at = int(version)
                if len(steps) > MAX_FOLLOWED:
                    raise BadInput(f"a decode loop of {len(steps)} steps to follow; at most {MAX_FOLLOWED}")
            except (TypeError, ValueError, BadInput) as e:
                # NOTE: nothing else answers: the caller waits for what this writes
                await write(-1, None, e if isinstance(e, BadInput) else BadInput(
                    f"a follow of a decode loop names requests {str(requests)[:80]}, blocks "
                    f"{str(blocks)[:80]} and version {str(version)[:20]}: {e}"))
                return Status.dont_reply
            await self.dataplane.follow(model, ticket, at, steps, wanted, str(tokens), write)
        except (CommClosedError, OSError):
            pass        # NOTE: the caller went; it forgets the steps it did not read
        return Status.dont_reply

    async def seabiscuit_dp_lane(self, comm: Any = None, model: str = "", ticket: str = "", lane: int = 0,
                                 edits: Any = ()) -> int:
        """Edits of a decode loop's rows (``dataplane.Lane``): each [row, session or -1, first slot,
        token, steps or -1], and the row's pick where it is not greedy (``RowPick.message``, checked
        by the lane); the count of edit messages the lane took with these (0: it runs no more
        steps here)."""
        try:
            items = list(edits or ())
            if len(items) > MAX_EDITS:
                raise ValueError(f"{len(items)} edits at once; at most {MAX_EDITS}")
            parsed: list[tuple[Any, ...]] = []
            for item in items:
                item = list(item)
                if len(item) not in (5, 6):
                    raise ValueError(f"an edit of {len(item)} fields")
                r, s, p, t, n = (int(v) for v in item[:5])
                if p < 0 or t < 0 or n < -1:
                    raise ValueError("a negative slot, token or steps")
                parsed.append((r, s, p, t, n, item[5]) if len(item) == 6 else (r, s, p, t, n))
            lane_id = int(lane)
        except (TypeError, ValueError, OverflowError) as e:
            raise BadInput(f"a lane's edits must be [row, session, slot, token, steps] integers (and a "
                           f"row's pick), got {str(edits)[:120]}: {e}") from None
        try:
            if any(len(e) == 6 and e[5] is not None for e in parsed):
                # NOTE: the rows' pickers made for a caller of this model only, and off the event loop
                await self.dataplane.host.check(model, ticket)
                made = await asyncio.to_thread(row_pickers, [e[5] if len(e) == 6 else None for e in parsed])
                parsed = [(*e[:5], m) for e, m in zip(parsed, made)]
            return await self.dataplane.edit(model, ticket, lane_id, parsed)
        except ValueError as e:
            raise BadInput(f"a lane's edits do not fit it: {e}") from None

    async def seabiscuit_dp_fail(self, comm: Any = None, model: str = "", ticket: str = "", version: int = 0,
                                 request: int = 0, reason: str = "", block: int = -1, kind: str = "") -> bool:
        return await self.dataplane.fail(model, ticket, version, request, reason, block, str(kind))

    async def seabiscuit_dp_forget(self, comm: Any = None, model: str = "", ticket: str = "",
                                   requests: Any = ()) -> int:
        return await self.dataplane.forget(model, ticket, list(requests or ()))

    async def seabiscuit_dp_status(self, comm: Any = None, model: str = "", ticket: str = "",
                                   request: int = 0) -> list[int]:
        return await self.dataplane.status(model, ticket, int(request))

    async def _secret_known(self) -> None:
        """Wait for the scheduler plugin's secret (a worker that just joined may be asked to sync
        or run before its stream has brought it)."""
        if not self.has_secret.is_set():
            await asyncio.to_thread(self.has_secret.wait, seconds("runtime.sync-timeout"))

    async def _check_ticket(self, model: Any, ticket: Any) -> str:
        """``ticket`` if it is ``model``'s (a sync tells it, else the scheduler plugin once), else
        ``AccessDenied``."""
        access.check_model_id(model)
        want = self._tickets.get(model)
        if want is None:
            want = await self._ask_ticket(model)
        if not access.same_token(want, ticket):      # NOTE: compared even when fetched just now
            raise AccessDenied(f"a data-plane message for model {model} without its ticket: only the model's "
                               "client and its workers may send them")
        return want

    async def _ask_ticket(self, model: str) -> str:
        """The ticket of a model no sync told this worker of, from the scheduler plugin. An id the
        scheduler did not issue (``access.issued``) is refused without asking; a model it did not
        know is refused without asking again for ``seabiscuit.runtime.refuse-unknown-for``; one
        question at a time, at most ``MAX_ASKING`` waiting. So messages naming made-up models cost
        the scheduler nothing."""
        w = self.worker
        await self._secret_known()
        if not (self.peer_key and access.issued(model, self.peer_key)):
            raise AccessDenied(f"{model} is no model id the scheduler of worker {w.address} issued")
        if self._asking is None:
            self._asking = asyncio.Lock()
        if self._waiting >= MAX_ASKING:
            raise AccessDenied(f"worker {w.address} has {self._waiting} questions for tickets of models it "
                               f"does not hold waiting; a data-plane message for model {model} is refused")
        self._waiting += 1
        try:
            async with self._asking:
                if model in self._tickets:
                    return self._tickets[model]
                if self._unknown.get(model, -1.0) > time.monotonic():
                    raise AccessDenied(f"model {model} is not deployed on this cluster (the scheduler said "
                                       "so lately)")
                self.ticket_questions += 1
                try:
                    want = str(await w.scheduler.seabiscuit_ticket(model=model, address=w.address,
                                                                   secret=self.secret))
                except Exception as e:
                    self._remember_unknown(model)
                    raise AccessDenied(f"worker {w.address} could not learn the ticket of model {model}: "
                                       f"{e}") from e
                self._tickets[model] = want
                return want
        finally:
            self._waiting -= 1

    def _remember_unknown(self, model: str) -> None:
        self._unknown[model] = time.monotonic() + seconds("runtime.refuse-unknown-for")
        self._unknown.move_to_end(model)
        while len(self._unknown) > MAX_UNKNOWN:
            self._unknown.popitem(last=False)

    async def seabiscuit_dp_stream(self, comm: Any = None, raw: bool = False, sender: Any = "",
                                   **kwargs: Any) -> Any:
        """A peer's stream of one-way data-plane messages (``dataplane.streams``), read until it closes,
        once the peer proved it is a worker of this cluster (``streams.admit``). One stream per peer:
        a newer one ends the older (its sender opened it because the older broke). A stream that
        sends more than the credit window lets a worker have open is dropped; either refusal is
        logged once per peer."""
        try:
            await self._secret_known()
            peer = await admit(comm, sender, self._verify, seconds("runtime.probe-timeout"))
        except (AccessDenied, CommClosedError, OSError) as e:
            self._refused(str(sender or getattr(comm, "peer_address", "")), e)
            comm.abort()
            return Status.dont_reply
        older = self._streams.get(peer)
        if older is not None:
            older.abort()
        self._streams[peer] = comm
        held = self._receiving[peer] = Receiving(window_bytes=self._links.settings.window_bytes)
        try:
            await serve(comm, bool(raw), self.dataplane.receive, held, self._links.settings.priority_bytes)
        except Overrun as e:
            self._refused(peer, e)
        finally:
            comm.abort()
            if self._receiving.get(peer) is held:
                del self._receiving[peer]
            if self._streams.get(peer) is comm:
                del self._streams[peer]
        return Status.dont_reply

    async def _prove(self, nonce: str, receiver: str) -> str:
        """This worker's answer to a peer's ``nonce`` (``access.peer_proof``)."""
        await self._secret_known()
        return access.peer_proof(self.peer_key, nonce, self.worker.address, receiver)

    def _verify(self, nonce: str, sender: str, proof: Any) -> bool:
        return bool(self.peer_key) and access.same_token(
            access.peer_proof(self.peer_key, nonce, sender, self.worker.address), proof)

    def _refused(self, peer: str, error: BaseException) -> None:
        """A data-plane stream from ``peer`` dropped: logged the first time only (a flood logs once)."""
        if peer in self._refused_peers or len(self._refused_peers) >= MAX_LOGGED:
            return
        self._refused_peers.add(peer)
        logger.warning("seabiscuit: worker %s dropped a data-plane stream from %s: %s: %s (further ones from "
                       "there are dropped without a log line)", self.worker.address, peer,
                       type(error).__name__, error)

    async def seabiscuit_dp_echo(self, comm: Any = None, data: Any = None) -> Any:
        """``data`` (tensors, as a request's inputs come) sent back as a request's outputs go: what
        ``discover`` times a caller's round trip of a request with."""
        if not isinstance(data, Tensors):
            raise BadInput(f"an echo takes tensors (wire.Tensors), got {type(data).__name__}")
        return to_serialize(data)

    async def seabiscuit_dp_flush(self, comm: Any = None) -> int:
        """Report the data plane's block runs now; returns once the scheduler has them."""
        return await self._report_runs()

    async def _report_runs(self) -> int:
        """Block runs of the data plane and samples of its links go to the scheduler in batches (one
        message a tick)."""
        records = self.dataplane.take_records()
        links = [[peer, *sample] for peer, samples in self._links.take_samples().items()
                 for sample in samples]
        if records or links:
            try:
                await self.worker.scheduler.seabiscuit_ran(address=self.worker.address, secret=self.secret,
                                                           runs=records, links=links)
            except Exception as e:  # noqa: BLE001 - figures only: the requests stand
                logger.info("seabiscuit: %d block runs not reported: %s", len(records), e)
        return len(records)


class WorkerHost:
    """What the data plane asks of this worker (``runtime.dataplane.host.Host``): its resident blocks
    run and their specs, the plan it holds, its streams to peers and its tickets."""

    def __init__(self, plugin: SeaBiscuitWorkerPlugin) -> None:
        self.plugin, self.resident, self.worker = plugin, plugin.resident, plugin.worker
        self.address: str = plugin.worker.address
        self.executor = plugin._pool
        self._timed = timed(self._run, self.address)

    def compute(self, model: str, version: int, request: int, block: int, imports: Imports) -> Outcome:
        return self._timed(model, version, request, block, imports)

    def _run(self, model: str, version: int, request: int, block: int,
             imports: Imports) -> tuple[dict[str, torch.Tensor], str]:
        return self.resident.run(model, version, request, block, imports, (), self._fetch)

    def spec_of(self, model: str, version: int, block: int) -> BlockSpec | None:
        p = self.resident.programs.get((model, block))
        return p.spec if p is not None and p.spec.version == version else None

    def load_spec(self, model: str, version: int, block: int) -> BlockSpec:
        return self.resident.program(model, version, block, self._fetch).spec

    def describe(self, model: str, version: int, block: int) -> BlockSpec:
        return BlockSpec.from_dict(self._fetch(model, version, block))

    def version_of(self, model: str) -> int:
        return self.resident.versions.get(model, -1)

    def ready(self, model: str, version: int, block: int, imports: Imports) -> bool:
        """Whether a block of a prompt's later chunk finds its sessions cached up to its first slot
        here (its run holds it until then)."""
        spec = self.spec_of(model, version, block)
        return spec is None or self.resident.kv.ready(model, spec, imports)

    def send(self, address: str, op: str, **msg: Any) -> asyncio.Future[None]:
        """A one-way message to a peer, down the stream to it (``seabiscuit_dp_push|feed|fail``): the
        future of its being on the wire (``Links.send``)."""
        msg = {"op": op.removeprefix("seabiscuit_dp_"), "sender": self.address, **msg}
        return self.plugin._links.send(address, msg)

    def forward(self, address: str, msg: dict[str, Any]) -> Awaitable[None]:
        return self.plugin._links.send(address, msg, direct=True)

    async def check(self, model: str, ticket: Any) -> str:
        return await self.plugin._check_ticket(model, ticket)

    def _fetch(self, model: str, version: int, block: int) -> Mapping[str, Any]:
        return fetch_spec(model, version, block, self.worker)


def _stopped(address: str) -> Any:
    """The handler of an RPC to a worker whose plugin has stopped: refused, as a worker gone."""
    async def stopped(comm: Any = None, **kwargs: Any) -> Any:
        return error_message(WorkerLost(f"SeaBiscuit has stopped on worker {address} (it is closing)"),
                             status="uncaught-error")
    return stopped
