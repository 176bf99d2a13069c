"""Reductions cut along a dim they reduce: each piece reduces a slice of the input to a partial
result of the output's shape, and the partial results are combined as a tree (added, or their
maximum, minimum or product taken). Leading and trailing kept dims are cut by ``strips``, which
is exact and preferred where both fit."""

from __future__ import annotations

from ... import ops as O
from ...ir import Op
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register

# NOTE: how the partial results of each reduction combine: "sum" is a tree of adds
COMBINE = {
    "aten.sum.default": "sum", "aten.sum.dim_IntList": "sum", "aten.histc.default": "sum",
    "aten.amax.default": "aten.maximum.default", "aten.max.default": "aten.maximum.default",
    "aten.min.default": "aten.minimum.default", "aten.prod.dim_int": "aten.mul.Tensor",
}


def reduced_dims(op: Op, rank: int) -> set[int] | None:
    """Input dims ``op`` reduces, or None when its parts would not combine to its result."""
    args = list(op.attrs.get("args", ()))
    if op.target in ("aten.sum.default", "aten.max.default", "aten.min.default"):
        return set(range(rank))
    if op.target == "aten.histc.default":      # NOTE: bins from the data's own range: parts differ
        lo, hi = O.operand(args, 2, 0), O.operand(args, 3, 0)
        return set(range(rank)) if lo < hi else None
    if op.target == "aten.prod.dim_int":
        return {int(args[1]) % rank} if rank else None
    dims = O.operand(args, 1)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return set(range(rank))
    return {int(x) % rank for x in ([dims] if isinstance(dims, int) else dims)} if rank else None


@register("reduction")
def reduce_parts(d: Decomposing, op: Op) -> Split | None:
    """Slices of the input along its longest reduced dim, each reduced on its own; the partial
    results combined by ``COMBINE``."""
    join = COMBINE.get(op.target)
    args = list(op.attrs.get("args", ()))
    if join is None or not args or O.ref_name(args[0]) is None:
        return None
    x, out = args[0], d.tensors[op.outputs[0]]
    si = d.shape(x)
    dims = reduced_dims(op, len(si))
    kept = max((s for j, s in enumerate(si) if j not in (dims or ())), default=1)
    dims = {j for j in dims or () if si[j] > 1}
    if not dims or out.dtype == "bool":
        return None
    xb, y = d.nbytes(x), out.nbytes
    if kept > 1 and (xb + y) / kept <= d.budget:
        return None              # NOTE: strips of the kept dims fit, and keep every sum whole (exact)
    j = max(dims, key=lambda k: (si[k], -k))
    n = si[j]
    kwargs = dict(op.attrs.get("kwargs", {}))

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        return [d.cut(x, j, lo, hi, op.scope, pieces), *args[1:]], kwargs, op.target, out

    return Split("p", f"the reduced dim {j} into partial results", n, lambda k: xb * frac(n, k) + y, 0,
                 piece, join, -1, tiebreak=1, along=(x, j, 1))
