"""What the repairs of ``replan`` share: where a device is, how long work takes there, and how a
repaired plan is made.

The op-by-op repair (``rehome``), the whole hand-over (``handover``), the repairs of a pipeline
(``pipelines``) and those of a join or a capacity change (``rebalance``) all read these.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .cluster import ClusterSpec, DeviceSpec
from .plan import Plan, phases
from .workload import Workload

QUICK = 4                  # a device this many times slower than the quickest for some work is a last resort


def nearby(spec: ClusterSpec, like: DeviceSpec) -> list[list[int]]:
    """Device indices of ``spec`` in rings around ``like``: same host, same rack, the rest."""
    rings: list[list[int]] = [[], [], []]
    for i, d in enumerate(spec.devices):
        rings[0 if d.where == like.where else 1 if d.rack == like.rack else 2].append(i)
    return rings


def seconds_on(w: Workload, spec: ClusterSpec, ops: np.ndarray) -> list[float]:
    """[D] seconds each device of ``spec`` would take for ``ops``."""
    # NOTE: devices alike share one time column (``device_times``): each is summed once
    sums: dict[int, float] = {}
    cols = [w.device_times(d) for d in spec.devices]
    return [sums[id(c)] if id(c) in sums else sums.setdefault(id(c), float(c[ops].sum())) for c in cols]


_DEPTHS: weakref.WeakKeyDictionary[Workload, np.ndarray] = weakref.WeakKeyDictionary()


def op_depths(w: Workload) -> np.ndarray:
    """[ops] the longest path, in ops, from a source to each op (``Workload.depth``), kept per graph.

    It is the phases of a plan with every op on a device of its own: ``phases`` loops over the edge
    lists, 1 ms on a 7k-op graph where ``Workload.depth`` takes 4 (a loop over numpy scalars).
    """
    depth = _DEPTHS.get(w)
    if depth is None:
        depth = _DEPTHS[w] = phases(w, np.arange(w.n))
    return depth


def with_ops(dev: np.ndarray, ops: np.ndarray, d: int) -> np.ndarray:
    """A copy of ``dev`` (each op's device) with ``ops`` on device d."""
    out = dev.copy()
    out[ops] = d
    return out


def repaired(plan: Plan, spec: ClusterSpec, dev: np.ndarray, info: dict[str, Any]) -> Plan:
    """``plan`` repaired: its graph and method on ``spec`` with the devices ``dev``."""
    return Plan(plan.graph, spec, dev, plan.method, plan.planning_s, info)
