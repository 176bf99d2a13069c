"""Elementwise, norm, pool and keep-dim reductions (and the few other ops ``ops.row_split_forbidden_dims``
knows, such as padding): strips along a dim the op does not mix."""

from __future__ import annotations

from typing import Any

from ... import ops as O
from ...ir import Op, TensorSpec, iter_refs
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register


def strip_dim(op: Op, shape: tuple[int, ...]) -> int | None:
    """The longest output dim ``op`` may be cut along (first on ties), or None."""
    forbidden = O.row_split_forbidden_dims(op.target, list(op.attrs.get("args", ())), len(shape))
    if forbidden is None or not shape:
        return None
    allowed = [d for d in range(len(shape)) if d not in forbidden and shape[d] > 1]
    # NOTE: rows first: the ops around (norms, softmax, matmul) keep their last dim whole
    return max(allowed, key=lambda i: (i != len(shape) - 1, shape[i], -i)) if allowed else None


SLICES_WEIGHTS = {"aten._weight_norm.default", "aten.index.Tensor",     # NOTE: beside elementwise ops
                  "aten.index_select.default", "aten.gather.default"}
FIRST_ONLY = {"aten.index.Tensor", "aten.index_select.default"}   # NOTE: the indices go whole to each strip
# NOTE: every tensor operand is cut with the output (an index may be smaller than its data along
# the other dims, so a whole operand would be read at the wrong rows)
ALL_CUT = {"aten.gather.default", "aten.scatter.src", "aten.scatter_reduce.two"}


# NOTE: "sum" ops are the partial sums a split leaves behind (aten.add.Tensor).
@register("elementwise", "norm", "reduction", "pool", "sum", "opaque", "creation", "index")
def strips(d: Decomposing, op: Op) -> Split | None:
    """Slices of every operand aligned with the cut dim (right-aligned broadcasting);
    the strips are concatenated. Params are sliced only by elementwise ops (and weight norm)."""
    dim = strip_dim(op, d.tensors[op.outputs[0]].shape)
    return None if dim is None else strips_along(d, op, dim)


def strips_along(d: Decomposing, op: Op, dim: int) -> Split | None:
    """``strips`` along output dim ``dim`` (None where the op mixes that dim)."""
    args = list(op.attrs.get("args", ()))
    kwargs = dict(op.attrs.get("kwargs", {}))
    out = d.tensors[op.outputs[0]]
    r = len(out.shape)
    forbidden = O.row_split_forbidden_dims(op.target, args, r)
    if forbidden is None or dim in forbidden or not 0 <= dim < r or out.shape[dim] < 2:
        return None
    n = out.shape[dim]
    slice_params = op.target in O.ELEMENTWISE or op.target in SLICES_WEIGHTS
    # NOTE: x[idx] slices x alone (the dims after the indexed one), and only a 1-D idx keeps them
    # where they were
    sliced = args[:1] if op.target in FIRST_ONLY else args
    if op.target in FIRST_ONLY and len(d.shape(args[0])) != r:
        return None

    only = O.STRIP_OPERANDS.get(op.target, {}).get(dim)
    cut_ids = None if only is None else {id(args[i]) for i in only if i < len(args)}

    def aligned(ref: Any) -> int | None:
        rr = O.ref_name(ref)
        if rr is None or (rr[0] == "p" and not slice_params):
            return None
        if cut_ids is not None and id(ref) not in cut_ids:
            return None
        s = d.shape(ref)
        di = O.operand_dim(op.target, args, r, dim, len(s))
        return di if di is not None and s[di] == n else None

    if op.target in ALL_CUT and any(aligned(a) is None for a in iter_refs(args)):
        return None

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        def sub(v: Any) -> Any:
            if O.ref_name(v) is not None:
                di = aligned(v)
                return v if di is None else d.cut(v, di, lo, hi, op.scope, pieces)
            if isinstance(v, (list, tuple)):
                return [sub(x) for x in v]
            return v
        shape = (*out.shape[:dim], hi - lo, *out.shape[dim + 1:])
        return [sub(a) for a in sliced] + args[len(sliced):], kwargs, op.target, TensorSpec(shape, out.dtype)

    refs = list(iter_refs(sliced))
    cut_refs = [a for a in refs if aligned(a) is not None and O.ref_name(a)[0] == "t"]  # type: ignore[index]
    big = max(cut_refs, key=d.nbytes, default=None)
    big_dim = aligned(big) if big is not None else None
    main = (big, big_dim, 1) if big_dim is not None else None
    cut_bytes = sum(d.nbytes(a) for a in refs if aligned(a) is not None)
    whole = sum(d.nbytes(a) for a in refs if aligned(a) is None) + sum(
        d.nbytes(a) for a in iter_refs(args[len(sliced):]))
    y = out.nbytes
    return Split("s", f"the output into strips along dim {dim}", n,
                 lambda k: (cut_bytes + y) * frac(n, k) + whole, 0,
                 piece, "concat", dim, along=main)


@register("norm")
def whole_groups(d: Decomposing, op: Op) -> Split | None:
    """``group_norm`` by whole groups of channels, each with its slice of the weight and bias;
    the tiles are concatenated (a group's statistics never cross a cut)."""
    args = list(op.attrs.get("args", ()))
    if op.target != "aten.group_norm.default" or len(args) < 2 or O.ref_name(args[0]) is None:
        return None
    out = d.tensors[op.outputs[0]]
    groups = int(args[1])
    if groups < 2 or len(out.shape) < 2 or out.shape[1] % groups:
        return None
    per = out.shape[1] // groups
    kwargs = dict(op.attrs.get("kwargs", {}))

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(args)
        new[0] = d.cut(args[0], 1, lo * per, hi * per, op.scope, pieces)
        new[1] = hi - lo
        for j in (2, 3):             # NOTE: the per-channel weight and bias, where given
            if j < len(new) and O.ref_name(new[j]) is not None:
                new[j] = d.cut(new[j], 0, lo * per, hi * per, op.scope, pieces)
        shape = (out.shape[0], (hi - lo) * per, *out.shape[2:])
        return new, kwargs, op.target, TensorSpec(shape, out.dtype)

    params = sum(d.nbytes(a) for a in args[2:4] if O.ref_name(a) is not None)
    x, y = d.nbytes(args[0]), out.nbytes
    return Split("g", "whole groups of channels", groups, lambda k: (x + y + params) * frac(groups, k), 0,
                 piece, "concat", 1, along=(args[0], 1, per))
