"""Plans: which device runs each micro-op, grouped into blocks that Dask runs as tasks.

A ``Plan`` is kept beside its graph (like a ``device_map``), never inside it.
Blocks are the execution grain: one Dask task per block per request. A Dask task
waits for all of its inputs, so the blocks must form an acyclic quotient graph.
``blocks_for`` guarantees that: an op's *phase* is the largest number of device
changes on any path from a source to it, and a block is the ops of one device
with one phase. Every edge between blocks goes from a lower phase to a higher
one, so blocks cannot form a cycle. Unless the plan is *fused*, a device's ops of
one phase are cut again after each op whose output another device reads, so that
output leaves as soon as it exists; fused, they stay one task (one Dask hop less).

JSON schema (``Plan.to_json``, ``schema`` = 1)::

    {
      "schema": 1,
      "graph": {"name": "...", "ops": 7334, "fingerprint": "<sha1 of op names>"},
      "cluster": {...ClusterSpec.to_dict()...},
      "method": "multilevel",
      "fused": true,                                       # optional: one block per device and phase
      "assignment": {"<op name>": "<device name>", ...},
      "blocks": [{"name": "b12", "device": "h0-gpu1", "phase": 3,
                  "ops": ["<op name>", ...]}, ...],       # ops in execution order
      "stats": {"makespan_s": 0.012, "cut_bytes": 3.1e8, "planning_s": 0.9,     # optional
                "devices": {"h0-gpu0": {"weight_bytes": ..., "peak_bytes": ..., "memory_bytes": ...}}}
    }

``stats`` is left out by ``to_json(stats=False)``: the form the client and the
scheduler plugin exchange (deploy, and every plan change after). The graph itself
is saved with ``OpGraph.to_json``; ``Plan.from_json(text, graph)``
checks the fingerprint so a plan is never applied to the wrong graph.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..config import MAX_BYTES, MAX_BYTES_TEXT
from ..errors import BadClusterSpec, BadPlan, ClusterTooSmall
from ..ir import OpGraph, fmt_bytes, is_count
from .cluster import ClusterSpec
from .simulate import Schedule, simulate
from .workload import Workload, workload

if TYPE_CHECKING:    # NOTE: report.py builds on Plan and replan: Plan.report() is its one way in
    from .report import PlanReport

PLAN_SCHEMA = 1


@dataclass(frozen=True)
class Block:
    """Ops of one device run back to back as one task."""

    name: str
    device: str
    phase: int
    ops: tuple[str, ...]


def phases(w: Workload, dev: np.ndarray, prior: np.ndarray | None = None, start: int = 0,
           end: int | None = None) -> np.ndarray:
    """Largest number of device changes on any path from a source to each op.

    With ``prior`` (the phases of a plan that agrees with ``dev`` on every op outside
    ``[start, end)``, up to renumbering devices) only the ops in that window are
    recomputed exactly; every op after it keeps its prior phase shifted by the one
    amount that keeps all edges into it ordered. The shift keeps the blocks acyclic
    (along every edge the phase still grows by at least the device change) and costs
    the repair of one device's stretch, not of the whole graph.
    """
    ev = w.edges[1]
    if prior is None:
        start, end, prior = 0, w.n, np.zeros(w.n, dtype=np.int64)
    end = w.n if end is None else max(start, min(end, w.n))
    first, last = int(np.searchsorted(ev, start)), int(np.searchsorted(ev, end))
    ph = prior[:end].tolist()
    ph[start:end] = [0] * (end - start)
    eu_l, ev_l = w.edge_lists
    dl = dev[:end].tolist()
    # NOTE: edges are sorted by consumer and producers come first, so ph[u] is final when read.
    for u, v in zip(eu_l[first:last], ev_l[first:last]):
        x = ph[u] + (dl[u] != dl[v])
        if x > ph[v]:
            ph[v] = x
    out = prior.astype(np.int64, copy=True)
    out[start:end] = ph[start:end]
    if end < w.n:
        # NOTE: only edges out of the window can need the shift: before it, phases are prior's
        pu, pv = w.edges_by_producer
        a, b = int(np.searchsorted(pu, start)), int(np.searchsorted(pu, end))
        tu, tv = pu[a:b], pv[a:b]
        into = tv >= end
        need = out[tu[into]] + (dev[tu[into]] != dev[tv[into]]) - prior[tv[into]]
        out[end:] = prior[end:] + max(0, int(need.max()) if len(need) else 0)
    return out


def blocks_for(w: Workload, dev: np.ndarray, n_devices: int,
               ph: np.ndarray | None = None, split: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group ops into blocks: returns (block of each op, device of each block, phase of each block).

    With ``split``, ops of one device and phase are cut after every op whose output
    another device reads, so that output leaves as soon as it exists. Along every edge
    the key (phase, cut index) grows, so the blocks stay acyclic.
    """
    ph = phases(w, dev) if ph is None else ph
    t_idx, c_op = w.pairs
    src = w.t_src[t_idx]
    sender = np.zeros(w.n, dtype=np.int64)
    if split:
        sender[src[dev[src] != dev[c_op]]] = 1
    group = ph * n_devices + dev
    # NOTE: small keys sort as int16, which numpy sorts stably by radix, in linear time
    order = np.argsort(group.astype(np.int16) if w.n and group.max() < 2**15 else group, kind="stable")
    g_sorted, s_sorted = group[order], sender[order]
    cs = np.cumsum(s_sorted) - s_sorted                     # senders strictly before, overall
    starts = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
    first = np.repeat(starts, np.diff(np.r_[starts, w.n]))
    sub_sorted = cs - cs[first]
    n_sub = int(sub_sorted.max()) + 1 if w.n else 1
    # NOTE: blocks are the runs of equal (group, sub) along ``order``; they are numbered in
    # (phase, sub, device) order, a topological order of the blocks.
    head = np.r_[True, (g_sorted[1:] != g_sorted[:-1]) | (sub_sorted[1:] != sub_sorted[:-1])] if w.n \
        else np.zeros(0, dtype=bool)
    run = np.cumsum(head) - 1
    lead = order[head]
    bkey = (ph[lead] * n_sub + sub_sorted[head]) * n_devices + dev[lead]
    by_key = np.argsort(bkey, kind="stable")
    rank = np.empty(len(bkey), dtype=np.int64)
    rank[by_key] = np.arange(len(bkey))
    block_of = np.empty(w.n, dtype=np.int64)
    block_of[order] = rank[run]
    uniq = bkey[by_key]
    return block_of, (uniq % n_devices).astype(np.int64), (uniq // n_devices // n_sub).astype(np.int64)


def check_spec(spec: ClusterSpec) -> ClusterSpec:
    """Refuse figures no machine has: a device's memory above ``config.MAX_BYTES``, or a
    speed, time or link figure that is not finite (``DeviceSpec`` and ``LinkSpec`` already refuse
    ones <= 0 and NaN; an infinite client bandwidth is ``NO_DASK``'s "no Dask costs" and stays).
    Returns the spec."""
    for d in spec.devices:
        if d.memory_bytes > MAX_BYTES:
            raise BadClusterSpec(f"device {d.name!r} claims {fmt_bytes(d.memory_bytes)} ({d.memory_bytes} "
                                 f"bytes) of memory; a device has at most {MAX_BYTES_TEXT}: give the "
                                 "memory it has")
        speeds = {f"flops_per_s[{c!r}]": v for c, v in d.flops_per_s.items()}
        _finite(f"device {d.name!r}", {**speeds, "mem_bytes_per_s": d.mem_bytes_per_s,
                                       "op_overhead_s": d.op_overhead_s,
                                       "view_overhead_s": d.view_overhead_s})
    for level, link in spec.links.items():
        _finite(f"link {level!r}", {"bandwidth": link.bandwidth_bytes_per_s, "latency": link.latency_s})
    for what, m in zip(("bandwidth", "latency"), spec.matrix or ()):
        _finite("matrix", {f"{what}[{a}][{b}]": v for a, row in enumerate(m) for b, v in enumerate(row)})
    return spec


def _finite(what: str, figures: Mapping[str, float]) -> None:
    bad = {k: v for k, v in figures.items() if not math.isfinite(v)}
    if bad:
        raise BadClusterSpec(f"{what}: {', '.join(f'{k} = {v}' for k, v in bad.items())}; every figure of "
                             "a cluster must be a finite number (measure it, or leave it to a profile)")


def fingerprint(graph: OpGraph) -> str:
    h = hashlib.sha1()
    for op in graph.ops:
        h.update(op.name.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class Plan:
    """Op -> device for every op of ``graph`` on ``spec``, with the blocks Dask will run.

    Build one with ``place`` (or a baseline); ``replan`` repairs it. ``table()``
    prints it; ``to_json()`` saves it (schema in the module docstring).
    """

    graph: OpGraph
    spec: ClusterSpec
    device_of: np.ndarray                 # [n ops] device index
    method: str = "multilevel"
    planning_s: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dev = device_indices(self.device_of, self.graph, self.spec)
        dev.flags.writeable = False
        object.__setattr__(self, "device_of", dev)

    # --- structure ----------------------------------------------------------------
    @property
    def workload(self) -> Workload:
        return workload(self.graph)

    @cached_property
    def phases(self) -> np.ndarray:
        """[n ops] device changes on the longest path to each op (see ``phases``)."""
        hint = self.info.get("phases_from")
        if hint is not None:
            prior, start, end = hint
            return phases(self.workload, self.device_of, prior, start, end)
        return phases(self.workload, self.device_of)

    @cached_property
    def _blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return blocks_for(self.workload, self.device_of, len(self.spec.devices), self.phases,
                          split=not self.fused)

    @property
    def fused(self) -> bool:
        """One block per device and phase (else also cut where an output leaves its device)."""
        return bool(self.info.get("fused"))

    @property
    def block_of(self) -> np.ndarray:
        return self._blocks[0]

    @property
    def block_device(self) -> np.ndarray:
        return self._blocks[1]

    @property
    def block_phase(self) -> np.ndarray:
        """[blocks] phase of each block (device changes on the longest path to it)."""
        return self._blocks[2]

    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        block_of, bdev, bph = self._blocks
        members: list[list[str]] = [[] for _ in range(len(bdev))]
        for name, b in zip(self.workload.names, block_of.tolist()):
            members[b].append(name)
        names = self.spec.names
        return tuple(Block(f"b{i}", names[int(bdev[i])], int(bph[i]), tuple(m))
                     for i, m in enumerate(members))

    @cached_property
    def assignment(self) -> Mapping[str, str]:
        names = self.spec.names
        return {op: names[d] for op, d in zip(self.workload.names, self.device_of.tolist())}

    def ops_on(self, device: str) -> tuple[str, ...]:
        i = self.spec.index(device)
        return tuple(self.workload.names[j] for j in np.flatnonzero(self.device_of == i))

    # --- memory --------------------------------------------------------------------
    @cached_property
    def weight_bytes(self) -> np.ndarray:
        """[D] bytes of weights resident on each device (a shared weight once per device)."""
        w = self.workload
        n_dev = len(self.spec.devices)
        out = np.bincount(self.device_of, weights=w.weight_bytes, minlength=n_dev)
        tile, user, nbytes, first = w.shared_arrays
        if len(tile):   # NOTE: each (tile, device) pair once, less the copy its first user counted
            held = np.zeros((len(nbytes), n_dev), dtype=bool)
            held[tile, self.device_of[user]] = True
            out += nbytes @ held
            out -= np.bincount(self.device_of[first], weights=nbytes, minlength=n_dev)
        return out

    @cached_property
    def activation_bytes(self) -> np.ndarray:
        """[D] largest activation footprint of one block on each device.

        A block holds its inputs from other blocks, the outputs it hands on, and the
        inputs and outputs of its largest op while that op runs (weights are counted
        in ``weight_bytes``). A graph output counts once.
        """
        w = self.workload
        block_of, bdev, _ = self._blocks
        nb = len(bdev)
        t_idx, c_op = w.pairs
        src_block = block_of[w.t_src[t_idx]]
        dst_block = block_of[c_op]
        ext = src_block != dst_block
        key = np.unique(t_idx[ext] * nb + dst_block[ext])
        ins = np.stack([key // nb, key % nb])
        outs = np.unique(t_idx[ext])
        per_block = np.bincount(ins[1], weights=w.t_bytes[ins[0]], minlength=nb).astype(np.float64)
        per_block += np.bincount(block_of[w.t_src[outs]], weights=w.t_bytes[outs], minlength=nb)
        sent = {w.t_names[t] for t in outs.tolist()}
        for t in self.graph.leaf_outputs:
            if t in self.graph.producer and t not in sent:
                per_block[block_of[w.index[self.graph.producer[t]]]] += self.graph.tensors[t].nbytes
        ws_max = np.zeros(nb)
        np.maximum.at(ws_max, block_of, w.act_bytes)
        per_block += ws_max
        out = np.zeros(len(self.spec.devices))
        np.maximum.at(out, bdev, per_block)
        return out

    @property
    def peak_bytes(self) -> np.ndarray:
        """[D] weights plus the largest block's activations."""
        return self.weight_bytes + self.activation_bytes

    def check(self) -> Plan:
        """Raise ``ClusterTooSmall`` if any device would hold more than its memory."""
        mem = np.array([d.memory_bytes for d in self.spec.devices])
        over = np.flatnonzero(self.peak_bytes > mem)
        if len(over):
            d = int(over[0])
            raise ClusterTooSmall(
                f"plan ({self.method}) puts {fmt_bytes(self.peak_bytes[d])} on {self.spec.names[d]!r} "
                f"(weights {fmt_bytes(self.weight_bytes[d])} + activations "
                f"{fmt_bytes(self.activation_bytes[d])}), its memory is {fmt_bytes(mem[d])}")
        return self

    @cached_property
    def acyclic(self) -> bool:
        """Whether the blocks form an acyclic graph (Kahn's algorithm on the block graph)."""
        w = self.workload
        t_idx, c_op = w.pairs
        a, b = self.block_of[w.t_src[t_idx]], self.block_of[c_op]
        cross = a != b
        nb = len(self.block_device)
        key = np.unique(a[cross] * nb + b[cross])
        src, dst = (key // nb).tolist(), (key % nb).tolist()
        indeg = np.bincount(dst, minlength=nb).tolist()
        out: list[list[int]] = [[] for _ in range(nb)]
        for x, y in zip(src, dst):
            out[x].append(y)
        stack = [i for i in range(nb) if indeg[i] == 0]
        seen = 0
        while stack:
            x = stack.pop()
            seen += 1
            for y in out[x]:
                indeg[y] -= 1
                if indeg[y] == 0:
                    stack.append(y)
        return seen == nb

    @property
    def feasible(self) -> bool:
        mem = np.array([d.memory_bytes for d in self.spec.devices])
        return bool((self.peak_bytes <= mem).all())

    # --- communication ----------------------------------------------------------------
    @cached_property
    def bytes_between(self) -> np.ndarray:
        """[D, D] bytes sent from device a to device b per request (a tensor once per receiver)."""
        w = self.workload
        n_dev = len(self.spec.devices)
        t_idx, c_op = w.pairs
        src = self.device_of[w.t_src[t_idx]]
        dst = self.device_of[c_op]
        ext = src != dst
        key = np.unique(t_idx[ext] * n_dev + dst[ext])
        t, d = key // n_dev, key % n_dev
        out = np.zeros((n_dev, n_dev))
        np.add.at(out, (self.device_of[w.t_src[t]], d), w.t_bytes[t])
        return out

    @property
    def cut_bytes(self) -> float:
        """Bytes sent between devices per request: hypergraph lambda-1 of the tensors."""
        return float(self.bytes_between.sum())

    # --- time -------------------------------------------------------------------------
    @cached_property
    def schedule(self) -> Schedule:
        """When each block runs and each tensor moves in one request (``simulate``)."""
        return simulate(self)

    @property
    def makespan_s(self) -> float:
        """Simulated time of one request, with link contention (see ``simulate``)."""
        return float(self.schedule.makespan_s)

    # --- presentation -------------------------------------------------------------------
    def __repr__(self) -> str:
        used = len(set(self.device_of.tolist()))
        return (f"<Plan {self.method}: {len(self.device_of)} ops on {used}/{len(self.spec.devices)} devices, "
                f"{len(self.block_device)} blocks, cut {fmt_bytes(self.cut_bytes)}>")

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """Per device: blocks, ops, weights, peak memory over budget, busy time, bytes in/out."""
        n_dev = len(self.spec.devices)
        sched = self.schedule
        nblocks = np.bincount(self.block_device, minlength=n_dev)
        nops = np.bincount(self.device_of, minlength=n_dev)
        bb = self.bytes_between
        lines = [f"{'device':<12} {'blocks':>6} {'ops':>6} {'weights':>10} {'peak/memory':>18} "
                 f"{'busy ms':>8} {'in':>10} {'out':>10}"]
        for d, dev in enumerate(self.spec.devices):
            lines.append(
                f"{dev.name:<12} {nblocks[d]:>6} {nops[d]:>6} {fmt_bytes(self.weight_bytes[d]):>10} "
                f"{fmt_bytes(self.peak_bytes[d]):>9}/{fmt_bytes(dev.memory_bytes):>8} "
                f"{sched.busy_s[d] * 1e3:>8.2f} {fmt_bytes(bb[:, d].sum()):>10} {fmt_bytes(bb[d].sum()):>10}")
        lines.append(f"makespan {self.makespan_s * 1e3:.2f} ms (simulated), cut {fmt_bytes(self.cut_bytes)}, "
                     f"{len(self.block_device)} blocks, planned in {self.planning_s * 1e3:.0f} ms "
                     f"by {self.method}")
        return "\n".join(lines)

    def report(self, context: int | None = None,
               lose: str | Sequence[str | Sequence[str]] = ()) -> PlanReport:
        """A dry run for choosing hardware: memory headroom and the KV cache that fits in it, the
        bottleneck device and link, latency and throughput, and what losing devices changes.

        ``context`` is tokens per generation session (default 512); ``lose`` names devices to try
        losing, each on its own (an inner list: lost together), or ``"all"`` for every device in
        turn. See ``placement/report.py``.

        >>> r = plan.report(context=1024, lose=["h0-gpu1"])         # doctest: +SKIP
        >>> print(r)                                                # doctest: +SKIP
        >>> r.sessions, r.devices[0].headroom_bytes                 # doctest: +SKIP
        """
        # NOTE: imported here, not above: report.py imports this module (it repairs plans with replan)
        from .report import report

        return report(self, context, lose)

    # --- serialisation --------------------------------------------------------------------
    def to_dict(self, stats: bool = True) -> dict[str, Any]:
        """The documented JSON document (module docstring); ``stats=False`` leaves out the
        figures that need a simulation (the form sent between client and scheduler)."""
        out = {
            "schema": PLAN_SCHEMA,
            "graph": {"name": self.graph.meta.get("name", "graph"), "ops": len(self.graph.ops),
                      "fingerprint": fingerprint(self.graph)},
            "cluster": self.spec.to_dict(),
            "method": self.method,
            **({"fused": True} if self.fused else {}),
            "assignment": dict(self.assignment),
            "blocks": [{"name": b.name, "device": b.device, "phase": b.phase, "ops": list(b.ops)}
                       for b in self.blocks],
        }
        if stats:
            names, mem = self.spec.names, self.peak_bytes
            out["stats"] = {
                "makespan_s": self.makespan_s, "cut_bytes": self.cut_bytes, "planning_s": self.planning_s,
                "devices": {names[d]: {"weight_bytes": int(self.weight_bytes[d]), "peak_bytes": int(mem[d]),
                                       "memory_bytes": self.spec.devices[d].memory_bytes}
                            for d in range(len(names))}}
        return out

    def to_json(self, indent: int | None = None, stats: bool = True) -> str:
        return json.dumps(self.to_dict(stats), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], graph: OpGraph) -> Plan:
        try:
            return cls._from_dict(d, graph)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BadPlan(f"plan document is malformed: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any], graph: OpGraph) -> Plan:
        if d.get("schema") != PLAN_SCHEMA:
            raise BadPlan(f"plan schema {d.get('schema')!r} is not supported "
                          f"(expected {PLAN_SCHEMA})")
        g = d.get("graph", {})
        if g.get("ops") != len(graph.ops) or g.get("fingerprint") != fingerprint(graph):
            raise BadPlan(f"plan was made for graph {g.get('name')!r} with {g.get('ops')} ops; "
                          f"this graph has {len(graph.ops)} ops and other names")
        spec = check_spec(ClusterSpec.from_dict(d["cluster"]))
        assignment = d["assignment"]
        missing = [op.name for op in graph.ops if op.name not in assignment]
        if missing:
            raise BadPlan(f"plan assigns no device to {len(missing)} op(s), e.g. {missing[0]!r}")
        if len(assignment) != len(graph.ops):
            extra = next(n for n in assignment if n not in graph.op_by_name)
            raise BadPlan(f"plan assigns devices to {len(assignment) - len(graph.ops)} op(s) the "
                          f"graph does not have, e.g. {extra!r}")
        idx = {n: i for i, n in enumerate(spec.names)}
        try:
            dev = np.array([idx[assignment[op.name]] for op in graph.ops], dtype=np.int64)
        except KeyError as e:
            raise BadPlan(f"plan names device {e.args[0]!r}, not in its cluster") from None
        stats = d.get("stats", {})
        info: dict[str, Any] = {"phases_from": (ph, len(graph.ops), len(graph.ops))} \
            if (ph := _block_phases(d.get("blocks"), graph, workload(graph), dev)) is not None else {}
        if d.get("fused"):
            info["fused"] = True
        planning_s = float(stats.get("planning_s", 0.0))
        if not 0 <= planning_s < math.inf:
            raise BadPlan(f"plan stats.planning_s is {planning_s}: a time is a finite number of "
                          "seconds >= 0")
        return cls(graph, spec, dev, method=str(d.get("method", "loaded")), planning_s=planning_s, info=info)

    @classmethod
    def from_json(cls, text: str | bytes, graph: OpGraph) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadPlan(f"plan is not valid JSON: {e}") from e
        return cls.from_dict(data, graph)


def device_indices(device_of: npt.ArrayLike, graph: OpGraph, spec: ClusterSpec) -> np.ndarray:
    """``device_of`` as int64, checked: one int per op of ``graph``, each a device of ``spec``."""
    raw = np.asarray(device_of)
    n_ops, n_dev = len(graph.ops), len(spec.devices)
    if raw.shape != (n_ops,):
        raise BadPlan(f"a plan needs one device per op: {n_ops} ops, "
                      f"{raw.shape[0] if raw.ndim else 0} devices given")
    if raw.size and raw.dtype.kind not in "iu":
        raise BadPlan(f"a plan's devices are indices into its cluster, ints; got {raw.dtype} "
                      f"values such as {raw[0].item()!r}")
    dev = np.asarray(raw, dtype=np.int64)
    bad = np.flatnonzero((dev < 0) | (dev >= n_dev))
    if len(bad):
        i = int(bad[0])
        raise BadPlan(f"plan puts op {graph.ops[i].name!r} (#{i}) on device {int(dev[i])}, and "
                      f"{len(bad) - 1} more op(s) out of range: the cluster has devices "
                      f"0..{n_dev - 1}")
    return dev


def _block_phases(blocks: Any, graph: OpGraph, w: Workload, dev: np.ndarray) -> np.ndarray | None:
    """The phase of each op from a plan document's blocks, so that both ends of the wire cut
    the same blocks; None when the document lists none. Phases that do not order every
    edge (a device change must raise the phase) are refused."""
    if not blocks:
        return None
    index = {op.name: i for i, op in enumerate(graph.ops)}
    ph = np.full(len(graph.ops), -1, dtype=np.int64)
    for b in blocks:
        phase = b["phase"]
        if not is_count(phase) or phase > len(graph.ops):
            raise BadPlan(f"plan block {b.get('name')!r} has phase {phase!r}: a phase is an int "
                          f"from 0 to the graph's {len(graph.ops)} ops")
        ph[[index[name] for name in b["ops"]]] = phase
    eu, ev = w.edges
    if (ph < 0).any() or (ph[ev] < ph[eu] + (dev[eu] != dev[ev])).any():
        raise BadPlan("plan blocks do not cover every op in phase order: a block would wait "
                      "on a later one")
    return ph


def make_plan(graph: OpGraph, spec: ClusterSpec, device_of: Sequence[int] | np.ndarray, method: str,
              planning_s: float = 0.0, **info: Any) -> Plan:
    return Plan(graph, spec, np.asarray(device_of, dtype=np.int64), method, planning_s, info)
