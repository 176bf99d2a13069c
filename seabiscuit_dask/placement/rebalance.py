"""``replan`` after a join or a capacity change: a newcomer takes part of its host peers' work; a
device past its new memory sheds ops, and one that became slower sheds the tail of its work
(see ``replan``'s module docstring).
"""

from __future__ import annotations

import numpy as np

from .capacity import weight_capacity
from .cluster import ClusterSpec
from .pipelines import is_pipeline, shed_stage, stage_tries
from .plan import Plan
from .rehome import rehome
from .repair import op_depths
from .workload import Workload


def adopt(plan: Plan, spec: ClusterSpec, dev: np.ndarray, new: int) -> np.ndarray:
    """Move part of the new device's host peers' work onto it, evening out depth levels."""
    w = plan.workload
    newdev = spec.devices[new]
    peers = [i for i, d in enumerate(spec.devices[:-1]) if d.where == newdev.where]
    if not peers:
        return dev
    times = w.times(spec)
    speed = times.min(axis=1).sum() / times.sum(axis=0)
    in_host = np.flatnonzero(np.isin(dev, peers))
    host_w = float(w.weight_bytes[in_host].sum())
    budget = min(float(weight_capacity(spec)[new]),
                 host_w * speed[new] / (speed[peers].sum() + speed[new]))
    n_dev = len(spec.devices)
    depth = op_depths(w)
    loads = np.bincount(depth * n_dev + dev, weights=times[np.arange(w.n), dev],
                        minlength=(int(depth.max()) + 1) * n_dev).tolist()
    taken = 0.0
    for v in in_host.tolist():
        a, wv = int(dev[v]), float(w.weight_bytes[v])
        if taken + wv > budget:
            continue
        la, ln = depth[v] * n_dev + a, depth[v] * n_dev + new
        if loads[ln] + times[v, new] < loads[la]:
            loads[la] -= times[v, a]
            loads[ln] += times[v, new]
            dev[v] = new
            taken += wv
    if taken < budget / 2:
        taken += _take_tail(w, times, dev, peers, new, budget - taken)
    return dev


def _take_tail(w: Workload, times: np.ndarray, dev: np.ndarray, peers: list[int], new: int,
               room: float) -> float:
    """A chain has no level to even out: the newcomer takes the later half of its busiest peer's ops.

    A contiguous stretch keeps the pipeline a pipeline (one more hop), and both
    devices end with about half the peer's time, so a stream of requests gains.
    """
    busy = {p: float(times[dev == p, p].sum()) for p in peers}
    peer = max(busy, key=lambda p: busy[p])
    ops = np.flatnonzero(dev == peer)[::-1]
    moved_t = taken = 0.0
    for v in ops.tolist():
        wv = float(w.weight_bytes[v])
        if moved_t >= busy[peer] / 2 or taken + wv > room:
            break
        dev[v] = new
        moved_t += float(times[v, peer])
        taken += wv
    return taken


SLOWER = 1.2          # NOTE: a device this much slower than planned sheds work
SIMULATE_MAX_OPS = 20_000


def _slowed(plan: Plan, spec: ClusterSpec, i: int) -> tuple[np.ndarray, np.ndarray]:
    """After a speed change: a device that became slower by f sheds the last (1 - 1/f) of its work."""
    w = plan.workload
    dev = plan.device_of.copy()
    mine = np.flatnonzero(dev == i)
    none = np.zeros(0, dtype=np.int64)
    if not len(mine) or len(spec.devices) < 2:
        return dev, none
    new_t = w.device_times(spec.devices[i])[mine]
    old_t = float(w.device_times(plan.spec.devices[i])[mine].sum())
    f = float(new_t.sum()) / max(old_t, 1e-30)
    if f < SLOWER:
        return dev, none
    shed = (1 - 1 / f) * float(new_t.sum())
    tries = stage_tries(plan, spec, i, shed) if is_pipeline(plan) else _tail_tries(plan, spec, i, shed)
    return _first_faster(plan, spec, dev, tries)


def _tail_tries(plan: Plan, spec: ClusterSpec, i: int, shed: float) -> list[list[tuple[np.ndarray, int]]]:
    """The last ops of device i holding ``shed`` seconds of its work (then half, a quarter of
    them), each to the devices nearest, then fastest, first."""
    w = plan.workload
    mine = np.flatnonzero(plan.device_of == i)
    k = int(np.searchsorted(np.cumsum(w.device_times(spec.devices[i])[mine][::-1]), shed)) + 1
    home = spec.devices[i]
    # NOTE: the tail moves whole to one device, nearest and fastest first, so the pipeline
    # stays a pipeline (one hop more at most); less of it moves where it does not fit.
    speed = {e: float(w.device_times(d)[mine].sum()) for e, d in enumerate(spec.devices) if e != i}
    order = sorted(speed, key=lambda e: (spec.devices[e].where != home.where,
                                         spec.devices[e].rack != home.rack, speed[e]))
    return [[(np.sort(mine[::-1][:part]), e) for e in order] for part in (k, k // 2, k // 4) if part]


def _first_faster(plan: Plan, spec: ClusterSpec, dev: np.ndarray,
                  tries: list[list[tuple[np.ndarray, int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Of each list of (ops, device) moves, the first that fits; the one the simulator finds
    fastest, if faster than ``dev`` (the first that fits, past ``SIMULATE_MAX_OPS``)."""
    none = np.zeros(0, dtype=np.int64)
    cap = weight_capacity(spec)
    simulate = plan.workload.n <= SIMULATE_MAX_OPS
    best, best_s, best_moving = None, Plan(plan.graph, spec, dev, plan.method,
                                           info={"fused": plan.fused}).makespan_s if simulate else 0.0, none
    for moves in tries:
        for moving, e in moves:
            trial = dev.copy()
            trial[moving] = e
            p = Plan(plan.graph, spec, trial, plan.method, info={"fused": plan.fused})
            if p.weight_bytes[e] > cap[e]:      # NOTE: the others only lose weights
                continue
            if not simulate:
                return trial, moving
            if p.makespan_s < best_s:
                best, best_s, best_moving = trial, p.makespan_s, moving
            break
    return (best, best_moving) if best is not None else (dev, none)


def shrink(plan: Plan, spec: ClusterSpec, i: int) -> tuple[np.ndarray, np.ndarray]:
    """After a capacity change: if device i's weights no longer fit, move ops off it;
    if it became slower, move part of its work (``_slowed``)."""
    w = plan.workload
    dev = plan.device_of.copy()
    cap = weight_capacity(spec)
    mine = np.flatnonzero(dev == i)
    held = float(w.weight_bytes[mine].sum())
    if held <= cap[i]:
        return _slowed(plan, spec, i)
    shed = shed_stage(plan, spec, i) if is_pipeline(plan) else None
    if shed is not None:
        return shed, np.flatnonzero(shed != plan.device_of)
    times = w.times(spec)
    # Leave first the ops that hold the most bytes per second of work here.
    ratio = w.weight_bytes[mine] / np.maximum(times[mine, i], 1e-12)
    order = mine[np.argsort(-ratio, kind="stable")]
    cum = np.cumsum(w.weight_bytes[order])
    k = int(np.searchsorted(cum, held - cap[i], side="left")) + 1
    # NOTE: tiles the device shares with ops that stay are still held: leave until they are not.
    while k < len(order):
        left = dev.copy()
        left[order[:k]] = (i + 1) % len(spec.devices)
        if Plan(plan.graph, spec, left).weight_bytes[i] <= cap[i]:
            break
        k += max(1, k // 4)
    moving = np.sort(order[:k])
    dev[moving] = -1
    return rehome(plan, spec, dev, moving, spec.devices[i], exclude=i), moving
