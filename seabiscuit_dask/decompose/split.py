"""What a rule returns: one way to cut an op, and how many pieces it takes to fit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..ir import Op, TensorSpec

Pieces = list[tuple[Op, bool]]
"""Ops made by a split, each with ``is_tile``: tiles may be cut again, glue is kept as is."""

Piece = tuple[list[Any], dict[str, Any], str, "TensorSpec | None"]
"""Args, kwargs, target and output spec of one tile (None: the tile adds nothing; skip it)."""

PieceFn = Callable[[int, int, int, Pieces], Piece]
"""``piece(i, lo, hi, pieces)``: tile ``i`` over ``[lo, hi)``; slices it needs go to ``pieces``."""


@dataclass(frozen=True)
class Split:
    """One way to cut an op into tiles along one dimension.

    Attributes
    ----------
    tag : str
        Letter naming the tiles (``up_proj.linear_4.c1``: column tile 1).
    about : str
        What is cut, in words ("the output columns"), for error messages.
    n : int
        Units along the cut.
    ws : callable
        ``ws(k)``: the largest piece's working set for ``k`` pieces (non-increasing).
    glue : float
        Bytes the joining ops need (a concatenation needs none: the output stays tiled;
        partial sums are added by a tree of adds that are cut like any op).
    piece : PieceFn
        Makes one tile.
    join : str
        ``"concat"`` (the tiles are the output), ``"sum"`` (partial sums, added as a
        tree) or the target of a binary merge applied as a tree (``sb.attention_merge``).
    dim : int
        Output dim the tiles are concatenated along.
    tiebreak : int
        Among splits needing equally many pieces, the smaller wins (then rule order).
    kind : str or None
        Kind of the tiles when it differs from the op's.
    finish : str or None
        Target applied to the merged tiles (with the output dtype) to give the output.
    along : (ref, dim, ratio) or None
        The activation operand the split cuts, its dim, and elements per unit: pieces
        are aligned with that operand's tiles, so they read whole tiles where they can.
    quantum : int
        Pieces of at least this many units are whole multiples of it (see ``bounds_for``).
    """

    tag: str
    about: str
    n: int
    ws: Callable[[int], float]
    glue: float
    piece: PieceFn
    join: str = "concat"
    dim: int = -1
    tiebreak: int = 0
    kind: str | None = None
    finish: str | None = None
    along: tuple[Any, int, int] | None = None
    quantum: int = 1

    def bounds(self, k: int) -> list[int]:
        """Bounds of the pieces of a ``k``-way cut."""
        return bounds_for(self.n, k, self.quantum)


def largest_piece(n: int, k: int, q: int = 1) -> int:
    """Units in the largest of ``k`` pieces of ``n``, rounded up to a multiple of ``q``
    unless the pieces are smaller than ``q``."""
    s = -(-n // k)
    return s if s < q else min(n, -(-s // q) * q)


def frac(n: int, k: int, q: int = 1) -> float:
    """Share of ``n`` units held by the largest of ``k`` pieces (see ``bounds_for``)."""
    return largest_piece(n, k, q) / n


def bounds_for(n: int, k: int, q: int = 1) -> list[int]:
    """Bounds ``[0, ..., n]`` of ``k`` balanced pieces of ``n`` units.

    With a quantum ``q > 1`` every piece but the last is a whole multiple of ``q`` units
    (when pieces hold ``q`` or more): there may then be fewer than ``k`` pieces, none
    larger than ``largest_piece(n, k, q)``. Output columns are cut so: a matrix kernel
    gives a column in a whole SIMD vector of a tile the bits the unsplit op gives it, so
    no column differs from its neighbour by a rounding (a softmax over huge logits
    amplifies one ulp into a different answer).
    """
    s = largest_piece(n, k, q)
    if q == 1 or s < q:
        return [round(i * n / k) for i in range(k + 1)]
    return [*range(0, n, s), n]


def min_pieces(split: Split, limit: float) -> int | None:
    """Fewest pieces whose largest working set is at most ``limit``, or None."""
    if split.n < 2 or split.ws(split.n) > limit:
        return None
    lo, hi = 2, split.n
    while lo < hi:  # NOTE: ws(k) is non-increasing in k
        mid = (lo + hi) // 2
        if split.ws(mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo
