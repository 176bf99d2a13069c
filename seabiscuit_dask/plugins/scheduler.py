"""``SeaBiscuitSchedulerPlugin``: the Dask adapter that owns placement on the scheduler.

It forwards hooks to ``PlacementState`` and carries out its instructions:
pins ``sb-*`` tasks by setting worker restrictions in ``update_graph`` (tasks
are still ``released`` there), replans on ``add_worker``/``remove_worker`` and
re-pins tasks left without a worker, and publishes plan changes on the
``seabiscuit`` event topic. In ``start()`` it registers its RPC handlers
(``seabiscuit_*``) and installs ``SeaBiscuitWorkerPlugin`` on every worker, so a
user registers one thing::

    client.register_plugin(SeaBiscuitSchedulerPlugin())
    # or: dask scheduler --preload seabiscuit_dask.plugins.preload
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from dask.utils import parse_timedelta
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from .. import config
from ..errors import SeaBiscuitError
from ..ir import OpGraph
from ..lower.blocks import task_name
from ..placement import ClusterSpec, Plan
from .state import (
    BudgetChanged,
    Instruction,
    ModelDeployed,
    ModelReleased,
    Pin,
    PlacementState,
    PlanChanged,
    Stranded,
    TasksForgotten,
    TasksSubmitted,
    WorkerDraining,
    WorkerJoined,
    WorkerLeft,
    WorkerRestored,
    parse_key,
)
from .worker import PLUGIN_NAME, SeaBiscuitWorkerPlugin

logger = logging.getLogger(__name__)

TOPIC = "seabiscuit"
RUNS_TOPIC = "seabiscuit-runs"


class SeaBiscuitSchedulerPlugin(SchedulerPlugin):
    """Holds the plans of deployed models and pins their tasks to the planned workers."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.state = PlacementState()
        self.scheduler: Any = None
        self.events: list[dict[str, Any]] = []
        self._background: set[Any] = set()
        self.runs: dict[str, dict[Any, int]] = {}            # model -> live task key -> times computed
        self.run_totals: dict[str, dict[str, int]] = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "seabiscuit_deploy": self.deploy, "seabiscuit_release": self.release,
            "seabiscuit_block": self.block, "seabiscuit_workers": self.workers,
            "seabiscuit_plan": self.plan, "seabiscuit_owned": self.owned,
            "seabiscuit_drain": self.drain, "seabiscuit_pressure": self.pressure,
            "seabiscuit_budget": self.budget, "seabiscuit_restore": self.restore,
            "seabiscuit_runs": self.run_counts,
        })
        if scheduler.no_workers_timeout is None:
            # NOTE: a task pinned to a worker that never comes back must fail, not hang.
            scheduler.no_workers_timeout = parse_timedelta(config.get("scheduler.no-workers-timeout"))
        for addr in scheduler.workers:
            self.state.handle(WorkerJoined(addr))
        await scheduler.register_worker_plugin(None, dumps(SeaBiscuitWorkerPlugin()), PLUGIN_NAME,
                                               idempotent=True)

    # --- hooks ------------------------------------------------------------------------------
    def update_graph(self, scheduler: Any, *, tasks: Iterable[Any] = (), **kwargs: Any) -> None:
        keys = tuple(k for k in tasks if parse_key(k) is not None)
        if keys:
            self._apply(self.state.handle(TasksSubmitted(keys)))

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "forgotten" and key in self.state.pinned:
            self.state.handle(TasksForgotten((key,)))
            parts = parse_key(key)
            if parts is not None:
                self.runs.get(parts[0], {}).pop(key, None)

    def log_event(self, topic: str, msg: Any) -> None:
        """Count block executions reported by the workers (topic ``seabiscuit-runs``).

        Per-block counts live only while the block's task does (see ``transition``);
        the totals stay.
        """
        if topic != RUNS_TOPIC or not isinstance(msg, dict):
            return
        model = str(msg.get("model"))
        totals = self.run_totals.setdefault(model, {"computed": 0, "resumed": 0, "re_executed": 0})
        if msg.get("how") != "computed":
            totals["resumed"] += 1
            return
        key = (task_name(model), int(msg.get("version", 0)), int(msg.get("request", 0)),
               int(msg.get("block", 0)))
        runs = self.runs.setdefault(model, {})
        if runs.get(key, 0):
            totals["re_executed"] += 1
        runs[key] = runs.get(key, 0) + 1
        totals["computed"] += 1

    def add_worker(self, scheduler: Any = None, worker: str = "", **kwargs: Any) -> None:
        self._apply(self.state.handle(WorkerJoined(worker, self._device_of(worker))))

    def remove_worker(self, scheduler: Any = None, worker: str = "", **kwargs: Any) -> None:
        if str(getattr(self.scheduler, "status", "")).endswith(("closing", "closed")):
            return      # NOTE: the cluster is shutting down: nothing to repair
        self._apply(self.state.handle(WorkerLeft(worker)))

    # --- carrying out instructions -----------------------------------------------------------
    def _apply(self, instructions: list[Instruction]) -> None:
        s = self.scheduler
        retry: dict[Any, str] = {}
        for ins in instructions:
            if isinstance(ins, Pin):
                ts = s.tasks.get(ins.key)
                if ts is None:
                    continue
                ts.worker_restrictions = {ins.address}
                ts.loose_restrictions = False
                if not ins.repin and ts.priority is not None:
                    # NOTE: requests in the order they came (Dask gives graphs sent within
                    # 100 ms one generation), and in each, blocks whose outputs leave the
                    # worker first: concurrent requests pipeline instead of queueing.
                    ts.priority = (ts.priority[0], *ins.order)
                if ins.repin and ts.state == "no-worker":
                    retry[ins.key] = "processing"
            elif isinstance(ins, PlanChanged):
                dep = self.state.models[ins.model]
                if ins.version > 0:
                    logger.info("seabiscuit: model %s plan v%d (%s): replanned in %.2f ms, %.0f bytes "
                                "of weights move", ins.model, ins.version, ins.reason, ins.replan_s * 1e3,
                                ins.moved_bytes)
                self._publish({"action": "plan", "model": ins.model, "version": ins.version,
                               "reason": ins.reason, "moved_bytes": ins.moved_bytes,
                               "replan_s": ins.replan_s,
                               "device_of": dep.plan.device_of.tolist(),
                               "cluster": dep.plan.spec.to_dict()})
                if ins.version > 0:
                    self._prefetch(ins.model, ins.version)
            elif isinstance(ins, Stranded):
                logger.error("seabiscuit: %s", ins.message)
                self._publish({"action": "stranded", "model": ins.model, "message": ins.message})
        if retry:
            s.transitions(retry, stimulus_id="seabiscuit-repin")

    def _prefetch(self, model: str, version: int) -> None:
        """Have every worker load the blocks it now owns (and drop what it no longer does)."""
        import asyncio

        budgets = {d.address: d.memory_bytes for d in self.state.models[model].plan.spec.devices}

        async def one(addr: str) -> None:
            try:
                await self.scheduler.rpc(addr).seabiscuit_prefetch(model=model, version=version,
                                                                   budget_bytes=budgets.get(addr))
            except Exception as e:  # noqa: BLE001 - the lazy path loads it on first use instead
                logger.warning("seabiscuit: prefetch of model %s v%d on %s failed: %s", model, version,
                               addr, e)

        for addr in list(self.scheduler.workers):
            task = asyncio.ensure_future(one(addr))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _publish(self, msg: dict[str, Any]) -> None:
        self.events.append({k: v for k, v in msg.items() if k not in ("device_of", "cluster")})
        self.scheduler.log_event(TOPIC, msg)

    def _device_of(self, address: str) -> Any:
        """A DeviceSpec for a worker that joins (or is restored), None before any report on its host.

        Its speeds are those its plan peers were placed with (same host, kind and
        threads) when there are any, so a noisy measurement does not skew a repair.
        """
        from .discover import device_from_report, device_name

        ws = self.scheduler.workers.get(address)
        if ws is None:
            return None
        peers = [w.metrics[PLUGIN_NAME] for w in self.scheduler.workers.values()
                 if w.host == ws.host and w.address != address and w.metrics.get(PLUGIN_NAME)]
        report = ws.metrics.get(PLUGIN_NAME) or (dict(peers[0]) if peers else None)
        if report is None:
            return None
        report = {**report, "budget_bytes": int(ws.resources.get("MEM") or report["budget_bytes"])}
        info = _worker_info(ws, report)
        taken = {d.name for dep in self.state.models.values() for d in dep.plan.spec.devices}
        device = device_from_report(info, device_name(info, taken))
        placed = [d for dep in self.state.models.values() for d in dep.plan.spec.devices
                  if d.host == device.host and d.kind == device.kind]
        if placed:
            like = placed[0]
            device = replace(device, flops_per_s=dict(like.flops_per_s), mem_bytes_per_s=like.mem_bytes_per_s,
                             op_overhead_s=like.op_overhead_s)
        return device

    # --- RPC handlers (first argument: the comm, unused) -------------------------------------
    def deploy(self, comm: Any = None, model: str = "", graph: str = "", device_of: list[int] | None = None,
               cluster: dict[str, Any] | None = None, checkpoint_dir: str = "",
               verify_every: int = 0) -> dict[str, Any]:
        g = OpGraph.from_json(graph)
        plan = Plan(g, ClusterSpec.from_dict(cluster or {}), np.asarray(device_of, dtype=np.int64),
                    method="deployed")
        for addr in self.scheduler.workers:
            self.state.workers.setdefault(addr, None)
        ins = self.state.handle(ModelDeployed(model, plan, checkpoint_dir or "", int(verify_every or 0)))
        self._apply(ins)
        return {"version": self.state.models[model].version}

    def release(self, comm: Any = None, model: str = "") -> bool:
        existed = model in self.state.models
        self.runs.pop(model, None)
        self.run_totals.pop(model, None)
        self.state.handle(ModelReleased(model))
        return existed

    def block(self, comm: Any = None, model: str = "", version: int = 0, block: int = 0) -> dict[str, Any]:
        return self.state.block_spec(model, int(version), int(block))

    def plan(self, comm: Any = None, model: str = "") -> dict[str, Any]:
        dep = self.state.models.get(model)
        if dep is None:
            raise SeaBiscuitError(f"model {model} is not deployed on this cluster")
        return {"version": dep.version, "device_of": dep.plan.device_of.tolist(),
                "cluster": dep.plan.spec.to_dict()}

    def run_counts(self, comm: Any = None, model: str = "") -> dict[str, int]:
        """Blocks of ``model`` computed, read back from checkpoints, and computed more than once."""
        return dict(self.run_totals.get(model, {"computed": 0, "resumed": 0, "re_executed": 0}))

    def owned(self, comm: Any = None, model: str = "", version: int = 0, address: str = "") -> list[Any]:
        return self.state.owned(model, int(version), address)

    def _event(self, event: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        ins = self.state.handle(event)
        self._apply(ins)
        changed = [i for i in ins if isinstance(i, PlanChanged)]
        return {"handled_s": time.perf_counter() - t0, "replan_s": [i.replan_s for i in changed],
                "versions": {i.model: i.version for i in changed}}

    def drain(self, comm: Any = None, address: str = "", reason: str = "drained") -> dict[str, Any]:
        """Move every model off ``address`` while it keeps serving what it already runs."""
        return self._event(WorkerDraining(address, reason))

    def restore(self, comm: Any = None, address: str = "") -> dict[str, Any]:
        """A drained worker takes work again: models spread onto it as onto a worker that joins."""
        return self._event(WorkerRestored(address, self._device_of(address)))

    def pressure(self, comm: Any = None, address: str = "", reason: str = "") -> dict[str, Any]:
        """A worker's agent reports memory pressure or an overheating GPU: drain it if the rest can."""
        logger.warning("seabiscuit: %s reports %s: moving its work away", address, reason)
        self._publish({"action": "pressure", "address": address, "reason": reason})
        try:
            return self._event(WorkerDraining(address, reason))
        except SeaBiscuitError as e:
            logger.error("seabiscuit: cannot move work off %s: %s", address, e)
            self._publish({"action": "pressure-unresolved", "address": address, "reason": str(e)})
            return {"handled_s": 0.0, "replan_s": [], "versions": {}, "error": str(e)}

    def budget(self, comm: Any = None, address: str = "", memory_bytes: int = 0) -> dict[str, Any]:
        """A worker's budget changed: shrink (or grow) what it holds."""
        return self._event(BudgetChanged(address, int(memory_bytes)))

    def workers(self, comm: Any = None) -> list[dict[str, Any]]:
        """Every worker but drained ones, with its agent's last report (None before its first heartbeat)."""
        return [_worker_info(ws, ws.metrics.get(PLUGIN_NAME)) for ws in self.scheduler.workers.values()
                if ws.address not in self.state.draining]


def _worker_info(ws: Any, report: dict[str, Any] | None) -> dict[str, Any]:
    return {"address": ws.address, "name": str(ws.name), "host": ws.host, "nthreads": ws.nthreads,
            "memory_limit": ws.memory_limit, "resources": dict(ws.resources), "report": report}
