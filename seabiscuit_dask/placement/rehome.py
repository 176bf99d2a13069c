"""The op-by-op repair of ``replan``: each op that must move goes, in topological order, to the
device near its old one that finishes it soonest (see ``replan``'s module docstring).
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from ..errors import ClusterTooSmall
from ..ir import fmt_bytes
from .capacity import weight_capacity
from .cluster import ClusterSpec, DeviceSpec
from .plan import Plan
from .repair import QUICK, nearby, op_depths, seconds_on
from .workload import Workload

LIGHT_FLOPS_PER_BYTE = 4   # an op without weights doing less per byte it moves follows its input


def rehome(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, home: DeviceSpec,
           exclude: int = -1) -> np.ndarray:
    """Give each op in ``moving`` (``dev`` = -1 there) a device of ``spec``, nearest first.

    ``exclude`` (a device whose memory just shrank) takes none of them.
    """
    out = rehome_within(plan, spec, dev, moving, home, exclude, np.inf)
    assert out is not None      # NOTE: a repair gives up only within a finite time
    return out


def rehome_within(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, home: DeviceSpec,
                  exclude: int, give_up_s: float) -> np.ndarray | None:
    """``rehome``, or None once the repair is sure to take longer than ``give_up_s`` besides the
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
    rings = [[d for d in ring if d != exclude] for ring in nearby(spec, home)]
    cands = _candidates(rings, seconds_on(w, spec, moving), free, need)
    return _assign(plan, spec, dev, moving, cands, [d for ring in rings for d in ring], free, home, give_up_s)


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
    depth = op_depths(w)[moving]
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
    depth = op_depths(w)
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


def _tile_holders(w: Workload, dev: np.ndarray) -> dict[int, int]:
    """Shared weight tile -> a device (``dev`` >= 0) already holding it."""
    tile, user, nbytes, _ = w.shared_arrays
    placed = dev[user] >= 0
    held = np.zeros((len(nbytes), int(dev.max()) + 2), dtype=bool)
    held[tile[placed], dev[user[placed]]] = True
    some = held.any(axis=1)
    return dict(zip(np.flatnonzero(some).tolist(), held[some].argmax(axis=1).tolist()))
