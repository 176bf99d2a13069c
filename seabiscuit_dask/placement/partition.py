"""``place``: topology-aware multilevel partitioning of a graph over a cluster.

The cluster is a tree: hosts joined by slow links, devices in a host joined by
fast ones. The partitioner follows it in two tiers.

1. ``coarsen`` (see ``levels``): merge ops along heavy edges and group twin ops,
   without cycles, layer by layer, until the graph stops shrinking.
2. ``initial_hosts``: on the coarsest graph, cut the topological order into one
   contiguous stage per host, sized by the host's speed, each cut where the fewest
   bytes cross and never past the host's memory.
3. ``refine_hosts`` at every level while uncoarsening: FM-style boundary moves of
   single nodes to the neighbouring stage, taken when they lower the time spent
   on slow links (a tensor counts once per receiving host: hypergraph lambda-1)
   and keep stages in order and within memory.
4. ``assign_devices`` on the op graph: list scheduling by upward rank, each op on
   the device of its host with the earliest estimated finish, memory permitting.
   Fast links inside a host carry the parallel work (tiles, heads).
5. The same list scheduling over the whole cluster, ignoring stages, is the
   fallback (small graphs can gain from spreading one layer over hosts; large ones
   never do on real links).
6. ``fewest_devices``: contiguous stages on the k fastest devices that hold the
   weights, for the smallest few k; a model that fits one device is one block.

Every cut is priced with what Dask charges for it (``ClusterSpec.cut_latency``: a
hop and the scheduler's time for the task on the far side, besides the link), and
``simulate``, which models Dask's costs one by one, picks among the candidates, each
with its blocks cut where outputs leave a device or fused to one block per device
and phase: more parallelism is taken only where it pays for its hops.

The result is a ``Plan`` whose blocks form an acyclic graph.
"""

from __future__ import annotations

import heapq
import time as _time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import ClusterTooSmall, InvalidGraph
from ..ir import OpGraph
from ..pauses import no_gc
from .capacity import check_fits, weight_capacity
from .cluster import ClusterSpec
from .levels import LevelGraph, coarsen
from .plan import Plan, make_plan
from .workload import Workload, workload


def place(graph: OpGraph, spec: ClusterSpec, *, refine_passes: int = 4) -> Plan:
    """Place every op of ``graph`` on a device of ``spec``.

    Parameters
    ----------
    graph : OpGraph
        Usually the output of ``decompose``.
    spec : ClusterSpec
        The devices and links.
    refine_passes : int
        Boundary-move passes per level while uncoarsening.

    Returns
    -------
    Plan
        Memory-feasible, with acyclic blocks. Raises ``ClusterTooSmall`` if the
        model cannot fit.

    Examples
    --------
    >>> plan = sb.place(sb.decompose(g, "16MiB"), sb.ClusterSpec.synthetic())   # doctest: +SKIP
    >>> print(plan.table())                                                      # doctest: +SKIP
    """
    t0 = _time.perf_counter()
    if not graph.ops:
        raise InvalidGraph("the graph has no ops to place")
    with no_gc():
        return _place_all(graph, spec, refine_passes, t0)


def _place_all(graph: OpGraph, spec: ClusterSpec, refine_passes: int, t0: float) -> Plan:
    w = workload(graph)
    cap = weight_capacity(spec)
    check_fits(w, spec, cap)
    mem = np.array([d.memory_bytes for d in spec.devices], dtype=np.float64)
    best = plan = _place(graph, spec, w, cap, refine_passes)
    # NOTE: long inputs can need more activation memory than the reserve: a device over its
    # memory gets that much less room for weights, and the cluster is placed again.
    for _ in range(4):
        over = np.maximum(plan.peak_bytes - mem, 0)
        if not over.any() or float(w.weight_bytes.sum()) > (cap - over).sum():
            break
        cap = np.maximum(cap - 1.1 * over, 0)
        try:
            plan = _place(graph, spec, w, cap, refine_passes)
        except ClusterTooSmall:
            break
        best = min((best, plan), key=lambda p: float(np.maximum(p.peak_bytes - mem, 0).sum()))
    return make_plan(graph, spec, best.device_of, "multilevel", _time.perf_counter() - t0,
                     **best.info).check()


def place_stages(graph: OpGraph, spec: ClusterSpec) -> Plan:
    """Contiguous stages on the fewest devices that hold ``graph`` (``fewest_devices``), the
    fastest by simulation: for a step run over and over whose latency is mostly Dask's cost per
    task (a decode step moves kilobytes and computes milliseconds), fewest tasks first.

    Raises ``ClusterTooSmall`` as ``place`` does.
    """
    t0 = _time.perf_counter()
    w = workload(graph)
    cap = weight_capacity(spec)
    check_fits(w, spec, cap)
    cands = {f"stages{k}": dev for k, dev in fewest_devices(w, spec, cap).items()}
    if not cands:
        return place(graph, spec)
    best = choose(graph, spec, {k: _settle(w, dev) for k, dev in cands.items()})
    return make_plan(graph, spec, best.device_of, "stages", _time.perf_counter() - t0, **best.info).check()


def _settle(w: Workload, dev: np.ndarray) -> np.ndarray:
    """Ops that hold no weights and read from one device only run on that device (a join of
    tiles stays where its tiles are, instead of costing a task of its own)."""
    out = dev.copy()
    ops = w.graph.ops
    for i, preds in enumerate(w.preds):
        if preds and not ops[i].params and not w.weight_bytes[i]:
            where = {int(out[u]) for u in preds}
            if len(where) == 1:
                out[i] = where.pop()
    return out


SPREAD_MIN_S = (1e-3, 10e-3)   # NOTE: the shortest branches worth spreading, tried by simulation
FLAT_MAX_OPS = 20_000   # NOTE: past this, a layer is wide enough to keep a host busy alone
SLOW_CUT_WINDOW = 0.25   # NOTE: how far (share of the ops) a stage boundary between hosts looks


def _place(graph: OpGraph, spec: ClusterSpec, w: Workload, cap: np.ndarray, refine_passes: int) -> Plan:
    """One multilevel placement with ``cap`` bytes of weights per device."""
    times = w.times(spec)
    g0 = LevelGraph.from_workload(w, times)
    width = max(len(grp) for grp in spec.groups)
    n_layers = max(1, len(set(w.layer.tolist())))
    levels = coarsen(g0, max_weight=min(cap.min(), w.weight_bytes.sum() / max(n_layers, len(cap))),
                     max_time=times.min(axis=1).sum() / max(n_layers, len(cap)), min_parallel=width)
    host_cap = np.array([cap[list(grp)].sum() for grp in spec.groups])
    host = initial_hosts(levels[-1][0], spec, host_cap)
    for g, node_of in reversed(levels[:-1]):
        host = refine_hosts(g, spec, host_cap, host[node_of], passes=refine_passes)
    shared = shared_params(w)
    cands = {"hosts": assign_devices(g0, spec, cap, host, shared=shared)}
    if g0.k <= FLAT_MAX_OPS:
        # A small graph may gain more from parallel work across hosts than it pays in slow
        # links: schedule it on the whole cluster too, and keep the faster by simulation.
        cands["flat"] = _list_schedule(g0, spec, cap, [list(range(len(cap)))] * g0.k, shared=shared)
    for k, dev in fewest_devices(w, spec, cap).items():
        cands[f"stages{k}"] = dev
        if width > 1:
            # NOTE: the stages with each layer's parallel branches spread over their host (how
            # long a branch must be to pay for its hops is left to the simulator)
            for min_s in SPREAD_MIN_S:
                cands[f"stages{k}+spread{min_s * 1e3:g}ms"] = _settle(
                    w, spread_branches(w, spec, cap, _settle(w, dev), times, min_s))
    return choose(graph, spec, cands, levels=[g.k for g, _ in levels])


def branches(w: Workload, join: int, succs: Sequence[Sequence[int]]) -> list[list[int]]:
    """The parallel branches that meet at op ``join``: for each of its inputs' producers, the ops
    that feed only that one (walking back while every consumer of an op is in the branch). An
    MLP cut into column tiles meets at the sum of its partial products, one branch per tile:
    its slice of the first linear, the activation on it, its part of the second linear.
    Empty unless every producer feeds ``join`` alone (else one branch would wait for another:
    a residual add's two inputs are a layer and what the layer read)."""
    out: list[list[int]] = []
    for p in w.preds[join]:
        if any(c != join for c in succs[p]):
            return []
        out.append(sorted(_feeding_only(w, succs, p)))
    return out


def _feeding_only(w: Workload, succs: Sequence[Sequence[int]], op: int) -> set[int]:
    """``op`` and the ops that feed it alone (walking back while every consumer of an op is in)."""
    seen, todo = {op}, [op]
    while todo:
        v = todo.pop()
        for u in w.preds[v]:
            if u not in seen and all(c in seen for c in succs[u]):
                seen.add(u)
                todo.append(u)
    return seen


def output_branches(w: Workload, succs: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """The parallel branches that end in graph outputs, grouped by the tensors they start from:
    an output delivered as tiles (a large vocabulary's logits, the column tiles of one linear)
    is one group, a branch per tile, and no op joins them. A branch is a sink and the ops that
    feed only it (as in ``branches``)."""
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for s in range(w.n):
        if succs[s]:
            continue
        seen = _feeding_only(w, succs, s)
        start = tuple(sorted({u for v in seen for u in w.preds[v] if u not in seen}))
        if start:
            groups.setdefault(start, []).append(sorted(seen))
    return [parts for parts in groups.values() if len(parts) >= 2]


def spread_branches(w: Workload, spec: ClusterSpec, cap: np.ndarray, dev: np.ndarray, times: np.ndarray,
                    min_s: float) -> np.ndarray:
    """``dev`` with the parallel branches of each join (``branches``) spread over the devices of
    the join's host, the longest first onto the least loaded with room for its weights (``cap``),
    where each branch takes at least ``min_s`` and none reads a weight another op shares (a tied
    embedding stays whole). Joins left whole for want of room are tried again while others move
    (a full stage takes half of the next stage's layers once it gave half of its own away).
    This is intra-layer parallelism: two halves of an MLP at once on two devices, one sum after.
    The tiles of an output (``output_branches``) spread the same way; there a branch that
    shares a weight stays where it is and counts in its device's load (the lm head tiles that
    read a tied embedding's tiles stay beside it, and the others balance them)."""
    dev = np.array(dev, copy=True)
    succs = w.succs
    shared = {u for _, users in w.shared for u in users}
    fastest = times.min(axis=1)
    held = np.bincount(dev, weights=w.weight_bytes, minlength=len(cap))
    # (anchor op: its device is the host's and wins ties, branches to spread, branches that stay)
    joins: list[tuple[int, list[list[int]], list[list[int]]]] = []
    taken: set[int] = set()
    for j in reversed(range(w.n)):
        if len(w.preds[j]) < 2 or j in taken:
            continue
        parts = branches(w, j, succs)
        if len(parts) < 2 or any(shared.intersection(b) for b in parts) \
                or len({v for b in parts for v in b}) != sum(map(len, parts)) \
                or min(float(fastest[b].sum()) for b in parts) < min_s:
            continue
        joins.append((j, parts, []))
        taken.update(v for b in parts for v in b)
    outputs = []
    for parts in output_branches(w, succs):
        if any(taken.intersection(b) for b in parts):
            continue
        stay = [b for b in parts if shared.intersection(b)]
        free = [b for b in parts if b not in stay]
        if len(free) >= 2 and min(float(fastest[b].sum()) for b in free) >= min_s:
            outputs.append((parts[0][-1], free, stay))
    # NOTE: the layers' joins first, the output tiles after, in the room they leave: an output
    # runs once, a layer's join once per layer
    host_of = {d: i for i, grp in enumerate(spec.groups) for d in grp}
    for group in (joins, outputs):
        _spread(w, spec, cap, dev, times, fastest, host_of, held, group)
    return dev


def _spread(w: Workload, spec: ClusterSpec, cap: np.ndarray, dev: np.ndarray, times: np.ndarray,
            fastest: np.ndarray, host_of: dict[int, int], held: np.ndarray,
            joins: list[tuple[int, list[list[int]], list[list[int]]]]) -> None:
    """``spread_branches``' moves, made in ``dev`` and ``held``."""
    while joins:
        left = []
        for j, parts, stay in joins:
            devices = list(spec.groups[host_of[int(dev[j])]])
            load = dict.fromkeys(devices, 0.0)
            for b in stay:
                at = int(dev[b[0]])
                if at in load:
                    load[at] += float(times[b, at].sum())
            for b in sorted(parts, key=lambda b: -float(fastest[b].sum())):
                need = float(w.weight_bytes[b].sum())
                src = int(dev[b[0]])
                room = [d for d in devices if d == src or held[d] + need <= cap[d] + 0.5]
                d = min(room, key=lambda d: (load[d] + float(times[b, d].sum()), d != int(dev[j]), d))
                load[d] += float(times[b, d].sum())
                np.subtract.at(held, dev[b], w.weight_bytes[b])
                held[d] += need
                dev[b] = d
            if len({int(dev[b[0]]) for b in parts + stay}) == 1:
                left.append((j, parts, stay))
        if len(left) == len(joins):
            break
        joins = left


def _join_shared(w: Workload, dev: np.ndarray) -> np.ndarray:
    """Every op reading a weight tile that an op of another stage reads too goes to the stage of
    the tile's first user (a tied embedding's lm_head joins the embedding): no tile held twice."""
    dev = dev.copy()
    for _, users in w.shared:
        dev[list(users)] = dev[users[0]]
    return dev


def choose(graph: OpGraph, spec: ClusterSpec, cands: dict[str, np.ndarray], **info: Any) -> Plan:
    """The candidate placement (each with blocks cut at senders, and fused) that the
    simulator finds fastest. A feasible plan beats an infeasible one; within 0.1%, the
    earlier candidate and then the fused blocks win (fewer tasks for the same time).
    Its ``info`` holds ``info``, ``tier``, ``fused`` and every candidate's latency."""
    best: Plan | None = None
    best_key: tuple[bool, float] | None = None
    # NOTE: past FLAT_MAX_OPS blocks are large and many: a cut at every send never pays there
    variants = (True,) if len(graph.ops) > FLAT_MAX_OPS else (True, False)
    tried: dict[str, float] = {}
    for i, (tier, dev) in enumerate(cands.items()):
        for fused in variants:
            plan = make_plan(graph, spec, dev, "multilevel", tier=tier, fused=fused, candidates=tried, **info)
            key = (not plan.feasible, plan.makespan_s * (1 + 1e-3 * (2 * i + (not fused))))
            tried[f"{tier}{'' if fused else '-cut'}"] = plan.makespan_s if plan.feasible else float("inf")
            if best_key is None or key < best_key:
                best, best_key = plan, key
    assert best is not None
    return best


def fewest_devices(w: Workload, spec: ClusterSpec, cap: np.ndarray, tries: int = 3) -> dict[int, np.ndarray]:
    """Placements on few devices: for the smallest ``tries`` counts k that can hold the
    weights, contiguous stages of the topological order on the k fastest devices (kept
    host by host), each stage's work by its device's speed, never past its memory."""
    times_sum = np.array([w.device_times(d).sum() for d in spec.devices])
    fastest = np.min([w.device_times(d) for d in spec.devices], axis=0)
    for _, users in w.shared:       # NOTE: ops that join a shared tile's first user count there
        fastest[users[0]] += fastest[list(users[1:])].sum()
        fastest[list(users[1:])] = 0.0
    host_rank = {d: i for i, grp in enumerate(spec.groups) for d in grp}
    by_speed = sorted(range(len(cap)), key=lambda d: (times_sum[d], host_rank[d], d))
    total = float(w.weight_bytes.sum())
    last = np.fromiter((max(d) for d in w.t_dst), dtype=np.int64, count=len(w.t_dst))
    mem = np.array([d.memory_bytes for d in spec.devices], dtype=np.float64)
    out: dict[int, np.ndarray] = {}
    for k in range(1, len(cap) + 1):
        chosen = sorted(by_speed[:k], key=lambda d: (host_rank[d], d))
        if cap[chosen].sum() < total:
            continue
        speed = 1.0 / np.maximum(times_sum[chosen], 1e-30)
        order = np.array(chosen, dtype=np.int64)
        # NOTE: a boundary between hosts looks farther for a cheap cut: it is the slow link
        windows = [SLOW_CUT_WINDOW if spec.devices[a].where != spec.devices[b].where else 0.05
                   for a, b in zip(chosen, chosen[1:])]
        room = cap.copy()
        for _ in range(4):      # NOTE: a stage whose activations overflow gets less weight room
            stage = contiguous_split(w.weight_bytes.astype(np.float64), w.t_src, last, w.t_bytes,
                                     speed / speed.sum(), room[order], window=windows, load=fastest)
            dev = _join_shared(w, order[stage])
            if not (np.bincount(dev, weights=w.weight_bytes, minlength=len(cap)) <= room + 0.5).all():
                break
            over = np.maximum(make_plan(w.graph, spec, dev, "stages", fused=True).peak_bytes - mem, 0)
            if not over.any():
                out[k] = dev
                break
            room = np.maximum(room - 1.1 * over, 0)
            if room[order].sum() < total:
                break
        if len(out) >= tries:
            break
    return out


def contiguous_split(weight: np.ndarray, src_pos: np.ndarray, last_pos: np.ndarray, nbytes: np.ndarray,
                     share: np.ndarray, cap: np.ndarray, window: float | Sequence[float] = 0.05,
                     load: np.ndarray | None = None) -> np.ndarray:
    """Cut a topological order into ``len(share)`` contiguous stages.

    ``weight`` is in order; a tensor made at position ``src_pos`` and last read at
    ``last_pos`` crosses every boundary in between. Stage k aims at ``share[k]`` of
    the weight (of ``load`` if given); each boundary moves within ``window`` of the
    ops (one figure, or one per boundary: a wider one where a slow link is cut) to where
    the fewest bytes cross, never past ``cap[k]`` of weight. Returns the stage of each
    position.
    """
    n, k = len(weight), len(share)
    diff = np.zeros(n + 2)
    np.add.at(diff, src_pos + 1, nbytes)
    np.add.at(diff, last_pos + 1, -nbytes)
    cut = np.cumsum(diff)[: n + 1]
    cum = np.concatenate([[0.0], np.cumsum(weight)])
    lcum = cum if load is None else np.concatenate([[0.0], np.cumsum(load)])
    total = cum[-1]
    windows = [float(window)] * (k - 1) if isinstance(window, (int, float)) else [float(x) for x in window]
    bounds = [0]
    for s in range(k - 1):
        span = max(1, int(windows[s] * n))
        lo = bounds[-1]
        target = int(np.searchsorted(lcum, lcum[-1] * share[: s + 1].sum()))
        hi = int(np.searchsorted(cum, cum[lo] + cap[s], side="right")) - 1
        need_rest = int(np.searchsorted(cum, total - cap[s + 1:].sum(), side="left"))
        a, b = max(lo, target - span, need_rest), min(n, target + span, hi)
        if a > b:
            a = b = max(lo, min(hi, n))
        seg = cut[a: b + 1]
        ties = np.flatnonzero(seg <= seg.min() * (1 + 1e-6))      # NOTE: of the cheapest cuts, the nearest
        bounds.append(a + int(ties[np.argmin(np.abs(a + ties - target))]))
    bounds.append(n)
    stage = np.empty(n, dtype=np.int64)
    for s in range(k):
        stage[bounds[s]: bounds[s + 1]] = s
    return stage


def initial_hosts(g: LevelGraph, spec: ClusterSpec, host_cap: np.ndarray) -> np.ndarray:
    """Stage (index into ``spec.groups``) of each node: contiguous in topological order."""
    order = np.array(g.order, dtype=np.int64)
    pos = np.empty(g.k, dtype=np.int64)
    pos[order] = np.arange(g.k)
    speed = g.time.min(axis=1).sum() / np.maximum(g.time.sum(axis=0), 1e-30)   # [D] vs the fastest
    host_speed = np.array([speed[list(grp)].sum() for grp in spec.groups])
    last = np.fromiter((max(pos[d] for d in ds) for ds in g.t_dst), dtype=np.int64, count=len(g.t_dst))
    stage_of_pos = contiguous_split(g.weight[order], pos[g.t_src], last, g.t_bytes,
                                    host_speed / host_speed.sum(), host_cap)
    stage = np.empty(g.k, dtype=np.int64)
    stage[order] = stage_of_pos
    return stage


def host_links(spec: ClusterSpec) -> tuple[list[list[float]], list[list[float]]]:
    """Cost of a cut and seconds per byte between host groups (their first devices' link)."""
    first = [grp[0] for grp in spec.groups]
    lat = [[float(spec.cut_latency[a, b]) if a != b else 0.0 for b in first] for a in first]
    inv = [[float(1.0 / spec.bandwidth[a, b]) if a != b else 0.0 for b in first] for a in first]
    return lat, inv


def refine_hosts(g: LevelGraph, spec: ClusterSpec, host_cap: np.ndarray, host: np.ndarray,
                 passes: int = 4) -> np.ndarray:
    """FM-style boundary moves between neighbouring stages that cut slow-link time.

    A node moves from stage k to k-1 only if all its predecessors are in stages
    <= k-1 (to k+1: successors >= k+1), so stages stay in pipeline order and the
    host-level quotient graph stays acyclic. Memory per host is a hard limit.
    """
    n_hosts = len(host_cap)
    if n_hosts < 2:
        return host
    lat, inv = host_links(spec)
    h = host.tolist()
    src, nbytes = g.t_src.tolist(), g.t_bytes.tolist()
    free = (host_cap - np.bincount(host, weights=g.weight, minlength=n_hosts)).tolist()
    weight = g.weight.tolist()
    cnt: list[dict[int, int]] = []
    for ds in g.t_dst:
        c: dict[int, int] = {}
        for d in ds:
            c[h[d]] = c.get(h[d], 0) + 1
        cnt.append(c)

    def comm(t: int, sender: int, receivers: Iterable[int]) -> float:
        return sum(lat[sender][r] + nbytes[t] * inv[sender][r] for r in receivers if r != sender)

    def gain(v: int, b: int) -> float:
        a, out = h[v], 0.0
        for t in g.outs[v]:
            out += comm(t, a, cnt[t]) - comm(t, b, cnt[t])
        for t in g.ins[v]:
            x, c = h[src[t]], cnt[t]
            if c[a] == 1 and a != x:
                out += lat[x][a] + nbytes[t] * inv[x][a]
            if b not in c and b != x:
                out -= lat[x][b] + nbytes[t] * inv[x][b]
        return out

    preds, succs = g.preds, g.succs
    for _ in range(passes):
        moved = 0
        for v in g.order:
            a = h[v]
            best, best_b = 1e-12, -1
            for b in (a - 1, a + 1):
                if not 0 <= b < n_hosts or free[b] < weight[v]:
                    continue
                if b < a and any(h[u] > b for u in preds[v]):
                    continue
                if b > a and any(h[u] < b for u in succs[v]):
                    continue
                gn = gain(v, b)
                if gn > best:
                    best, best_b = gn, b
            if best_b < 0:
                continue
            for t in g.ins[v]:
                c = cnt[t]
                c[a] -= 1
                if not c[a]:
                    del c[a]
                c[best_b] = c.get(best_b, 0) + 1
            h[v] = best_b
            free[a] += weight[v]
            free[best_b] -= weight[v]
            moved += 1
        if not moved:
            break
    return np.array(h, dtype=np.int64)


Shared = list[list[tuple[int, int, int]]]
"""Per op: the weight tiles it shares with other ops, as (tile id, bytes, first user)."""


def shared_params(w: Workload) -> Shared:
    """The weight tiles several ops read, listed under each of those ops."""
    out: Shared = [[] for _ in range(w.n)]
    for pid, (nbytes, users) in enumerate(w.shared):
        for u in users:
            out[u].append((pid, int(nbytes), min(users)))
    return out


def assign_devices(g: LevelGraph, spec: ClusterSpec, cap: np.ndarray, host: np.ndarray,
                   slack: float = 0.05, shared: Shared | None = None) -> np.ndarray:
    """Device of each node: list scheduling inside the node's host.

    Each device first takes at most its share (by speed) of its host's work, plus
    ``slack``: a chain of layers then spreads evenly over a host's devices, which
    costs a single request nothing and lets a stream of requests pipeline.
    """
    groups = [list(grp) for grp in spec.groups]
    share = np.zeros(len(cap))
    for s, grp in enumerate(groups):
        mine = host == s
        work = g.time[mine][:, grp].sum(axis=0)                 # the host's work, in each device's time
        speed = 1.0 / np.maximum(g.time[:, grp].sum(axis=0), 1e-30)
        share[grp] = speed / speed.sum() * (1 + slack) * np.maximum(work, 1e-30)
    return _list_schedule(g, spec, cap, [groups[s] for s in host.tolist()], share, shared)


def upward_rank(g: LevelGraph, comm_s_per_byte: float, comm_latency_s: float) -> np.ndarray:
    """Longest time from each node to a sink (fastest device, average link), HEFT's priority."""
    tmin = g.time.min(axis=1).tolist()
    rank = [0.0] * g.k
    outs, dst, nbytes = g.outs, g.t_dst, g.t_bytes.tolist()
    for v in reversed(g.order):
        best = 0.0
        for t in outs[v]:
            c = comm_latency_s + nbytes[t] * comm_s_per_byte
            for s in dst[t]:
                if c + rank[s] > best:
                    best = c + rank[s]
        rank[v] = tmin[v] + best
    return np.array(rank)


def _list_schedule(g: LevelGraph, spec: ClusterSpec, cap: np.ndarray, allowed: list[list[int]],
                   busy_limit_s: np.ndarray | None = None,
                   shared: Shared | None = None) -> np.ndarray:
    """Earliest-finish-time list scheduling by upward rank.

    Node v may go to a device of ``allowed[v]`` with memory for it and busy time
    under ``busy_limit_s``, else one of ``allowed[v]`` with memory, else anywhere
    with memory. A tensor is sent once to each device that reads it. A weight tile
    several ops read (``shared``, per node) costs memory once per device holding it.
    """
    return _ListSchedule(g, spec, cap, allowed, busy_limit_s, shared).run()


class _ListSchedule:
    """The state of one ``_list_schedule``: each device's free memory, busy time and next free
    moment, each node's device and finish, the tensors sent, and the shared tiles' holders."""

    def __init__(self, g: LevelGraph, spec: ClusterSpec, cap: np.ndarray, allowed: list[list[int]],
                 busy_limit_s: np.ndarray | None, shared: Shared | None) -> None:
        n_dev = len(cap)
        self.g, self.allowed = g, allowed
        self.lat, self.inv_bw = spec.cut_latency.tolist(), (1.0 / spec.bandwidth).tolist()
        inner = [(a, b) for grp in spec.groups for a in grp for b in grp if a != b]
        per_byte = float(np.mean([self.inv_bw[a][b] for a, b in inner])) if inner else 0.0
        latency = float(np.mean([self.lat[a][b] for a, b in inner])) if inner else 0.0
        self.rank = upward_rank(g, per_byte, latency).tolist()
        self.free, self.busy, self.avail = cap.tolist(), [0.0] * n_dev, [0.0] * n_dev
        self.limit = busy_limit_s.tolist() if busy_limit_s is not None else [float("inf")] * n_dev
        self.finish, self.dev = [0.0] * g.k, [-1] * g.k
        self.src, self.nbytes, self.times = g.t_src.tolist(), g.t_bytes.tolist(), g.time.tolist()
        self.weight = g.weight.tolist()
        self.tiles = shared if shared is not None and len(shared) == g.k else [[] for _ in range(g.k)]
        for v, ts in enumerate(self.tiles):       # NOTE: a first user's weight counted its shared tiles
            self.weight[v] -= sum(b for _, b, first in ts if first == v)
        self.holders: dict[int, set[int]] = {}    # shared tile -> devices holding it
        # NOTE: bytes of weights still to place, each shared tile once
        tiles = {pid: b for ts in self.tiles for pid, b, _ in ts}
        self.left = float(sum(self.weight)) + float(sum(tiles.values()))
        self.arrived: dict[tuple[int, int], float] = {}

    def run(self) -> np.ndarray:
        """Each node's device: nodes in order of upward rank as they become ready, each on the
        device among its candidates where it finishes first."""
        g, rank = self.g, self.rank
        indeg = [len(p) for p in g.preds]
        ready = [(-rank[v], v) for v in range(g.k) if indeg[v] == 0]
        heapq.heapify(ready)
        while ready:
            _, v = heapq.heappop(ready)
            best, d = self.earliest(v, self.candidates(v))
            self.assign(v, d, best)
            for s in g.succs[v]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, (-rank[s], s))
        return np.array(self.dev, dtype=np.int64)

    def new_tiles(self, v: int, d: int) -> tuple[float, float]:
        """Bytes of ``v``'s shared tiles ``d`` lacks: (held nowhere yet, copies of held ones)."""
        first = copy = 0.0
        for pid, b, _ in self.tiles[v]:
            where = self.holders.get(pid)
            if not where:
                first += b
            elif d not in where:
                copy += b
        return first, copy

    def room(self, v: int, d: int) -> bool:
        free, weight = self.free, self.weight
        if not self.tiles[v]:
            return free[d] >= weight[v]
        first, copy = self.new_tiles(v, d)
        n = weight[v] + first + copy
        # NOTE: a second copy of a tile only while the weights still to place keep fitting
        return free[d] >= n and (copy == 0 or sum(free) - n >= 1.05 * (self.left - weight[v] - first))

    def candidates(self, v: int) -> list[int]:
        """The devices ``v`` may go to, the first of these that has any: where its shared tiles are
        (when memory is tight), its allowed ones with room and busy time left, its allowed ones with
        room, any with room, any that holds its bytes."""
        allowed, busy, times, limit = self.allowed[v], self.busy, self.times[v], self.limit
        everywhere = range(len(self.free))
        cands = []
        if self.tiles[v] and sum(self.free) < 1.5 * self.left:    # NOTE: memory is tight: where the tiles are
            cands = [d for d in allowed if self.new_tiles(v, d)[1] == 0 and self.room(v, d)]
        if not cands:
            cands = [d for d in allowed if self.room(v, d) and busy[d] + times[d] <= limit[d]]
        if not cands:
            cands = [d for d in allowed if self.room(v, d)]
        if not cands:
            cands = [d for d in everywhere if self.room(v, d)]
        if not cands:
            cands = [d for d in everywhere if self.free[d] >= self.weight[v] + sum(self.new_tiles(v, d))]
        return cands

    def earliest(self, v: int, cands: list[int]) -> tuple[float, int]:
        """(finish, device): the candidate where ``v`` finishes first, once its inputs are there
        (ties: the one with more memory free); ``ClusterTooSmall`` when there is none."""
        src, dev, finish, arrived, free = self.src, self.dev, self.finish, self.arrived, self.free
        lat, inv_bw, nbytes, times = self.lat, self.inv_bw, self.nbytes, self.times[v]
        best, best_d = float("inf"), -1
        for d in cands:
            est = self.avail[d]
            for t in self.g.ins[v]:
                s = src[t]
                x = dev[s]
                if x == d:
                    arr = finish[s]
                else:
                    arr = arrived.get((t, d), -1.0)
                    if arr < 0:
                        arr = finish[s] + lat[x][d] + nbytes[t] * inv_bw[x][d]
                if arr > est:
                    est = arr
            eft = est + times[d]
            if eft < best - 1e-12 or (abs(eft - best) <= 1e-12 and free[d] > free[best_d]):
                best, best_d = eft, d
        if best_d < 0:
            raise ClusterTooSmall(
                f"no device has room left for {int(self.weight[v])} bytes of weights (node {v} of "
                f"{self.g.k}); "
                f"most free: {int(max(free))} bytes. The weights fit in total but not in pieces: "
                "add memory or decompose with a smaller budget")
        return best, best_d

    def assign(self, v: int, d: int, finish_s: float) -> None:
        """Run ``v`` on ``d``, finishing at ``finish_s``: its inputs are sent there, its weights and
        the shared tiles ``d`` lacked take its memory."""
        src, dev, finish = self.src, self.dev, self.finish
        for t in self.g.ins[v]:
            x = dev[src[t]]
            if x != d and (t, d) not in self.arrived:
                self.arrived[(t, d)] = finish[src[t]] + self.lat[x][d] + self.nbytes[t] * self.inv_bw[x][d]
        dev[v], self.finish[v], self.avail[d] = d, finish_s, finish_s
        first, copy = self.new_tiles(v, d)
        self.free[d] -= self.weight[v] + first + copy
        self.left -= self.weight[v] + first
        for pid, _, _ in self.tiles[v]:
            self.holders.setdefault(pid, set()).add(d)
        self.busy[d] += self.times[v][d]
