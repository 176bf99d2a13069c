"""Attention: heads x query chunks x key chunks, merged exactly (running max / log-sum-exp).

Three targets are cut: ``aten.scaled_dot_product_attention`` and SeaBiscuit's tile
kernels ``sb.attention`` (a chunk of queries against a chunk of keys, normalised)
and ``sb.attention_part`` (the same, unnormalised: its output carries the
log-sum-exp of each row as one more column, so parts over key chunks merge exactly
with ``sb.attention_merge``). Causal masks become a diagonal offset per chunk pair;
key chunks that every query of a tile is masked from are never computed. The score
matrix of a tile counts in its working set (``ops.scratch``), so no tile holds
a full one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ... import ops as O
from ...ir import Op, TensorSpec
from ...ops import ATTENTION_SCORES
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register

SDPA = "aten.scaled_dot_product_attention.default"
CHUNK = "sb.attention"
PART = "sb.attention_part"
MERGE = "sb.attention_merge"
FINISH = "sb.attention_finish"


@dataclass(frozen=True)
class Attention:
    """``attention(Q, K, V, mask)`` on (B, H, L, E) tensors: what any of the targets computes."""

    q: Any
    k: Any
    v: Any
    mask: Any
    diag: int | None        # causal: query i sees key j iff j <= i + diag; None: no causal mask
    scale: float
    sq: tuple[int, int, int, int]
    sk: tuple[int, int, int, int]
    mask_shape: tuple[int, ...]   # padded on the left to 4 dims
    part: bool              # the output carries a log-sum-exp column
    sizes: tuple[int, int, int, int, int]   # bytes: Q, K + V, mask, output, scores
    out: TensorSpec

    @property
    def group(self) -> int:
        return self.sq[1] // self.sk[1]

    def cut_mask(self, d: Decomposing, dim: int, lo: int, hi: int, size: int, scope: str) -> Any:
        """The mask's ``[lo, hi)`` along ``dim`` (of the 4-D score shape), unless it broadcasts."""
        if self.mask is None or self.mask_shape[dim] != size:
            return self.mask
        return d.cut(self.mask, dim - (4 - len(d.shape(self.mask))), lo, hi, scope)

    def tile(self, q: Any, k: Any, v: Any, mask: Any, diag: int | None, part: bool,
             rows: int, heads: int) -> tuple[list[Any], str, TensorSpec]:
        """Args, target and output spec of a tile on the given operands."""
        dv = self.out.shape[3] - (1 if self.part else 0)
        shape = (self.sq[0], heads, rows, dv + 1 if part else dv)
        spec = TensorSpec(shape, "float32" if part else self.out.dtype)
        return [q, k, v, mask, diag, self.scale], PART if part else CHUNK, spec


def read(d: Decomposing, op: Op) -> Attention | None:
    """The attention in ``op``, or None when the rules cannot cut it (dropout, odd shapes)."""
    args = list(op.attrs["args"])
    kwargs = dict(op.attrs.get("kwargs", {}))
    q, k, v = args[:3]
    mask = O.operand(args, 3)
    if op.target == SDPA:
        if float(O.operand(args, 4, kwargs.get("dropout_p", 0.0)) or 0.0) != 0.0:
            return None
        causal = bool(O.operand(args, 5, kwargs.get("is_causal", False)))
        diag = 0 if causal else None
        scale = O.operand(args, 6, kwargs.get("scale"))
    else:
        diag, scale = O.operand(args, 4), O.operand(args, 5)
    sq, sk = d.shape(q), d.shape(k)
    if len(sq) != 4 or len(sk) != 4 or sq[1] % sk[1] or len(d.shape(v)) != 4:
        return None
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(sq[3])
    ms = d.shape(mask) if mask is not None else ()
    out = d.tensors[op.outputs[0]]
    scores = sq[0] * sq[1] * sq[2] * sk[2] * ATTENTION_SCORES
    sizes = (d.nbytes(q), d.nbytes(k) + d.nbytes(v), d.nbytes(mask), out.nbytes, scores)
    return Attention(q, k, v, mask, diag, scale, (sq[0], sq[1], sq[2], sq[3]), (sk[0], sk[1], sk[2], sk[3]),
                     (1,) * (4 - len(ms)) + tuple(ms), op.target == PART, sizes, out)


@register("attention")
def heads(d: Decomposing, op: Op) -> Split | None:
    """Whole KV heads with their query heads (GQA-aware); the tiles are the output."""
    a = d.read(op, read)
    if a is None:
        return None
    g, H, n = a.group, a.sq[1], a.sk[1]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        s = op.scope
        mask = a.cut_mask(d, 1, lo * g, hi * g, H, s)
        args, target, spec = a.tile(d.cut(a.q, 1, lo * g, hi * g, s), d.cut(a.k, 1, lo, hi, s),
                                    d.cut(a.v, 1, lo, hi, s), mask, a.diag, a.part, a.sq[2], (hi - lo) * g)
        return args, {}, target, spec

    total = sum(a.sizes)
    return Split("h", "the heads", n, lambda k: total * frac(n, k), 0, piece, "concat", 1, along=(a.q, 1, g))


@register("attention")
def query_rows(d: Decomposing, op: Op) -> Split | None:
    """Chunks of query rows; a causal chunk reads only the keys its last row may see."""
    a = d.read(op, read)
    if a is None:
        return None
    L, S = a.sq[2], a.sk[2]
    q_b, kv, m, y, sc = a.sizes

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        s = op.scope
        keys = S if a.diag is None else max(1, min(S, hi + a.diag))
        mask = a.cut_mask(d, 2, lo, hi, L, s)
        if mask is not None and a.mask_shape[3] == S and keys < S:
            mask = d.cut(mask, -1, 0, keys, s)
        args, target, spec = a.tile(d.cut(a.q, 2, lo, hi, s), d.cut(a.k, 2, 0, keys, s),
                                    d.cut(a.v, 2, 0, keys, s),
                                    mask, None if a.diag is None else a.diag + lo, a.part, hi - lo, a.sq[1])
        return args, {}, target, spec

    return Split("q", "the query rows", L, lambda k: (q_b + m + y + sc) * frac(L, k) + kv, 0, piece,
                 "concat", 2, along=(a.q, 2, 1))


@register("attention")
def key_chunks(d: Decomposing, op: Op) -> Split | None:
    """Chunks of keys: unnormalised parts merged as a tree by log-sum-exp, then normalised."""
    a = d.read(op, read)
    if a is None:
        return None
    L, S = a.sq[2], a.sk[2]
    q_b, kv, m, _, sc = a.sizes
    part = TensorSpec((a.sq[0], a.sq[1], L, a.out.shape[3] + (0 if a.part else 1)), "float32")

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        s = op.scope
        if a.diag is not None and lo > L - 1 + a.diag:   # NOTE: every query is masked from these keys
            return [], {}, PART, None
        mask = a.cut_mask(d, 3, lo, hi, S, s)
        args, target, spec = a.tile(a.q, d.cut(a.k, 2, lo, hi, s), d.cut(a.v, 2, lo, hi, s), mask,
                                    None if a.diag is None else a.diag - lo, True, L, a.sq[1])
        return args, {}, target, spec

    return Split("k", "the keys", S, lambda k: q_b + part.nbytes + (kv + m + sc) * frac(S, k),
                 3 * part.nbytes,
                 piece, MERGE, 2, kind="attention", finish=None if a.part else FINISH, along=(a.k, 2, 1))
