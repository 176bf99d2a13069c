"""Place another program of a deployed model where its weights already are.

A model that generates runs several programs on one deployment: the forward
pass it was placed for, and the prefill and decode steps of each shape. Weights
never move for a new program: ``follow(plan, graph)`` puts every op of ``graph``
that reads a weight tile on the device that holds that tile in ``plan`` (a tile
cut differently goes with the tile it overlaps most), every KV-cache attention
with the attention ops of its layer, and any other op with the op that made its
largest input, the newest of equals (so a residual add stays in the stage that
made its branch, and a rotation stays with its queries, not its angles). The
result is a fused plan (one task per device and phase):
a decode step is latency-bound, so it runs as few Dask tasks as the weights allow.
The function is pure and deterministic, so the client and the scheduler derive
the same program plan from the same model plan.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..ir import OpGraph, ParamSpec
from .plan import Plan
from .workload import layer_of


def _tile(p: ParamSpec) -> tuple[str, tuple[tuple[int, int], ...] | None, str | None]:
    return p.source.key, p.source.slices, p.source.quant


Slices = tuple[tuple[int, int], ...] | None

def follow(plan: Plan, graph: OpGraph) -> Plan:
    """The plan of ``graph`` on ``plan``'s devices that moves none of ``plan``'s weights.

    Examples
    --------
    >>> step = follow(dm.plan, decomposed_decode_graph)     # doctest: +SKIP
    >>> len(step.blocks)                                    # tasks per decode step  # doctest: +SKIP
    2
    """
    base = plan.graph
    owner: dict[tuple[str, tuple[tuple[int, int], ...] | None, str | None], int] = {}
    # NOTE: by key and derived kind: an int4 weight's slices (blocks) and its scales' (groups) are in
    # units of their own
    by_key: dict[tuple[str, str | None], list[tuple[Slices, int]]] = {}
    attn_votes: dict[int, Counter[int]] = {}
    dev_of = plan.device_of.tolist()
    for op, d in zip(base.ops, dev_of):
        for p in op.params:
            spec = base.params[p]
            owner.setdefault(_tile(spec), d)
            by_key.setdefault((spec.source.key, spec.source.quant), []).append((spec.source.slices, d))
        if op.kind in ("attention", "kv_attention"):
            attn_votes.setdefault(layer_of(op.scope or op.name), Counter())[d] += 1
    attn = {layer: votes.most_common(1)[0][0] for layer, votes in attn_votes.items()}
    fallback = Counter(dev_of).most_common(1)[0][0] if dev_of else 0
    out = np.full(len(graph.ops), -1, dtype=np.int64)
    made_at: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        d = -1
        if op.params:
            d = _param_device(graph.params[op.params[0]], owner, by_key)
        elif op.kind in ("kv_attention", "attention"):
            d = attn.get(layer_of(op.scope or op.name), -1)
        if d < 0:       # NOTE: with its largest input, the newest of equals: a stage keeps its work
            src = max(((graph.tensors[t].nbytes, made_at[t]) for t in op.inputs if t in made_at),
                      default=(0, -1))[1]
            d = int(out[src]) if src >= 0 else -1
        out[i] = d
        if d >= 0:
            for t in op.outputs:
                made_at[t] = i
    # NOTE: ops that read only graph inputs (positions, constants) go with their first reader
    index = {op.name: i for i, op in enumerate(graph.ops)}
    for i in range(len(graph.ops) - 1, -1, -1):
        if out[i] < 0:
            readers = [index[c] for t in graph.ops[i].outputs for c in graph.consumers.get(t, ())]
            readers = [j for j in readers if out[j] >= 0]
            out[i] = out[min(readers)] if readers else fallback
    return Plan(graph, plan.spec, out, method="follow", info={"fused": True, "follows": plan.method})


def _param_device(p: ParamSpec, owner: dict[tuple[str, tuple[tuple[int, int], ...] | None, str | None], int],
                  by_key: dict[tuple[str, str | None], list[tuple[Slices, int]]]) -> int:
    d = owner.get(_tile(p))
    if d is not None:
        return d
    best, where = 0, -1
    for slices, dev in by_key.get((p.source.key, p.source.quant), ()):
        overlap = _overlap(p.source.slices, slices, p.shape)
        if overlap > best:
            best, where = overlap, dev
    return where


def _overlap(a: tuple[tuple[int, int], ...] | None, b: tuple[tuple[int, int], ...] | None,
             shape: tuple[int, ...]) -> int:
    if a is None or b is None:
        a = a or b
        return int(np.prod([hi - lo for lo, hi in a])) if a else int(np.prod(shape) or 1)
    n = 1
    for (a0, a1), (b0, b1) in zip(a, b):
        n *= max(0, min(a1, b1) - max(a0, b0))
    return n
