"""Views and joins (reshape, permute, expand, slice, cat, ...): strips that map to input strips.

An output dim ``d`` maps to an input dim ``j`` with a ratio ``r`` and a quantum ``q`` when
output rows ``[lo * q, hi * q)`` along ``d`` are exactly input rows ``[lo * r, hi * r)`` along
``j`` with every other input dim whole (``q > 1``: a reshape that makes ``q`` rows of each
input row). Each strip is the same view of its input strip; the strips are the output's tiles.
"""

from __future__ import annotations

import math
from typing import Any

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register

RESHAPES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
            "aten.flatten.using_ints", "aten.unflatten.int", "aten.unsqueeze.default",
            "aten.squeeze.dim", "aten.squeeze.default", "aten.reshape_as.default"}
JOINS = ("aten.cat.default", "aten.concat.default", "aten.stack.default")
DimMap = dict[int, tuple[int, int, int]]
"""output dim -> (input dim, ratio, quantum)."""


def reshape_map(si: tuple[int, ...], so: tuple[int, ...]) -> DimMap:
    """Output dims of a reshape ``si -> so`` whose strips are input strips."""
    out: DimMap = {}
    for d in range(len(so)):
        outer, inner = math.prod(so[:d]), math.prod(so[d + 1:])
        for j in range(len(si)):
            inner_i = math.prod(si[j + 1:])
            if math.prod(si[:j]) != outer or so[d] * inner != si[j] * inner_i:
                continue
            if inner % max(inner_i, 1) == 0:
                out[d] = (j, inner // max(inner_i, 1), 1)
                break
            if inner and inner_i % inner == 0 and d not in out:    # NOTE: each input row makes q rows
                out[d] = (j, 1, inner_i // inner)              # (unless a later dim maps one to one)
    return out


EXPANDS = ("aten.expand.default", "aten.broadcast_to.default")


def dim_map(op: Op, args: list[Any], si: tuple[int, ...], so: tuple[int, ...]) -> DimMap:
    """How ``op``'s output dims map to its (first) input's dims."""
    t = op.target
    if t in RESHAPES:
        return reshape_map(si, so)
    if t == "aten.permute.default":
        return {d: (int(p) % len(si), 1, 1) for d, p in enumerate(args[1])}
    if t in ("aten.transpose.int", "aten.t.default"):
        a, b = (int(args[1]) % len(si), int(args[2]) % len(si)) if t == "aten.transpose.int" else (0, 1)
        perm = list(range(len(si)))
        perm[a], perm[b] = perm[b], perm[a]
        return {d: (perm[d], 1, 1) for d in range(len(so))}
    if t == "aten.repeat.default":        # NOTE: dims repeated once are the input's, right-aligned
        lead = len(so) - len(si)
        return {d: (d - lead, 1, 1) for d in range(lead, len(so)) if int(args[1][d]) == 1}
    if t == "aten.numpy_T.default":       # NOTE: x.T reverses every dim
        return {d: (len(si) - 1 - d, 1, 1) for d in range(len(so))}
    if t in EXPANDS:
        lead = len(so) - len(si)
        return {d: (d - lead, 1, 1) for d in range(lead, len(so)) if si[d - lead] == so[d]}
    if t in ("aten.slice.Tensor", "aten.cat.default", "aten.concat.default", "aten.narrow.default"):
        dim = int(O.operand(args, 1, 0)) % len(so)
        return {d: (d, 1, 1) for d in range(len(so)) if d != dim}
    if t == "aten.stack.default":             # NOTE: the new dim picks the input; the others are theirs
        dim = int(O.operand(args, 1, 0)) % len(so)
        return {d: (d if d < dim else d - 1, 1, 1) for d in range(len(so)) if d != dim}
    if t == "aten.select.int":
        dim = int(args[1]) % len(si)
        return {d: (d if d < dim else d + 1, 1, 1) for d in range(len(so))}
    return {}


def first_input(op: Op, args: list[Any]) -> Any:
    return args[0][0] if op.target in JOINS else args[0]


@register("view", "concat")
def view_strips(d: Decomposing, op: Op) -> Split | None:
    """Strips of the output along its longest dim that maps to an input dim (of an activation, or
    of a weight, whose tiles are then read in its place)."""
    args = list(op.attrs["args"])
    if op.target in JOINS and not all(O.ref_name(a) for a in args[0]):
        return None
    x = first_input(op, args)
    if O.ref_name(x) is None:        # NOTE: a view of a weight is cut as its weight tiles (x @ W.T)
        return None
    so = d.tensors[op.outputs[0]].shape
    dims = dim_map(op, args, d.shape(x), so)
    dims = {k: v for k, v in dims.items() if so[k] // v[2] > 1}      # NOTE: at least two units to cut
    if not dims:
        return None
    return view_strips_along(d, op, max(dims, key=lambda k: (so[k] // dims[k][2], -k)))


def view_strips_along(d: Decomposing, op: Op, dim: int) -> Split | None:
    """``view_strips`` along output dim ``dim`` (None where it maps to no input dim)."""
    args = list(op.attrs["args"])
    x = first_input(op, args)
    if O.ref_name(x) is None:
        return None
    out = d.tensors[op.outputs[0]]
    so, si = out.shape, d.shape(x)
    dims = dim_map(op, args, si, so)
    if dim not in dims or so[dim] // dims[dim][2] < 2:
        return None
    j, r, q = dims[dim]
    n = so[dim] // q

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        shape = (*so[:dim], (hi - lo) * q, *so[dim + 1:])
        spec = TensorSpec(shape, out.dtype)
        if op.target in JOINS:
            parts = [d.cut(a, j, lo, hi, op.scope) for a in args[0]]
            return [parts, *args[1:]], {}, op.target, spec
        cut = d.cut(x, j, lo * r, hi * r, op.scope)
        if op.target in RESHAPES:
            return [cut, list(shape)], {}, "aten.reshape.default", spec
        if op.target in EXPANDS:
            return [cut, list(shape)], {}, op.target, spec
        return [cut, *args[1:]], dict(op.attrs.get("kwargs", {})), op.target, spec

    xin = sum(d.nbytes(a) for a in (args[0] if op.target in JOINS else [x]))
    y = out.nbytes
    return Split("s", f"the output into strips along dim {dim}", n, lambda k: (xin + y) * frac(n, k), 0,
                 piece, "concat", dim, along=(x, j, r))
