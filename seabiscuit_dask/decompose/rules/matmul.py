"""linear, addmm, mm, matmul, bmm, sb.qlinear: by output columns, input rows, the reduction dim, or
the leading (batch) dim of an input of 3 dims or more against a 2-D weight."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ... import ops as O
from ...ir import DTYPE_BYTES, Op, TensorSpec
from ...ops import QLINEAR, qlinear_columns, qlinear_scratch
from ..split import Piece, Pieces, Split, frac, largest_piece
from .registry import Decomposing, register

COLUMNS = 16
"""Column tiles are whole multiples of this many columns (one 64-byte line of float32)."""

# NOTE: per-column operands cut with the columns (and kept whole across the reduction):
# sb.qlinear's scales and zero points
COLUMN_OPERANDS: dict[str, tuple[int, ...]] = {"sb.qlinear.default": (2, 3)}


@dataclass(frozen=True)
class Matmul:
    """``y = A @ B (+ bias)`` read from an op's arguments, with operand sizes in bytes."""

    args: list[Any]
    a_i: int
    b_i: int
    bias_i: int | None
    sa: tuple[int, ...]
    sb: tuple[int, ...]
    n_dim: int
    k_dim: int
    a: int
    b: int
    bb: int
    y: int
    out: TensorSpec
    cols: tuple[int, ...] = ()
    slab_item: int = 0        # sb.qlinear: bytes per element of its dequantized slab (0: no slab)
    integer: bool = False     # sb.qlinear over integers (accumulated in float64)

    def scratch(self, n: int, k: int, rows: float) -> float:
        """sb.qlinear's scratch (as ``ops.scratch`` counts it) for ``n`` columns over ``k`` of
        the reduction and ``rows`` rows: its slab, A in float64 when integer, one step's product."""
        if not self.slab_item:
            return 0
        return qlinear_scratch(n, k, self.slab_item, qlinear_columns(n, k, self.slab_item), math.ceil(rows),
                               self.integer)

    @property
    def A(self) -> Any:
        return self.args[self.a_i]

    @property
    def B(self) -> Any:
        return self.args[self.b_i]

    @property
    def bias(self) -> Any:
        return O.operand(self.args, self.bias_i) if self.bias_i is not None else None


def read(d: Decomposing, op: Op) -> Matmul | None:
    """The matmul in ``op`` (its operands where the op table's ``MATMUL_OPERANDS`` says), or None
    when it is not one the rules cut."""
    where = O.MATMUL_OPERANDS.get(op.target)
    args = list(op.attrs["args"])
    if where is None or (op.target == "aten.addmm.default"
                         and (O.operand(args, 3, 1) != 1 or O.operand(args, 4, 1) != 1)):
        return None
    a_i, b_i, bias_i, b_nk = where.a, where.b, where.bias, where.b_out_in
    A, B = args[a_i], args[b_i]
    sa, sb = d.shape(A), d.shape(B)
    if len(sa) < 2 or len(sb) < 2:
        return None
    bias = O.operand(args, bias_i) if bias_i is not None else None
    n_dim, k_dim = (0, 1) if b_nk else (len(sb) - 1, len(sb) - 2)
    out = d.tensors[op.outputs[0]]
    cols = tuple(i for i in COLUMN_OPERANDS.get(op.target, ()) if O.operand(args, i) is not None)
    per_column = d.nbytes(bias) + sum(d.nbytes(args[i]) for i in cols)
    slab, integer = 0, False
    if op.target == QLINEAR:
        a_ref = O.ref_name(A)
        dtype = d.tensors[a_ref[1]].dtype if a_ref is not None and a_ref[0] == "t" else "float32"
        integer = not dtype.startswith(("float", "bfloat"))
        slab = 8 if integer else DTYPE_BYTES.get(dtype, 4)
    return Matmul(args, a_i, b_i, bias_i, sa, sb, n_dim, k_dim, d.nbytes(A), d.nbytes(B),
                  per_column, out.nbytes, out, cols, slab, integer)


@register("linear", "matmul")
def output_columns(d: Decomposing, op: Op) -> Split | None:
    """Columns of B (and of the bias); tiles are concatenated."""
    m = d.read(op, read)
    if m is None:
        return None

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(m.args)
        new[m.b_i] = d.cut(m.B, m.n_dim, lo, hi, op.scope, pieces)
        if m.bias is not None and m.bias_i is not None:
            new[m.bias_i] = d.cut(m.bias, -1, lo, hi, op.scope, pieces)
        for j in m.cols:
            new[j] = d.cut(m.args[j], 0, lo, hi, op.scope, pieces)
        spec = TensorSpec((*m.out.shape[:-1], hi - lo), m.out.dtype)
        return new, dict(op.attrs["kwargs"]), op.target, spec

    a, b, bb, y, N, K, q = m.a, m.b, m.bb, m.y, m.sb[m.n_dim], m.sb[m.k_dim], COLUMNS
    rows = math.prod(m.out.shape[:-1])
    return Split("c", "the output columns", N,
                 lambda k: a + (b + bb + y) * frac(N, k, q) + m.scratch(largest_piece(N, k, q), K, rows),
                 0, piece, "concat", -1, along=(m.B, m.n_dim, 1), quantum=q)


@register("linear", "matmul")
def input_rows(d: Decomposing, op: Op) -> Split | None:
    """Rows of A (and of a 2-D bias); tiles are concatenated."""
    m = d.read(op, read)
    if m is None:
        return None
    M = m.sa[-2]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(m.args)
        new[m.a_i] = d.cut(m.A, len(m.sa) - 2, lo, hi, op.scope, pieces)
        bias = m.bias
        if bias is not None and m.bias_i is not None and len(d.shape(bias)) >= 2 \
                and d.shape(bias)[-2] == M:
            new[m.bias_i] = d.cut(bias, -2, lo, hi, op.scope, pieces)
        shape = (*m.out.shape[:-2], hi - lo, m.out.shape[-1])
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec(shape, m.out.dtype)

    a, b, bb, y, N, K = m.a, m.b, m.bb, m.y, m.sb[m.n_dim], m.sb[m.k_dim]
    rows = math.prod(m.out.shape[:-1])
    return Split("m", "the input rows", M,
                 lambda k: (a + y) * frac(M, k) + b + bb + m.scratch(N, K, rows * frac(M, k)),
                 0, piece, "concat", -2, along=(m.A, len(m.sa) - 2, 1))


@register("linear", "matmul")
def reduction(d: Decomposing, op: Op) -> Split | None:
    """The reduction dim of A and B; partial products are summed, the bias added once
    (per-column scales and zero points go whole to every partial product)."""
    m = d.read(op, read)
    if m is None or (op.target == "aten.matmul.default" and len(m.sa) != len(m.sb)):
        return None   # NOTE: a broadcasting matmul keeps to the exact concat splits

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(m.args)
        new[m.a_i] = d.cut(m.A, -1, lo, hi, op.scope, pieces)
        new[m.b_i] = d.cut(m.B, m.k_dim, lo, hi, op.scope, pieces)
        target = op.target
        if m.bias is not None and m.bias_i is not None and i > 0:
            if target == "aten.addmm.default":   # NOTE: no bias left: a plain mm
                new, target = [new[1], new[2]], "aten.mm.default"
            else:
                new[m.bias_i] = None
        return new, dict(op.attrs["kwargs"]), target, m.out

    a, b, bb, y, K, N = m.a, m.b, m.bb, m.y, m.sa[-1], m.sb[m.n_dim]
    rows = math.prod(m.out.shape[:-1])
    b_ref = O.ref_name(m.B)
    weight_cut = b_ref is not None and b_ref[0] == "p" and (b_ref[1], m.k_dim % len(m.sb)) in d.param_edges
    along = (m.B, m.k_dim, 1) if weight_cut else (m.A, -1, 1)   # NOTE: a weight is cut one way only
    return Split("r", "the reduction", K,
                 lambda k: (a + b) * frac(K, k) + bb + y + m.scratch(N, -(-K // k), rows),
                 0, piece, "sum", -1, along=along)


@register("linear", "matmul")
def leading_rows(d: Decomposing, op: Op) -> Split | None:
    """The leading dim of an A of 3 dims or more (a step's rows, each of its own tokens) against a
    2-D B: every tile reads all of B, as it lies. What a tile of a weight held whole elsewhere is
    cut by when its rows pass the budget (``Decomposer.cuts_seeded_tile``): a decode step of
    many rows, whose other dims are one token long."""
    m = d.read(op, read)
    if m is None or len(m.sa) < 3 or len(m.sb) != 2 or m.sa[0] < 2 \
            or (m.bias is not None and len(d.shape(m.bias)) > 1):
        return None
    R = m.sa[0]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(m.args)
        new[m.a_i] = d.cut(m.A, 0, lo, hi, op.scope, pieces)
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec((hi - lo, *m.out.shape[1:]), m.out.dtype)

    a, b, bb, y, N, K = m.a, m.b, m.bb, m.y, m.sb[m.n_dim], m.sb[m.k_dim]
    rows = math.prod(m.out.shape[:-1])
    return Split("b", "the leading rows", R,
                 lambda k: (a + y) * frac(R, k) + b + bb + m.scratch(N, K, rows * frac(R, k)),
                 0, piece, "concat", 0, along=(m.A, 0, 1))
