"""Cost of micro-ops: flops, bytes and working set, and a roofline time estimate.

Flops follow the usual conventions (a multiply-add is 2 flops); elementwise ops
count one flop per output element. Bytes come from the IR's specs, so the cost
of a graph is known without running it.
"""

from __future__ import annotations

from . import ops as O
from .ir import Op, OpCost, OpGraph

op_flops = O.flops       # NOTE: the op table's entry says


def graph_flops(graph: OpGraph) -> int:
    return sum(op.flops for op in graph.ops)


def streamed_bytes(target: str, param_bytes: float, input_bytes: float, output_bytes: float) -> float:
    """Bytes an op streams through memory: its weights, inputs and outputs; a lookup
    (``ops.GATHERS``) reads only the rows it gathers of its table, as many bytes as it writes."""
    if target in O.GATHERS:
        param_bytes = min(param_bytes, output_bytes)
    return param_bytes + input_bytes + output_bytes


def roofline_time_s(cost: OpCost, flops_per_s: float, bytes_per_s: float,
                    overhead_s: float = 0.0, target: str = "") -> float:
    """Time of an op on a device: compute-bound or memory-bound, plus a fixed overhead."""
    moved = streamed_bytes(target, cost.param_bytes, cost.input_bytes, cost.output_bytes)
    return max(cost.flops / flops_per_s, moved / bytes_per_s) + overhead_s


def op_time_s(graph: OpGraph, op: Op, flops_per_s: float, bytes_per_s: float,
              overhead_s: float = 0.0) -> float:
    return roofline_time_s(graph.cost(op), flops_per_s, bytes_per_s, overhead_s, op.target)
