"""``replan``: repair a plan when the cluster changes, moving as few weights as possible.

Events are frozen descriptions; ``replan(plan, event)`` returns a new ``Plan`` on
the new cluster and records what moved in ``plan.info`` (``moved_bytes``,
``moved_ops``). The repair is local and deterministic:

- ``DeviceLost(name)``: only the lost device's ops move. Each goes, in
  topological order, to the device of the same host (then the same rack, then
  anywhere) with room that finishes it soonest by a cheap estimate: that
  device's work in the op's depth level, the op's time there, and the time to
  bring its inputs.
- ``DeviceAdded(device)``: a device joining a host takes over part of its peers'
  ops (up to its share of the host's speed) where that evens out a depth level.
  A device on a new host is spare capacity until the next ``place``.
- ``CapacityChanged(name, ...)``: new memory or speed figures (or learned time
  ``scale`` s). If the device no longer holds its weights, its ops leave (most bytes
  per second of work first) as on a loss until they fit. If it became slower by a
  factor f, the last (1 - 1/f) of its work in topological order moves whole to the
  nearest, fastest device with room (less of it where it does not fit), so it is back
  to its old time; kept only if the simulator finds the repair faster.

A repair keeps every device's weights within its memory less the activation
reserve, or raises ``ClusterTooSmall`` naming the device; ``plan.check()`` adds
the activations of the largest block (as ``place`` does) when there is time.
A cluster described by a measured matrix cannot take ``DeviceAdded`` (the new
device's links are unknown): measure again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import ClusterTooSmall, SeaBiscuitError
from ..ir import fmt_bytes
from ..pauses import no_gc
from .capacity import weight_capacity
from .cluster import ClusterSpec, DeviceSpec
from .plan import Plan


@dataclass(frozen=True)
class DeviceLost:
    """A device (worker) left the cluster."""

    name: str


@dataclass(frozen=True)
class DeviceAdded:
    """A device joined the cluster."""

    device: DeviceSpec


@dataclass(frozen=True)
class CapacityChanged:
    """A device's memory budget or speed changed (``None``: unchanged)."""

    name: str
    memory_bytes: int | None = None
    flops_per_s: dict[str, float] | None = None
    mem_bytes_per_s: float | None = None
    scale: dict[str, float] | None = None       # measured / modelled time per op class (learned)


Event = DeviceLost | DeviceAdded | CapacityChanged


def replan(plan: Plan, event: Event) -> Plan:
    """Repair ``plan`` after ``event``; see the module docstring.

    >>> plan2 = sb.replan(plan, sb.DeviceLost("h0-gpu1"))      # doctest: +SKIP
    >>> plan2.info["moved_bytes"]                               # doctest: +SKIP
    """
    with no_gc():
        return _replan(plan, event, time.perf_counter())


def _replan(plan: Plan, event: Event, t0: float) -> Plan:
    if isinstance(event, DeviceLost):
        spec = plan.spec.without(event.name)
        lost = plan.spec.index(event.name)
        old = plan.device_of
        dev = np.where(old > lost, old - 1, old)
        moving = np.flatnonzero(old == lost)
        dev[moving] = -1
        dev = _rehome(plan, spec, dev, moving, plan.spec.devices[lost])
    elif isinstance(event, DeviceAdded):
        spec = plan.spec.with_device(event.device)
        dev = _adopt(plan, spec, plan.device_of.copy(), len(spec.devices) - 1)
        moving = np.flatnonzero(dev != plan.device_of)
    elif isinstance(event, CapacityChanged):
        changes: dict[str, Any] = {k: v for k, v in (("memory_bytes", event.memory_bytes),
                                                       ("flops_per_s", event.flops_per_s),
                                                       ("mem_bytes_per_s", event.mem_bytes_per_s),
                                                       ("scale", event.scale))
                                   if v is not None}
        spec = plan.spec.with_changes(event.name, **changes)
        dev, moving = _shrink(plan, spec, plan.spec.index(event.name))
    else:
        raise SeaBiscuitError(f"replan does not know the event {event!r}; expected DeviceLost, "
                              "DeviceAdded or CapacityChanged")
    w = plan.workload
    moved = float(w.weight_bytes[moving].sum()) if len(moving) else 0.0
    info = {k: v for k, v in plan.info.items() if k != "phases_from"}
    info.update(event=repr(event), moved_bytes=moved, moved_ops=len(moving),
                phases_from=(plan.phases, *_window(w, moving)))
    new = Plan(plan.graph, spec, dev, plan.method, plan.planning_s, info)
    _ = new.block_of  # NOTE: blocks are part of the repair: the runtime needs them at once.
    cap = weight_capacity(spec)
    # NOTE: only a device the repair gave more weights: ``place`` may leave one just past the
    # weight room when its activations are small (it checks weights and activations together)
    before = dict(zip(plan.spec.names, plan.weight_bytes.tolist()))
    grew = new.weight_bytes > np.array([before.get(n, 0.0) for n in spec.names]) + 0.5
    over = np.flatnonzero((new.weight_bytes > cap) & grew)
    if len(over):   # a weight shared by ops on several devices is held by each of them
        d = int(over[0])
        raise ClusterTooSmall(f"after {event!r}, {spec.names[d]!r} would hold "
                              f"{fmt_bytes(new.weight_bytes[d])} of weights; it has room for "
                              f"{fmt_bytes(cap[d])}")
    object.__setattr__(new, "planning_s", time.perf_counter() - t0)
    return new


def _window(w: Any, moving: np.ndarray) -> tuple[int, int]:
    """The ops whose phases are recomputed exactly: from the first moved op to the last (after
    it, phases shift as one, which also orders the edges out of moved ops; see ``phases``)."""
    if not len(moving):
        return w.n, w.n
    return int(moving.min()), int(moving.max()) + 1


LIGHT_FLOPS_PER_BYTE = 4   # an op without weights doing less per byte it moves follows its input


def _nearby(spec: ClusterSpec, like: DeviceSpec) -> list[list[int]]:
    """Device indices of ``spec`` in rings around ``like``: same host, same rack, the rest."""
    rings: list[list[int]] = [[], [], []]
    for i, d in enumerate(spec.devices):
        rings[0 if d.where == like.where else 1 if d.rack == like.rack else 2].append(i)
    return rings


def _rehome(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray,
            home: DeviceSpec, exclude: int = -1) -> np.ndarray:
    """Give each op in ``moving`` (``dev`` = -1 there) a device of ``spec``, nearest first.

    ``exclude`` (a device whose memory just shrank) takes none of them.
    """
    if not len(moving):
        return dev
    w = plan.workload
    n_dev = len(spec.devices)
    cap = weight_capacity(spec)
    staying = dev >= 0
    free = cap - np.bincount(dev[staying], weights=w.weight_bytes[staying], minlength=n_dev)
    if exclude >= 0:
        free[exclude] = -np.inf
    need = float(w.weight_bytes[moving].sum())
    room = float(np.maximum(free, 0).sum())
    if need > room:
        raise ClusterTooSmall(
            f"{len(moving)} op(s) with {fmt_bytes(need)} of weights need a new device, but the remaining "
            f"{n_dev} devices have {fmt_bytes(room)} free: short by {fmt_bytes(need - room)} "
            f"({int(need - room)} bytes)")
    cands: list[int] = []
    rings = [[d for d in ring if d != exclude] for ring in _nearby(spec, home)]
    everywhere = [d for ring in rings for d in ring]
    for ring in rings:
        cands += ring
        if float(np.maximum(free[cands], 0).sum()) >= need:
            break
    # NOTE: time columns per device, not the [ops x devices] matrix: a repair reads few of them.
    cols = [w.device_times(d) for d in spec.devices]
    # Devices far slower than the best for this work (a CPU beside GPUs) are a last resort.
    work = np.array([cols[d][moving].sum() for d in cands])
    quick = [d for d, x in zip(cands, work.tolist()) if x <= 4 * work.min()]
    if float(np.maximum(free[quick], 0).sum()) >= need:
        cands = quick
    cand = np.array(cands, dtype=np.int64)
    depth = w.depth
    levels = int(depth.max()) + 1
    # NOTE: the work already at each depth level of each candidate, for evening out
    loads = np.stack([np.bincount(depth[dev == d], weights=cols[d][dev == d], minlength=levels)
                      for d in cands], axis=1)
    base = loads[depth[moving]].tolist()
    t_mv_a = np.stack([cols[d][moving] for d in cands], axis=1)
    t_mv = t_mv_a.tolist()
    lat = spec.cut_latency[:, cand].tolist()
    inv = (1.0 / spec.bandwidth[:, cand]).tolist()
    wb = w.weight_bytes[moving].tolist()
    dv = depth[moving].tolist()
    in_pairs = w.in_pairs
    free_l = free.tolist()
    extra: dict[int, float] = {}
    d_list = dev.tolist()
    # NOTE: memory-bound ops without weights (joins, views, elementwise) go where their largest
    # input is: moving them elsewhere would only move that input too.
    light = ((w.weight_bytes[moving] == 0)
             & (w.flops[moving] < LIGHT_FLOPS_PER_BYTE * w.moved_bytes[moving])).tolist()
    slot = {d: j for j, d in enumerate(cands)}
    holder = _tile_holders(w, dev)
    tiles_of = w.tiles_of
    for i, v in enumerate(moving.tolist()):
        # NOTE: an op reading a weight tile a candidate already holds goes there: no second copy
        if tiles_of[v]:
            held = next((holder[t] for t in tiles_of[v] if holder.get(t, -1) in slot), -1)
            if held >= 0 and free_l[held] >= wb[i]:
                d_list[v] = held
                free_l[held] -= wb[i]
                continue
        ins = [(d_list[s], nb) for s, nb in in_pairs[v]]
        if light[i] and ins:   # NOTE: glue (a join, a view) goes where its largest input is
            d = max(ins, key=itemgetter(1))[0]
            if d in slot:
                d_list[v] = d
                continue
        best, best_j = float("inf"), -1
        for j, d in enumerate(cands):
            if free_l[d] < wb[i]:
                continue
            s = base[i][j] + extra.get(dv[i] * n_dev + d, 0.0) + t_mv[i][j]
            for x, nb in ins:
                if x != d:
                    s += lat[x][j] + nb * inv[x][j]
            if s < best:
                best, best_j = s, j
        if best_j >= 0:
            d = cands[best_j]
            key = dv[i] * n_dev + d
            extra[key] = extra.get(key, 0.0) + t_mv[i][best_j]
        else:   # nothing near has room for this op: the nearest device farther out that does
            d = next((e for e in everywhere if free_l[e] >= wb[i]), -1)
            if d < 0:
                raise ClusterTooSmall(f"no device has room for op {w.names[v]!r} ({fmt_bytes(wb[i])}) "
                                      f"once {home.name!r} is gone; most free: {fmt_bytes(max(free_l))}")
        d_list[v] = d
        free_l[d] -= wb[i]
        for t in tiles_of[v]:
            holder.setdefault(t, d)
    return np.array(d_list, dtype=np.int64)


def _tile_holders(w: Any, dev: np.ndarray) -> dict[int, int]:
    """Shared weight tile -> a device (``dev`` >= 0) already holding it."""
    tile, user, nbytes, _ = w.shared_arrays
    placed = dev[user] >= 0
    held = np.zeros((len(nbytes), int(dev.max()) + 2), dtype=bool)
    held[tile[placed], dev[user[placed]]] = True
    some = held.any(axis=1)
    return dict(zip(np.flatnonzero(some).tolist(), held[some].argmax(axis=1).tolist()))


def _adopt(plan: Plan, spec: ClusterSpec, dev: np.ndarray, new: int) -> np.ndarray:
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
    depth = w.depth
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


def _take_tail(w: Any, times: np.ndarray, dev: np.ndarray, peers: list[int], new: int, room: float) -> float:
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
    tail = np.cumsum(new_t[::-1])
    k = int(np.searchsorted(tail, (1 - 1 / f) * float(new_t.sum()))) + 1
    cap = weight_capacity(spec)
    home = spec.devices[i]
    # NOTE: the tail moves whole to one device, nearest and fastest first, so the pipeline
    # stays a pipeline (one hop more at most); less of it moves where it does not fit.
    speed = {e: float(w.device_times(d)[mine].sum()) for e, d in enumerate(spec.devices) if e != i}
    order = sorted(speed, key=lambda e: (spec.devices[e].where != home.where,
                                         spec.devices[e].rack != home.rack, speed[e]))
    simulate = w.n <= SIMULATE_MAX_OPS
    best, best_s, best_moving = None, Plan(plan.graph, spec, dev, plan.method,
                                           info={"fused": plan.fused}).makespan_s if simulate else 0.0, none
    for part in (k, k // 2, k // 4):
        moving = np.sort(mine[::-1][:part]) if part else none
        for e in order if len(moving) else ():
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


def _shrink(plan: Plan, spec: ClusterSpec, i: int) -> tuple[np.ndarray, np.ndarray]:
    """After a capacity change: if device i's weights no longer fit, move ops off it;
    if it became slower, move part of its work (``_slowed``)."""
    w = plan.workload
    dev = plan.device_of.copy()
    cap = weight_capacity(spec)
    mine = np.flatnonzero(dev == i)
    held = float(w.weight_bytes[mine].sum())
    if held <= cap[i]:
        return _slowed(plan, spec, i)
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
    return _rehome(plan, spec, dev, moving, spec.devices[i], exclude=i), moving
