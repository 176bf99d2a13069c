"""One deployed model as the scheduler holds it: its plan, the older plans tasks still need, and
where each block of each version runs now.

Task keys of a deployed model are ``("sb-<model>", version, request, block)``
(``request`` is -1 for the task that loads a block's weights). A key is pinned
to the worker that owns its block in the plan of its version; a key of an older
version (a request in flight when the plan changed) goes to the worker that now
owns most of that block's ops. Old plans are kept while a task needs them, and
the newest old plan besides (a client may not have heard of the change yet).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from ...ir import OpGraph
from ...lower.blocks import BlockSpec, block_specs, split_block
from ...placement import DeviceSpec, Plan
from ...placement.cluster import OP_CLASSES
from ...placement.follow import follow


def modelled_block_times(plan: Plan) -> list[tuple[str, dict[str, float]]]:
    """Per block: its device's address and its modelled time per op class at scale 1."""
    w = plan.workload
    out = []
    cols = np.stack([w.device_times(replace(dev, scale={})) for dev in plan.spec.devices], axis=1)
    t = cols[np.arange(w.n), plan.device_of]
    n_blocks = len(plan.block_device)
    per = {c: np.bincount(plan.block_of, weights=np.where(w.is_matmul == (c == "matmul"), t, 0.0),
                          minlength=n_blocks) for c in OP_CLASSES}
    for b, d in enumerate(plan.block_device.tolist()):
        dev = plan.spec.devices[d]
        out.append((dev.address or dev.name, {c: float(per[c][b]) for c in OP_CLASSES}))
    return out


@dataclass
class Deployment:
    """One model on the cluster: its current plan and the older plans tasks still need."""

    model: str
    plan: Plan
    token: str = ""
    owner: str = ""                  # id of the client whose stream claimed its deploy
    version: int = 0
    checkpoint_dir: str = ""
    verify_every: int = 0
    history: dict[int, Plan] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)     # address -> why (drained for this model)
    lost: list[str] = field(default_factory=list)              # devices gone while stranded
    stranded: str = ""
    tasks: Counter[int] = field(default_factory=Counter)       # version -> pinned tasks
    _specs: dict[int, list[BlockSpec]] = field(default_factory=dict)
    _homes: dict[tuple[int, int], str] = field(default_factory=dict)
    _urgent: dict[int, list[bool]] = field(default_factory=dict)
    _modelled: dict[int, list[tuple[str, dict[str, float]]]] = field(default_factory=dict)
    warm: set[tuple[int, int]] = field(default_factory=set)       # (version, block) run at least once
    programs: dict[int, OpGraph] = field(default_factory=dict)    # program >= 1 -> its graph
    _program_plans: dict[tuple[int, int], Plan] = field(default_factory=dict)
    _program_specs: dict[tuple[int, int], list[BlockSpec]] = field(default_factory=dict)

    def plan_at(self, version: int) -> Plan | None:
        return self.plan if version == self.version else self.history.get(version)

    def program_plan(self, program: int, version: int) -> Plan | None:
        """Plan ``version`` of another program: where the model's plan of that version has its weights."""
        key = (program, version)
        if key not in self._program_plans:
            base = self.plan_at(version)
            if base is None or program not in self.programs:
                return None
            self._program_plans[key] = follow(base, self.programs[program])
        return self._program_plans[key]

    def program_specs(self, program: int, version: int) -> list[BlockSpec]:
        if not program:
            return self.specs(version)
        key = (program, version)
        if key not in self._program_specs:
            plan = self.program_plan(program, version)
            if plan is None:
                return []
            self._program_specs[key] = block_specs(plan, self.model, version, "", self.verify_every, program)
        return self._program_specs[key]

    def modelled(self, version: int) -> list[tuple[str, dict[str, float]]]:
        """Per block of plan ``version``: its worker's address and its modelled time per op
        class before any learned correction (what ``CostLearner`` compares runs with)."""
        if version not in self._modelled:
            plan = self.plan if version == self.version else self.history.get(version)
            if plan is None:
                return []
            self._modelled[version] = modelled_block_times(plan)
        return self._modelled[version]

    def specs(self, version: int) -> list[BlockSpec]:
        if version not in self._specs:
            plan = self.plan if version == self.version else self.history[version]
            self._specs[version] = block_specs(plan, self.model, version, self.checkpoint_dir,
                                              self.verify_every)
        return self._specs[version]

    def address_of_device(self, d: int) -> str:
        return self.plan.spec.devices[d].address or self.plan.spec.devices[d].name

    def addresses(self) -> set[str]:
        return {d.address for d in self.plan.spec.devices}

    def home(self, version: int, block: int) -> str | None:
        """Address that runs ``block`` of plan ``version`` under the current plan."""
        cached = self._homes.get((version, block))
        if cached is not None:
            return cached
        program, local = split_block(block)
        if program:
            return self._program_home(version, block, program, local)
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

    def _program_home(self, version: int, block: int, program: int, local: int) -> str | None:
        now = self.program_plan(program, self.version)
        then = self.program_plan(program, version)
        if now is None or then is None or local >= len(then.block_device):
            return None
        if version == self.version:
            addr = self.address_of_device(int(now.block_device[local]))
        else:
            ops = np.flatnonzero(then.block_of == local)
            addr = self.address_of_device(int(np.bincount(now.device_of[ops]).argmax()))
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
        self.prune()
        return self.version

    def prune(self) -> None:
        """Drop old plans no task needs, keeping the newest old one for late submissions."""
        newest_old = self.version - 1
        for v in [v for v in self.history if v != newest_old and not self.tasks[v]]:
            del self.history[v]
            self._specs.pop(v, None)
            self._urgent.pop(v, None)
            self._modelled.pop(v, None)
        for cache in (self._program_plans, self._program_specs):
            for k in [k for k in cache if k[1] != self.version and k[1] not in self.history]:
                del cache[k]
        self.warm = {k for k in self.warm if k[0] == self.version or k[0] in self.history}


def admits(dep: Deployment, device: DeviceSpec) -> bool:
    """Whether ``dep`` may take ``device`` when it joins: a model placed with ``device="cuda"``
    only GPU workers, one placed with ``device="cpu"`` only CPU workers (the scheduler knows a
    GPU worker's budget as a GPU, so it does not take one as a CPU device)."""
    choice = dep.plan.graph.meta.get("device", "auto")
    return choice == "auto" or device.kind == {"cuda": "gpu", "cpu": "cpu"}.get(choice, device.kind)

