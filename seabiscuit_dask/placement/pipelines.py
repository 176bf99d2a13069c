"""``replan`` for a pipeline (a plan placed as contiguous stages of the topological order): stage
boundaries move and stages are handed over whole; stages do not scatter (see ``replan``'s module
docstring).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .capacity import weight_capacity
from .cluster import ClusterSpec
from .plan import Plan
from .repair import QUICK, nearby, with_ops

PIPELINE_METHODS = ("follow-decode", "stages")


def is_pipeline(plan: Plan) -> bool:
    """Placed as contiguous stages of the topological order (see the module docstring)."""
    return plan.method in PIPELINE_METHODS


def _runs(dev: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, device) of each maximal run of equal entries of ``dev``."""
    cuts = (np.flatnonzero(dev[1:] != dev[:-1]) + 1).tolist()
    return [(s, e, int(dev[s])) for s, e in zip([0, *cuts], [*cuts, len(dev)])]


def stages_of(plan: Plan, dev: np.ndarray, d: int) -> list[tuple[np.ndarray, int, int]]:
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


def merge_lost(plan: Plan, lost: int) -> np.ndarray | None:
    """A pipeline's loss, in ``plan.spec``'s indices: each run of the lost device goes to the
    runs around it (``_split``), the runs no split fits whole to one device (``_whole``);
    None when some run fits neither."""
    spec, dev = plan.spec, plan.device_of.copy()
    room = np.maximum(weight_capacity(spec), plan.weight_bytes + 0.5)   # NOTE: as replan checks it
    busy = _busy(plan, spec, dev)
    left: list[np.ndarray] = []
    for ops, prev, nxt in stages_of(plan, plan.device_of, lost):
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
    ring = {x: r for r, xs in enumerate(nearby(spec, spec.devices[lost])) for x in xs if x != lost}
    took = {x: float(w.device_times(spec.devices[x])[moving].sum()) for x in ring}
    quickest = min(took.values(), default=0.0)
    for x in sorted(ring, key=lambda x: (took[x] > QUICK * quickest, x in holding, ring[x], took[x], x)):
        trial = with_ops(dev, moving, x)
        if _held(plan, spec, trial)[x] <= room[x]:
            return trial
    return None


def take_stage(plan: Plan, spec: ClusterSpec, dev: np.ndarray, new: int) -> np.ndarray:
    """A pipeline's newcomer takes one of the busiest device's runs whole, or the back of one
    (``_backs``): of those that gain more than a cut costs, the one that adds the fewest tasks
    per step, then gains the most. None gains: it stays spare."""
    a = int(np.argmax(_busy(plan, spec, dev)))
    cut = float(spec.cut_latency[a, new])
    takes = [(g, back) for ops, _, _ in stages_of(plan, dev, a)
             for g, back in _backs(plan, spec, dev, ops, a, new) if g > cut]
    if not takes:
        return dev
    tasks = len(_fused(plan, spec, dev).blocks)

    def cost(take: tuple[float, np.ndarray]) -> tuple[int, float]:
        return len(_fused(plan, spec, with_ops(dev, take[1], new)).blocks) - tasks, -take[0]

    return with_ops(dev, min(takes, key=cost)[1], new)


def _backs(plan: Plan, spec: ClusterSpec, dev: np.ndarray, ops: np.ndarray, a: int,
           new: int) -> list[tuple[float, np.ndarray]]:
    """Device a's run ``ops`` whole, and its back split where the two finish soonest, each
    within the newcomer's room, with the seconds device a then finishes sooner."""
    cols = plan.workload.device_times(spec.devices[a]), plan.workload.device_times(spec.devices[new])
    room = float(weight_capacity(spec)[new])

    def fits(k: int) -> bool:
        return bool(_held(plan, spec, with_ops(dev, ops[k:], new))[new] <= room)

    ks = np.arange(_first(0, len(ops) - 1, fits), len(ops))    # NOTE: the newcomer takes one op at least
    busy = float(cols[0][dev == a].sum())
    back_a, back_new = (np.cumsum(c[ops][::-1])[::-1][ks] for c in cols)
    gain = busy - np.maximum(busy - back_a, back_new)
    out = [(float(gain[0]), ops)] if len(ks) and ks[0] == 0 else []
    if len(ks) > len(out):
        j = len(out) + int(np.argmax(gain[len(out):]))
        out.append((float(gain[j]), ops[int(ks[j]):]))
    return out


def _fused(plan: Plan, spec: ClusterSpec, dev: np.ndarray) -> Plan:
    return Plan(plan.graph, spec, dev.copy(), plan.method, info={"fused": plan.fused})


def stage_tries(plan: Plan, spec: ClusterSpec, i: int, shed: float) -> list[list[tuple[np.ndarray, int]]]:
    """A pipeline's device i sheds ``shed`` seconds (then half, a quarter) of its busiest run:
    its tail to the next stage's device, else its head to the previous one."""
    t = plan.workload.device_times(spec.devices[i])
    ops, prev, nxt = max(stages_of(plan, plan.device_of, i), key=lambda r: float(t[r[0]].sum()))
    k_tail = min(int(np.searchsorted(np.cumsum(t[ops][::-1]), shed)) + 1, len(ops))
    k_head = min(int(np.searchsorted(np.cumsum(t[ops]), shed)) + 1, len(ops))
    tries = []
    for d in (1, 2, 4):
        tail, head = ops[len(ops) - k_tail // d:], ops[:k_head // d]
        tries.append([(part, to) for part, to in ((tail, nxt), (head, prev)) if to >= 0 and len(part)])
    return tries


def shed_stage(plan: Plan, spec: ClusterSpec, i: int) -> np.ndarray | None:
    """A pipeline's device i past its new memory: the fewest ops at one end of one of its runs
    go to the device of the run beside that end (``_shed_end``), the receiver that then
    finishes soonest; None when no end can take enough."""
    dev, w = plan.device_of, plan.workload
    room = np.maximum(weight_capacity(spec), plan.weight_bytes + 0.5)   # NOTE: as replan checks it
    room[i] = weight_capacity(spec)[i]
    busy = _busy(plan, spec, dev)
    best, best_t = None, np.inf
    for ops, prev, nxt in stages_of(plan, dev, i):
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
        return bool(_held(plan, spec, with_ops(plan.device_of, end[:m], to))[i] <= room[i])

    m = _first(1, len(end), fits)
    if m > len(end):
        return None
    trial = with_ops(plan.device_of, end[:m], to)
    return trial if _held(plan, spec, trial)[to] <= room[to] else None
