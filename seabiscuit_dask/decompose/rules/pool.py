"""max and average pooling: strips of the output along a spatial dim, each with its halo.

As for convolutions (``conv.py``): output rows ``[a, b)`` read input rows
``[a*s - p, (b-1)*s - p + dil*(k-1) + 1)`` clipped to the input, and a strip pads
where the clip removed the border: with ``-inf`` for max pooling (so ceil mode is
exact too), with zeros for average pooling, which is exact only where the padding
counts in the divisor (``count_include_pad``, or no padding) and no window runs past
the padded input (ceil mode that changes nothing). Adaptive pooling is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split
from .conv import Window, halo_strips, per_dim, strip_dim
from .registry import Decomposing, register

MAX = "sb.max_pool_strip"   # (X, kernel_size, stride, [[before, after], ...], dilation)
AVG = "sb.avg_pool_strip"   # (X, kernel_size, stride, [[before, after], ...], divisor_override)


@dataclass(frozen=True)
class Pool:
    """A pooling as a strip kernel's arguments: ``strip(X, size, stride, pads, last)``."""

    strip: str
    X: Any
    size: list[int]
    stride: list[int]
    last: Any             # dilation (max) or divisor_override (avg)
    windows: list[Window]


def windows(d: Decomposing, op: Op, size: list[int], stride: list[int], dilation: list[int],
            pads: list[tuple[int, int]]) -> list[Window]:
    """The windows along each spatial dim (the last ``len(size)`` dims) of ``op``."""
    sx, out = d.shape(op.attrs["args"][0]), d.tensors[op.outputs[0]].shape
    nd = len(size)
    return [Window(sx[j - nd], out[j - nd], stride[j], dilation[j] * (size[j] - 1) + 1, *pads[j])
            for j in range(nd)]


def read(d: Decomposing, op: Op) -> Pool | None:
    """The pooling in ``op`` as a strip kernel would run it; None where strips are not exact."""
    args, target = list(op.attrs["args"]), op.target
    nd = O.pool_nd(target, args)
    if "adaptive" in target:
        return None
    size = per_dim(args[1], nd)
    stride = per_dim(O.operand(args, 2) or size, nd)    # NOTE: no stride means the kernel size
    if target in (MAX, AVG):
        pads = [(int(a), int(b)) for a, b in args[3]]
        dilation = per_dim(args[4], nd) if target == MAX else [1] * nd
        return Pool(target, args[0], size, stride, args[4], windows(d, op, size, stride, dilation, pads))
    padding = per_dim(O.operand(args, 3, 0), nd)
    pads = [(p, p) for p in padding]
    if "max_pool" in target:
        dilation = per_dim(O.operand(args, 4, 1), nd)
        return Pool(MAX, args[0], size, stride, dilation, windows(d, op, size, stride, dilation, pads))
    wins = windows(d, op, size, stride, [1] * nd, pads)
    counts_pad = bool(O.operand(args, 5, True)) or not any(padding)
    overhang = any(w.pads[1] > w.after for w in wins)   # NOTE: ceil mode made a partial last window
    return Pool(AVG, args[0], size, stride, O.operand(args, 6), wins) if counts_pad and not overhang else None


@register("pool")
def spatial_strips(d: Decomposing, op: Op) -> Split | None:
    """Strips of the output along its longest spatial dim, each reading its rows of X with a
    halo; tiles are concatenated."""
    p = d.read(op, read)
    out = d.tensors[op.outputs[0]]
    dim = strip_dim(out.shape, p.windows) if p is not None else None
    if p is None or dim is None:
        return None
    j = dim - (len(out.shape) - len(p.windows))
    win = p.windows[j]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        start, stop, before, after = win.rows(lo, hi)
        pads = [w.pads for w in p.windows]
        pads[j] = [before, after]
        args = [d.cut(p.X, dim, start, stop, op.scope, pieces), p.size, p.stride, pads, p.last]
        shape = (*out.shape[:dim], hi - lo, *out.shape[dim + 1:])
        return args, {}, p.strip, TensorSpec(shape, out.dtype)

    return halo_strips(win, dim, d.nbytes(p.X), 0, out.nbytes, piece)
