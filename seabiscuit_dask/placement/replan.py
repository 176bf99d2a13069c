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
  each side. The kept repair is the one simulating them all would keep, with
  fewer simulations: devices alike and idle are tried once (they simulate
  alike), a repair whose bound (its longest chain of blocks, each a Dask hop
  and the scheduler's time after the one before) passes the fastest one found
  is not simulated, and the op-by-op repair stops as soon as a chain of its
  ops crosses devices so often that its hops alone would.
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
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import ClusterTooSmall, SeaBiscuitError
from ..ir import fmt_bytes
from ..pauses import no_gc
from .capacity import weight_capacity
from .cluster import ClusterSpec, DeviceSpec
from .plan import Plan, phases
from .reroute import LinkChanged, reroute
from .workload import Workload


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
        new = _lose(plan, spec, lost, moving, _info(plan, event, moving))
    else:
        spec, dev, moving = _moves(plan, event)
        new = _repaired(plan, spec, dev, _info(plan, event, moving))
    _ = new.block_of  # NOTE: blocks are part of the repair: the runtime needs them at once.
    _check_room(plan, new, event)
    object.__setattr__(new, "planning_s", time.perf_counter() - t0)
    return new


def _moves(plan: Plan, event: Event) -> tuple[ClusterSpec, np.ndarray, np.ndarray]:
    """After a join or a capacity change: the new cluster, every op's device and the ops moved."""
    if isinstance(event, DeviceAdded):
        spec = plan.spec.with_device(event.device)
        join = _take_stage if _is_pipeline(plan) else _adopt
        dev = join(plan, spec, plan.device_of.copy(), len(spec.devices) - 1)
        return spec, dev, np.flatnonzero(dev != plan.device_of)
    if isinstance(event, CapacityChanged):
        changes: dict[str, Any] = {k: v for k, v in (("memory_bytes", event.memory_bytes),
                                                       ("flops_per_s", event.flops_per_s),
                                                       ("mem_bytes_per_s", event.mem_bytes_per_s),
                                                       ("scale", event.scale))
                                   if v is not None}
        spec = plan.spec.with_changes(event.name, **changes)
        dev, moving = _shrink(plan, spec, plan.spec.index(event.name))
        return spec, dev, moving
    raise SeaBiscuitError(f"replan does not know the event {event!r}; expected DeviceLost, "
                          "DeviceAdded or CapacityChanged")


def _info(plan: Plan, event: Event, moving: np.ndarray) -> dict[str, Any]:
    """The repaired plan's info: the old plan's, the event, what moved, and where phases change."""
    w = plan.workload
    info = {k: v for k, v in plan.info.items() if k != "phases_from"}
    info.update(event=repr(event), moved_bytes=float(w.weight_bytes[moving].sum()) if len(moving) else 0.0,
                moved_ops=len(moving), phases_from=(plan.phases, *_window(w, moving)))
    return info


def _repaired(plan: Plan, spec: ClusterSpec, dev: np.ndarray, info: dict[str, Any]) -> Plan:
    return Plan(plan.graph, spec, dev, plan.method, plan.planning_s, info)


def _check_room(plan: Plan, new: Plan, event: Event) -> None:
    """Raise ``ClusterTooSmall`` if the repair gave a device more weights than it has room for."""
    d = _overfilled(plan, new)
    if d is not None:
        raise ClusterTooSmall(f"after {event!r}, {new.spec.names[d]!r} would hold "
                              f"{fmt_bytes(new.weight_bytes[d])} of weights; it has room for "
                              f"{fmt_bytes(weight_capacity(new.spec)[d])}")


def _overfilled(plan: Plan, new: Plan) -> int | None:
    """The first device ``new`` gives more weights than it has room for (None: none): a weight
    shared by ops on several devices is held by each of them, so moving ops one by one can."""
    spec = new.spec
    cap = weight_capacity(spec)
    # NOTE: only a device the repair gave more weights: ``place`` may leave one just past the
    # weight room when its activations are small (it checks weights and activations together)
    before = dict(zip(plan.spec.names, plan.weight_bytes.tolist()))
    grew = new.weight_bytes > np.array([before.get(n, 0.0) for n in spec.names]) + 0.5
    over = np.flatnonzero((new.weight_bytes > cap) & grew)
    return int(over[0]) if len(over) else None


def _lose(plan: Plan, spec: ClusterSpec, lost: int, moving: np.ndarray, info: dict[str, Any]) -> Plan:
    """The repaired plan on ``spec`` once device ``lost`` of ``plan.spec`` is gone: the op-by-op
    repair (``_rehome``) or, where the simulator finds it faster, a whole hand-over (``_wholes``)."""
    merged = _merge_lost(plan, lost) if _is_pipeline(plan) else None
    if merged is not None:
        return _repaired(plan, spec, np.where(merged > lost, merged - 1, merged), info)
    old = plan.device_of
    dev = np.where(old > lost, old - 1, old)
    dev[moving] = -1
    home = plan.spec.devices[lost]
    whole = _fastest(_wholes(plan, spec, dev, moving, home, info))
    if whole is None:
        return _repaired(plan, spec, _rehome(plan, spec, dev, moving, home), info)
    # NOTE: the op-by-op repair gives up once its chain of cuts alone outlasts the whole hand-over
    give_up_s = whole.makespan_s * (1 + BOUND_SLACK) - whole.schedule.client_s
    rehomed = _rehome_within(plan, spec, dev, moving, home, -1, give_up_s)
    if rehomed is None:
        return whole
    op_by_op = _repaired(plan, spec, rehomed, info)
    # NOTE: one that overfills a device through a weight its ops share loses to a hand-over that fits
    return whole if _overfilled(plan, op_by_op) is not None else _rather(op_by_op, whole)


def _wholes(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, home: DeviceSpec,
            info: dict[str, Any]) -> list[Plan]:
    """``dev`` with the lost device's ops all on one device with room for them: the nearest and
    quickest ``WHOLE_TRIES``, less the twins of one before (``_twins``: they would simulate alike).
    A stage handed over whole keeps its one cut on each side, where ops spread one by one over
    five devices made a 41 GB Llama's lost stage 268 blocks and its plan 2.6x a fresh one."""
    if not len(moving):
        return []
    w = plan.workload
    n_dev = len(spec.devices)
    cap = weight_capacity(spec)
    staying = dev >= 0
    held = np.bincount(dev[staying], weights=w.weight_bytes[staying], minlength=n_dev)
    idle = np.bincount(dev[staying], minlength=n_dev) == 0
    need = float(w.weight_bytes[moving].sum())
    work = _work(w, spec, moving)
    fastest = min(work)
    order = [d for ring in _nearby(spec, home) for d in sorted(ring, key=lambda d: work[d])]
    tries = [d for d in order if held[d] + need <= cap[d] and work[d] <= QUICK * fastest][:WHOLE_TRIES]
    kept: list[int] = []
    for d in tries:
        if not any(_twins(spec, idle, e, d) for e in kept):
            kept.append(d)
    out: list[Plan] = []
    # NOTE: onto an idle device the ops only change their device's number, and the phases with
    # them: one such try's phases are every such try's (the plan's own where it computed them whole)
    renamed = plan.phases if "phases_from" not in plan.info else None
    for d in kept:
        hint = {"phases_from": (renamed, w.n, w.n)} if idle[d] and renamed is not None else {}
        p = _repaired(plan, spec, _with(dev, moving, d), {**info, **hint})
        if idle[d] and renamed is None:
            renamed = p.phases
        if p.weight_bytes[d] <= cap[d]:
            out.append(p)
    return out


def _twins(spec: ClusterSpec, idle: np.ndarray, a: int, b: int) -> bool:
    """Whether a plan with the moved ops all on device b simulates exactly as one with them on a:
    both idle and alike but for their names, with the same links to every other device, and no
    busy device numbered between them (blocks are numbered by device)."""
    lo, hi = min(a, b), max(a, b)
    da, db = spec.devices[a], spec.devices[b]
    if spec.relays or not idle[lo:hi + 1].all() or replace(da, name=db.name, address=db.address) != db:
        return False
    swap = np.arange(len(spec.devices))
    swap[[a, b]] = b, a
    return all(np.array_equal(m, m[swap][:, swap]) for m in (spec.bandwidth, spec.latency))


def _fastest(plans: list[Plan]) -> Plan | None:
    """The first of the plans the simulator finds fastest (None: no plans). The first is simulated,
    the others in the order of a time that none of their simulations beats (``_bound_s``) until
    that time passes the fastest one found."""
    if len(plans) <= 1:
        return plans[0] if plans else None
    best, best_s, client_s = 0, plans[0].makespan_s, plans[0].schedule.client_s
    bound = {i: _bound_s(p, client_s) for i, p in enumerate(plans) if i}
    for i in sorted(bound, key=lambda i: (bound[i], i)):
        if (bound[i], i) > (best_s, best):
            break
        if (plans[i].makespan_s, i) < (best_s, best):
            best, best_s = i, plans[i].makespan_s
    return plans[best]


def _rather(op_by_op: Plan, whole: Plan) -> Plan:
    """The op-by-op repair where the simulator finds it no slower than the whole hand-over; not
    simulated where its bound already is (a repair cut into a hundred stages)."""
    if _bound_s(op_by_op, whole.schedule.client_s) > whole.makespan_s:
        return whole
    return op_by_op if op_by_op.makespan_s <= whole.makespan_s else whole


def _bound_s(plan: Plan, client_s: float) -> float:
    """Seconds that no simulation of ``plan`` beats, given the client's (``Schedule.client_s``: the
    same for every plan of one graph on one cluster).

    ``simulate`` runs a block once the blocks it reads have finished, a cut later
    (``DaskSpec.cut_s``: the hop and the scheduler's time), and its transfers start no sooner
    than that; so its longest chain of blocks, each its ops' time and a cut, and each link the
    slowest of its transfers without contention, is a bound.
    """
    w, spec = plan.workload, plan.spec
    t_idx, c_op = w.pairs
    p_op = w.t_src[t_idx]
    blk, dev = plan.block_of, plan.device_of
    cross = np.flatnonzero(blk[p_op] != blk[c_op])
    src, dst = dev[p_op[cross]], dev[c_op[cross]]
    # NOTE: latency is 0 and bandwidth inf on the diagonal: a tensor on its device waits for nothing
    wait = spec.latency[src, dst] + w.t_bytes[t_idx[cross]] / spec.bandwidth[src, dst]
    nb = len(plan.block_device)
    key = blk[c_op[cross]] * nb + blk[p_op[cross]]
    order = np.lexsort((wait, key))     # NOTE: by consumer block; each link's slowest transfer last
    key, wait = key[order], wait[order]
    last = np.ones(len(key), dtype=bool)
    last[:-1] = key[1:] != key[:-1]
    took = (np.bincount(blk, weights=_own_times(plan), minlength=nb) + spec.dask.cut_s).tolist()
    finish = list(took)
    # NOTE: blocks are numbered in a topological order (``blocks_for``): a producer is final when read
    for k, x in zip(key[last].tolist(), wait[last].tolist()):
        c, p = divmod(k, nb)
        if finish[p] + x + took[c] > finish[c]:
            finish[c] = finish[p] + x + took[c]
    return (max(finish) + client_s) * (1 - BOUND_SLACK)


def _own_times(plan: Plan) -> np.ndarray:
    """[ops] each op's time on its device."""
    w, dev = plan.workload, plan.device_of
    out = np.zeros(w.n)
    for d in np.flatnonzero(np.bincount(dev, minlength=len(plan.spec.devices))).tolist():
        on = dev == d
        out[on] = w.device_times(plan.spec.devices[d])[on]
    return out


def _window(w: Any, moving: np.ndarray) -> tuple[int, int]:
    """The ops whose phases are recomputed exactly: from the first moved op to the last (after
    it, phases shift as one, which also orders the edges out of moved ops; see ``phases``)."""
    if not len(moving):
        return w.n, w.n
    return int(moving.min()), int(moving.max()) + 1


LIGHT_FLOPS_PER_BYTE = 4   # an op without weights doing less per byte it moves follows its input
QUICK = 4                  # a device this many times slower than the quickest for some work is a last resort
WHOLE_TRIES = 4            # devices a lost device's ops are tried on whole (nearest, then quickest, first)
BOUND_SLACK = 1e-9        # NOTE: a bound is summed in another order than the simulator's: a hair less


def _nearby(spec: ClusterSpec, like: DeviceSpec) -> list[list[int]]:
    """Device indices of ``spec`` in rings around ``like``: same host, same rack, the rest."""
    rings: list[list[int]] = [[], [], []]
    for i, d in enumerate(spec.devices):
        rings[0 if d.where == like.where else 1 if d.rack == like.rack else 2].append(i)
    return rings


def _rehome(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, home: DeviceSpec,
            exclude: int = -1) -> np.ndarray:
    """Give each op in ``moving`` (``dev`` = -1 there) a device of ``spec``, nearest first.

    ``exclude`` (a device whose memory just shrank) takes none of them.
    """
    out = _rehome_within(plan, spec, dev, moving, home, exclude, np.inf)
    assert out is not None      # NOTE: a repair gives up only within a finite time
    return out


def _rehome_within(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, home: DeviceSpec,
                   exclude: int, give_up_s: float) -> np.ndarray | None:
    """``_rehome``, or None once the repair is sure to take longer than ``give_up_s`` besides the
    client's time (``_assign``)."""
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
    cands = _candidates(rings, _work(w, spec, moving), free, need)
    return _assign(plan, spec, dev, moving, cands, [d for ring in rings for d in ring], free, home, give_up_s)


def _work(w: Workload, spec: ClusterSpec, ops: np.ndarray) -> list[float]:
    """[D] seconds each device of ``spec`` would take for ``ops``."""
    # NOTE: devices alike share one time column (``device_times``): each is summed once
    sums: dict[int, float] = {}
    cols = [w.device_times(d) for d in spec.devices]
    return [sums[id(c)] if id(c) in sums else sums.setdefault(id(c), float(c[ops].sum())) for c in cols]


def _candidates(rings: list[list[int]], work: list[float], free: np.ndarray, need: float) -> list[int]:
    """The devices moved ops may go to: the nearest rings with room for them all.

    Devices far slower than the quickest anywhere for this work (a CPU beside GPUs) are a last
    resort: the nearest rings whose quick devices have room, before the slow ones of a nearer
    ring (a lost GPU's layers on its host's CPU made a 41 GB Llama's plan 4.7x slower; on a GPU
    of the next host, one cut more).
    """
    fastest = min((work[d] for ring in rings for d in ring), default=0.0)
    cands: list[int] = []
    for ring in rings:
        cands += ring
        quick = [d for d in cands if work[d] <= QUICK * fastest]
        if float(np.maximum(free[quick], 0).sum()) >= need:
            return quick
    cands = []
    for ring in rings:
        cands += ring
        if float(np.maximum(free[cands], 0).sum()) >= need:
            break
    return cands


def _assign(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, cands: list[int],
            everywhere: list[int], free: np.ndarray, home: DeviceSpec, give_up_s: float) -> np.ndarray | None:
    """Each op of ``moving`` in turn (topological order) to the candidate that finishes it soonest:
    the work already at its depth level there, its own time, and the time to bring its inputs.
    An op reading a weight tile a candidate holds goes there; glue goes where its largest input is.

    None once a chain of ops crosses devices so often that its blocks, a cut each
    (``DaskSpec.cut_s``: ``simulate`` runs a block a hop and the scheduler's time after the
    blocks it reads), take more than ``give_up_s``.
    """
    w = plan.workload
    depth = _depth(w)[moving]
    lo = int(depth.min())
    base = _level_work(w, spec, dev, cands, lo, int(depth.max())).tolist()
    level = (depth - lo).tolist()
    own = _columns(w, spec, cands, moving)
    cand = np.array(cands, dtype=np.int64)
    lat = spec.cut_latency[:, cand].tolist()
    inv = (1.0 / spec.bandwidth[:, cand]).tolist()
    wb = w.weight_bytes[moving].tolist()
    src, nbytes = w.lists
    free_l = free.tolist()
    extra: dict[int, list[float]] = {}     # depth level -> work moved there, per candidate
    d_list = dev.tolist()
    # NOTE: memory-bound ops without weights (joins, views, elementwise) go where their largest
    # input is: moving them elsewhere would only move that input too.
    light = ((w.weight_bytes[moving] == 0)
             & (w.flops[moving] < LIGHT_FLOPS_PER_BYTE * w.moved_bytes[moving])).tolist()
    slot = {d: j for j, d in enumerate(cands)}
    holder = _tile_holders(w, dev)
    tiles_of = _tiles(w, moving)
    # NOTE: device changes on a chain of ops ending at each moved op (ops that stay count 0): a
    # lower bound on its blocks' chain, so that the repair can give up as soon as it is too long
    changes = [0] * w.n
    cut_s = spec.dask.cut_s
    most = int(give_up_s / cut_s) if cut_s > 0 and give_up_s < np.inf else w.n + 1
    for i, v in enumerate(moving.tolist()):
        wv = wb[i]
        # NOTE: an op reading a weight tile a candidate already holds goes there: no second copy
        if v in tiles_of:
            held = next((holder[t] for t in tiles_of[v] if holder.get(t, -1) in slot), -1)
            if held >= 0 and free_l[held] >= wv:
                d_list[v] = held
                free_l[held] -= wv
                continue
        pairs = [(src[t], nbytes[t]) for t in w.op_in[v]]     # NOTE: (producing op, bytes) per input
        if light[i] and pairs:   # NOTE: glue (a join, a view) goes where its largest input is
            d = d_list[pairs[0][0] if len(pairs) == 1 else max(pairs, key=itemgetter(1))[0]]
            if d in slot:
                d_list[v] = d
                changes[v] = _changes(changes, d_list, pairs, d)
                continue
        ins = [(d_list[s], nb) for s, nb in pairs]
        moved = extra.get(level[i])
        if moved is None:
            moved = extra[level[i]] = [0.0] * len(cands)
        j = _soonest(cands, base[level[i]], moved, own, i, ins, lat, inv, free_l, wv)
        if j >= 0:
            d = cands[j]
            moved[j] += own[j][i]
        else:   # nothing near has room for this op: the nearest device farther out that does
            d = next((e for e in everywhere if free_l[e] >= wv), -1)
            if d < 0:
                raise ClusterTooSmall(f"no device has room for op {w.names[v]!r} ({fmt_bytes(wv)}) "
                                      f"once {home.name!r} is gone; most free: {fmt_bytes(max(free_l))}")
        d_list[v] = d
        free_l[d] -= wv
        for t in tiles_of.get(v, ()):
            holder.setdefault(t, d)
        changes[v] = _changes(changes, d_list, pairs, d)
        if changes[v] >= most:
            return None
    return np.array(d_list, dtype=np.int64)


_DEPTHS: weakref.WeakKeyDictionary[Workload, np.ndarray] = weakref.WeakKeyDictionary()


def _depth(w: Workload) -> np.ndarray:
    """[ops] the longest path, in ops, from a source to each op (``Workload.depth``), kept per graph.

    It is the phases of a plan with every op on a device of its own: ``phases`` loops over the edge
    lists, 1 ms on a 7k-op graph where ``Workload.depth`` takes 4 (a loop over numpy scalars).
    """
    depth = _DEPTHS.get(w)
    if depth is None:
        depth = _DEPTHS[w] = phases(w, np.arange(w.n))
    return depth


def _tiles(w: Workload, ops: np.ndarray) -> dict[int, list[int]]:
    """Each of ``ops`` that reads shared weight tiles -> their ids (``Workload.shared``), in order."""
    tile, user, _, _ = w.shared_arrays
    mine = np.zeros(w.n, dtype=bool)
    mine[ops] = True
    out: dict[int, list[int]] = {}
    for t, u in zip(*(a[mine[user]].tolist() for a in (tile, user))):
        out.setdefault(u, []).append(t)
    return out


def _level_work(w: Workload, spec: ClusterSpec, dev: np.ndarray, cands: list[int], lo: int,
                hi: int) -> np.ndarray:
    """[depth levels lo..hi, candidates] seconds of work each candidate has at each level (``dev``)."""
    # NOTE: one count for all candidates, each level's sum in op order (as one count each adds it)
    slot_of = np.full(len(spec.devices) + 1, -1, dtype=np.int64)
    slot_of[cands] = np.arange(len(cands))
    depth = _depth(w)
    on = np.flatnonzero((slot_of[dev] >= 0) & (depth >= lo) & (depth <= hi))
    j_on = slot_of[dev[on]]
    t_on = np.empty(len(on))
    for j, d in enumerate(cands):
        mine = j_on == j
        t_on[mine] = w.device_times(spec.devices[d])[on[mine]]
    n = len(cands)
    return np.bincount((depth[on] - lo) * n + j_on, weights=t_on, minlength=(hi - lo + 1) * n).reshape(-1, n)


def _columns(w: Workload, spec: ClusterSpec, cands: list[int], ops: np.ndarray) -> list[list[float]]:
    """Per candidate, the time of each of ``ops`` there (one list for devices alike)."""
    cols = [w.device_times(spec.devices[d]) for d in cands]
    made: dict[int, list[float]] = {}
    return [made[id(c)] if id(c) in made else made.setdefault(id(c), c[ops].tolist()) for c in cols]


def _changes(changes: list[int], dev: list[int], pairs: list[tuple[int, float]], d: int) -> int:
    """Device changes on the longest chain of ops into an op on device d reading ``pairs``."""
    if len(pairs) == 1:
        s = pairs[0][0]
        return changes[s] + (dev[s] != d)
    return max((changes[s] + (dev[s] != d) for s, _ in pairs), default=0)


def _soonest(cands: list[int], base: list[float], moved: list[float], own: list[list[float]], i: int,
             ins: list[tuple[int, float]], lat: list[list[float]], inv: list[list[float]],
             free: list[float], nbytes: float) -> int:
    """The slot of the candidate with room that finishes op i soonest: the work at its depth level
    there (``base`` before the repair, ``moved`` by it), its own time and the time to bring each
    input from its device (``ins``); -1 if none has room."""
    best, best_j = float("inf"), -1
    for j, (d, b, e, t) in enumerate(zip(cands, base, moved, own)):
        if free[d] >= nbytes:
            s = b + e + t[i]
            for x, nb in ins:
                if x != d:
                    s += lat[x][j] + nb * inv[x][j]
            if s < best:
                best, best_j = s, j
    return best_j


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
    depth = _depth(w)
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
