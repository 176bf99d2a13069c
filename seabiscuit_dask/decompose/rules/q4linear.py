"""sb.q4linear: by output columns (whole blocks of 64 rows of its int4 weight), input rows, or the
reduction (whole groups)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ... import ops as O
from ...ir import DTYPE_BYTES, Op, TensorSpec
from ...ops import Q4_BLOCK
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register


@dataclass(frozen=True)
class Q4:
    """``sb.q4linear(x, w, sz, bias, group)`` read from an op: its sizes in bytes and units."""

    args: list[Any]
    n: int
    k: int
    group: int
    rows: int
    x: int
    w: int            # NOTE: the int4 weight, its scales and zeros and the bias
    y: int
    out: TensorSpec
    itemsize: int

    def scratch(self, n: float, rows: float) -> float:
        return O.q4linear_scratch(math.ceil(rows), self.k, math.ceil(n), self.itemsize)


def read(d: Decomposing, op: Op) -> Q4 | None:
    if op.target != O.Q4LINEAR:
        return None
    args = list(op.attrs["args"])
    sx, sw = d.shape(args[0]), d.shape(args[1])
    if len(sx) < 2 or len(sw) != 3:
        return None
    out = d.tensors[op.outputs[0]]
    bias = O.operand(args, 3)
    return Q4(args, sw[0] * Q4_BLOCK, sw[1], int(args[4]), math.prod(sx[:-1]), d.nbytes(args[0]),
              d.nbytes(args[1]) + d.nbytes(args[2]) + d.nbytes(bias), out.nbytes, out,
              DTYPE_BYTES.get(out.dtype, 4))


@register("linear")
def q4_columns(d: Decomposing, op: Op) -> Split | None:
    """Whole blocks of ``Q4_BLOCK`` rows of the weight (its kernel's layout), with their scales, zeros
    and bias; tiles are concatenated."""
    m = d.read(op, read)
    if m is None:
        return None
    blocks = m.n // Q4_BLOCK

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        a, b = lo * Q4_BLOCK, hi * Q4_BLOCK
        new = list(m.args)
        new[1] = d.cut(m.args[1], 0, lo, hi, op.scope, pieces)
        new[2] = d.cut(m.args[2], 1, a, b, op.scope, pieces)
        if O.operand(m.args, 3) is not None:
            new[3] = d.cut(m.args[3], -1, a, b, op.scope, pieces)
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec((*m.out.shape[:-1], b - a), m.out.dtype)

    return Split("c", "the output columns", blocks,
                 lambda k: m.x + (m.w + m.y) * frac(blocks, k) + m.scratch(m.n * frac(blocks, k), m.rows),
                 0, piece, "concat", -1, along=(m.args[1], 0, 1))


@register("linear")
def q4_rows(d: Decomposing, op: Op) -> Split | None:
    """Rows of the input; tiles are concatenated."""
    m = d.read(op, read)
    if m is None:
        return None
    M = d.shape(m.args[0])[-2]
    nd = len(d.shape(m.args[0]))

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(m.args)
        new[0] = d.cut(m.args[0], nd - 2, lo, hi, op.scope, pieces)
        shape = (*m.out.shape[:-2], hi - lo, m.out.shape[-1])
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec(shape, m.out.dtype)

    return Split("m", "the input rows", M,
                 lambda k: (m.x + m.y) * frac(M, k) + m.w + m.scratch(m.n, m.rows * frac(M, k)),
                 0, piece, "concat", -2, along=(m.args[0], nd - 2, 1))


@register("linear")
def q4_reduction(d: Decomposing, op: Op) -> Split | None:
    """Whole groups of the reduction (a group's scale and zero go with it); partial products are
    summed, the bias added once."""
    m = d.read(op, read)
    if m is None or m.k % m.group:
        return None
    groups = m.k // m.group

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        a, b = lo * m.group, hi * m.group
        new = list(m.args)
        new[0] = d.cut(m.args[0], -1, a, b, op.scope, pieces)
        new[1] = d.cut(m.args[1], 1, a, b, op.scope, pieces)
        new[2] = d.cut(m.args[2], 0, lo, hi, op.scope, pieces)
        if i > 0:
            new[3] = None
        return new, dict(op.attrs["kwargs"]), op.target, m.out

    w = O.ref_name(m.args[1])
    weight_cut = w is not None and w[0] == "p" and (w[1], 1) in d.param_edges
    # NOTE: as the deployment cut the weight, when it did
    along = (m.args[1], 1, m.group) if weight_cut else (m.args[0], -1, m.group)
    return Split("r", "the reduction", groups,
                 lambda k: (m.x + m.w) * frac(groups, k) + m.y + m.scratch(m.n, m.rows),
                 0, piece, "sum", -1, along=along)
