"""Cost of micro-ops: flops, bytes and working set, and a roofline time estimate.

Flops follow the usual conventions (a multiply-add is 2 flops); elementwise ops
count one flop per output element. Bytes come from the IR's specs, so the cost
of a graph is known without running it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from . import ops as O
from .ir import Op, OpCost, OpGraph

SpecOf = Callable[[Any], "tuple[int, ...] | None"]


def op_flops(target: str, args: Sequence[Any], out_shapes: Sequence[tuple[int, ...]],
             shape_of: SpecOf) -> int:
    """Flops of one call of ``target``; ``shape_of(arg)`` gives an operand's shape or None."""
    out = out_shapes[0] if out_shapes else ()
    out_numel = math.prod(out) if out_shapes else 0
    if target in ("aten.linear.default", "sb.qlinear.default"):
        w = shape_of(args[1])
        return 2 * out_numel * (w[-1] if w else 1)
    if target == "aten.addmm.default":
        a = shape_of(args[1])
        return 2 * out_numel * (a[-1] if a else 1)
    if target in O.MATMUL:
        a = shape_of(args[0])
        return 2 * out_numel * (a[-1] if a else 1)
    if target in O.CONV_TRANSPOSE:       # NOTE: every input element meets C_out/groups x kernel weights
        x, w = shape_of(args[0]), shape_of(args[1])
        return 2 * math.prod(x) * math.prod(w[1:]) if x and w else out_numel
    if target in O.CONV:
        w = shape_of(args[1])
        return 2 * out_numel * (math.prod(w[1:]) if w else 1)
    if target in O.ATTENTION:
        q, k = shape_of(args[0]), shape_of(args[1])
        if not q or not k:
            return out_numel
        # QK^T and AV: 2 * (L * S * E) each, per batch and head.
        return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    if target in O.NORM:
        return 5 * out_numel
    if target in O.POOL:
        return out_numel * pool_window(target, args, out, shape_of)
    if target in O.VIEW or target in O.CREATION:
        return 0
    return out_numel


def pool_window(target: str, args: Sequence[Any], out: tuple[int, ...], shape_of: SpecOf) -> int:
    """Input elements one output of a pooling op reads (one flop each)."""
    nd = O.pool_nd(target, args)
    if "adaptive" in target:
        x = shape_of(args[0])
        return math.prod(x[-nd:]) // max(math.prod(out[-nd:]), 1) if x else 1
    sizes = [args[1]] if isinstance(args[1], int) else list(args[1])
    return math.prod(sizes) ** (nd if len(sizes) == 1 else 1)   # NOTE: one size serves every dim


def graph_flops(graph: OpGraph) -> int:
    return sum(op.flops for op in graph.ops)


GATHERS = frozenset({"embedding"})     # op kinds that read only the weight rows they look up


def streamed_bytes(kind: str, param_bytes: float, input_bytes: float, output_bytes: float) -> float:
    """Bytes an op streams through memory: its weights, inputs and outputs; a lookup
    (``GATHERS``) reads only the rows it gathers of its table, as many bytes as it writes."""
    if kind in GATHERS:
        param_bytes = min(param_bytes, output_bytes)
    return param_bytes + input_bytes + output_bytes


def roofline_time_s(cost: OpCost, flops_per_s: float, bytes_per_s: float,
                    overhead_s: float = 0.0, kind: str = "") -> float:
    """Time of an op on a device: compute-bound or memory-bound, plus a fixed overhead."""
    moved = streamed_bytes(kind, cost.param_bytes, cost.input_bytes, cost.output_bytes)
    return max(cost.flops / flops_per_s, moved / bytes_per_s) + overhead_s


def op_time_s(graph: OpGraph, op: Op, flops_per_s: float, bytes_per_s: float,
              overhead_s: float = 0.0) -> float:
    return roofline_time_s(graph.cost(op), flops_per_s, bytes_per_s, overhead_s, op.kind)
