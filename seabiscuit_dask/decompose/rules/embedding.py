"""embedding: by token rows, vocabulary rows (masked lookups, summed) or embedding columns."""

from __future__ import annotations

from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register

ROWS = "sb.embedding_rows"   # lookup in rows [base, base + V) of a table; zero elsewhere


@register("embedding")
def vocabulary_rows(d: Decomposing, op: Op) -> Split | None:
    """Rows of the table, each tile a masked lookup; tiles are summed.

    Preferred over columns for tall tables (``V >= 4 D``).
    """
    if op.target == ROWS:
        return None
    args = list(op.attrs["args"])
    W, idx = args[0], args[1]
    V, D = d.shape(W)
    out = d.tensors[op.outputs[0]]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        return [d.cut(W, 0, lo, hi, op.scope, pieces), idx, lo], {}, ROWS, out

    w, i_b, y = d.nbytes(W), d.nbytes(idx), out.nbytes
    return Split("v", "the vocabulary rows", V, lambda k: w * frac(V, k) + i_b + y, 0,
                 piece, "sum", -1, tiebreak=0 if V >= 4 * D else 1, along=(W, 0, 1))


@register("index")
def selected_rows(d: Decomposing, op: Op) -> Split | None:
    """``index_select(table, 0, idx)`` of a 2-D table is a lookup of ``idx`` in it (position tables
    read by index): cut as the vocabulary rows of an embedding."""
    args = list(op.attrs["args"])
    if op.target != "aten.index_select.default" or len(args) != 3 or not isinstance(args[1], int):
        return None
    W, dim, idx = args
    if len(d.shape(W)) != 2 or dim % 2 != 0 or len(d.shape(idx)) != 1:
        return None
    V = d.shape(W)[0]
    out = d.tensors[op.outputs[0]]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        return [d.cut(W, 0, lo, hi, op.scope, pieces), idx, lo], {}, ROWS, out

    w, i_b, y = d.nbytes(W), d.nbytes(idx), out.nbytes
    return Split("v", "the table rows", V, lambda k: w * frac(V, k) + i_b + y, 0, piece, "sum", -1,
                 along=(W, 0, 1))


@register("embedding")
def embedding_columns(d: Decomposing, op: Op) -> Split | None:
    """Columns of the table; tiles are concatenated."""
    args = list(op.attrs["args"])
    W, idx = args[0], args[1]
    _, D = d.shape(W)
    out = d.tensors[op.outputs[0]]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(args)
        new[0] = d.cut(W, 1, lo, hi, op.scope, pieces)
        return new, {}, op.target, TensorSpec((*out.shape[:-1], hi - lo), out.dtype)

    w, i_b, y = d.nbytes(W), d.nbytes(idx), out.nbytes
    return Split("d", "the embedding columns", D, lambda k: (w + y) * frac(D, k) + i_b, 0,
                 piece, "concat", -1, along=(W, 1, 1))


@register("embedding")
def token_rows(d: Decomposing, op: Op) -> Split | None:
    """Rows of the indices (the last dim): each tile looks up its own tokens; the tiles are the output."""
    args = list(op.attrs["args"])
    W, idx = args[0], args[1]
    si = d.shape(idx)
    if not si:
        return None
    out = d.tensors[op.outputs[0]]
    n, dim = si[-1], len(si) - 1

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(args)
        new[1] = d.cut(idx, dim, lo, hi, op.scope)
        shape = (*out.shape[:dim], hi - lo, out.shape[-1])
        return new, {}, op.target, TensorSpec(shape, out.dtype)

    w, i_b, y = d.nbytes(W), d.nbytes(idx), out.nbytes
    return Split("t", "the token rows", n, lambda k: w + (i_b + y) * frac(n, k), 0, piece, "concat", dim,
                 along=(idx, dim, 1))
