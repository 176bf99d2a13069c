"""Event-driven simulation of one request through a plan, with link contention.

The simulation follows how the runtime executes: a block (one Dask task) starts
when every tensor it reads from other blocks is on its device and its device is
free; it runs its ops back to back; its outputs are available when it ends.
A device runs one block at a time, the ready block of lowest phase first (list
scheduling). A tensor goes once to each other device that reads it. A transfer
holds the shared resources on its route (a host's NIC for traffic leaving or
entering a host; a device pair's channel inside a host) for bytes / bandwidth,
first come first served, and arrives one latency after it leaves.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SeaBiscuitError
from ..ir import OpGraph
from .cluster import ClusterSpec
from .workload import workload

if TYPE_CHECKING:    # NOTE: a Plan calls simulate(); the type alone comes from plan.py
    from .plan import Plan


@dataclass(frozen=True)
class Schedule:
    """When each block ran and each tensor moved, for one request."""

    makespan_s: float
    block_start: np.ndarray          # [blocks]
    block_finish: np.ndarray         # [blocks]
    op_start: np.ndarray             # [ops]
    op_finish: np.ndarray            # [ops]
    busy_s: np.ndarray               # [devices] time spent computing
    arrivals: dict[tuple[int, int], float]   # (tensor id, device) -> time it is there
    transfers: tuple[tuple[int, int, int, float, float], ...]  # (tensor, src, dst, start, end)


def simulate(plan: Plan) -> Schedule:
    """Simulate one request through ``plan``; see the module docstring for the model."""
    w, spec = plan.workload, plan.spec
    n_dev = len(spec.devices)
    block_of, bdev = plan.block_of, plan.block_device
    n_blocks = len(bdev)
    dev = plan.device_of
    t_op = w.times(spec)[np.arange(w.n), dev]
    dur = np.bincount(block_of, weights=t_op, minlength=n_blocks)
    phase = plan.block_phase
    blk = block_of.tolist()
    devl = dev.tolist()
    bdevl = bdev.tolist()

    # Which blocks wait for which tensors, and where each block's outputs must go.
    pending = [0] * n_blocks
    waiting: dict[tuple[int, int], list[int]] = {}     # (tensor, device) -> blocks there that read it
    sends: list[list[tuple[int, int]]] = [[] for _ in range(n_blocks)]  # block -> (tensor, device)
    for t, (src, dsts) in enumerate(zip(w.t_src.tolist(), w.t_dst)):
        sb = blk[src]
        seen_dev: set[int] = set()
        seen_blk: set[int] = set()
        for c in dsts:
            cb = blk[c]
            if cb == sb or cb in seen_blk:
                continue
            seen_blk.add(cb)
            e = devl[c]
            pending[cb] += 1
            waiting.setdefault((t, e), []).append(cb)
            if e not in seen_dev:
                seen_dev.add(e)
                sends[sb].append((t, e))

    bw, lat, routes = spec.bandwidth, spec.latency, spec.routes
    t_bytes = w.t_bytes.tolist()
    link_free: dict[int, float] = {}
    ready: list[list[tuple[int, int]]] = [[] for _ in range(n_dev)]
    dev_free_at = [0.0] * n_dev
    dev_busy = [False] * n_dev
    start = np.zeros(n_blocks)
    finish = np.zeros(n_blocks)
    arrivals: dict[tuple[int, int], float] = {}
    transfers: list[tuple[int, int, int, float, float]] = []
    events: list[tuple[float, int, int, int, int]] = []   # (time, seq, kind, a, b)
    seq = 0
    FINISH, ARRIVE = 0, 1

    def dispatch(d: int, now: float) -> None:
        nonlocal seq
        if dev_busy[d] or not ready[d]:
            return
        _, b = heapq.heappop(ready[d])
        s = max(now, dev_free_at[d])
        start[b], finish[b] = s, s + dur[b]
        dev_busy[d] = True
        seq += 1
        heapq.heappush(events, (finish[b], seq, FINISH, b, 0))

    for b in range(n_blocks):
        if pending[b] == 0:
            heapq.heappush(ready[bdevl[b]], (int(phase[b]), b))
    for d in range(n_dev):
        dispatch(d, 0.0)

    while events:
        now, _, kind, a, e = heapq.heappop(events)
        if kind == FINISH:
            d = bdevl[a]
            dev_busy[d] = False
            dev_free_at[d] = now
            for t, dst in sends[a]:
                if dst == d:
                    seq += 1
                    heapq.heappush(events, (now, seq, ARRIVE, t, dst))
                    continue
                route = routes[d][dst]
                s = max([now] + [link_free.get(r, 0.0) for r in route])
                busy = t_bytes[t] / bw[d, dst]
                for r in route:
                    link_free[r] = s + busy
                end = s + busy + lat[d, dst]
                transfers.append((t, d, dst, s, end))
                seq += 1
                heapq.heappush(events, (end, seq, ARRIVE, t, dst))
            dispatch(d, now)
        else:
            arrivals[(a, e)] = now
            for b in waiting.get((a, e), ()):
                pending[b] -= 1
                if pending[b] == 0:
                    heapq.heappush(ready[e], (int(phase[b]), b))
            dispatch(e, now)

    if n_blocks and not (finish > 0).sum() + (dur == 0).sum() >= n_blocks:
        stuck = [b for b in range(n_blocks) if pending[b] > 0]
        raise SeaBiscuitError(f"plan deadlocks: {len(stuck)} block(s) wait for inputs that never come "
                              f"(first: block {stuck[0]} on {spec.names[bdevl[stuck[0]]]!r})")
    # Op times inside blocks: back to back, in topological order.
    order = np.argsort(block_of, kind="stable")
    csum = np.cumsum(t_op[order])
    first = np.searchsorted(block_of[order], np.arange(n_blocks))
    base = np.where(first > 0, csum[np.maximum(first - 1, 0)], 0.0)
    op_finish = np.empty(w.n)
    op_finish[order] = start[block_of[order]] + csum - base[block_of[order]]
    op_start = op_finish - t_op
    busy = np.bincount(dev, weights=t_op, minlength=n_dev)
    return Schedule(float(finish.max()) if n_blocks else 0.0, start, finish, op_start, op_finish, busy,
                    arrivals, tuple(transfers))


def lower_bound_s(plan_or_graph: Plan | OpGraph, spec: ClusterSpec | None = None) -> float:
    """No plan can beat this: max(total work / total speed, critical path).

    Work is counted on the fastest device for each op; the cluster's speed is the
    sum of each device's speed relative to that. The critical path takes each op
    at its fastest and every transfer as free.
    """
    if isinstance(plan_or_graph, OpGraph):
        graph = plan_or_graph
    else:
        graph, spec = plan_or_graph.graph, plan_or_graph.spec
    if spec is None:
        raise SeaBiscuitError("lower_bound_s needs a cluster spec")
    w = workload(graph)
    times = w.times(spec)
    fastest = times.min(axis=1)
    speed = fastest.sum() / np.maximum(times.sum(axis=0), 1e-30)
    work = fastest.sum() / speed.sum()
    finish = [0.0] * w.n
    f = fastest.tolist()
    for v, ps in enumerate(w.preds):
        finish[v] = f[v] + (max(finish[u] for u in ps) if ps else 0.0)
    return max(work, max(finish, default=0.0))
