"""``replan``: repair a plan when the cluster changes, moving as few weights as possible.

Events are frozen descriptions; ``replan(plan, event)`` returns a new ``Plan`` on
the new cluster and records what moved in ``plan.info`` (``moved_bytes``,
``moved_ops``). The repair is local and deterministic:

- ``DeviceLost(name)``: only the lost device's ops move. Each goes, in
  topological order, to the device of the same host (then the same rack, then
  anywhere) with room that finishes it soonest by a cheap estimate: that
  device's work in the op's depth level, the op's time there, and the time to
  bring its inputs. Devices more than ``QUICK`` times slower for that work than
  the quickest anywhere are a last resort: a farther ring's quick devices with
  room come before a near CPU. Then the lost ops all on one device with room
  (the nearest and quickest ``WHOLE_TRIES``) are simulated too, and the
  fastest of these repairs is kept: a stage handed over whole keeps one cut on
  each side.
- ``DeviceAdded(device)``: a device joining a host takes over part of its peers'
  ops (up to its share of the host's speed) where that evens out a depth level.
  A device on a new host is spare capacity until the next ``place``.
- ``CapacityChanged(name, ...)``: new memory or speed figures (or learned time
  ``scale`` s). If the device no longer holds its weights, its ops leave (most bytes
  per second of work first) as on a loss until they fit. If it became slower by a
  factor f, the last (1 - 1/f) of its work in topological order moves whole to the
  nearest, fastest device with room (less of it where it does not fit), so it is back
  to its old time; kept only if the simulator finds the repair faster.

A *pipeline* (a plan placed as contiguous stages of the topological order: method
``"follow-decode"``, a generation deployment, or ``"stages"``) is repaired so that it
stays one: a decode step that follows it (``follow``) runs a task per stage, and the
rules above would scatter its ops into many. It is told by its method, which travels
with the plan in its JSON (both ends of the wire take the same branch); its structure
is not guessed, and the rules below only move stage boundaries or hand a stage over
whole, so they stay sound on a pipeline that an earlier fallback scattered. A *run*
of a device is a maximal stretch of its ops in op order, passing over other devices'
ops that read no weights (a mask, a view that follows its input): a decode step's
tasks follow the weights.

- ``DeviceLost``: each run of the lost device goes to the devices of the runs around
  it, a prefix to the one before and the rest to the one after, split where the two
  finish soonest (their modelled time) within their weight room. The runs no split
  fits go whole to one device with room (not far slower than the quickest, idle
  first: it takes the stage over, then nearest, then fastest). Failing both, the
  rule above.
- ``DeviceAdded``: the newcomer takes one of the busiest device's runs whole (a device
  that took a lost stage over hands it back) or the back of one, split where the two
  finish soonest, within its room: one stage more at most. Of the takes that make that
  device finish sooner by more than a new cut costs per step (``ClusterSpec.cut_latency``:
  the link and a Dask hop), the one that adds the fewest tasks, then gains the most: a
  decode step is latency-bound. Where none gains that much, the newcomer stays spare
  (the rule above would scatter the pipeline).
- ``CapacityChanged``, memory: the fewest ops at one end of one of the device's runs
  move to the device of the run beside that end (the tail to the next stage, the head
  to the previous), the receiver that finishes soonest; speed: the last (1 - 1/f) of
  the device's time, from its busiest run, as that run's tail to the next stage, else
  its head to the previous one, kept as above. Where no end fits, the rules above.

A repair keeps every device's weights within its memory less the activation
reserve, or raises ``ClusterTooSmall`` naming the device; ``plan.check()`` adds
the activations of the largest block (as ``place`` does) when there is time.
A cluster described by a measured matrix cannot take ``DeviceAdded`` (the new
device's links are unknown): measure again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
from .reroute import LinkChanged, reroute


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


def replan(plan: Plan, event: Event | LinkChanged) -> Plan:
    """Repair ``plan`` after ``event``; see the module docstring (``LinkChanged``: ``reroute``).

    >>> plan2 = sb.replan(plan, sb.DeviceLost("h0-gpu1"))      # doctest: +SKIP
    >>> plan2.info["moved_bytes"]                               # doctest: +SKIP
    """
    if isinstance(event, LinkChanged):
        return reroute(plan, event).plan
    with no_gc():
        return _replan(plan, event, time.perf_counter())


def _replan(plan: Plan, event: Event, t0: float) -> Plan:
    if isinstance(event, DeviceLost):
        spec = plan.spec.without(event.name)
        lost = plan.spec.index(event.name)
        moving = np.flatnonzero(plan.device_of == lost)
        dev = _lose(plan, spec, lost, moving)
    elif isinstance(event, DeviceAdded):
        spec = plan.spec.with_device(event.device)
        join = _take_stage if _is_pipeline(plan) else _adopt
        dev = join(plan, spec, plan.device_of.copy(), len(spec.devices) - 1)
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


def _lose(plan: Plan, spec: ClusterSpec, lost: int, moving: np.ndarray) -> np.ndarray:
    """The device of every op on ``spec`` once device ``lost`` of ``plan.spec`` is gone."""
    merged = _merge_lost(plan, lost) if _is_pipeline(plan) else None
    if merged is not None:
        return np.where(merged > lost, merged - 1, merged)
    old = plan.device_of
    dev = np.where(old > lost, old - 1, old)
    dev[moving] = -1
    dev = _rehome(plan, spec, dev, moving, plan.spec.devices[lost])
    return _whole_if_faster(plan, spec, dev, moving, plan.spec.devices[lost])


def _whole_if_faster(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray,
                     home: DeviceSpec) -> np.ndarray:
    """``dev``, or the lost device's ops all on one device with room for them (the nearest and
    quickest ``WHOLE_TRIES``) where the simulator finds that faster: a stage handed over whole keeps
    its one cut on each side, where ops spread one by one over five devices made a 41 GB Llama's
    lost stage 268 blocks and its plan 2.6x a fresh one."""
    if not len(moving):
        return dev
    w = plan.workload
    n_dev = len(spec.devices)
    cap = weight_capacity(spec)
    staying = np.ones(len(dev), dtype=bool)
    staying[moving] = False
    held = np.bincount(dev[staying], weights=w.weight_bytes[staying], minlength=n_dev)
    need = float(w.weight_bytes[moving].sum())
    work = [float(w.device_times(d)[moving].sum()) for d in spec.devices]
    fastest = min(work)
    order = [d for ring in _nearby(spec, home) for d in sorted(ring, key=lambda d: work[d])]
    tries = [d for d in order if held[d] + need <= cap[d] and work[d] <= QUICK * fastest][:WHOLE_TRIES]
    if not tries:
        return dev
    info = {**{k: v for k, v in plan.info.items() if k != "phases_from"},
            "phases_from": (plan.phases, *_window(w, moving))}

    def simulated(d: np.ndarray) -> Plan:
        return Plan(plan.graph, spec, d, plan.method, 0.0, info)

    best, best_s = dev, simulated(dev).makespan_s
    for d in tries:
        alt = dev.copy()
        alt[moving] = d
        p = simulated(alt)
        if p.makespan_s < best_s and p.weight_bytes[d] <= cap[d]:
            best, best_s = alt, p.makespan_s
    return best


def _window(w: Any, moving: np.ndarray) -> tuple[int, int]:
    """The ops whose phases are recomputed exactly: from the first moved op to the last (after
    it, phases shift as one, which also orders the edges out of moved ops; see ``phases``)."""
    if not len(moving):
        return w.n, w.n
    return int(moving.min()), int(moving.max()) + 1


LIGHT_FLOPS_PER_BYTE = 4   # an op without weights doing less per byte it moves follows its input
QUICK = 4                  # a device this many times slower than the quickest for some work is a last resort
WHOLE_TRIES = 4            # devices a lost device's ops are tried on whole (nearest, then quickest, first)


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
    rings = [[d for d in ring if d != exclude] for ring in _nearby(spec, home)]
    everywhere = [d for ring in rings for d in ring]
    # NOTE: time columns per device, not the [ops x devices] matrix: a repair reads few of them.
    cols = [w.device_times(d) for d in spec.devices]
    # Devices far slower than the quickest anywhere for this work (a CPU beside GPUs) are a last
    # resort: the nearest rings whose quick devices have room, before the slow ones of a nearer
    # ring (a lost GPU's layers on its host's CPU made a 41 GB Llama's plan 4.7x slower; on a GPU
    # of the next host, one cut more).
    work = {d: float(cols[d][moving].sum()) for d in everywhere}
    fastest = min(work.values(), default=0.0)
    cands: list[int] = []
    for ring in rings:
        cands += ring
        quick = [d for d in cands if work[d] <= QUICK * fastest]
        if float(np.maximum(free[quick], 0).sum()) >= need:
            cands = quick
            break
    else:
        cands = []
        for ring in rings:
            cands += ring
            if float(np.maximum(free[cands], 0).sum()) >= need:
                break
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
    shed = (1 - 1 / f) * float(new_t.sum())
    tries = _stage_tries(plan, spec, i, shed) if _is_pipeline(plan) else _tail_tries(plan, spec, i, shed)
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


def _stage_tries(plan: Plan, spec: ClusterSpec, i: int, shed: float) -> list[list[tuple[np.ndarray, int]]]:
    """A pipeline's device i sheds ``shed`` seconds (then half, a quarter) of its busiest run:
    its tail to the next stage's device, else its head to the previous one."""
    t = plan.workload.device_times(spec.devices[i])
    ops, prev, nxt = max(_stages_of(plan, plan.device_of, i), key=lambda r: float(t[r[0]].sum()))
    k_tail = min(int(np.searchsorted(np.cumsum(t[ops][::-1]), shed)) + 1, len(ops))
    k_head = min(int(np.searchsorted(np.cumsum(t[ops]), shed)) + 1, len(ops))
    tries = []
    for d in (1, 2, 4):
        tail, head = ops[len(ops) - k_tail // d:], ops[:k_head // d]
        tries.append([(part, to) for part, to in ((tail, nxt), (head, prev)) if to >= 0 and len(part)])
    return tries


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
    shed = _shed_stage(plan, spec, i) if _is_pipeline(plan) else None
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
    return _rehome(plan, spec, dev, moving, spec.devices[i], exclude=i), moving


# --- pipelines: stage boundaries move, stages do not scatter ------------------------------------
PIPELINE_METHODS = ("follow-decode", "stages")


def _is_pipeline(plan: Plan) -> bool:
    """Placed as contiguous stages of the topological order (see the module docstring)."""
    return plan.method in PIPELINE_METHODS


def _runs(dev: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, device) of each maximal run of equal entries of ``dev``."""
    cuts = (np.flatnonzero(dev[1:] != dev[:-1]) + 1).tolist()
    return [(s, e, int(dev[s])) for s, e in zip([0, *cuts], [*cuts, len(dev)])]


def _stages_of(plan: Plan, dev: np.ndarray, d: int) -> list[tuple[np.ndarray, int, int]]:
    """Device d's runs, passing over other devices' ops that read no weights (a view that follows
    its input, a mask): (its ops, the device of the run before, of the run after; -1: none)."""
    anchor = np.fromiter((bool(op.params) for op in plan.graph.ops), dtype=bool, count=len(dev))
    pos = np.flatnonzero((dev == d) | anchor)
    return [(pos[s:e], int(dev[pos[s - 1]]) if s else -1, int(dev[pos[e]]) if e < len(pos) else -1)
            for s, e, x in _runs(dev[pos]) if x == d]


def _held(plan: Plan, spec: ClusterSpec, dev: np.ndarray) -> np.ndarray:
    """[D] weight bytes each device of ``spec`` holds under ``dev`` (a shared tile once each)."""
    return Plan(plan.graph, spec, dev.copy()).weight_bytes


def _first(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest k in [lo, hi] with ``ok(k)`` (false, then true from there on); hi + 1 if none."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid - 1
        else:
            lo = mid + 1
    return lo


def _busy(plan: Plan, spec: ClusterSpec, dev: np.ndarray) -> np.ndarray:
    """[D] modelled seconds of the ops ``dev`` gives each device."""
    w = plan.workload
    return np.array([float(w.device_times(d)[dev == i].sum()) for i, d in enumerate(spec.devices)])


def _merge_lost(plan: Plan, lost: int) -> np.ndarray | None:
    """A pipeline's loss, in ``plan.spec``'s indices: each run of the lost device goes to the
    runs around it (``_split``), the runs no split fits whole to one device (``_whole``);
    None when some run fits neither."""
    spec, dev = plan.spec, plan.device_of.copy()
    room = np.maximum(weight_capacity(spec), plan.weight_bytes + 0.5)   # NOTE: as _replan checks
    busy = _busy(plan, spec, dev)
    left: list[np.ndarray] = []
    for ops, prev, nxt in _stages_of(plan, plan.device_of, lost):
        nxt = -1 if nxt == prev else nxt
        k = _split(plan, dev, ops, prev, nxt, busy, room)
        if k < 0:
            left.append(ops)
            continue
        dev[ops[:k]], dev[ops[k:]] = prev, nxt
        for x, part in ((prev, ops[:k]), (nxt, ops[k:])):
            busy[x] += float(plan.workload.device_times(spec.devices[x])[part].sum())
    return _whole(plan, dev, lost, np.concatenate(left), room) if left else dev


def _split(plan: Plan, dev: np.ndarray, ops: np.ndarray, prev: int, nxt: int, busy: np.ndarray,
           room: np.ndarray) -> int:
    """How many of ``ops`` go to ``prev``, the rest going to ``nxt`` (-1: none), both within
    ``room`` and finishing soonest by ``busy`` and the ops' times; -1 if no split fits."""
    lo, hi = (0 if nxt >= 0 else len(ops)), (len(ops) if prev >= 0 else 0)

    def held(k: int) -> np.ndarray:
        trial = dev.copy()
        trial[ops[:k]], trial[ops[k:]] = prev, nxt
        return _held(plan, plan.spec, trial)

    if prev >= 0:   # NOTE: prev holds more as k grows, nxt less: the splits that fit are [lo, hi]
        hi = _first(lo, hi, lambda k: held(k)[prev] > room[prev]) - 1
    if nxt >= 0:
        lo = _first(lo, hi, lambda k: held(k)[nxt] <= room[nxt])
    if lo > hi:
        return -1
    w, ks = plan.workload, np.arange(lo, hi + 1)
    finish = np.zeros(len(ks))
    if prev >= 0:
        finish = busy[prev] + np.r_[0.0, np.cumsum(w.device_times(plan.spec.devices[prev])[ops])][ks]
    if nxt >= 0:
        t = w.device_times(plan.spec.devices[nxt])[ops]
        finish = np.maximum(finish, busy[nxt] + np.r_[np.cumsum(t[::-1])[::-1], 0.0][ks])
    return int(ks[int(np.argmin(finish))])


def _whole(plan: Plan, dev: np.ndarray, lost: int, moving: np.ndarray, room: np.ndarray) -> np.ndarray | None:
    """``moving`` on one device with room: one not far slower than the quickest, an idle one
    (it takes the stage over), the nearest to the lost one, the fastest first; None if none fits."""
    spec, w = plan.spec, plan.workload
    holding = set(dev.tolist())
    ring = {x: r for r, xs in enumerate(_nearby(spec, spec.devices[lost])) for x in xs if x != lost}
    took = {x: float(w.device_times(spec.devices[x])[moving].sum()) for x in ring}
    quickest = min(took.values(), default=0.0)
    for x in sorted(ring, key=lambda x: (took[x] > QUICK * quickest, x in holding, ring[x], took[x], x)):
        trial = _with(dev, moving, x)
        if _held(plan, spec, trial)[x] <= room[x]:
            return trial
    return None


def _take_stage(plan: Plan, spec: ClusterSpec, dev: np.ndarray, new: int) -> np.ndarray:
    """A pipeline's newcomer takes one of the busiest device's runs whole, or the back of one
    (``_backs``): of those that gain more than a cut costs, the one that adds the fewest tasks
    per step, then gains the most. None gains: it stays spare."""
    a = int(np.argmax(_busy(plan, spec, dev)))
    cut = float(spec.cut_latency[a, new])
    takes = [(g, back) for ops, _, _ in _stages_of(plan, dev, a)
             for g, back in _backs(plan, spec, dev, ops, a, new) if g > cut]
    if not takes:
        return dev
    tasks = len(_fused(plan, spec, dev).blocks)

    def cost(take: tuple[float, np.ndarray]) -> tuple[int, float]:
        return len(_fused(plan, spec, _with(dev, take[1], new)).blocks) - tasks, -take[0]

    return _with(dev, min(takes, key=cost)[1], new)


def _backs(plan: Plan, spec: ClusterSpec, dev: np.ndarray, ops: np.ndarray, a: int,
           new: int) -> list[tuple[float, np.ndarray]]:
    """Device a's run ``ops`` whole, and its back split where the two finish soonest, each
    within the newcomer's room, with the seconds device a then finishes sooner."""
    cols = plan.workload.device_times(spec.devices[a]), plan.workload.device_times(spec.devices[new])
    room = float(weight_capacity(spec)[new])

    def fits(k: int) -> bool:
        return bool(_held(plan, spec, _with(dev, ops[k:], new))[new] <= room)

    ks = np.arange(_first(0, len(ops) - 1, fits), len(ops))    # NOTE: the newcomer takes one op at least
    busy = float(cols[0][dev == a].sum())
    back_a, back_new = (np.cumsum(c[ops][::-1])[::-1][ks] for c in cols)
    gain = busy - np.maximum(busy - back_a, back_new)
    out = [(float(gain[0]), ops)] if len(ks) and ks[0] == 0 else []
    if len(ks) > len(out):
        j = len(out) + int(np.argmax(gain[len(out):]))
        out.append((float(gain[j]), ops[int(ks[j]):]))
    return out


def _with(dev: np.ndarray, ops: np.ndarray, d: int) -> np.ndarray:
    out = dev.copy()
    out[ops] = d
    return out


def _fused(plan: Plan, spec: ClusterSpec, dev: np.ndarray) -> Plan:
    return Plan(plan.graph, spec, dev.copy(), plan.method, info={"fused": plan.fused})


def _shed_stage(plan: Plan, spec: ClusterSpec, i: int) -> np.ndarray | None:
    """A pipeline's device i past its new memory: the fewest ops at one end of one of its runs
    go to the device of the run beside that end (``_shed_end``), the receiver that then
    finishes soonest; None when no end can take enough."""
    dev, w = plan.device_of, plan.workload
    room = np.maximum(weight_capacity(spec), plan.weight_bytes + 0.5)   # NOTE: as _replan checks
    room[i] = weight_capacity(spec)[i]
    busy = _busy(plan, spec, dev)
    best, best_t = None, np.inf
    for ops, prev, nxt in _stages_of(plan, dev, i):
        for end, to in ((ops[::-1], nxt), (ops, prev)):     # its tail to the next, its head to the previous
            trial = _shed_end(plan, spec, end, to, i, room) if to >= 0 else None
            if trial is not None:
                t = busy[to] + float(w.device_times(spec.devices[to])[trial != dev].sum())
                if t < best_t:
                    best, best_t = trial, t
    return best


def _shed_end(plan: Plan, spec: ClusterSpec, end: np.ndarray, to: int, i: int,
              room: np.ndarray) -> np.ndarray | None:
    """The plan's devices with the fewest first ops of ``end`` on ``to`` that bring device i
    within ``room``, if ``to`` stays within its own; else None."""
    def fits(m: int) -> bool:
        return bool(_held(plan, spec, _with(plan.device_of, end[:m], to))[i] <= room[i])

    m = _first(1, len(end), fits)
    if m > len(end):
        return None
    trial = _with(plan.device_of, end[:m], to)
    return trial if _held(plan, spec, trial)[to] <= room[to] else None
