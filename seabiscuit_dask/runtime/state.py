"""What the scheduler decides, as plain Python: ``PlacementState.handle(event) -> instructions``.

No cluster in here. The scheduler plugin turns Dask hooks into events and carries
out the instructions; tests drive this class directly.

Task keys of a deployed model are ``("sb-<model>", version, request, block)``
(``request`` is -1 for the task that loads a block's weights). A key is pinned
to the worker that owns its block in the plan of its version; a key of an older
version (a request that was in flight when the plan changed) goes to the worker
that now owns most of that block's ops.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SeaBiscuitError
from ..lower.blocks import KEY_PREFIX, BlockSpec, block_specs
from ..placement import CapacityChanged, DeviceAdded, DeviceLost, DeviceSpec, Plan, replan

logger = logging.getLogger(__name__)

Key = Hashable


# --- events ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDeployed:
    model: str
    plan: Plan                        # its devices carry their workers' addresses
    checkpoint_dir: str = ""          # block outputs are checkpointed there ("" = not)
    verify_every: int = 0             # resident tiles are checked every N runs of a block


@dataclass(frozen=True)
class ModelReleased:
    model: str


@dataclass(frozen=True)
class WorkerJoined:
    address: str
    device: DeviceSpec | None = None  # None: not usable for placement (no report yet)


@dataclass(frozen=True)
class WorkerLeft:
    address: str


@dataclass(frozen=True)
class WorkerDraining:
    """Move everything off a worker that stays up (drained by hand, or under pressure)."""

    address: str
    reason: str = "drained"


@dataclass(frozen=True)
class WorkerRestored:
    """A drained worker may take work again: models spread onto it as onto a worker that joins."""

    address: str
    device: DeviceSpec | None = None


@dataclass(frozen=True)
class BudgetChanged:
    """A worker's memory budget changed."""

    address: str
    memory_bytes: int


@dataclass(frozen=True)
class TasksSubmitted:
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class TasksForgotten:
    keys: tuple[Key, ...]


Event = (ModelDeployed | ModelReleased | WorkerJoined | WorkerLeft | WorkerDraining | WorkerRestored
         | BudgetChanged | TasksSubmitted | TasksForgotten)


# --- instructions ----------------------------------------------------------------------
@dataclass(frozen=True)
class Pin:
    """Run ``key`` on ``address`` only."""

    key: Key
    address: str
    repin: bool = False               # True: the task was pinned before (its worker left)
    order: tuple[int, int, int] = (1, 0, 0)   # (0 if its outputs leave the worker, request, block)


@dataclass(frozen=True)
class PlanChanged:
    """A model has a new plan version: tell its clients and workers."""

    model: str
    version: int
    reason: str
    moved_bytes: float = 0.0
    replan_s: float = 0.0


@dataclass(frozen=True)
class Stranded:
    """A model lost a worker and the rest of the cluster cannot hold it."""

    model: str
    message: str


Instruction = Pin | PlanChanged | Stranded


def parse_key(key: Key) -> tuple[str, int, int, int] | None:
    """``("sb-<model>", version, request, block)`` -> its parts; None for other keys."""
    if (isinstance(key, tuple) and len(key) == 4 and isinstance(key[0], str)
            and key[0].startswith(KEY_PREFIX)):
        try:
            return key[0][len(KEY_PREFIX):], int(key[1]), int(key[2]), int(key[3])
        except (TypeError, ValueError):
            return None
    return None


@dataclass
class Deployment:
    """One model on the cluster: its current plan and the plans its in-flight tasks came from."""

    model: str
    plan: Plan
    version: int = 0
    checkpoint_dir: str = ""
    verify_every: int = 0
    history: dict[int, Plan] = field(default_factory=dict)
    _specs: dict[int, list[BlockSpec]] = field(default_factory=dict)
    _homes: dict[tuple[int, int], str] = field(default_factory=dict)
    _urgent: dict[int, list[bool]] = field(default_factory=dict)

    def specs(self, version: int) -> list[BlockSpec]:
        if version not in self._specs:
            plan = self.plan if version == self.version else self.history[version]
            self._specs[version] = block_specs(plan, self.model, version, self.checkpoint_dir,
                                              self.verify_every)
        return self._specs[version]

    def address_of_device(self, d: int) -> str:
        return self.plan.spec.devices[d].address or self.plan.spec.devices[d].name

    def home(self, version: int, block: int) -> str | None:
        """Address that runs ``block`` of plan ``version`` under the current plan."""
        cached = self._homes.get((version, block))
        if cached is not None:
            return cached
        if version == self.version:
            if block >= len(self.plan.block_device):
                return None
            addr = self.address_of_device(int(self.plan.block_device[block]))
        else:
            old = self.history.get(version)
            if old is None or block >= len(old.block_device):
                return None
            ops = np.flatnonzero(old.block_of == block)
            addr = self.address_of_device(int(np.bincount(self.plan.device_of[ops]).argmax()))
        self._homes[(version, block)] = addr
        return addr

    def urgent(self, version: int) -> list[bool]:
        """Per block: do its outputs leave its worker (to another worker or the client)?

        Running those first lets concurrent requests pipeline: a worker hands a
        request on before it starts another request's local work.
        """
        if version not in self._urgent:
            specs = self.specs(version)
            out = [False] * len(specs)
            for s in specs:
                for d in s.deps:
                    if specs[d].device != s.device:
                        out[d] = True
            readers = {d for s in specs for d in s.deps}
            for s in specs:
                if s.index not in readers and s.exports:
                    out[s.index] = True
            self._urgent[version] = out
        return self._urgent[version]

    def advance(self, plan: Plan) -> int:
        self.history[self.version] = self.plan
        self.plan, self.version = plan, self.version + 1
        self._homes.clear()
        return self.version


class PlacementState:
    """Deployed models, workers, and where every pinned task runs."""

    def __init__(self) -> None:
        self.models: dict[str, Deployment] = {}
        self.workers: dict[str, DeviceSpec | None] = {}
        self.draining: dict[str, str] = {}
        self.pinned: dict[Key, str] = {}

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, TasksSubmitted):
            return self._pin(event.keys)
        if isinstance(event, TasksForgotten):
            for k in event.keys:
                self.pinned.pop(k, None)
            return []
        if isinstance(event, WorkerLeft):
            return self._worker_left(event.address)
        if isinstance(event, WorkerJoined):
            return self._worker_joined(event.address, event.device)
        if isinstance(event, WorkerDraining):
            return self._drain(event.address, event.reason)
        if isinstance(event, WorkerRestored):
            self.draining.pop(event.address, None)
            return self._worker_joined(event.address, event.device)
        if isinstance(event, BudgetChanged):
            return self._budget(event.address, event.memory_bytes)
        if isinstance(event, ModelDeployed):
            return self._deployed(event.model, event.plan, event.checkpoint_dir, event.verify_every)
        if isinstance(event, ModelReleased):
            self.models.pop(event.model, None)
            return []
        raise SeaBiscuitError(f"PlacementState does not know the event {event!r}")

    # --- handlers -----------------------------------------------------------------------
    def _deployed(self, model: str, plan: Plan, checkpoint_dir: str = "",
                  verify_every: int = 0) -> list[Instruction]:
        missing = [d.name for d in plan.spec.devices if d.address not in self.workers]
        if missing:
            raise SeaBiscuitError(f"model {model}: the plan uses devices {missing} whose workers are "
                                  f"not in the cluster (workers: {sorted(self.workers)})")
        dep = self.models.get(model)
        if dep is None:
            self.models[model] = Deployment(model, plan, checkpoint_dir=checkpoint_dir,
                                            verify_every=verify_every)
            return [PlanChanged(model, 0, "deployed")]
        v = dep.advance(plan)
        return [PlanChanged(model, v, "redeployed")]

    def _pin(self, keys: tuple[Key, ...], repin: bool = False) -> list[Instruction]:
        out: list[Instruction] = []
        for key in keys:
            parts = parse_key(key)
            if parts is None:
                continue
            model, version, request, block = parts
            dep = self.models.get(model)
            addr = dep.home(version, block) if dep is not None else None
            if addr is None:
                continue    # NOTE: an unknown model's task fails on its worker with a clear error
            self.pinned[key] = addr
            urgent = dep.urgent(version) if dep is not None else []
            leaves = block < len(urgent) and urgent[block]
            out.append(Pin(key, addr, repin, (0 if leaves else 1, request, block)))
        return out

    def _worker_left(self, address: str) -> list[Instruction]:
        self.workers.pop(address, None)
        self.draining.pop(address, None)
        out = self._move_off(address, f"worker {address} left", stranded=True)
        stuck = tuple(k for k, a in self.pinned.items() if a == address)
        return out + self._pin(stuck, repin=True)

    def _drain(self, address: str, reason: str) -> list[Instruction]:
        """Move every model off a live worker; its in-flight tasks still run there."""
        if address not in self.workers:
            raise SeaBiscuitError(f"no worker {address} in the cluster (workers: {sorted(self.workers)})")
        self.draining[address] = reason
        try:
            return self._move_off(address, f"worker {address} drained: {reason}", stranded=False)
        except SeaBiscuitError:
            self.draining.pop(address, None)     # NOTE: nothing could move: the worker stays in use
            raise

    def _move_off(self, address: str, why: str, stranded: bool) -> list[Instruction]:
        out: list[Instruction] = []
        for dep in list(self.models.values()):
            lost = [d.name for d in dep.plan.spec.devices if d.address == address]
            if not lost:
                continue
            try:
                plan = replan(dep.plan, DeviceLost(lost[0]))
            except SeaBiscuitError as e:
                msg = (f"{why}; the remaining {len(dep.plan.spec.devices) - 1} worker(s) cannot hold "
                       f"model {dep.model}: {e}")
                if stranded:
                    out.append(Stranded(dep.model, msg))
                    continue
                raise SeaBiscuitError(msg) from e
            v = dep.advance(plan)
            out.append(PlanChanged(dep.model, v, why, plan.info["moved_bytes"], plan.planning_s))
        return out

    def _budget(self, address: str, memory_bytes: int) -> list[Instruction]:
        out: list[Instruction] = []
        for dep in list(self.models.values()):
            names = [d.name for d in dep.plan.spec.devices if d.address == address]
            if not names:
                continue
            plan = replan(dep.plan, CapacityChanged(names[0], memory_bytes=int(memory_bytes)))
            v = dep.advance(plan)
            out.append(PlanChanged(dep.model, v, f"worker {address} budget now {memory_bytes} bytes",
                                   plan.info["moved_bytes"], plan.planning_s))
        return out

    def _worker_joined(self, address: str, device: DeviceSpec | None) -> list[Instruction]:
        self.workers[address] = device
        out: list[Instruction] = []
        if device is None or address in self.draining:
            return out
        for dep in self.models.values():
            if any(d.address == address for d in dep.plan.spec.devices):
                continue
            try:
                plan = replan(dep.plan, DeviceAdded(device))
            except SeaBiscuitError as e:
                logger.info("model %s stays on its workers after %s joined: %s", dep.model, address, e)
                continue
            if not plan.info.get("moved_ops"):
                continue
            v = dep.advance(plan)
            out.append(PlanChanged(dep.model, v, f"worker {address} joined", plan.info["moved_bytes"],
                                   plan.planning_s))
        return out

    # --- queries --------------------------------------------------------------------------
    def owned(self, model: str, version: int, address: str) -> list[dict[str, Any]]:
        """Specs of the blocks ``address`` owns in plan ``version`` of ``model`` (none if it is stale)."""
        dep = self.models.get(model)
        if dep is None or version != dep.version:
            return []
        return [s.to_dict() for s in dep.specs(version) if s.address == address]

    def block_spec(self, model: str, version: int, block: int) -> dict[str, Any]:
        dep = self.models.get(model)
        if dep is None:
            raise SeaBiscuitError(f"model {model} is not deployed on this cluster "
                                  f"(deployed: {sorted(self.models)})")
        if version != dep.version and version not in dep.history:
            raise SeaBiscuitError(f"model {model} has no plan version {version} "
                                  f"(current {dep.version})")
        specs = dep.specs(version)
        if not 0 <= block < len(specs):
            raise SeaBiscuitError(f"model {model} plan {version} has {len(specs)} blocks, not block {block}")
        return specs[block].to_dict()
