"""The whole hand-over of ``replan``: a lost device's ops all on one device with room, the
fastest of a few such tries by the simulator, and the bound that spares simulating the rest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .capacity import weight_capacity
from .cluster import ClusterSpec, DeviceSpec
from .plan import Plan
from .repair import QUICK, nearby, repaired, seconds_on, with_ops

WHOLE_TRIES = 4            # devices a lost device's ops are tried on whole (nearest, then quickest, first)
BOUND_SLACK = 1e-9        # NOTE: a bound is summed in another order than the simulator's: a hair less


def wholes(plan: Plan, spec: ClusterSpec, dev: np.ndarray, moving: np.ndarray, home: DeviceSpec,
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
    work = seconds_on(w, spec, moving)
    quickest = min(work)
    order = [d for ring in nearby(spec, home) for d in sorted(ring, key=lambda d: work[d])]
    tries = [d for d in order if held[d] + need <= cap[d] and work[d] <= QUICK * quickest][:WHOLE_TRIES]
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
        p = repaired(plan, spec, with_ops(dev, moving, d), {**info, **hint})
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


def fastest(plans: list[Plan]) -> Plan | None:
    """The first of the plans the simulator finds fastest (None: no plans). The first is simulated,
    the others in the order of a time that none of their simulations beats (``bound_s``) until
    that time passes the fastest one found."""
    if len(plans) <= 1:
        return plans[0] if plans else None
    best, best_s, client_s = 0, plans[0].makespan_s, plans[0].schedule.client_s
    bound = {i: bound_s(p, client_s) for i, p in enumerate(plans) if i}
    for i in sorted(bound, key=lambda i: (bound[i], i)):
        if (bound[i], i) > (best_s, best):
            break
        if (plans[i].makespan_s, i) < (best_s, best):
            best, best_s = i, plans[i].makespan_s
    return plans[best]


def rather(op_by_op: Plan, whole: Plan) -> Plan:
    """The op-by-op repair where the simulator finds it no slower than the whole hand-over; not
    simulated where its bound already is (a repair cut into a hundred stages)."""
    if bound_s(op_by_op, whole.schedule.client_s) > whole.makespan_s:
        return whole
    return op_by_op if op_by_op.makespan_s <= whole.makespan_s else whole


def bound_s(plan: Plan, client_s: float) -> float:
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
