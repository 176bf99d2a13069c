"""The graph at one level of the multilevel hierarchy, and acyclic coarsening.

Level 0 is the op graph; each coarser level merges nodes of the level below.
Two merges are used, both proven not to create cycles:

- *edge merges* (heavy edges first): ``u -> v`` where ``u`` has no other
  successor or ``v`` has no other predecessor, so no second path ``u ~> v``
  exists. Pairs are disjoint, and merging one pair never changes the in- or
  out-degree that makes another pair safe, so a whole matching is safe.
- *twin merges*: nodes with the same predecessors and the same successors (the
  tiles of one split op, the heads of one attention) are grouped; twins have no
  path between them, and a merged group connects exactly like one member.

Merges stay inside one layer (the ``layers.N`` of the scope path) and under a
size cap, and twins are kept in at least ``min_parallel`` groups so that the
coarse graph still shows the parallelism a host can use.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .workload import Workload


@dataclass(frozen=True, eq=False)
class LevelGraph:
    """Nodes (groups of ops) with summed weights and times, and tensors as hyperedges."""

    weight: np.ndarray                      # [k] weight bytes
    time: np.ndarray                        # [k, D] seconds on each device
    layer: np.ndarray                       # [k]
    t_src: np.ndarray                       # [m] producing node
    t_dst: tuple[tuple[int, ...], ...]      # [m] distinct reading nodes, never the producer
    t_bytes: np.ndarray                     # [m]

    @property
    def k(self) -> int:
        return len(self.weight)

    @cached_property
    def outs(self) -> tuple[tuple[int, ...], ...]:
        o: list[list[int]] = [[] for _ in range(self.k)]
        for t, s in enumerate(self.t_src.tolist()):
            o[s].append(t)
        return tuple(tuple(x) for x in o)

    @cached_property
    def ins(self) -> tuple[tuple[int, ...], ...]:
        i: list[list[int]] = [[] for _ in range(self.k)]
        for t, ds in enumerate(self.t_dst):
            for d in ds:
                i[d].append(t)
        return tuple(tuple(x) for x in i)

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted({d for t in ts for d in self.t_dst[t]})) for ts in self.outs)

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        src = self.t_src.tolist()
        return tuple(tuple(sorted({src[t] for t in ts})) for ts in self.ins)

    @cached_property
    def order(self) -> tuple[int, ...]:
        """A topological order (Kahn's algorithm, smallest id first among the ready)."""
        indeg = [len(p) for p in self.preds]
        ready = [v for v in range(self.k) if indeg[v] == 0]
        out: list[int] = []
        import heapq

        heapq.heapify(ready)
        while ready:
            v = heapq.heappop(ready)
            out.append(v)
            for s in self.succs[v]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, s)
        if len(out) != self.k:
            raise AssertionError(f"coarsening made a cycle: {self.k - len(out)} nodes unordered")
        return tuple(out)

    @cached_property
    def depth(self) -> np.ndarray:
        d = np.zeros(self.k, dtype=np.int64)
        preds = self.preds
        for v in self.order:
            if preds[v]:
                d[v] = 1 + max(d[u] for u in preds[v])
        return d

    @classmethod
    def from_workload(cls, w: Workload, times: np.ndarray) -> LevelGraph:
        return cls(w.weight_bytes.astype(np.float64), times, w.layer, w.t_src, w.t_dst, w.t_bytes)

    def contract(self, node_of: np.ndarray) -> LevelGraph:
        """The coarser graph where fine node v becomes ``node_of[v]``."""
        k = int(node_of.max()) + 1 if len(node_of) else 0
        weight = np.bincount(node_of, weights=self.weight, minlength=k)
        time = np.zeros((k, self.time.shape[1]))
        np.add.at(time, node_of, self.time)
        layer = np.full(k, -1, dtype=np.int64)
        layer[node_of] = self.layer
        src, dst, nbytes = [], [], []
        nof = node_of.tolist()
        for t, (s, ds) in enumerate(zip(self.t_src.tolist(), self.t_dst)):
            cs = nof[s]
            cd = tuple(sorted({nof[d] for d in ds} - {cs}))
            if cd:
                src.append(cs)
                dst.append(cd)
                nbytes.append(self.t_bytes[t])
        return LevelGraph(weight, time, layer, np.array(src, dtype=np.int64), tuple(dst),
                          np.array(nbytes, dtype=np.float64))


def _twins(g: LevelGraph) -> dict[tuple[tuple[int, ...], tuple[int, ...], int], list[int]]:
    groups: dict[tuple[tuple[int, ...], tuple[int, ...], int], list[int]] = defaultdict(list)
    for v in range(g.k):
        groups[(g.preds[v], g.succs[v], int(g.layer[v]))].append(v)
    return {key: vs for key, vs in groups.items() if len(vs) > 1}


def coarsen_once(g: LevelGraph, max_weight: float, max_time: float, min_parallel: int) -> np.ndarray:
    """One level of coarsening: twin groups, then a heavy-edge matching. Returns node_of."""
    merged_into = list(range(g.k))
    used = [False] * g.k
    tmin = g.time.min(axis=1)
    has_twin = [False] * g.k
    # Twin merges: pair twins up, keeping at least min_parallel groups of each family.
    for vs in _twins(g).values():
        for v in vs:
            has_twin[v] = True
        groups = len(vs)
        vs = sorted(vs, key=lambda v: (tmin[v], v))   # lightest with lightest keeps groups even
        i = 0
        while i + 1 < len(vs) and groups > min_parallel:
            a, b = vs[i], vs[i + 1]
            if g.weight[a] + g.weight[b] <= max_weight and tmin[a] + tmin[b] <= max_time:
                merged_into[b] = a
                used[a] = used[b] = True
                groups -= 1
            i += 2
    # Edge merges, heaviest tensor first.
    order = np.argsort(-g.t_bytes, kind="stable")
    succs, preds = g.succs, g.preds
    for t in order.tolist():
        u = int(g.t_src[t])
        if used[u]:
            continue
        for v in g.t_dst[t]:
            if used[v] or g.layer[u] != g.layer[v]:
                continue
            only_succ = len(succs[u]) == 1
            only_pred = len(preds[v]) == 1
            if not ((only_succ and only_pred) or (only_succ and not has_twin[u])
                    or (only_pred and not has_twin[v])):
                continue
            if g.weight[u] + g.weight[v] > max_weight or tmin[u] + tmin[v] > max_time:
                continue
            merged_into[v] = u
            used[u] = used[v] = True
            break
    roots = np.array(merged_into, dtype=np.int64)
    _, node_of = np.unique(roots, return_inverse=True)
    return node_of.astype(np.int64)


def coarsen(g0: LevelGraph, max_weight: float, max_time: float, min_parallel: int,
            min_nodes: int = 64, min_shrink: float = 0.05,
            max_levels: int = 30) -> list[tuple[LevelGraph, np.ndarray]]:
    """Coarsen until the graph stops shrinking; returns [(graph, node_of into the next level)]."""
    levels: list[tuple[LevelGraph, np.ndarray]] = []
    g = g0
    while g.k > min_nodes and len(levels) < max_levels:
        node_of = coarsen_once(g, max_weight, max_time, min_parallel)
        k = int(node_of.max()) + 1
        if k > (1 - min_shrink) * g.k:
            break
        levels.append((g, node_of))
        g = g.contract(node_of)
    levels.append((g, np.arange(g.k)))
    return levels
