"""What a rule returns: one way to cut an op, and how many pieces it takes to fit."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..ir import Op, TensorSpec

Pieces = list[tuple[Op, bool]]
"""Ops made by a split, each with ``is_tile``: tiles may be cut again, glue is kept as is."""

Piece = tuple[list[Any], dict[str, Any], str, TensorSpec]
"""Args, kwargs, target and output spec of one tile."""

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
        Bytes the joining (and slicing) ops need.
    piece : PieceFn
        Makes one tile.
    join : str
        ``"concat"`` (exact) or ``"sum"`` (partial sums).
    dim : int
        Output dim the tiles are concatenated along.
    tiebreak : int
        Among splits needing equally many pieces, the smaller wins (then rule order).
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


def frac(n: int, k: int) -> float:
    """Share of ``n`` units held by the largest of ``k`` balanced pieces."""
    return math.ceil(n / k) / n


def bounds_for(n: int, k: int) -> list[int]:
    """Bounds of ``k`` balanced pieces of ``n`` units: ``[0, ..., n]``."""
    return [round(i * n / k) for i in range(k + 1)]


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
