"""``x[mask] = v``: an ``index_put`` through one boolean mask over leading dims of ``x`` with one
value (``where(mask, v, x)`` in effect), cut into strips along any dim, the mask with ``x`` where
it has that dim. ``index_put`` through integer indices is cut by ``strips``, along the dims its
indices leave whole."""

from __future__ import annotations

import math
from typing import Any

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register


def _dtype(d: Decomposing, ref: Any) -> str:
    tag, name = O.ref_name(ref) or ("", "")
    return d.tensors[name].dtype if tag == "t" else d.params[name].dtype


def _mask_and_value(d: Decomposing, args: list[Any]) -> tuple[Any, Any] | None:
    """``(mask, value)`` of ``index_put(x, [mask], value, ...)`` when the mask is boolean, covers the
    leading dims of ``x`` and the value is one element; else None."""
    if len(args) < 3 or O.ref_name(args[0]) is None or not isinstance(args[1], (list, tuple)):
        return None
    if len(args[1]) != 1 or O.ref_name(args[1][0]) is None or O.ref_name(args[2]) is None:
        return None
    mask, value = args[1][0], args[2]
    ms = d.shape(mask)
    if _dtype(d, mask) != "bool" or d.shape(args[0])[:len(ms)] != ms or math.prod(d.shape(value)) != 1:
        return None
    return mask, value


@register("opaque")
def masked_strips(d: Decomposing, op: Op) -> Split | None:
    """Strips of ``x[mask] = v`` along its longest dim (rows first): ``x``, the output and, along
    a dim the mask has, the mask are cut; the value goes whole to each strip."""
    args = list(op.attrs.get("args", ()))
    found = _mask_and_value(d, args) if op.target == "aten.index_put.default" else None
    if found is None:
        return None
    mask, value = found
    out = d.tensors[op.outputs[0]]
    r = len(out.shape)
    dims = [i for i in range(r) if out.shape[i] > 1]
    if not dims:
        return None
    dim = max(dims, key=lambda i: (i != r - 1, out.shape[i], -i))
    n, x, kwargs = out.shape[dim], args[0], dict(op.attrs.get("kwargs", {}))
    cuts_mask = dim < len(d.shape(mask))

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        m = d.cut(mask, dim, lo, hi, op.scope, pieces) if cuts_mask else mask
        shape = (*out.shape[:dim], hi - lo, *out.shape[dim + 1:])
        return ([d.cut(x, dim, lo, hi, op.scope, pieces), [m], value, *args[3:]], kwargs, op.target,
                TensorSpec(shape, out.dtype))

    cut = d.nbytes(x) + out.nbytes + (d.nbytes(mask) if cuts_mask else 0)
    whole = d.nbytes(value) + (0 if cuts_mask else d.nbytes(mask))
    return Split("s", f"the output into strips along dim {dim}", n, lambda k: cut * frac(n, k) + whole, 0,
                 piece, "concat", dim, along=(x, dim, 1))
