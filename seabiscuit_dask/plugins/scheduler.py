"""``SeaBiscuitSchedulerPlugin``: the Dask adapter over the scheduler's state.

It turns Dask hooks and RPCs into ``PlacementState`` events and carries out the
instructions: pins ``sb-*`` tasks by worker restrictions in ``update_graph``
(tasks are still ``released`` there), replans when workers leave or join,
publishes plan changes on the ``seabiscuit`` topic and has the workers sync.
What SeaBiscuit knows lives in the state (``runtime/scheduler/``): plans, owners,
deploy claims, fenced workers and what they missed, run counts. The plugin keeps
only what is Dask's: RPC calls and streams, the waits on them, background tasks.
RPCs (``seabiscuit_*``) validate what they receive (``runtime.access``): a model
id it issued, the deploying client's token, paths inside the roots, budgets the
machine can have; workers show the secret this plugin sent down their own
stream. The owner of a model is the client whose stream claimed its deploy, and
``sb-*`` tasks of a model from any other client are refused. A worker that stops
answering mid-request is fenced (``stalled``) and restored once it answers.
``start()`` installs ``SeaBiscuitWorkerPlugin`` on every worker, so a user
registers one thing::

    client.register_plugin(SeaBiscuitSchedulerPlugin())
    # or: dask scheduler --preload seabiscuit_dask.plugins.preload
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import replace
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from ..dashboard import Activity, Serving
from ..dashboard import install as install_dashboard
from ..errors import AccessDenied, SeaBiscuitError, UnknownWorker, WorkerHung
from ..ir import OpGraph
from ..lower.blocks import parse_key, split_block
from ..lower.registry import require_registered
from ..placement import CapacityChanged, DeviceAdded, DeviceLost, DeviceSpec, Plan
from ..runtime import access
from ..runtime.client.events import TOPIC
from ..runtime.discover import device_from_report, device_name
from ..runtime.scheduler.events import (
    BlockRan,
    DeviceDrained,
    DeviceRestored,
    Event,
    ForModel,
    Instruction,
    LinksObserved,
    ModelDeployed,
    ModelReleased,
    Pin,
    PlanChanged,
    ProgramAdded,
    Rerouted,
    RoutesChanged,
    Stranded,
    TasksForgotten,
    TasksSubmitted,
    WorkerFenced,
)
from ..runtime.scheduler.fencing import SessionEnd
from ..runtime.scheduler.state import PlacementState
from ..runtime.watch import seconds
from ..runtime.worker import agent
from ..runtime.worker.store import remove_store
from ..runtime.worker.tasks import PLUGIN_NAME, RUNS_TOPIC
from .refusing import refusing
from .worker import SeaBiscuitWorkerPlugin

logger = logging.getLogger(__name__)


class SeaBiscuitSchedulerPlugin(SchedulerPlugin):
    """Holds the plans of deployed models and pins their tasks to the planned workers."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.state = PlacementState()
        self.scheduler: Any = None
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.activity = Activity()                           # block runs and request latencies, for the page
        self.serving = Serving()                             # what serving processes report, for the page
        self._hellos: dict[str, asyncio.Event] = {}          # address -> set once its agent said hello
        self._secret = access.new_token()                    # NOTE: each worker gets its own HMAC of it
        self._claim_waiters: dict[str, asyncio.Future[str]] = {}     # deploy claim -> its deploy, waiting
        self._background: set[Any] = set()

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({f"seabiscuit_{n}": refusing(getattr(self, n)) for n in (
            "deploy", "release", "block", "owned", "workers", "plan", "drain", "restore", "budget",
            "pressure", "runs", "hello", "learned", "program", "end_sessions", "stalled", "ticket", "ran",
            "links")})
        # NOTE: a client's own batched stream: the scheduler fills in ``client=`` (as for Dask's own
        # update-graph, a client may name another there; see docs/runtime.md)
        scheduler.stream_handlers["seabiscuit_claim"] = self.claim
        self._desires_keys = scheduler.stream_handlers["client-desires-keys"]
        scheduler.stream_handlers["client-desires-keys"] = self._desires
        for addr in scheduler.workers:
            self.add_worker(scheduler, addr)
        install_dashboard(scheduler, self)
        replies = await scheduler.register_worker_plugin(None, dumps(SeaBiscuitWorkerPlugin()), PLUGIN_NAME,
                                                         idempotent=True)
        for addr, reply in (replies or {}).items():     # NOTE: only a worker with the plugin knows the op
            if isinstance(reply, dict) and reply.get("status") == "OK":
                self._send_secret(addr)

    # --- hooks ------------------------------------------------------------------------------
    def update_graph(self, scheduler: Any, *, tasks: Iterable[Any] = (), keys: Iterable[Any] = (),
                     client: str = "", **kwargs: Any) -> None:
        parsed = [(k, p) for k in tasks if (p := parse_key(k)) is not None]
        foreign = {k for k in [*tasks, *keys] if not self.state.may_touch(client, k)}
        # NOTE: a task that reads another client's block output would hand it over
        foreign |= {k for k in tasks if (ts := self.scheduler.tasks.get(k)) is not None
                    and any(not self.state.may_touch(client, d.key) for d in ts.dependencies)}
        if foreign:
            self._refuse(client, foreign)
            parsed = [(k, p) for k, p in parsed if k not in foreign]
        if parsed:
            self._apply(self.state.handle(TasksSubmitted(tuple(k for k, _ in parsed))))
            self.activity.submitted([p for _, p in parsed])

    def _desires(self, keys: Any = (), client: str = "", **kwargs: Any) -> None:
        """Dask's ``client-desires-keys`` (``Future(key)``), less other owners' block outputs."""
        keys = list(keys or ())
        refused = {k for k in keys if not self.state.may_touch(client, k)}
        if refused:
            self._refuse(client, refused)
        self._desires_keys(keys=[k for k in keys if k not in refused], client=client, **kwargs)

    def _refuse(self, client: str, keys: set[Any]) -> None:
        """``client`` sent tasks of models it did not deploy: they never run, and it is told why."""
        models = sorted({str(p[0]) for k in keys if (p := parse_key(k)) is not None}) or ["(dependents)"]
        msg = (f"AccessDenied: client {client} sent {len(keys)} task(s) of or reading model(s) "
               f"{', '.join(models)}, which another client deployed; only a model's owner may run or "
               "read it")
        logger.warning("seabiscuit: %s", msg)
        cs = self.scheduler.clients.get(client)
        for k in keys:
            ts = self.scheduler.tasks.get(k)
            if ts is not None and ts.state == "released" and not (ts.who_wants or set()) - {cs}:
                ts.worker_restrictions = {"seabiscuit-refused"}      # NOTE: no worker has this address
                ts.loose_restrictions = False

        def cancel() -> None:
            self.scheduler.client_releases_keys(keys=list(keys), client=client,
                                                stimulus_id=f"seabiscuit-refused-{time.time()}")
            self.scheduler.report({"op": "cancelled-keys", "keys": list(keys), "reason": "seabiscuit-access",
                                   "msg": msg}, client=client)

        self.scheduler.loop.add_callback(cancel)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "forgotten" and key in self.state.pinned:
            self.state.handle(TasksForgotten((key,)))

    def log_event(self, topic: str, msg: Any) -> None:
        """Count block runs the workers' tasks report (the data plane reports in batches: ``ran``);
        per-block counts live as long as the block's task."""
        if topic == RUNS_TOPIC and isinstance(msg, dict):
            self._ran(msg)

    def ran(self, comm: Any = None, address: str = "", secret: str = "", runs: Any = (),
            links: Any = ()) -> int:
        """A worker's data plane reports a batch of block runs (and request latencies), and the
        transfers it timed: ``[receiver, bytes, seconds, when, read seconds]`` each."""
        self._check_worker(address, secret)
        batch = [r for r in list(runs or ())[:10_000] if isinstance(r, dict)]
        for one in batch:
            self._ran(one)
        self._task_stream(address, batch)
        samples = []
        for x in list(links or ())[:10_000]:
            try:
                samples.append((str(x[0]), float(x[1]), float(x[2]), float(x[3]),
                                float(x[4]) if len(x) > 4 else 0.0))
            except (TypeError, ValueError, IndexError):
                continue
        if samples:
            try:
                self._apply(self.state.handle(LinksObserved(address, tuple(samples))))
            except SeaBiscuitError as e:       # NOTE: a repair that cannot be made leaves the plan
                logger.warning("seabiscuit: %s", e)
        return len(batch)

    def links(self, comm: Any = None) -> list[dict[str, Any]]:
        """Every link the data plane measured: estimate, the figures plans use, relay, history."""
        return self.state.links_data()

    def _task_stream(self, address: str, runs: list[dict[str, Any]]) -> None:
        """The data plane's block runs on Dask's own task stream (the status page), beside the tasks
        Dask ran: a run reached no Dask task, so the page would look idle while models answer
        (``task_stream_records``). Dask starts its task stream when its status page is opened."""
        stream = (getattr(self.scheduler, "plugins", None) or {}).get("task-stream")
        buffer = getattr(stream, "buffer", None)
        if stream is None or buffer is None:
            return
        for record in task_stream_records(address, runs, self.state.models):
            buffer.append(record)
            stream.index += 1

    def _ran(self, msg: dict[str, Any]) -> None:
        model = str(msg.get("model"))
        if model not in self.state.models:
            return
        if "latency_s" in msg:
            self.activity.measured(msg)
            return
        self.activity.ran(msg)
        try:
            self._apply(self.state.handle(_block_ran(model, msg)))
        except SeaBiscuitError as e:       # NOTE: a repair that cannot be made leaves the plan
            logger.warning("seabiscuit: %s", e)

    def add_worker(self, scheduler: Any = None, worker: str = "", **kwargs: Any) -> None:
        device = self._device_of(worker)
        if device is None:
            logger.info("seabiscuit: worker %s has no agent report yet: not used for placement", worker)
            return
        self._apply(self.state.handle(DeviceAdded(device)))

    def _hello_of(self, address: str) -> asyncio.Event:
        return self._hellos.setdefault(address, asyncio.Event())

    def remove_worker(self, scheduler: Any = None, worker: str = "", **kwargs: Any) -> None:
        self._hellos.pop(worker, None)
        self.state.fencing.left(worker)
        if str(getattr(self.scheduler, "status", "")).endswith(("closing", "closed")):
            return      # NOTE: the cluster is shutting down: nothing to repair
        self._apply(self.state.handle(DeviceLost(worker)))

    def remove_client(self, scheduler: Any = None, client: str = "", **kwargs: Any) -> None:
        """A client that leaves without ``close()`` takes its models with it."""
        self.state.claims.client_left(client)
        for model in self.state.owned_by(client):
            logger.info("seabiscuit: client %s left: releasing model %s", client, model)
            graph = self.state.models[model].plan.graph if model in self.state.models else None
            self._background_task(self._release(model, graph))

    async def _drop_store(self, model: str, graph: OpGraph) -> None:
        """Remove the weight store of a model whose client left (it cannot remove it now)."""
        try:
            for folder in await asyncio.to_thread(remove_store, graph):
                logger.info("seabiscuit: removed the weight store %s of model %s", folder, model)
        except OSError as e:
            logger.warning("seabiscuit: weight store of model %s not removed: %s", model, e)

    # --- carrying out instructions -----------------------------------------------------------
    def _apply(self, instructions: list[Instruction], wait: bool = False) -> list[str]:
        """Carry out ``instructions``; returns the models whose workers must sync to a new plan.

        Unless ``wait`` (the caller awaits ``_sync_workers`` itself), the syncs run in the background.
        """
        retry: dict[Any, str] = {}
        changed: list[str] = []
        for ins in instructions:
            if isinstance(ins, Pin):
                ts = self.scheduler.tasks.get(ins.key)
                if ts is None:
                    continue
                ts.worker_restrictions = {ins.address}
                ts.loose_restrictions = False
                if not ins.repin and ts.priority is not None:
                    # NOTE: requests in the order they came (Dask gives graphs sent within
                    # 100 ms one generation), and in each, blocks whose outputs leave the
                    # worker first: concurrent requests pipeline instead of queueing.
                    ts.priority = (ts.priority[0], *ins.order)
                if ts.state == "no-worker":     # NOTE: a re-pin, or a key a refused task held first
                    retry[ins.key] = "processing"
            elif isinstance(ins, PlanChanged):
                self._plan_changed(ins)
                if ins.version > 0:
                    changed.append(ins.model)
            elif isinstance(ins, Stranded):
                logger.error("seabiscuit: %s", ins.message)
                self._publish({"action": "stranded", "model": ins.model, "message": ins.message})
            elif isinstance(ins, Rerouted):
                logger.info("seabiscuit: model %s: %s (%s)", ins.model, ins.reason, ins.kind)
                self._publish({"action": f"link-{ins.kind}", "model": ins.model,
                               "address": f"{ins.src} -> {ins.dst}", "reason": ins.reason})
            elif isinstance(ins, RoutesChanged):
                self._send_routes(ins.routes)
        if retry:
            self.scheduler.transitions(retry, stimulus_id="seabiscuit-repin")
        if not wait:
            for model in changed:
                self._background_task(self._sync_workers(model))
        return changed

    def _plan_changed(self, ins: PlanChanged) -> None:
        plan = self.state.models[ins.model].plan
        if ins.version > 0:
            logger.info("seabiscuit: model %s plan v%d (%s): replanned in %.2f ms, %.0f bytes of weights "
                        "move", ins.model, ins.version, ins.reason, ins.replan_s * 1e3, ins.moved_bytes)
        self._publish({"action": "plan", "model": ins.model, "version": ins.version, "reason": ins.reason,
                       "moved_bytes": ins.moved_bytes, "replan_s": ins.replan_s,
                       "plan": plan.to_json(stats=False)})

    async def _sync_workers(self, model: str, owners: bool | None = None) -> None:
        """Have workers hold what they now own of ``model`` (and drop what they do not): those of
        its plan (``owners=True``), the others (``False``) or all; never a fenced one, and none
        for longer than ``seabiscuit.runtime.sync-timeout``."""
        dep = self.state.models.get(model)
        mine = dep.addresses() if dep is not None else set()
        timeout = seconds("runtime.sync-timeout")

        async def one(addr: str) -> None:
            try:
                await asyncio.wait_for(self.scheduler.rpc(addr).seabiscuit_sync(model=model), timeout)
            except Exception as e:  # noqa: BLE001 - a block not loaded now is loaded on first use
                if addr in self.scheduler.workers and self.scheduler.status.name == "running":
                    logger.warning("seabiscuit: worker %s could not sync model %s: %s", addr, model,
                                   type(e).__name__ if isinstance(e, asyncio.TimeoutError) else e)

        await asyncio.gather(*(one(a) for a in list(self.scheduler.workers) if a not in self.state.fencing
                               and (owners is None or (a in mine) == owners)))

    def _background_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish(self, msg: dict[str, Any]) -> None:
        self.events.append({k: v for k, v in msg.items() if k != "plan"} | {"time": time.time()})
        self.scheduler.log_event(TOPIC, msg)

    def _device_of(self, address: str, report: dict[str, Any] | None = None) -> DeviceSpec | None:
        """A DeviceSpec for a worker, from its agent's report (or a device of its host), else None.

        Its speeds are those of the devices of its host already known (same kind) when
        there are any, so a noisy measurement does not skew a repair.
        """
        if address in self.state.devices:
            return self.state.devices[address]
        ws = self.scheduler.workers.get(address)
        if ws is None:
            return None
        report = report or ws.metrics.get(PLUGIN_NAME)
        like = [d for d in self.state.devices.values() if d.host == ws.host]
        if report is None and not like:
            return None
        info = _worker_info(ws, report)
        taken = {d.name for d in self.state.devices.values()}
        name = device_name(info, taken)
        machine = agent.machine_bytes(report or {}) or int(ws.memory_limit or 0)
        budget = int(ws.resources.get("MEM") or (report or {}).get("budget_bytes") or like[0].memory_bytes)
        budget = min(budget, machine) if machine else budget
        if report is None:
            return replace(like[0], name=name, address=address, memory_bytes=budget)
        device = replace(device_from_report(info, name), memory_bytes=budget)
        like = [d for d in like if d.kind == device.kind]
        if like:
            device = replace(device, flops_per_s=dict(like[0].flops_per_s),
                             mem_bytes_per_s=like[0].mem_bytes_per_s, op_overhead_s=like[0].op_overhead_s,
                             view_overhead_s=like[0].view_overhead_s)
        return device

    async def _event(self, event: Event) -> dict[str, Any]:
        """Handle ``event``, and return once every worker holds what the new plans give it."""
        t0 = time.perf_counter()
        ins = self.state.handle(event)
        handled_s = time.perf_counter() - t0
        models = self._apply(ins, wait=True)
        # NOTE: the caller waits for the workers that must load; a drained (maybe hung) one drops later
        await asyncio.gather(*(self._sync_workers(m, owners=True) for m in models))
        for m in models:
            self._background_task(self._sync_workers(m, owners=False))
        changed = [i for i in ins if isinstance(i, PlanChanged)]
        return {"handled_s": handled_s, "replan_s": [i.replan_s for i in changed],
                "versions": {i.model: i.version for i in changed}}

    # --- who is asking ------------------------------------------------------------------------
    def claim(self, client: str = "", nonce: str = "", **kwargs: Any) -> None:
        """Stream handler: ``client`` (filled in by the scheduler from its own stream) will deploy
        with ``nonce``; that deploy's model is then owned by ``client`` (``Claims``)."""
        if self.state.claims.claim(client, nonce, time.monotonic()):
            waiter = self._claim_waiters.pop(nonce, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(client)

    async def _claimant(self, nonce: Any) -> str:
        """The client whose stream sent ``nonce`` (it may arrive just after the deploy RPC)."""
        if not isinstance(nonce, str) or not nonce:
            raise AccessDenied("deploy needs the claim its client sent on its own stream "
                               "(use sb.deploy or sb.distribute)")
        client = self.state.claims.take(nonce)
        if client is None:
            waiter = self._claim_waiters.setdefault(nonce, asyncio.get_running_loop().create_future())
            try:
                client = await asyncio.wait_for(asyncio.shield(waiter), seconds("runtime.sync-timeout"))
            except asyncio.TimeoutError:
                raise AccessDenied("deploy's claim never came on a client's stream: only a connected "
                                   "client may deploy (use sb.deploy or sb.distribute)") from None
            finally:
                self._claim_waiters.pop(nonce, None)
                self.state.claims.take(nonce)
        if client not in self.scheduler.clients:
            raise AccessDenied(f"client {client} left before its deploy arrived")
        return client

    def _worker_secret(self, address: str) -> str:
        return hmac.new(self._secret.encode(), str(address).encode(), "sha256").hexdigest()

    def _send_routes(self, routes: tuple[tuple[str, str, str], ...]) -> None:
        """Tell every worker the relays and the links to probe (in the background)."""
        if str(getattr(self.scheduler, "status", "")).endswith(("closing", "closed")):
            return      # NOTE: the cluster is shutting down: no worker needs routes
        self._publish({"action": "routes", "reason": ", ".join(f"{a} -> {b} via {c}" for a, b, c in routes)
                       or "every link direct"})
        for addr in list(self.scheduler.workers):
            if addr not in self.state.fencing:
                self._background_task(self._tell_routes(addr))

    async def _tell_routes(self, address: str) -> None:
        """The current relays and links to probe, to one worker (it checks this plugin's secret)."""
        try:
            await asyncio.wait_for(self.scheduler.rpc(address).seabiscuit_routes(
                routes=[list(r) for r in self.state.routes], watch=[list(w) for w in self.state.watch],
                secret=self._worker_secret(address)), seconds("runtime.sync-timeout"))
        except Exception as e:  # noqa: BLE001 - a worker gone needs no routes; one back gets them at hello
            logger.info("seabiscuit: worker %s did not take the routes: %s", address, e)

    def _send_secret(self, address: str) -> None:
        """Tell a worker its secret down its own stream (no other peer can write there), and the key
        with which the cluster's workers prove themselves to each other (``access.peer_proof``)."""
        stream = self.scheduler.stream_comms.get(address)
        if stream is not None:
            stream.send({"op": "seabiscuit_secret", "secret": self._worker_secret(address),
                         "peers": self._peer_key()})
            if self.state.routes or self.state.watch:    # NOTE: a worker that joins later takes them too
                self._background_task(self._tell_routes(address))

    def _peer_key(self) -> str:
        """What the cluster's workers, and only they, hold to open data-plane streams to each other."""
        return hmac.new(self._secret.encode(), b"data-plane peers", "sha256").hexdigest()

    def _ticket(self, model: str) -> str:
        """What data-plane messages of ``model`` show: its client and its workers have it."""
        return hmac.new(self._secret.encode(), f"ticket:{model}".encode(), "sha256").hexdigest()

    def _check_worker(self, address: Any, secret: Any) -> str:
        """``address`` if it is a worker of this cluster and ``secret`` is the one it was sent."""
        if address not in self.scheduler.workers:
            raise AccessDenied(f"call for {address!r}, which is no worker of this cluster")
        if not access.same_token(self._worker_secret(str(address)), secret):
            raise AccessDenied(f"call for worker {address} without that worker's secret: only the "
                               "worker itself may make it")
        return str(address)

    # --- RPC handlers for clients (first argument: the comm) -----------------------------------
    async def deploy(self, comm: Any = None, graph: str = "", plan: str = "", checkpoint_dir: str = "",
                     verify_every: int = 0, claim: str = "") -> dict[str, Any]:
        """Take a graph and its plan (``Plan.to_json``); returns the model's id, token and version.

        The owner is the client whose stream sent ``claim`` (``runtime.client.deploy`` does).
        """
        owner = await self._claimant(claim)      # NOTE: first, so a refused deploy leaves no claim
        g = OpGraph.from_json(graph)
        require_registered(g, "deploy")          # NOTE: UnsupportedOp before any worker sees it
        access.check_graph_paths(g)
        if checkpoint_dir:
            access.check_path(checkpoint_dir, "checkpoint folder")
        p = Plan.from_json(plan, g)
        for d in p.spec.devices:     # NOTE: workers that joined before the plugin reported
            if d.address in self.scheduler.workers and d.address not in self.state.devices \
                    and d.address not in self.state.fencing:
                self._apply(self.state.handle(DeviceAdded(d)))
        model, token = access.new_model_id(self._peer_key()), access.new_token()
        self._apply(self.state.handle(ModelDeployed(model, p, token, checkpoint_dir or "",
                                                    max(0, int(verify_every or 0)), owner)))
        return {"model": model, "token": token, "version": 0, "ticket": self._ticket(model)}

    def program(self, comm: Any = None, model: str = "", token: str = "", graph: str = "") -> dict[str, Any]:
        """Another program of ``model`` (a generation step, ``trace.decoder``): returns its number.

        Its blocks run where the model's weights are, in this plan and every later one.
        """
        dep = self.state.authorized(access.check_model_id(model), token)
        g = OpGraph.from_json(graph)
        require_registered(g, f"step program of model {model}")
        access.check_graph_paths(g)
        self._apply(self.state.handle(ProgramAdded(model, g)))
        return {"program": len(dep.programs), "version": dep.version}

    async def end_sessions(self, comm: Any = None, model: str = "", token: str = "",
                           sessions: list[int] | None = None, renamed: Any = (), forked: Any = ()) -> int:
        """Every worker frees the KV caches of ``sessions`` of ``model``, renames those of
        ``renamed`` ((old, new, slots kept) each) and starts those of ``forked`` ((source, new,
        slots) each) with a copy of another's first slots; returns the bytes freed."""
        self.state.authorized(access.check_model_id(model), token)
        ids = [int(s) for s in sessions or ()]
        moves = [[int(old), int(new), int(keep)] for old, new, keep in renamed or ()]
        forks = [[int(src), int(dst), int(keep)] for src, dst, keep in forked or ()]
        timeout = seconds("runtime.probe-timeout")        # NOTE: a drop is quick; a hung worker waits

        async def one(addr: str) -> int:
            try:
                return int(await asyncio.wait_for(self.scheduler.rpc(addr).seabiscuit_drop_sessions(
                    model=model, sessions=ids, secret=self._worker_secret(addr), renamed=moves, forked=forks),
                    timeout))
            except Exception as e:  # noqa: BLE001 - a worker gone took its caches with it
                logger.info("seabiscuit: worker %s did not free sessions of %s: %s", addr, model, e)
                return 0

        self.state.fencing.sessions_ended(model, ids, moves)      # NOTE: told on their return (``_rejoin``)
        return sum(await asyncio.gather(*(one(a) for a in list(self.scheduler.workers)
                                          if a not in self.state.fencing)))

    async def release(self, comm: Any = None, model: str = "", token: str = "") -> bool:
        self.state.authorized(access.check_model_id(model), token)
        await self._release(model)
        return True

    async def _release(self, model: str, store_of: OpGraph | None = None) -> None:
        """Forget ``model`` everywhere; with ``store_of`` (its graph), remove its weight store too."""
        self._apply(self.state.handle(ModelReleased(model)))     # NOTE: fenced workers drop it on return
        self.activity.forget(model)
        await self._sync_workers(model)
        if store_of is not None:
            await self._drop_store(model, store_of)

    async def drain(self, comm: Any = None, model: str = "", token: str = "", address: str = "",
              reason: str = "drained") -> dict[str, Any]:
        """Move ``model`` off ``address`` while the worker finishes what it already runs (at once for
        a fenced worker: nothing runs there any more)."""
        self.state.authorized(access.check_model_id(model), token)
        why = self.state.fencing.fenced.get(address)
        if why is not None:
            return {"handled_s": 0.0, "replan_s": [], "versions": {}, "fenced": why}
        return await self._event(ForModel(model, DeviceDrained(address, str(reason)[:200])))

    async def restore(self, comm: Any = None, model: str = "", token: str = "",
                      address: str = "") -> dict[str, Any]:
        """``model`` may use a drained worker again: it spreads onto it as onto a worker that joins."""
        self.state.authorized(access.check_model_id(model), token)
        why = self.state.fencing.fenced.get(address)
        if why is not None:
            raise WorkerHung(f"worker {address} is fenced ({why}): it takes work again by itself once it "
                             "answers")
        device = self._device_of(address)
        if device is None:
            raise UnknownWorker(f"no worker {address} with a SeaBiscuit agent in the cluster")
        return await self._event(ForModel(model, DeviceRestored(device)))

    async def budget(self, comm: Any = None, model: str = "", token: str = "", address: str = "",
               memory_bytes: int = 0) -> dict[str, Any]:
        """``model`` gets ``memory_bytes`` on ``address``: what no longer fits moves elsewhere."""
        self.state.authorized(access.check_model_id(model), token)
        ws = self.scheduler.workers.get(address)
        if ws is None:
            raise UnknownWorker(f"no worker {address} in the cluster")
        machine = agent.machine_bytes(ws.metrics.get(PLUGIN_NAME) or {}) or int(ws.memory_limit or 0)
        nbytes = access.check_budget(memory_bytes, machine, f"worker {address}")
        return await self._event(ForModel(model, CapacityChanged(address, memory_bytes=nbytes)))

    def runs(self, comm: Any = None, model: str = "", token: str = "") -> dict[str, int]:
        """Blocks of ``model`` computed, read back from checkpoints, and computed more than once."""
        self.state.authorized(access.check_model_id(model), token)
        return self.state.runs.of(model)

    def learned(self, comm: Any = None, model: str = "", token: str = "", last: int = 100) -> dict[str, Any]:
        """Per worker of ``model``: measured over modelled time per op class, learned from its runs."""
        self.state.authorized(access.check_model_id(model), token)
        return self.state.learned(model, min(max(1, int(last)), 10_000))

    def plan(self, comm: Any = None, model: str = "", token: str = "") -> dict[str, Any]:
        """The current plan of ``model`` and its version, or why it is stranded."""
        dep = self.state.authorized(access.check_model_id(model), token)
        return {"version": dep.version, "plan": dep.plan.to_json(stats=False), "stranded": dep.stranded}

    async def workers(self, comm: Any = None, everyone: bool = False) -> list[dict[str, Any]]:
        """Workers (drained ones only if ``everyone``) with fresh agent reports and the bytes models hold."""
        drained = self.state.drained
        wss = [ws for ws in self.scheduler.workers.values()
               if ws.address not in self.state.fencing and (everyone or ws.address not in drained)]
        timeout = seconds("runtime.probe-timeout")

        async def report(ws: Any) -> Any:
            try:    # NOTE: a worker without the handler answers None
                return await asyncio.wait_for(self.scheduler.rpc(ws.address).seabiscuit_report(), timeout)
            except Exception:  # noqa: BLE001 - the caller falls back
                return None

        async def fresh(ws: Any) -> Any:
            got = await report(ws)
            if got is not None:
                return got
            last = ws.metrics.get(PLUGIN_NAME)      # NOTE: the last heartbeat's figures will do
            if last is not None:
                return last
            # NOTE: no report ever: a worker that just joined (a restarted one) may still be setting
            # its agent up; its hello is awaited for the sync timeout before it counts as one without
            # (one that said hello already is asked once more at once)
            try:
                await asyncio.wait_for(self._hello_of(ws.address).wait(), seconds("runtime.sync-timeout"))
            except asyncio.TimeoutError:
                return None
            return await report(ws)

        reports = await asyncio.gather(*(fresh(ws) for ws in wss))
        return [{**_worker_info(ws, r), "held_bytes": self.state.held_bytes(ws.address)}
                for ws, r in zip(wss, reports)]

    # --- hung workers ---------------------------------------------------------------------------
    async def stalled(self, comm: Any = None, model: str = "", token: str = "",
                      request: int = 0) -> dict[str, Any]:
        """A request of ``model`` made no progress in its bound: probe the workers it runs on or
        waits for; fence those that do not answer. Returns the fenced ones and the plan version."""
        dep = self.state.authorized(access.check_model_id(model), token)
        suspects = self._suspects(model, int(request)) | dep.addresses()
        answers = await asyncio.gather(*(self._answers(a) for a in sorted(suspects)))
        for addr, ok in zip(sorted(suspects), answers):
            if not ok and addr not in self.state.fencing:
                self._fence(addr, f"no answer to a probe within {seconds('runtime.probe-timeout'):.1f} s "
                                  f"while request {request} of model {model} waited on it")
        fenced = sorted(a for a in suspects if a in self.state.fencing)
        dep = self.state.models.get(model, dep)
        return {"fenced": fenced, "version": dep.version, "stranded": dep.stranded}

    def _suspects(self, model: str, request: int) -> set[str]:
        """Workers running a task of the request, or holding an input one of them waits for."""
        out: set[str] = set()
        for key, addr in list(self.state.pinned.items()):
            parts = parse_key(key)
            if parts is None or parts[0] != model or parts[2] != request:
                continue
            out.add(addr)
            ts = self.scheduler.tasks.get(key)
            if ts is None:
                continue
            if ts.processing_on is not None:
                out.add(ts.processing_on.address)
            for dts in ts.dependencies:
                out.update(ws.address for ws in dts.who_has or ())
        return {a for a in out if a in self.scheduler.workers}

    async def _answers(self, address: str, tries: int = 2) -> bool:
        """Whether ``address`` answers one of ``tries`` probes (a worker that left counts as one
        that answers: it is no hung one)."""
        for _ in range(tries):
            try:
                await asyncio.wait_for(self.scheduler.rpc(address).identity(),
                                       seconds("runtime.probe-timeout"))
                return True
            except Exception:  # noqa: BLE001 - no answer in time, or none at all
                if address not in self.scheduler.workers:
                    return True
        return False

    def _fence(self, address: str, why: str) -> None:
        """Replan every model around a worker that stopped answering, as if it had left."""
        logger.warning("seabiscuit: worker %s is fenced: %s", address, why)
        self._publish({"action": "fenced", "address": address, "reason": why})
        self._apply(self.state.handle(WorkerFenced(address, why)))
        self._background_task(self._watch(address))

    async def _watch(self, address: str) -> None:
        """Probe a fenced worker until it answers (then it takes work again) or leaves. Its return
        is tried again, a probe interval apart, until it takes: an error on the way is logged and
        never ends the watch (a model stays stranded only while the cluster cannot hold it)."""
        if not await self._answers_again(address):
            self.state.fencing.lift(address)
            return
        if self.state.fencing.lift(address) is None:
            return
        logger.info("seabiscuit: fenced worker %s answers again: it takes work again", address)
        self._publish({"action": "unfenced", "address": address})
        # NOTE: it drops what moved, and the models released, while it was fenced
        for model in [*self.state.models, *sorted(self.state.fencing.take_releases(address))]:
            self._background_task(self._sync_workers(model, owners=False))
        while address in self.scheduler.workers and address not in self.state.fencing:
            try:
                self._rejoin(address)
                return
            except Exception as e:  # noqa: BLE001 - logged, and tried again
                logger.warning("seabiscuit: worker %s answers again but did not rejoin the plans (%s: %s); "
                               "trying again", address, type(e).__name__, e)
            await asyncio.sleep(seconds("runtime.probe-timeout"))

    async def _answers_again(self, address: str) -> bool:
        """Whether a fenced worker answered a probe (False: it left, or a newer fence holds it)."""
        while address in self.state.fencing and address in self.scheduler.workers:
            if await self._answers(address, tries=1):
                return True
            await asyncio.sleep(seconds("runtime.probe-timeout"))
        return False

    def _rejoin(self, address: str) -> None:
        """A worker back from a fence: every plan that needs it takes it again, and it drops the
        sessions that ended while it was fenced."""
        device = self._device_of(address)
        if device is None:
            raise UnknownWorker(f"worker {address} has no agent report to place on yet")
        self._apply(self.state.handle(DeviceAdded(device)))
        missed = self.state.fencing.take_ends(address)
        if missed:
            self._background_task(self._end_missed(address, missed))

    async def _end_missed(self, address: str, missed: dict[str, list[SessionEnd]]) -> None:
        """The session ends a fenced worker missed, in the order they came."""
        timeout = seconds("runtime.sync-timeout")
        for model, ends in missed.items():
            for ids, moves in ends:
                try:
                    drop = self.scheduler.rpc(address).seabiscuit_drop_sessions
                    secret = self._worker_secret(address)
                    await asyncio.wait_for(drop(model=model, sessions=ids, secret=secret, renamed=moves),
                                           timeout)
                except Exception as e:  # noqa: BLE001 - a worker gone took its caches with it
                    logger.info("seabiscuit: worker %s did not free sessions of %s it missed: %s", address,
                                model, e)
                    return

    # --- RPC handlers for workers ----------------------------------------------------------------
    def block(self, comm: Any = None, model: str = "", version: int = 0, block: int = 0, address: str = "",
              secret: str = "") -> dict[str, Any]:
        access.check_model_id(model)
        self._check_worker(address, secret)
        return self.state.block_spec(model, int(version), int(block))

    def ticket(self, comm: Any = None, model: str = "", address: str = "", secret: str = "") -> str:
        """A deployed model's data-plane ticket, for one of the cluster's workers."""
        self._check_worker(address, secret)
        self.state.deployment(access.check_model_id(model))
        return self._ticket(model)

    def owned(self, comm: Any = None, model: str = "", address: str = "", secret: str = "") -> dict[str, Any]:
        """What a worker holds of ``model`` now, and the model's ticket (so its data plane need not ask)."""
        access.check_model_id(model)
        owned = self.state.owned(model, self._check_worker(address, secret))
        return owned if owned.get("released") else {**owned, "ticket": self._ticket(model)}

    async def hello(self, comm: Any = None, address: str = "", report: dict[str, Any] | None = None) -> bool:
        """A worker's agent reports for the first time: a worker not yet placed on becomes usable.

        Whoever asks, the worker at ``address`` is sent its secret down its own stream, once
        its plugin answers (a worker without one would drop its stream on the unknown op)."""
        if address not in self.scheduler.workers:
            return False
        try:
            await asyncio.wait_for(self.scheduler.rpc(address).seabiscuit_report(),
                                   seconds("runtime.sync-timeout"))
        except Exception:  # noqa: BLE001 - no agent there (yet): nothing to send or place
            return False
        self._send_secret(address)
        self._hello_of(address).set()
        if address in self.state.devices or address in self.state.fencing:
            return False
        device = self._device_of(address, dict(report) if isinstance(report, dict) else None)
        if device is not None:
            self._apply(self.state.handle(DeviceAdded(device)))
        return device is not None

    async def pressure(self, comm: Any = None, address: str = "", reason: str = "",
                       secret: str = "") -> dict[str, Any]:
        """A worker's agent reports memory pressure or an overheating GPU: drain it if the rest can."""
        self._check_worker(address, secret)
        reason = str(reason)[:200]
        logger.warning("seabiscuit: %s reports %s: moving its work away", address, reason)
        self._publish({"action": "pressure", "address": address, "reason": reason})
        try:
            return await self._event(DeviceDrained(address, reason))
        except SeaBiscuitError as e:
            logger.warning("seabiscuit: cannot move work off %s: %s", address, e)
            self._publish({"action": "pressure-unresolved", "address": address, "reason": str(e)})
            return {"handled_s": 0.0, "replan_s": [], "versions": {}, "error": str(e)}


def _block_ran(model: str, msg: dict[str, Any]) -> BlockRan:
    """A worker's report of a block run (``RUNS_TOPIC``, or a batch of ``ran``) as an event: a
    run's time is learned from only where it names its request."""
    if msg.get("how") != "computed":
        return BlockRan(model, computed=False)
    took = msg.get("compute_s")
    compute_s = float(took) if isinstance(took, (int, float)) and "request" in msg else None
    return BlockRan(model, int(msg.get("version", 0)), int(msg.get("request", 0)), int(msg.get("block", 0)),
                    compute_s=compute_s)


def _worker_info(ws: Any, report: dict[str, Any] | None) -> dict[str, Any]:
    return {"address": ws.address, "name": str(ws.name), "host": ws.host, "nthreads": ws.nthreads,
            "memory_limit": ws.memory_limit, "resources": dict(ws.resources), "report": report}


TASK_STREAM_GAP_S = 0.002   # NOTE: runs of one kind this close on a worker are drawn as one span


def task_stream_records(address: str, runs: Iterable[Any], models: Container[str]) -> list[dict[str, Any]]:
    """Records for Dask's task stream (``distributed``'s ``TaskStreamPlugin.buffer``) of one batch of
    ``address``'s block runs, of the ``models`` deployed: named ``seabiscuit-forward`` or
    ``seabiscuit-step`` (one colour each), in order of their start; runs of one kind that follow
    each other within ``TASK_STREAM_GAP_S`` are one span (a decode loop's blocks run back to back:
    thousands a minute would push Dask's own records out of its buffer)."""
    spans: list[list[Any]] = []       # NOTE: [kind, model, first block, start, stop]
    parsed = []
    for r in runs:
        try:
            model, block = str(r["model"]), int(r["block"])
            start, took = float(r["start"]), float(r["compute_s"])
        except (KeyError, TypeError, ValueError):
            continue
        if model in models and math.isfinite(start) and math.isfinite(took) and took >= 0:
            parsed.append(("step" if split_block(block)[0] else "forward", model, block, start, start + took))
    for kind, model, block, start, stop in sorted(parsed, key=lambda p: p[3]):
        last = spans[-1] if spans else None
        if last is not None and last[0] == kind and last[1] == model and start - last[4] <= TASK_STREAM_GAP_S:
            last[4] = max(last[4], stop)
        else:
            spans.append([kind, model, block, start, stop])
    return [{"key": f"seabiscuit-{kind}-{model[:8]}-b{block}-{int(start * 1e6)}", "worker": address,
             "thread": 0, "startstops": [{"action": "compute", "start": start, "stop": stop}], "status": "OK",
             "nbytes": 0, "type": None, "metadata": {}} for kind, model, block, start, stop in spans]
