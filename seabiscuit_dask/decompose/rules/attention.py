"""scaled_dot_product_attention: by heads (whole KV groups) or by query rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split, frac
from .registry import register

if TYPE_CHECKING:
    from ..decomposer import Decomposer


@dataclass(frozen=True)
class Attention:
    """``sdpa(Q, K, V, mask, dropout, causal)`` on (B, H, L, E) tensors, sizes in bytes."""

    args: list[Any]
    shape: tuple[int, int, int, int]   # of Q
    kv_heads: int
    mask_shape: tuple[int, ...]        # the mask's shape, padded on the left to 4 dims
    causal: bool
    qmy: int                           # Q + output + mask
    kv: int
    glue: float
    out: TensorSpec

    @property
    def group(self) -> int:
        return self.shape[1] // self.kv_heads

    def cut_mask(self, d: Decomposer, dim: int, lo: int, hi: int, size: int, scope: str,
                 pieces: Pieces) -> Any:
        """The mask's rows ``[lo, hi)`` along ``dim`` of Q, unless it broadcasts there."""
        mask = O.operand(self.args, 3)
        if mask is None or self.mask_shape[dim] != size:
            return mask
        return d.cut(mask, dim - (4 - len(d.shape(mask))), lo, hi, scope, pieces)


def read(d: Decomposer, op: Op) -> Attention | None:
    """The attention in ``op``, or None unless Q and K are 4-D and KV heads divide Q heads."""
    args = list(op.attrs["args"])
    Q, K, V = args[:3]
    mask = O.operand(args, 3)
    sq, sk = d.shape(Q), d.shape(K)
    if len(sq) != 4 or len(sk) != 4 or sq[1] % sk[1]:
        return None
    ms = d.shape(mask) if mask is not None else ()
    out = d.tensors[op.outputs[0]]
    q, m, y = d.nbytes(Q), d.nbytes(mask), out.nbytes
    biggest = max(q, d.nbytes(K), d.nbytes(V), m)
    return Attention(args, (sq[0], sq[1], sq[2], sq[3]), sk[1], (1,) * (4 - len(ms)) + tuple(ms),
                     bool(O.operand(args, 5, False)), q + y + m, d.nbytes(K) + d.nbytes(V),
                     max(2 * y, 1.5 * biggest), out)


@register("attention")
def heads(d: Decomposer, op: Op) -> Split | None:
    """Whole KV heads with their query heads (GQA-aware); tiles are concatenated."""
    a = d.read(op, read)
    if a is None:
        return None
    g, H = a.group, a.shape[1]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(a.args)
        new[0] = d.cut(new[0], 1, lo * g, hi * g, op.scope, pieces)
        new[1] = d.cut(new[1], 1, lo, hi, op.scope, pieces)
        new[2] = d.cut(new[2], 1, lo, hi, op.scope, pieces)
        if len(new) > 3:
            new[3] = a.cut_mask(d, 1, lo * g, hi * g, H, op.scope, pieces)
        shape = (a.shape[0], (hi - lo) * g, *a.out.shape[2:])
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec(shape, a.out.dtype)

    # NOTE: pieces are whole KV groups, so grouped-query heads stay with their KV head.
    qmy, kv, n = a.qmy, a.kv, a.kv_heads
    return Split("h", "the heads", n, lambda k: (qmy + kv) * frac(n, k), a.glue, piece, "concat", 1)


@register("attention")
def query_rows(d: Decomposer, op: Op) -> Split | None:
    """Rows of Q (and of the mask); every tile sees all keys. Not for causal attention."""
    a = d.read(op, read)
    if a is None or a.causal:
        return None
    L = a.shape[2]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(a.args)
        new[0] = d.cut(new[0], 2, lo, hi, op.scope, pieces)
        if len(new) > 3:
            new[3] = a.cut_mask(d, 2, lo, hi, L, op.scope, pieces)
        shape = (*a.out.shape[:2], hi - lo, *a.out.shape[3:])
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec(shape, a.out.dtype)

    qmy, kv = a.qmy, a.kv
    return Split("q", "the query rows", L, lambda k: qmy * frac(L, k) + kv, a.glue, piece, "concat", 2)
