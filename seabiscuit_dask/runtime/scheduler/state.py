"""What the scheduler decides, as plain Python: ``PlacementState.handle(event) -> instructions``.

No cluster in here. The scheduler plugin turns Dask hooks and RPCs into events
(``events``) and carries out the instructions; tests drive this class directly.
It holds every fact the scheduler keeps of SeaBiscuit: the deployed models
(``Deployment``, each with its owner), the usable devices, where every pinned task
runs, the learned speeds and links, the fenced workers (``Fencing``), the deploy
claims (``Claims``) and the block runs counted (``RunCounts``). Its settings are
read once, when it is built (``StateSettings``), never while it handles an event.
It keeps no log of events: one entry per block run and per batch of link samples
filled 45 MiB of the scheduler's memory in minutes, and nothing replayed it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import AccessDenied, ClusterTooSmall, RoomTaken, SeaBiscuitError, UnknownWorker
from ...lower.blocks import Key, parse_key, split_block, task_name
from ...placement import CapacityChanged, DeviceAdded, DeviceLost, DeviceSpec, Plan, place, replan
from ...placement.cluster import DEFAULT_LINKS, ClusterSpec, LinkSpec
from ...placement.learn import CostLearner
from ...placement.links import LinkLearner
from ...placement.reroute import LinkChanged, reroute
from .. import access
from .claims import Claims
from .deployment import Deployment, admits
from .events import (
    BlockObserved,
    BlockRan,
    DeviceDrained,
    DeviceEvent,
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
from .fencing import Fencing
from .runs import RunCounts
from .settings import StateSettings

logger = logging.getLogger(__name__)


class PlacementState:
    """Deployed models, usable devices, where every pinned task runs, and the workers fenced.

    ``settings`` default to ``StateSettings.from_config()``, read here and only here.
    """

    def __init__(self, settings: StateSettings | None = None) -> None:
        self.settings = s = settings or StateSettings.from_config()
        self.models: dict[str, Deployment] = {}
        self.devices: dict[str, DeviceSpec] = {}     # address -> the device its agent reported
        self.drained: dict[str, str] = {}            # address -> why, drained for every model
        self.pinned: dict[Key, str] = {}
        self.fencing = Fencing()
        self.claims = Claims(s.claim_ttl_s)
        self.runs = RunCounts()
        self.learner = CostLearner(change=s.speed_change, patience=s.learn_patience,
                                   cooldown=s.learn_cooldown)
        self.links = LinkLearner(forget=s.link_forget, prior=s.link_prior, change=s.link_change,
                                 patience=s.link_patience, cooldown=s.link_cooldown, history=s.link_history)
        self.routes: tuple[tuple[str, str, str], ...] = ()       # (from, to, via) worker addresses
        self.watch: tuple[tuple[str, str], ...] = ()            # links left by a repair, idle now
        self.avoided: set[tuple[str, str]] = set()              # links a repair left
        self.probed: dict[tuple[str, str], LinkSpec] = {}        # links as the deployed plans first had them
        self.pending: set[tuple[str, str]] = set()             # links that changed, repair not yet weighed

    def handle(self, event: Event) -> list[Instruction]:
        """The instructions ``event`` calls for; the state changes as it says (see ``events``)."""
        if isinstance(event, BlockRan):
            return self._ran(event)
        if isinstance(event, BlockObserved):
            return self._observed(event)
        if isinstance(event, LinksObserved):
            return self._links_observed(event)
        if isinstance(event, TasksSubmitted):
            return self._pin(event.keys)
        if isinstance(event, TasksForgotten):
            return self._forget(event.keys)
        if isinstance(event, ModelDeployed):
            return self._deployed(event)
        if isinstance(event, ProgramAdded):
            return self._program(event)
        if isinstance(event, ModelReleased):
            return self._released(event.model)
        if isinstance(event, WorkerFenced):
            self.fencing.fence(event.address, event.reason)
            return self._device_event(DeviceLost(event.address), list(self.models.values()))
        if isinstance(event, ForModel):
            return self._device_event(event.event, [self.deployment(event.model)])
        return self._device_event(event, list(self.models.values()))

    def deployment(self, model: str) -> Deployment:
        dep = self.models.get(model)
        if dep is None:
            raise AccessDenied(f"model {model!r} is not deployed on this cluster "
                               f"({len(self.models)} model(s) are)")
        return dep

    def authorized(self, model: str, token: Any) -> Deployment:
        """The deployment of ``model``, for the client that deployed it (it shows the token) only."""
        dep = self.deployment(model)
        if not access.same_token(dep.token, token):
            raise AccessDenied(f"model {model} belongs to the client that deployed it: the token "
                               "given is not the one its deploy returned")
        return dep

    def may_touch(self, client: str, key: Any) -> bool:
        """Whether ``client`` may run or read ``key``: any key but another owner's ``sb-*`` ones."""
        p = parse_key(key)
        dep = self.models.get(p[0]) if p is not None else None
        return dep is None or dep.owner == client

    def owned_by(self, client: str) -> list[str]:
        """The models ``client`` deployed, in the order it deployed them."""
        return [m for m, dep in self.models.items() if dep.owner == client]

    # --- device events ----------------------------------------------------------------------
    def _device_event(self, event: DeviceEvent, deps: list[Deployment]) -> list[Instruction]:
        everyone = len(deps) == len(self.models)
        if isinstance(event, DeviceLost):
            return self._lost(event.name, deps)
        if isinstance(event, DeviceDrained):
            return self._drain(event.name, event.reason, deps, everyone)
        if isinstance(event, (DeviceAdded, DeviceRestored)):
            return self._added(event.device, deps, restored=isinstance(event, DeviceRestored),
                               everyone=everyone)
        return self._capacity(event, deps)

    def _lost(self, address: str, deps: list[Deployment]) -> list[Instruction]:
        self.devices.pop(address, None)
        self.drained.pop(address, None)
        if len(deps) == len(self.models):   # NOTE: a gone worker is no peer to compare speeds with
            self.learner.forget_device(address)
            self.links.forget_device(address)
        out: list[Instruction] = []
        for dep in deps:
            dep.excluded.pop(address, None)
            out += self._move_off(dep, address, f"worker {address} left", stranded=True)
        stuck = tuple(k for k, a in self.pinned.items() if a == address)
        return out + self._routes_now() + self._pin(stuck, repin=True)

    def _drain(self, address: str, reason: str, deps: list[Deployment], everyone: bool) -> list[Instruction]:
        """Move models off a live worker; its in-flight tasks still run there. All or nothing."""
        if address not in self.devices:
            raise UnknownWorker(f"no worker {address} in the cluster (workers: {sorted(self.devices)})")
        planned: dict[str, Plan] = {}
        for dep in [d for d in deps if address in d.addresses()]:
            try:
                planned[dep.model] = self._replan_lost(dep, address)
            except SeaBiscuitError as e:
                raise ClusterTooSmall(f"worker {address} drained: {reason}; the remaining "
                                      f"{len(dep.plan.spec.devices) - 1} worker(s) cannot hold model "
                                      f"{dep.model}: {e}") from e
        if everyone:
            self.drained[address] = reason
        out: list[Instruction] = []
        for dep in deps:
            dep.excluded[address] = reason
            if dep.model in planned:
                p = planned[dep.model]
                v = dep.advance(p)
                out.append(PlanChanged(dep.model, v, f"worker {address} drained: {reason}",
                                       p.info["moved_bytes"], p.planning_s))
        return out

    def _move_off(self, dep: Deployment, address: str, why: str, stranded: bool) -> list[Instruction]:
        if address not in dep.addresses():
            return []
        try:
            plan = self._replan_lost(dep, address)
        except SeaBiscuitError as e:
            msg = (f"{why}; the remaining {len(dep.plan.spec.devices) - 1} worker(s) cannot hold "
                   f"model {dep.model}: {e}")
            dep.stranded = msg
            dep.lost.append(address)
            return [Stranded(dep.model, msg)]
        v = dep.advance(plan)
        return [PlanChanged(dep.model, v, why, plan.info["moved_bytes"], plan.planning_s)]

    def _replan_lost(self, dep: Deployment, address: str) -> Plan:
        """``dep``'s plan without ``address``; when the rest cannot hold it, with the spare workers
        too (ones that joined while the plan had no use for them, e.g. a fenced worker back)."""
        current = self._in_room(dep)
        try:
            return replan(current, DeviceLost(address))
        except SeaBiscuitError:
            spare = [self._joining(dep, d) for a, d in sorted(self.devices.items()) if a != address
                     and a not in dep.addresses() and a not in self.drained and a not in dep.excluded
                     and admits(dep, d)]
            if not spare:
                raise
            spec = current.spec
            for d in spare:
                spec = spec.with_device(d)
            old = current
            wider = Plan(old.graph, spec, old.device_of, old.method, old.planning_s, dict(old.info))
            return replan(wider, DeviceLost(address))

    def _capacity(self, event: CapacityChanged, deps: list[Deployment]) -> list[Instruction]:
        """Repair every model on the worker. A new budget that cannot be met raises; a speed
        change (learned ``scale``) is best effort: a model it cannot move, or need not, keeps
        its plan (a repair that moves nothing is no new plan)."""
        speed = event.scale is not None
        if speed and event.name in self.devices:
            self.devices[event.name] = replace(self.devices[event.name], scale=dict(event.scale or {}))
        why = (self._speed_reason(event.name, event.scale or {}) if speed
               else f"worker {event.name} budget now {event.memory_bytes} bytes")
        out: list[Instruction] = []
        for dep in deps:
            if event.name not in dep.addresses():
                continue
            try:
                p = replan(self._in_room(dep), event)
            except SeaBiscuitError as e:
                if not speed:
                    raise
                logger.warning("seabiscuit: no repair of model %s for the speed of %s: %s",
                               dep.model, event.name, e)
                continue
            if not speed or p.info.get("moved_ops"):
                out.append(PlanChanged(dep.model, dep.advance(p), why, p.info["moved_bytes"], p.planning_s))
        return out

    def _ran(self, e: BlockRan) -> list[Instruction]:
        """Count a block run (per task while its task lives); learn from a request's computed one."""
        if e.model not in self.models:
            return []
        key = (task_name(e.model), e.version, e.request, e.block)
        # NOTE: a task's run is counted per task; the data plane refuses repeats itself
        self.runs.ran(e.model, key if key in self.pinned else None, e.computed)
        if not e.computed or e.compute_s is None or e.request < 0:
            return []
        return self._observed(BlockObserved(e.model, e.version, e.block, e.compute_s))

    def _observed(self, e: BlockObserved) -> list[Instruction]:
        """Learn from a block's run; a worker whose speed changed gets a repair (all its models)."""
        dep = self.models.get(e.model)
        blocks = dep.modelled(e.version) if dep is not None else []
        if dep is None or not 0 <= e.block < len(blocks):
            return []
        if (e.version, e.block) not in dep.warm:      # NOTE: a first run pays first touches of its tiles
            dep.warm.add((e.version, e.block))
            return []
        address, modelled = blocks[e.block]
        scale = self.learner.observe(address, modelled, float(e.compute_s))
        if scale is None or address not in self.devices or not self.settings.learn_repair:
            return []
        logger.info("seabiscuit: worker %s runs at %s of its modelled time", address, scale)
        out = self._capacity(CapacityChanged(address, scale=scale), list(self.models.values()))
        if not out:
            self.learner.settle(address)       # NOTE: nothing churned: the next change may act at once
        return out

    @staticmethod
    def _speed_reason(address: str, scale: dict[str, float]) -> str:
        return (f"worker {address} runs at " + ", ".join(f"{v:.2f}x" for v in scale.values())
                + " the modelled time (" + ", ".join(scale) + ")")

    # --- links ----------------------------------------------------------------------------------
    def _links_observed(self, e: LinksObserved) -> list[Instruction]:
        """Learn each link from its transfers; a link that changed gets the repair that pays, in
        every model whose plan uses both its ends (``placement.reroute``), once every link those
        plans send over is measured (till then the change waits: a repair that weighs a measured
        link against ones only probed compares two instruments)."""
        for dst, nbytes, seconds, when, read_s in e.samples:
            if dst == e.sender:
                continue
            link = self.links.observe(e.sender, dst, nbytes, seconds, self.link_figures(e.sender, dst), when,
                                      read_s)
            if link is not None:
                logger.info("seabiscuit: link %s -> %s now measures %.3g bytes/s, %.3g s", e.sender, dst,
                            link.bandwidth_bytes_per_s, link.latency_s)
                self.pending.add((e.sender, dst))
        out: list[Instruction] = []
        for src, dst in sorted(self.pending):
            deps = [d for d in self.models.values() if {src, dst} <= d.addresses()]
            if all(self._measured(d) for d in deps):
                self.pending.discard((src, dst))
                out += self._reroute(src, dst, self.links.links[(src, dst)].applied)
        return out

    def _measured(self, dep: Deployment) -> bool:
        """Whether every link ``dep``'s plan sends over directly has ``patience`` transfers measured."""
        spec, bb = dep.plan.spec, dep.plan.bytes_between
        for i, j in zip(*np.nonzero(bb)):
            est = self.links.links.get((spec.devices[int(i)].address, spec.devices[int(j)].address))
            if spec.relay(int(i), int(j)) < 0 and (est is None or est.count < self.links.patience):
                return False
        return True

    def link_figures(self, src: str, dst: str) -> LinkSpec:
        """The link ``src -> dst`` as the plans first had it (measured by probes, or the topology's
        figure), else the topology's figure between hosts."""
        return self.probed.get((src, dst), DEFAULT_LINKS["network"])

    def calibrated(self, spec: ClusterSpec, but: tuple[str, str] = ("", "")) -> ClusterSpec:
        """``spec`` with each link the data plane has measured at its estimate, and each other one at
        its first figures scaled as the measured links' were (the median ratio, ``but`` left out):
        probes and the data plane are two instruments, and a repair compares like with like."""
        measured = {k: e for k, e in self.links.links.items() if e.count >= self.links.patience}
        ratios = [(e.estimate().bandwidth_bytes_per_s / e.prior.bandwidth_bytes_per_s,
                   e.estimate().latency_s / max(e.prior.latency_s, 1e-9))
                  for k, e in measured.items() if k != but]
        rb, rl = (float(np.median([r[x] for r in ratios])) for x in (0, 1)) if ratios else (1.0, 1.0)
        n = len(spec.devices)
        bw, lat = spec.direct_bandwidth.copy(), spec.direct_latency.copy()
        for i, a in enumerate(spec.devices):
            for j, b in enumerate(spec.devices):
                est = measured.get((a.address, b.address))
                first = self.probed.get((a.address, b.address))
                if i == j:
                    bw[i, j] = lat[i, j] = 0.0
                elif est is not None:
                    now = est.estimate()
                    bw[i, j], lat[i, j] = now.bandwidth_bytes_per_s, now.latency_s
                elif first is not None:
                    bw[i, j], lat[i, j] = first.bandwidth_bytes_per_s * rb, first.latency_s * rl
        def rows(m: np.ndarray) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(float(m[i, j]) for j in range(n)) for i in range(n))

        return replace(spec, matrix=(rows(bw), rows(lat)))

    def _reroute(self, src: str, dst: str, link: LinkSpec) -> list[Instruction]:
        out: list[Instruction] = []
        for dep in self.models.values():
            if dep.stranded or not {src, dst} <= dep.addresses():
                continue
            p = dep.plan
            now = Plan(p.graph, self.calibrated(p.spec, (src, dst)), p.device_of, p.method, p.planning_s,
                       dict(p.info))
            r = reroute(now, LinkChanged(src, dst, link), self.settings.reroute)
            out.append(Rerouted(dep.model, src, dst, r.kind, r.reason))
            if r.kind != "keep":
                self.avoided.add((src, dst))
            if r.kind == "recut":
                v = dep.advance(r.plan)
                out.append(PlanChanged(dep.model, v, r.reason, r.moved_bytes, r.plan.planning_s))
            else:
                dep.plan = r.plan       # NOTE: the same placement and version, on the new figures
        return out + self._routes_now()

    def _routes_now(self) -> list[Instruction]:
        """The relays of every model's plan as one table of addresses, and the links a repair left
        that no plan uses directly now (to be probed); a ``RoutesChanged`` if either changed."""
        table: dict[tuple[str, str], str] = {}
        used: set[tuple[str, str]] = set()
        for dep in self.models.values():
            spec = dep.plan.spec
            at = {d.name: d.address for d in spec.devices}
            for a, b, c in spec.relays:
                table[(at[a], at[b])] = at[c]
            bb = dep.plan.bytes_between
            used |= {(spec.devices[i].address, spec.devices[j].address) for i, j in zip(*np.nonzero(bb))
                     if spec.relay(int(i), int(j)) < 0}
        self.avoided &= {(a, b) for a, b in self.avoided if a in self.devices and b in self.devices}
        routes = tuple(sorted((a, b, c) for (a, b), c in table.items()))
        watch = tuple(sorted(self.avoided - used))
        if (routes, watch) == (self.routes, self.watch):
            return []
        self.routes, self.watch = routes, watch
        return [RoutesChanged(routes, watch)]

    def links_data(self) -> list[dict[str, Any]]:
        """Every link measured so far: its estimate, the figures plans use, and its history."""
        relayed = {(a, b): c for a, b, c in self.routes}
        return [{"src": src, "dst": dst, "bandwidth_bytes_per_s": est.estimate().bandwidth_bytes_per_s,
                 "latency_s": est.estimate().latency_s, "applied_bandwidth_bytes_per_s":
                 est.applied.bandwidth_bytes_per_s, "applied_latency_s": est.applied.latency_s,
                 "transfers": est.count, "bytes": est.bytes_total, "changes": est.changes,
                 "on_trial": est.trial is not None, "calibrated": est.calibrated,
                 "changed_at": [[t, n] for t, n in est.changed_at],
                 "via": relayed.get((src, dst), ""),
                 "history": [[t, bw, lat] for t, bw, lat in est.history]}
                for (src, dst), est in sorted(self.links.links.items())]

    def learned(self, model: str, last: int = 100) -> dict[str, Any]:
        """The learned scales of ``model``'s workers, and the mean relative error of the last
        ``last`` block-time predictions (each made before its run was seen)."""
        dep = self.deployment(model)
        return {"scales": {d.address: self.learner.scale(d.address) for d in dep.plan.spec.devices},
                "error": self.learner.mean_error(max(1, int(last))), "observed": len(self.learner.errors)}

    def _added(self, device: DeviceSpec, deps: list[Deployment], restored: bool,
               everyone: bool) -> list[Instruction]:
        address = device.address
        self.devices[address] = device
        if restored and everyone:
            self.drained.pop(address, None)
        out: list[Instruction] = []
        for dep in deps:
            if restored:
                dep.excluded.pop(address, None)
            if address in self.drained or address in dep.excluded or not admits(dep, device):
                continue
            if dep.stranded:
                out += self._recover(dep, device)
            elif address not in dep.addresses():
                out += self._spread(dep, device)
        return out

    def _spread(self, dep: Deployment, device: DeviceSpec) -> list[Instruction]:
        try:
            plan = replan(self._in_room(dep), DeviceAdded(self._joining(dep, device)))
        except SeaBiscuitError as e:
            logger.info("model %s stays on its workers after %s joined: %s", dep.model, device.address, e)
            return []
        if not plan.info.get("moved_ops"):
            return []
        v = dep.advance(plan)
        return [PlanChanged(dep.model, v, f"worker {device.address} joined", plan.info["moved_bytes"],
                            plan.planning_s)]

    def _recover(self, dep: Deployment, device: DeviceSpec) -> list[Instruction]:
        """A stranded model takes the newcomer in place of the workers it lost, if it now fits.

        The repair is incremental when it can be; else the model is placed afresh on
        the workers it has left and the newcomer.
        """
        device = self._joining(dep, device)
        current = self._in_room(dep)
        try:
            plan = current if device.address in dep.addresses() else replan(current, DeviceAdded(device))
            for gone in dep.lost:
                plan = replan(plan, DeviceLost(gone))
        except SeaBiscuitError:
            spec = current.spec
            for gone in dep.lost:
                spec = spec.without(gone)
            try:
                if device.address not in {d.address for d in spec.devices}:
                    spec = spec.with_device(device)
                plan = place(dep.plan.graph, spec)
            except SeaBiscuitError as e:
                logger.info("model %s is still stranded after %s joined: %s", dep.model, device.address, e)
                return []
        dep.stranded, dep.lost = "", []
        v = dep.advance(plan)
        return [PlanChanged(dep.model, v, f"recovered: worker {device.address} joined",
                            float(plan.info.get("moved_bytes", plan.weight_bytes.sum())), plan.planning_s)]

    # --- models and tasks -----------------------------------------------------------------
    def _deployed(self, e: ModelDeployed) -> list[Instruction]:
        missing = [d.name for d in e.plan.spec.devices if d.address not in self.devices]
        if missing:
            raise UnknownWorker(f"model {e.model}: the plan uses devices {missing} whose workers are "
                                f"not in the cluster (workers: {sorted(self.devices)})")
        if e.model in self.models:
            raise AccessDenied(f"model id {e.model} is already deployed; ids are issued once")
        over = [(d.name, d.memory_bytes, self.devices[d.address].memory_bytes) for d in e.plan.spec.devices
                if d.memory_bytes > self.devices[d.address].memory_bytes]
        if over:
            name, claimed, measured = over[0]
            raise ClusterTooSmall(f"model {e.model}: the plan gives device {name} {claimed} bytes, more than "
                                  f"its worker's measured budget of {measured} bytes ({len(over)} device(s) "
                                  "so); place the model on sb.measure_cluster(client) again")
        # NOTE: room the plan counted on that another model took since it was measured (two clients
        # that measured and placed at the same time): the second is refused, not overcommitted
        peaks = e.plan.peak_bytes
        room = [(d.name, int(peaks[i]), self.held_bytes(d.address), self.devices[d.address].memory_bytes)
                for i, d in enumerate(e.plan.spec.devices) if d.kind == self.devices[d.address].kind]
        taken = [r for r in room if r[2] + r[1] > r[3]]
        if taken:
            name, need, held, budget = taken[0]
            raise RoomTaken(f"model {e.model}: the plan puts {need} bytes on {name}, whose other models' "
                            f"plans take {held} of its budget of {budget} bytes ({held} + {need} > {budget}; "
                            f"{len(taken)} device(s) so): another model was deployed there since the plan "
                            "was made; measure the cluster and place again")
        self.models[e.model] = Deployment(e.model, e.plan, e.token, e.owner, checkpoint_dir=e.checkpoint_dir,
                                          verify_every=e.verify_every)
        spec = e.plan.spec
        for i, a in enumerate(spec.devices):
            for j, b in enumerate(spec.devices):
                if i != j:
                    first = LinkSpec(float(spec.direct_bandwidth[i, j]), float(spec.direct_latency[i, j]))
                    self.probed.setdefault((a.address, b.address), first)
        return [PlanChanged(e.model, 0, "deployed")]

    def _released(self, model: str) -> list[Instruction]:
        """Forget ``model``: its plans, owner and run counts; a fenced worker drops it on its return."""
        self.models.pop(model, None)
        self.runs.forget(model)
        self.fencing.released(model)
        return self._routes_now()

    def _program(self, e: ProgramAdded) -> list[Instruction]:
        """Number the new program; its blocks follow the model's weights in every plan version."""
        dep = self.deployment(e.model)
        base = dep.plan.graph.params
        foreign = sorted(p.source.key for p in e.graph.params.values()
                         if p.source.kind != "inline" and p.source.key not in
                         {q.source.key for q in base.values()})
        if foreign:
            raise AccessDenied(f"model {e.model}: the new program reads weights {foreign[:3]} that the "
                               "deployed model does not have; a program may only reuse its weights")
        dep.programs[len(dep.programs) + 1] = e.graph
        return []

    def _pin(self, keys: tuple[Key, ...], repin: bool = False) -> list[Instruction]:
        out: list[Instruction] = []
        for key in keys:
            parts = parse_key(key)
            if parts is None:
                continue
            model, version, request, block = parts
            dep = self.models.get(model)
            addr = dep.home(version, block) if dep is not None else None
            if dep is None or addr is None:
                continue    # NOTE: an unknown model's task fails on its worker with a clear error
            if key not in self.pinned:
                dep.tasks[version] += 1
            self.pinned[key] = addr
            urgent = dep.urgent(version)
            leaves = block >= len(urgent) or urgent[block]    # NOTE: a step program's blocks hand on at once
            out.append(Pin(key, addr, repin, (0 if leaves else 1, request, block)))
        return out

    def _forget(self, keys: tuple[Key, ...]) -> list[Instruction]:
        for key in keys:
            if self.pinned.pop(key, None) is None:
                continue
            parts = parse_key(key)
            if parts is not None:
                self.runs.task_forgotten(parts[0], key)
            dep = self.models.get(parts[0]) if parts is not None else None
            if dep is not None and parts is not None:
                dep.tasks[parts[1]] -= 1
                if dep.tasks[parts[1]] <= 0:
                    del dep.tasks[parts[1]]
                    dep.prune()
        return []

    # --- queries --------------------------------------------------------------------------
    def held_bytes(self, address: str, besides: str = "") -> int:
        """Bytes the deployed models' plans take on ``address`` (weights, activations and the KV room
        they keep), but model ``besides``'s."""
        total = 0.0
        for dep in self.models.values():
            if dep.model == besides:
                continue
            for i, d in enumerate(dep.plan.spec.devices):
                if d.address == address:
                    total += float(dep.plan.peak_bytes[i])
        return int(total)

    def _in_room(self, dep: Deployment) -> Plan:
        """``dep``'s plan, each device's memory cut to what the other models' plans leave there (never
        below what it holds there now): a repair of one model never moves its work into room
        another model holds. (Each plan's figures are the free room when it was made; a worker
        lost moved two models' work onto the same survivor, and calls failed for want of room.)"""
        plan = dep.plan
        devices = list(plan.spec.devices)
        for i, d in enumerate(devices):
            if d.address in self.devices:
                free = self.devices[d.address].memory_bytes - self.held_bytes(d.address, besides=dep.model)
                devices[i] = replace(d, memory_bytes=min(d.memory_bytes, max(int(plan.peak_bytes[i]), free)))
        if devices == list(plan.spec.devices):
            return plan
        return Plan(plan.graph, replace(plan.spec, devices=tuple(devices)), plan.device_of, plan.method,
                    plan.planning_s, dict(plan.info))

    def _joining(self, dep: Deployment, device: DeviceSpec) -> DeviceSpec:
        """``device`` as ``dep`` may use it: its budget less what the other models' plans hold there."""
        free = max(0, device.memory_bytes - self.held_bytes(device.address, besides=dep.model))
        return replace(device, memory_bytes=min(device.memory_bytes, free))

    def owned(self, model: str, address: str) -> dict[str, Any]:
        """What ``address`` should hold of ``model``: its blocks in the current plan, or nothing."""
        dep = self.models.get(model)
        if dep is None:
            return {"released": True, "version": -1, "blocks": []}
        blocks = [s.to_dict() for s in dep.specs(dep.version) if s.address == address]
        return {"released": False, "version": dep.version, "blocks": blocks}

    def block_spec(self, model: str, version: int, block: int) -> dict[str, Any]:
        dep = self.deployment(model)
        if version != dep.version and version not in dep.history:
            raise AccessDenied(f"model {model} has no plan version {version} "
                               f"(current {dep.version})")
        program, local = split_block(block)
        if program and program not in dep.programs:
            raise AccessDenied(f"model {model} has {len(dep.programs)} step program(s), "
                               f"not program {program}")
        specs = dep.program_specs(program, version)
        if not 0 <= local < len(specs):
            raise AccessDenied(f"model {model} plan {version} has {len(specs)} blocks, not block {block}")
        return specs[local].to_dict()
