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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import BadInput, BadPlan
from ..ir import OpGraph
from .cluster import ClusterSpec, DaskSpec
from .workload import Workload, workload


class Placed(Protocol):
    """What the simulation reads of a plan (``plan.Plan``, which calls ``simulate``): its graph
    and cluster, each op's device and block, and each block's device and phase."""

    @property
    def graph(self) -> OpGraph: ...

    @property
    def spec(self) -> ClusterSpec: ...

    @property
    def workload(self) -> Workload: ...

    @property
    def device_of(self) -> np.ndarray: ...

    @property
    def block_of(self) -> np.ndarray: ...

    @property
    def block_device(self) -> np.ndarray: ...

    @property
    def block_phase(self) -> np.ndarray: ...


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


def _block_links(plan: Placed) -> tuple[list[list[int]], list[list[int]], list[list[tuple[int, int]]]]:
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


def _client_s(tensors: Iterable[str], graph: OpGraph, dask: DaskSpec) -> float:
    """Seconds the client's link takes to carry ``tensors`` of ``graph`` (0 for an unlimited link)."""
    nbytes = float(sum(graph.tensors[t].nbytes for t in tensors if t in graph.tensors))
    return nbytes / dask.client_bytes_per_s if math.isfinite(dask.client_bytes_per_s) else 0.0


def simulate(plan: Placed, dask: DaskSpec | None = None) -> Schedule:
    """Simulate one request through ``plan``; see the module docstring for the model.

    ``dask`` replaces the cluster's Dask costs (``plan.spec.dask``).
    """
    w, spec, g = plan.workload, plan.spec, plan.graph
    dk = spec.dask if dask is None else dask
    dev, block_of = plan.device_of, plan.block_of
    n_blocks = len(plan.block_device)
    t_op = w.times(spec)[np.arange(w.n), dev]
    t0 = dk.submit_s + _client_s(g.inputs, g, dk)
    start, finish, arrivals, transfers = _Events(plan, dk, t_op).run(t0)
    _check_finished(finish, plan)
    # NOTE: every block counts, not only those with graph outputs: the runtime runs them all
    last = float(finish.max()) if n_blocks else t0
    gather = dk.gather_s + _client_s(g.leaf_outputs, g, dk)
    makespan = last + dk.hop_s / 2 + gather if n_blocks else 0.0
    op_start, op_finish = _op_times(block_of, t_op, start, n_blocks)
    busy = np.bincount(dev, weights=t_op, minlength=len(spec.devices))
    return Schedule(float(makespan), start, finish, op_start, op_finish, busy, arrivals, tuple(transfers),
                    scheduler_s=n_blocks * dk.task_s, client_s=t0 + gather)


def _check_finished(finish: np.ndarray, plan: Placed) -> None:
    """``BadPlan`` when a block never ran: it waits for inputs that never come."""
    if len(finish) and (finish < 0).any():
        stuck = [b for b in range(len(finish)) if finish[b] < 0]
        where = plan.spec.names[int(plan.block_device[stuck[0]])]
        raise BadPlan(f"plan deadlocks: {len(stuck)} block(s) wait for inputs that never come "
                      f"(first: block {stuck[0]} on {where!r})")


def _op_times(block_of: np.ndarray, t_op: np.ndarray, start: np.ndarray,
              n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Each op's start and finish: the ops of a block back to back, in topological order, from the
    block's start."""
    order = np.argsort(block_of, kind="stable")
    csum = np.cumsum(t_op[order])
    first = np.searchsorted(block_of[order], np.arange(n_blocks))
    base = np.where(first > 0, csum[np.maximum(first - 1, 0)], 0.0)
    op_finish = np.empty(len(block_of))
    op_finish[order] = start[block_of[order]] + csum - base[block_of[order]]
    return op_finish - t_op, op_finish


FINISH, SCHED, FETCH, READY = 0, 1, 2, 3       # NOTE: what an event is: a block's steps, in reverse


class _Events:
    """The event loop of one simulated request: blocks go through the scheduler, fetch their inputs
    over the links and run on their devices (the module docstring's model)."""

    def __init__(self, plan: Placed, dask: DaskSpec, t_op: np.ndarray) -> None:
        spec = plan.spec
        n_blocks, n_dev = len(plan.block_device), len(spec.devices)
        self.dask, self.half_hop = dask, dask.hop_s / 2
        self.dur = np.bincount(plan.block_of, weights=t_op, minlength=n_blocks).tolist()
        self.phase, self.bdev = plan.block_phase.tolist(), plan.block_device.tolist()
        self.deps, self.users, self.fetch = _block_links(plan)
        self.bw, self.lat, self.routes = spec.bandwidth, spec.latency, spec.routes
        self.t_bytes = plan.workload.t_bytes.tolist()
        self.link_free: dict[int, float] = {}
        self.ready: list[list[tuple[int, int]]] = [[] for _ in range(n_dev)]
        self.dev_busy = [False] * n_dev
        self.start, self.finish = np.zeros(n_blocks), np.full(n_blocks, -1.0)
        self.arrivals: dict[tuple[int, int], float] = {}
        self.transfers: list[tuple[int, int, int, float, float]] = []
        self.events: list[tuple[float, int, int, int]] = []   # (time, seq, kind, block)
        self.seq = 0
        self.pending = [len(d) for d in self.deps]           # NOTE: blocks each block still waits for

    def push(self, t: float, kind: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, b))

    def dispatch(self, d: int, now: float) -> None:
        """Start the ready block of lowest phase on device ``d``, if it is idle."""
        if self.dev_busy[d] or not self.ready[d]:
            return
        _, b = heapq.heappop(self.ready[d])
        self.start[b] = now
        self.dev_busy[d] = True
        self.push(now + self.dur[b], FINISH, b)

    def fetch_inputs(self, b: int, now: float) -> float:
        """Start the transfers block ``b`` needs on its device; when the last one arrives."""
        e, done = self.bdev[b], now
        arrivals, link_free = self.arrivals, self.link_free
        for t, src in self.fetch[b]:
            arr = arrivals.get((t, e))
            if arr is None:
                route = self.routes[src][e]
                s = max([now] + [link_free.get(r, 0.0) for r in route])
                busy = self.t_bytes[t] / self.bw[src, e]
                for r in route:
                    link_free[r] = s + busy
                arr = arrivals[(t, e)] = s + busy + self.lat[src, e]
                self.transfers.append((t, src, e, s, arr))
            done = max(done, arr)
        return done

    def finished(self, b: int, now: float) -> None:
        """Block ``b`` is done: its device is free, and the blocks that waited only for it go to the
        scheduler."""
        self.finish[b] = now
        d = self.bdev[b]
        self.dev_busy[d] = False
        for c in self.users[b]:
            self.pending[c] -= 1
            if self.pending[c] == 0:
                self.push(now + self.half_hop, SCHED, c)
        self.dispatch(d, now)

    def run(self, t0: float) -> tuple[np.ndarray, np.ndarray, dict[tuple[int, int], float],
                                      list[tuple[int, int, int, float, float]]]:
        """Every block's start and finish, the tensors' arrivals and the transfers, for a request
        submitted at ``t0``."""
        for b, n in enumerate(self.pending):
            if n == 0:
                self.push(t0, SCHED, b)
        sched_free, events, task_s, half_hop = 0.0, self.events, self.dask.task_s, self.half_hop
        push, pop, bdev, ready = self.push, heapq.heappop, self.bdev, self.ready
        while events:
            now, _, kind, b = pop(events)
            if kind == SCHED:                       # NOTE: the scheduler is one serial resource
                sched_free = max(now, sched_free) + task_s
                push(sched_free + half_hop, FETCH, b)
            elif kind == FETCH:
                push(self.fetch_inputs(b, now), READY, b)
            elif kind == READY:
                heapq.heappush(ready[bdev[b]], (self.phase[b], b))
                self.dispatch(bdev[b], now)
            else:
                self.finished(b, now)
        return self.start, self.finish, self.arrivals, self.transfers


def lower_bound_s(plan_or_graph: Placed | OpGraph, spec: ClusterSpec | None = None) -> float:
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
        raise BadInput("lower_bound_s needs a cluster spec")
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
