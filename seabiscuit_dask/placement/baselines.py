"""Baseline placements to compare ``place`` against.

- ``round_robin``: op i to the next device in turn that has room.
- ``pipeline``: contiguous stages of the topological order, one per device, sized
  by device memory; each boundary then moves to the cheapest cut near it.
- ``metis``: pymetis k-way partition of the undirected op graph (vertex weight =
  weight bytes, edge weight = tensor bytes); optional dependency.

Each checks its plan and raises ``ClusterTooSmall`` rather than return one that
overfills a device.
- ``heft``: HEFT list scheduling (upward rank, earliest finish time without
  insertion, average communication in the ranks), skipping devices without room.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import ClusterTooSmall, MissingPackage
from ..ir import OpGraph
from .capacity import check_fits, weight_capacity
from .cluster import ClusterSpec
from .partition import contiguous_split
from .plan import Plan, make_plan
from .workload import Workload, workload


def _fit_or_raise(w: Workload, spec: ClusterSpec, free: np.ndarray, v: int, method: str) -> None:
    raise ClusterTooSmall(f"{method}: no device has room for op {w.names[v]!r} "
                          f"({int(w.weight_bytes[v])} bytes of weights); most free: {int(free.max())} bytes")


def round_robin(graph: OpGraph, spec: ClusterSpec) -> Plan:
    t0 = time.perf_counter()
    w = workload(graph)
    cap = weight_capacity(spec)
    check_fits(w, spec, cap)
    free = cap.copy()
    n_dev = len(free)
    dev = np.empty(w.n, dtype=np.int64)
    d = 0
    for v, need in enumerate(w.weight_bytes.tolist()):
        for k in range(n_dev):
            c = (d + k) % n_dev
            if free[c] >= need:
                break
        else:
            _fit_or_raise(w, spec, free, v, "round-robin")
        dev[v], free[c] = c, free[c] - need
        d = (c + 1) % n_dev
    return make_plan(graph, spec, dev, "round-robin", time.perf_counter() - t0).check()


def pipeline(graph: OpGraph, spec: ClusterSpec) -> Plan:
    t0 = time.perf_counter()
    w = workload(graph)
    cap = weight_capacity(spec)
    check_fits(w, spec, cap)
    order = np.array([d for g in spec.groups for d in g])
    share = cap[order] / cap[order].sum()
    last = np.fromiter((max(d) for d in w.t_dst), dtype=np.int64, count=len(w.t_dst))
    stage = contiguous_split(w.weight_bytes.astype(np.float64), w.t_src, last, w.t_bytes, share, cap[order])
    return make_plan(graph, spec, order[stage], "pipeline", time.perf_counter() - t0).check()


def metis(graph: OpGraph, spec: ClusterSpec) -> Plan:
    try:
        import pymetis
    except ImportError as e:
        raise MissingPackage("the METIS baseline needs pymetis: pip install pymetis") from e
    t0 = time.perf_counter()
    w = workload(graph)
    cap = weight_capacity(spec)
    check_fits(w, spec, cap)
    adj: list[dict[int, float]] = [{} for _ in range(w.n)]
    for t, (src, dsts) in enumerate(zip(w.t_src.tolist(), w.t_dst)):
        b = float(w.t_bytes[t])
        for c in dsts:
            adj[src][c] = adj[src].get(c, 0.0) + b
            adj[c][src] = adj[c].get(src, 0.0) + b
    xadj = np.zeros(w.n + 1, dtype=np.int64)
    xadj[1:] = np.cumsum([len(a) for a in adj])
    adjncy = np.fromiter((j for a in adj for j in a), dtype=np.int64, count=int(xadj[-1]))
    ew = np.fromiter((max(1, int(b // 1024)) for a in adj for b in a.values()), dtype=np.int64,
                     count=int(xadj[-1]))
    vw = np.maximum(1, w.weight_bytes // 2**20).astype(np.int64)
    n_dev = len(spec.devices)
    tpw = (cap / cap.sum()).tolist()
    _, parts = pymetis.part_graph(n_dev, xadj=xadj, adjncy=adjncy, vweights=vw, eweights=ew,
                                  tpwgts=tpw) if n_dev > 1 else (0, [0] * w.n)
    dev = np.asarray(parts, dtype=np.int64)
    dev = _repair_memory(w, dev, cap)
    return make_plan(graph, spec, dev, "metis", time.perf_counter() - t0).check()


def _repair_memory(w: Workload, dev: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Move ops off over-full devices (largest first) to the device with most room."""
    dev = dev.copy()
    load = np.bincount(dev, weights=w.weight_bytes, minlength=len(cap))
    for d in np.flatnonzero(load > cap):
        ops = np.flatnonzero(dev == d)
        for v in ops[np.argsort(-w.weight_bytes[ops])]:
            if load[d] <= cap[d]:
                break
            e = int(np.argmax(cap - load))
            dev[v] = e
            load[d] -= w.weight_bytes[v]
            load[e] += w.weight_bytes[v]
    return dev


def heft(graph: OpGraph, spec: ClusterSpec) -> Plan:
    t0 = time.perf_counter()
    w = workload(graph)
    cap = weight_capacity(spec)
    check_fits(w, spec, cap)
    n_dev = len(spec.devices)
    times = w.times(spec)
    bw, lat = spec.bandwidth, spec.latency
    off = ~np.eye(n_dev, dtype=bool)
    inv_bw = float((1.0 / bw[off]).mean()) if n_dev > 1 else 0.0
    mean_lat = float(lat[off].mean()) if n_dev > 1 else 0.0
    mean_t = times.mean(axis=1)
    rank = np.zeros(w.n)
    for v in range(w.n - 1, -1, -1):
        best = 0.0
        for t in w.op_out[v]:
            c = mean_lat + w.t_bytes[t] * inv_bw
            for s in w.t_dst[t]:
                if c + rank[s] > best:
                    best = c + rank[s]
        rank[v] = mean_t[v] + best
    order = np.lexsort((np.arange(w.n), -rank))
    free = cap.copy()
    avail = np.zeros(n_dev)
    finish = np.zeros(w.n)
    dev = np.full(w.n, -1, dtype=np.int64)
    inv = 1.0 / bw
    for v in order.tolist():
        est = avail.copy()
        for t in w.op_in[v]:
            u = int(w.t_src[t])
            du, fu = int(dev[u]), finish[u]
            arr = fu + lat[du] + w.t_bytes[t] * inv[du]
            arr[du] = fu
            np.maximum(est, arr, out=est)
        eft = est + times[v]
        eft[free < w.weight_bytes[v]] = np.inf
        d = int(np.argmin(eft))
        if not np.isfinite(eft[d]):
            _fit_or_raise(w, spec, free, v, "heft")
        dev[v], finish[v], avail[d] = d, eft[d], eft[d]
        free[d] -= w.weight_bytes[v]
    return make_plan(graph, spec, dev, "heft", time.perf_counter() - t0).check()


BASELINES = {"round-robin": round_robin, "pipeline": pipeline, "metis": metis, "heft": heft}
