"""Event-driven simulation of one request through a plan: compute, links and Dask itself.

The simulation follows how Dask runs a request (one task per block):

- the client sends the request's graph (``dask.submit_s`` plus the inputs' bytes at
  the client's bandwidth); the blocks that need no other block are then ready;
- a ready block waits for the scheduler, one shared serial resource that spends
  ``dask.task_s`` on each task; the task reaches its worker half a hop later;
- the worker fetches the tensors it reads from other devices (a tensor goes once to
  each device that reads it; a transfer holds the shared resources on its route, a
  host's NIC for traffic leaving or entering a host, a device pair's channel inside
  a host, for bytes / bandwidth, first come first served, and arrives one latency
  after it leaves); a device runs one block at a time, the ready block of lowest
  phase first, its ops back to back;
- a finished block tells the scheduler (half a hop), which may make its dependents
  ready; when every block is done, the client gathers the graph's outputs
  (``dask.gather_s`` plus their bytes).

A dependent task thus costs a hop and the scheduler's time even on the same device:
that is what makes fusing blocks pay. ``simulate(plan, dask=NO_DASK)`` leaves Dask out.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SeaBiscuitError
from ..ir import OpGraph
from .cluster import ClusterSpec, DaskSpec
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
    scheduler_s: float = 0.0         # scheduler time spent on the request's tasks
    client_s: float = 0.0            # client time: submit, gather and their bytes

    @property
    def tasks(self) -> int:
        return len(self.block_start)


def _block_links(plan: Plan) -> tuple[list[list[int]], list[list[int]], list[list[tuple[int, int]]]]:
    """Per block: the blocks it waits for, the blocks that wait for it, and the
    (tensor, source device) pairs it fetches from other devices."""
    w = plan.workload
    blk, devl = plan.block_of.tolist(), plan.device_of.tolist()
    n_blocks = len(plan.block_device)
    deps: list[dict[int, None]] = [{} for _ in range(n_blocks)]
    fetch: list[dict[int, int]] = [{} for _ in range(n_blocks)]
    for t, (src, dsts) in enumerate(zip(w.t_src.tolist(), w.t_dst)):
        sb, sd = blk[src], devl[src]
        for c in dsts:
            cb = blk[c]
            if cb == sb:
                continue
            deps[cb][sb] = None
            if devl[c] != sd:
                fetch[cb][t] = sd
    users: list[list[int]] = [[] for _ in range(n_blocks)]
    for b, ds in enumerate(deps):
        for a in ds:
            users[a].append(b)
    return [list(d) for d in deps], users, [list(f.items()) for f in fetch]


def _output_bytes(plan: Plan) -> float:
    """Bytes of the graph's outputs: what the client gathers."""
    g = plan.graph
    return float(sum(g.tensors[t].nbytes for t in g.leaf_outputs if t in g.tensors))


def simulate(plan: Plan, dask: DaskSpec | None = None) -> Schedule:
    """Simulate one request through ``plan``; see the module docstring for the model.

    ``dask`` replaces the cluster's Dask costs (``plan.spec.dask``).
    """
    w, spec = plan.workload, plan.spec
    dk = spec.dask if dask is None else dask
    n_dev = len(spec.devices)
    block_of, bdev = plan.block_of, plan.block_device
    n_blocks = len(bdev)
    dev = plan.device_of
    t_op = w.times(spec)[np.arange(w.n), dev]
    dur = np.bincount(block_of, weights=t_op, minlength=n_blocks).tolist()
    phase = plan.block_phase.tolist()
    bdevl = bdev.tolist()
    deps, users, fetch = _block_links(plan)
    pending = [len(d) for d in deps]
    out_bytes = _output_bytes(plan)
    g = plan.graph
    in_bytes = float(sum(g.tensors[t].nbytes for t in g.inputs if t in g.tensors))
    client_bw = dk.client_bytes_per_s
    t0 = dk.submit_s + (in_bytes / client_bw if math.isfinite(client_bw) else 0.0)
    half_hop = dk.hop_s / 2

    bw, lat, routes = spec.bandwidth, spec.latency, spec.routes
    t_bytes = w.t_bytes.tolist()
    link_free: dict[int, float] = {}
    ready: list[list[tuple[int, int]]] = [[] for _ in range(n_dev)]
    dev_busy = [False] * n_dev
    start = np.zeros(n_blocks)
    finish = np.full(n_blocks, -1.0)
    arrivals: dict[tuple[int, int], float] = {}
    transfers: list[tuple[int, int, int, float, float]] = []
    events: list[tuple[float, int, int, int]] = []   # (time, seq, kind, block)
    seq = 0
    sched_free = 0.0
    FINISH, SCHED, FETCH, READY = 0, 1, 2, 3

    def push(t: float, kind: int, b: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, b))

    def dispatch(d: int, now: float) -> None:
        if dev_busy[d] or not ready[d]:
            return
        _, b = heapq.heappop(ready[d])
        start[b] = now
        dev_busy[d] = True
        push(now + dur[b], FINISH, b)

    def fetch_inputs(b: int, now: float) -> float:
        """Start the transfers block ``b`` needs on its device; when the last one arrives."""
        e, done = bdevl[b], now
        for t, src in fetch[b]:
            arr = arrivals.get((t, e))
            if arr is None:
                route = routes[src][e]
                s = max([now] + [link_free.get(r, 0.0) for r in route])
                busy = t_bytes[t] / bw[src, e]
                for r in route:
                    link_free[r] = s + busy
                arr = arrivals[(t, e)] = s + busy + lat[src, e]
                transfers.append((t, src, e, s, arr))
            done = max(done, arr)
        return done

    for b in range(n_blocks):
        if pending[b] == 0:
            push(t0, SCHED, b)
    while events:
        now, _, kind, b = heapq.heappop(events)
        if kind == SCHED:                       # NOTE: the scheduler is one serial resource
            s = max(now, sched_free)
            sched_free = s + dk.task_s
            push(sched_free + half_hop, FETCH, b)
        elif kind == FETCH:
            push(fetch_inputs(b, now), READY, b)
        elif kind == READY:
            heapq.heappush(ready[bdevl[b]], (phase[b], b))
            dispatch(bdevl[b], now)
        else:
            finish[b] = now
            d = bdevl[b]
            dev_busy[d] = False
            for c in users[b]:
                pending[c] -= 1
                if pending[c] == 0:
                    push(now + half_hop, SCHED, c)
            dispatch(d, now)

    if n_blocks and (finish < 0).any():
        stuck = [b for b in range(n_blocks) if finish[b] < 0]
        raise SeaBiscuitError(f"plan deadlocks: {len(stuck)} block(s) wait for inputs that never come "
                              f"(first: block {stuck[0]} on {spec.names[bdevl[stuck[0]]]!r})")
    # NOTE: every block counts, not only those with graph outputs: the runtime runs them all
    last = float(finish.max()) if n_blocks else t0
    gather = dk.gather_s + (out_bytes / client_bw if math.isfinite(client_bw) else 0.0)
    makespan = last + half_hop + gather if n_blocks else 0.0
    # Op times inside blocks: back to back, in topological order.
    order = np.argsort(block_of, kind="stable")
    csum = np.cumsum(t_op[order])
    first = np.searchsorted(block_of[order], np.arange(n_blocks))
    base = np.where(first > 0, csum[np.maximum(first - 1, 0)], 0.0)
    op_finish = np.empty(w.n)
    op_finish[order] = start[block_of[order]] + csum - base[block_of[order]]
    op_start = op_finish - t_op
    busy = np.bincount(dev, weights=t_op, minlength=n_dev)
    return Schedule(float(makespan), start, finish, op_start, op_finish, busy, arrivals, tuple(transfers),
                    scheduler_s=n_blocks * dk.task_s, client_s=t0 + gather)


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
