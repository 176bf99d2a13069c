"""A graph as arrays: what the placement algorithms read.

``Workload`` turns an ``OpGraph`` into numpy arrays indexed by op position (ops
are in topological order): weight bytes, flops, bytes moved, and the tensors
between ops as hyperedges (one producer, its distinct consumers). Building it is
linear in the graph; it is cached per graph.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..cost import streamed_bytes
from ..ir import OpGraph
from .cluster import MATMUL_KINDS, ClusterSpec, DeviceSpec

_LAYER = re.compile(r"\.(\d+)(?:\.|$)")


def layer_of(scope: str) -> int:
    """The layer number in an op's scope path (``model.layers.3.mlp`` -> 3), -1 outside layers."""
    m = _LAYER.search(scope)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True, eq=False)
class Workload:
    """Arrays describing a graph's ops and the tensors that flow between them."""

    graph: OpGraph
    names: tuple[str, ...]          # op names, topological order
    weight_bytes: np.ndarray        # [n] bytes of params first used by each op (shared params once),
                                    # plus the KV-cache room of its layer (``kv_reserve_bytes``)
    moved_bytes: np.ndarray         # [n] params + inputs + outputs: what a memory-bound op streams
                                    # (``cost.streamed_bytes``: a lookup reads its rows only)
    flops: np.ndarray               # [n]
    is_matmul: np.ndarray           # [n] bool: dense-math op class
    is_view: np.ndarray             # [n] bool: views and slices, which move no data
    layer: np.ndarray               # [n] layer index from the scope path, -1 outside layers
    t_bytes: np.ndarray             # [m] bytes of each op-to-op tensor
    t_src: np.ndarray               # [m] producing op
    t_names: tuple[str, ...]        # [m]
    t_dst: tuple[tuple[int, ...], ...]   # [m] distinct consuming ops
    op_in: tuple[tuple[int, ...], ...]   # [n] tensors (ids) each op reads
    op_out: tuple[tuple[int, ...], ...]  # [n] tensors (ids) each op produces and others read
    shared: tuple[tuple[int, tuple[int, ...]], ...]  # params read by several ops: (bytes, ops)
    out_bytes: np.ndarray           # [n] bytes of each op's outputs (graph outputs included)
    act_bytes: np.ndarray           # [n] inputs + outputs of each op (its working set less weights)

    @property
    def n(self) -> int:
        return len(self.names)

    @cached_property
    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}

    @cached_property
    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(tensor, consuming op) for every read of an op-to-op tensor, flattened."""
        t = np.repeat(np.arange(len(self.t_dst)), [len(d) for d in self.t_dst])
        c = np.fromiter((c for d in self.t_dst for c in d), dtype=np.int64, count=len(t))
        return t.astype(np.int64), c

    @cached_property
    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(producer, consumer) op pairs, one per dependency, sorted by consumer."""
        v = np.repeat(np.arange(self.n), [len(p) for p in self.preds])
        u = np.fromiter((u for p in self.preds for u in p), dtype=np.int64, count=len(v))
        return u, v.astype(np.int64)

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(dict.fromkeys(int(self.t_src[t]) for t in ins)) for ins in self.op_in)

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(dict.fromkeys(c for t in outs for c in self.t_dst[t])) for outs in self.op_out)

    @cached_property
    def depth(self) -> np.ndarray:
        """Longest path (in ops) from a source to each op."""
        d = np.zeros(self.n, dtype=np.int64)
        for v, ps in enumerate(self.preds):
            if ps:
                d[v] = 1 + max(d[u] for u in ps)
        return d

    def times(self, spec: ClusterSpec) -> np.ndarray:
        """``[n, D]`` roofline time of each op on each device, in seconds.

        Time = max(flops / the device's flops/s for the op's class, bytes streamed /
        memory bandwidth) + the device's per-op overhead, times the device's learned
        ``scale`` for the op's class. Views and slices only
        re-describe memory: they launch no kernel, but the runtime still calls each one
        (the device's ``view_overhead_s``, measured by its agent).
        """
        return np.stack([self.device_times(d) for d in spec.devices], axis=1)

    def device_times(self, d: DeviceSpec) -> np.ndarray:
        """``[n]`` time of each op on device ``d`` (cached per device description)."""
        mm, other = d.time_scale("matmul"), d.time_scale("other")
        key = (d.kind, d.flops_per_s["matmul"], d.flops_per_s["other"], d.mem_bytes_per_s, d.op_overhead_s,
               d.view_overhead_s, mm, other)
        col = self._times_cache.get(key)
        if col is None:
            fps = np.where(self.is_matmul, d.flops_per_s["matmul"], d.flops_per_s["other"])
            col = np.maximum(self.flops / fps, self.moved_bytes / d.mem_bytes_per_s) + d.op_overhead_s
            col[self.is_view] = d.view_overhead_s
            # NOTE: learned from observed runs, whose blocks' modelled times held their views as "other"
            col *= np.where(self.is_matmul, mm, other)
            col.flags.writeable = False
            self._times_cache[key] = col
        return col

    @cached_property
    def _times_cache(self) -> dict[tuple[str | float, ...], np.ndarray]:
        return {}

    @cached_property
    def in_pairs(self) -> list[list[tuple[int, float]]]:
        """Per op: (producing op, bytes) for each tensor it reads from another op."""
        src, nbytes = self.lists
        return [[(src[t], nbytes[t]) for t in ts] for ts in self.op_in]

    @cached_property
    def tiles_of(self) -> list[tuple[int, ...]]:
        """Per op: the ids of the shared weight tiles it reads (see ``shared``)."""
        out: list[list[int]] = [[] for _ in range(self.n)]
        for i, (_, users) in enumerate(self.shared):
            for u in users:
                out[u].append(i)
        return [tuple(x) for x in out]

    @cached_property
    def edges_by_producer(self) -> tuple[np.ndarray, np.ndarray]:
        """``edges`` sorted by producer."""
        u, v = self.edges
        order = np.argsort(u, kind="stable")
        return u[order], v[order]

    @cached_property
    def edge_lists(self) -> tuple[list[int], list[int]]:
        """``edges`` as Python lists, for tight loops."""
        return self.edges[0].tolist(), self.edges[1].tolist()

    @cached_property
    def shared_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Weights several ops read: (tile id per (tile, user) pair, user op, bytes per tile,
        first user per tile)."""
        tile = np.fromiter((i for i, (_, u) in enumerate(self.shared) for _ in u), dtype=np.int64)
        user = np.fromiter((x for _, u in self.shared for x in u), dtype=np.int64)
        nbytes = np.array([b for b, _ in self.shared], dtype=np.float64)
        first = np.array([u[0] for _, u in self.shared], dtype=np.int64)
        return tile, user, nbytes, first

    @cached_property
    def lists(self) -> tuple[list[int], list[float]]:
        """``t_src`` and ``t_bytes`` as Python lists, for tight loops."""
        return self.t_src.tolist(), self.t_bytes.tolist()


def workload(graph: OpGraph) -> Workload:
    """The arrays of ``graph``, built once per graph object and kept beside it."""
    # NOTE: OpGraph is frozen; derived views live in its __dict__ like its cached properties.
    w = graph.__dict__.get("_placement_workload")
    if w is None:
        w = graph.__dict__["_placement_workload"] = _build(graph)
    return w


def _build(graph: OpGraph) -> Workload:
    ops = graph.ops
    n = len(ops)
    index = {op.name: i for i, op in enumerate(ops)}
    tsize = {name: spec.nbytes for name, spec in graph.tensors.items()}
    psize = {name: p.nbytes for name, p in graph.params.items()}
    weight = np.zeros(n, dtype=np.int64)
    moved = np.zeros(n, dtype=np.float64)
    flops = np.fromiter((op.flops for op in ops), dtype=np.float64, count=n)
    is_mm = np.fromiter((op.kind in MATMUL_KINDS for op in ops), dtype=bool, count=n)
    layer = np.full(n, -1, dtype=np.int64)
    seen_params: set[str] = set()
    # NOTE: room kept for generation's KV cache, charged to the first attention op of each layer
    reserve = int(graph.meta.get("kv_reserve_bytes", 0) or 0)
    reserved: set[int] = set()
    users: dict[str, list[int]] = {}
    outb = np.zeros(n, dtype=np.float64)
    pall = np.zeros(n, dtype=np.float64)
    producer: dict[str, int] = {}
    t_ids: dict[str, int] = {}
    t_src: list[int] = []
    t_names: list[str] = []
    t_dst: list[list[int]] = []
    op_in: list[tuple[int, ...]] = []
    op_out: list[list[int]] = [[] for _ in range(n)]
    for i, op in enumerate(ops):
        ps = dict.fromkeys(op.params)
        weight[i] = sum(psize[p] for p in ps if p not in seen_params)
        seen_params.update(ps)
        for p in ps:
            users.setdefault(p, []).append(i)
        outb[i] = sum(tsize[t] for t in op.outputs)
        pall[i] = sum(psize[p] for p in ps)
        ins = dict.fromkeys(op.inputs)
        moved[i] = streamed_bytes(op.target, pall[i], sum(tsize[t] for t in ins), outb[i])
        layer[i] = layer_of(op.scope or op.name)
        if reserve and op.kind in ("attention", "kv_attention") and int(layer[i]) not in reserved:
            reserved.add(int(layer[i]))
            weight[i] += reserve
        reads = []
        for t in ins:
            src = producer.get(t)
            if src is None:          # a graph input: available everywhere at the start
                continue
            tid = t_ids.get(t)
            if tid is None:
                tid = t_ids[t] = len(t_src)
                t_src.append(src)
                t_names.append(t)
                t_dst.append([])
                op_out[src].append(tid)
            t_dst[tid].append(i)
            reads.append(tid)
        op_in.append(tuple(reads))
        for t in op.outputs:
            producer[t] = i
    del index
    return Workload(
        graph=graph, names=tuple(op.name for op in ops), weight_bytes=weight, moved_bytes=moved,
        flops=flops, is_matmul=is_mm, layer=layer,
        is_view=np.fromiter((op.kind in ("view", "slice") for op in ops), dtype=bool, count=n),
        t_bytes=np.array([tsize[t] for t in t_names], dtype=np.float64),
        t_src=np.array(t_src, dtype=np.int64), t_names=tuple(t_names),
        t_dst=tuple(tuple(d) for d in t_dst), op_in=tuple(op_in), op_out=tuple(tuple(o) for o in op_out),
        shared=tuple((psize[p], tuple(u)) for p, u in users.items() if len(u) > 1),
        out_bytes=outb, act_bytes=moved - pall)
