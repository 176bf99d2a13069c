"""Tensors made from their arguments (``full``, ``zeros``, ``arange``, ...): each strip is the
same op making its own part, its size (or its range) rewritten."""

from __future__ import annotations

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register

# NOTE: the argument holding the size, per op
SIZED = {"aten.full.default": 0, "aten.zeros.default": 0, "aten.ones.default": 0,
         "aten.empty.memory_format": 0}
# NOTE: x.new_ones(size) reads x only for its dtype: its strips are ones(size, dtype=...)
NEW = {"aten.new_ones.default": "aten.ones.default", "aten.new_zeros.default": "aten.zeros.default"}
RANGES = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step"}


def _range(op: Op) -> tuple[float, float, float]:
    """``(start, end, step)`` of an ``arange``."""
    args = list(op.attrs.get("args", ()))
    if op.target == "aten.arange.default":
        return 0, args[0], 1
    start, end = args[0], args[1]
    step = O.operand(args, 2, 1) if op.target == "aten.arange.start_step" else 1
    return start, end, step


@register("creation")
def made_strips(d: Decomposing, op: Op) -> Split | None:
    """Strips of the output along its longest dim, each made by the op at its own size (an
    ``arange`` over its own range)."""
    args = list(op.attrs.get("args", ()))
    kwargs = dict(op.attrs.get("kwargs", {}))
    out = d.tensors[op.outputs[0]]
    if not out.shape or (op.target not in SIZED and op.target not in RANGES and op.target not in NEW):
        return None
    if op.target in RANGES:
        start, _, step = _range(op)
        if not all(isinstance(v, int) for v in (start, step)):
            return None               # NOTE: a float range's values would round otherwise
        dim = 0
    else:
        dim = max(range(len(out.shape)), key=lambda k: (out.shape[k], -k))
    n = out.shape[dim]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        shape = (*out.shape[:dim], hi - lo, *out.shape[dim + 1:])
        if op.target in RANGES:
            return ([start + lo * step, start + hi * step, step], kwargs, "aten.arange.start_step",
                    TensorSpec(shape, out.dtype))
        if op.target in NEW:
            return [list(shape)], {"dtype": {"dtype": out.dtype}}, NEW[op.target], \
                TensorSpec(shape, out.dtype)
        new = list(args)
        new[SIZED[op.target]] = list(shape)
        return new, kwargs, op.target, TensorSpec(shape, out.dtype)

    y = out.nbytes
    return Split("s", f"the output into strips along dim {dim}", n, lambda k: y * frac(n, k), 0, piece,
                 "concat", dim)
