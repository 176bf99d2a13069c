"""conv1d/2d/3d: by output channels, input channels, whole groups, batch, or spatial strips.

A spatial strip is the output rows ``[a, b)`` along one spatial dim. It reads input
rows ``[a*s - p, (b-1)*s - p + dil*(k-1) + 1)`` (its rows and a halo) clipped to the
input, and pads explicitly where the clip removed the border (``sb.conv_strip``, which
takes ``[before, after]`` padding per spatial dim). Every rule here reads traced
convolutions and strips alike, so a strip can be cut again, by channels or in strips.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, PieceFn, Pieces, Split, frac
from .registry import Decomposing, register

STRIP = "sb.conv_strip"   # conv(X, W, bias, stride, [[before, after], ...], dilation, groups)


@dataclass(frozen=True)
class Window:
    """Sliding windows along one dim: output ``i`` reads rows ``[i*stride - before, ... + extent)``
    of an input of ``size`` rows, padded by ``before`` and ``after``."""

    size: int
    n: int
    stride: int
    extent: int       # dilation * (kernel - 1) + 1
    before: int
    after: int

    def rows(self, a: int, b: int) -> tuple[int, int, int, int]:
        """Input rows ``[start, stop)`` that outputs ``[a, b)`` read, and the padding before and
        after them that a strip adds (what the clip to the input cut off)."""
        start = a * self.stride - self.before
        stop = (b - 1) * self.stride + self.extent - self.before
        return max(start, 0), min(stop, self.size), max(-start, 0), max(stop - self.size, 0)

    def most_rows(self, m: int) -> int:
        """The most input rows that any ``m`` consecutive outputs read."""
        return min(self.size, (m - 1) * self.stride + self.extent)

    @property
    def pads(self) -> list[int]:
        """``[before, after]``, ``after`` grown to cover a last window that runs past it (ceil mode)."""
        need = (self.n - 1) * self.stride + self.extent - self.before - self.size
        return [self.before, max(self.after, need)]

    @property
    def reads_input(self) -> bool:
        """Whether every window reads some input row (so no strip is padding alone)."""
        return self.before < self.extent and (self.n - 1) * self.stride - self.before < self.size


def per_dim(v: Any, nd: int) -> list[int]:
    """An int or per-dim list (of one or ``nd`` ints) as ``nd`` ints."""
    vs = [int(v)] if isinstance(v, int) else [int(x) for x in v]
    return vs * nd if len(vs) == 1 else vs


def strip_dim(shape: Sequence[int], windows: Sequence[Window]) -> int | None:
    """The dim of ``shape`` to cut into strips: the longest of the last ``len(windows)``, among
    those with more than one output whose windows all read input (first on ties), or None."""
    first = len(shape) - len(windows)
    dims = [first + j for j, w in enumerate(windows) if w.n > 1 and w.reads_input]
    return max(dims, key=lambda i: (shape[i], -i)) if dims else None


def halo_strips(win: Window, dim: int, x: int, whole: int, y: int, piece: PieceFn) -> Split:
    """Strips of the output along ``dim``, each reading its input rows with their halo.

    ``x`` and ``y`` are the bytes of the input and the output, ``whole`` those every
    strip reads whole (weights, bias). The working set of ``k`` strips is the largest
    strip's input rows, halo included, plus ``whole``, plus its output rows.
    """
    n = win.n
    x_row, y_row = x // win.size, y // n

    def ws(k: int) -> int:
        m = math.ceil(n / k)
        return win.most_rows(m) * x_row + whole + m * y_row

    # NOTE: a halo is read twice, so cuts without one win ties (tiebreak).
    return Split("s", f"the output into strips along dim {dim}", n, ws, 0, piece, "concat", dim,
                 tiebreak=1)


@dataclass(frozen=True)
class Conv:
    """``conv(X, W, bias, stride, padding, dilation, groups)`` with operand sizes in bytes.

    ``padding`` is a list of ints (``aten.conv*.default``), ``"same"`` or ``"valid"``
    (``aten.conv*.padding``), or ``[before, after]`` per spatial dim (``sb.conv_strip``).
    """

    target: str
    args: list[Any]
    sx: tuple[int, ...]
    sw: tuple[int, ...]
    groups: int
    x: int
    w: int
    bb: int
    y: int
    out: TensorSpec

    @property
    def X(self) -> Any:
        return self.args[0]

    @property
    def W(self) -> Any:
        return self.args[1]

    @property
    def bias(self) -> Any:
        return O.operand(self.args, 2)

    def with_args(self, **changes: Any) -> list[Any]:
        """All seven arguments, defaults filled in, with ``a<i>=value`` replacing argument i."""
        new = list(self.args) + [None] * (7 - len(self.args))
        nd = len(self.sx) - 2
        padding = "valid" if self.target.endswith(".padding") else [0] * nd
        defaults = {3: [1] * nd, 4: padding, 5: [1] * nd, 6: 1}
        for pos, v in defaults.items():
            if new[pos] is None:
                new[pos] = v
        for name, v in changes.items():
            new[int(name[1:])] = v
        return new

    def spec(self, dim: int, size: int) -> TensorSpec:
        """The output spec with ``size`` along ``dim``."""
        shape = self.out.shape
        return TensorSpec((*shape[:dim], size, *shape[dim + 1:]), self.out.dtype)

    def windows(self) -> list[Window] | None:
        """The sliding windows along each spatial dim; None for a padding mode not known here."""
        _, _, _, stride, padding, dilation, _ = self.with_args()
        nd = len(self.sx) - 2
        stride, dilation = per_dim(stride, nd), per_dim(dilation, nd)
        extent = [dl * (k - 1) + 1 for dl, k in zip(dilation, self.sw[2:])]
        if padding == "valid":
            pads = [(0, 0)] * nd
        elif padding == "same":   # NOTE: as torch does: an odd total pads one more after
            pads = [((e - 1) // 2, e - 1 - (e - 1) // 2) for e in extent]
        elif isinstance(padding, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in padding):
            pads = [(int(a), int(b)) for a, b in padding]
        elif isinstance(padding, (int, list, tuple)):
            pads = [(p, p) for p in per_dim(padding, nd)]
        else:
            return None
        return [Window(self.sx[2 + j], self.out.shape[2 + j], stride[j], extent[j], *pads[j])
                for j in range(nd)]


def read(d: Decomposing, op: Op) -> Conv | None:
    """The convolution in ``op``, or None for an unbatched input (left alone)."""
    args = list(op.attrs["args"])
    X, W = args[0], args[1]
    sx, sw = d.shape(X), d.shape(W)
    if len(sx) != len(sw):
        return None
    out = d.tensors[op.outputs[0]]
    return Conv(op.target, args, sx, sw, int(O.operand(args, 6, 1)), d.nbytes(X), d.nbytes(W),
                d.nbytes(O.operand(args, 2)), out.nbytes, out)


@register("conv")
def output_channels(d: Decomposing, op: Op) -> Split | None:
    """Filters of W (and the bias); tiles are concatenated."""
    c = d.read(op, read)
    if c is None or c.groups != 1:
        return None

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        bias = c.bias
        new = c.with_args(a1=d.cut(c.W, 0, lo, hi, op.scope, pieces),
                          a2=d.cut(bias, 0, lo, hi, op.scope, pieces) if bias else None)
        return new, {}, op.target, c.spec(1, hi - lo)

    x, w, bb, y, n = c.x, c.w, c.bb, c.y, c.sw[0]
    return Split("c", "the output channels", n, lambda k: x + (w + bb + y) * frac(n, k), 0,
                 piece, "concat", 1)


@register("conv")
def input_channels(d: Decomposing, op: Op) -> Split | None:
    """Channels of X and W; partial convolutions are summed, the bias added once."""
    c = d.read(op, read)
    if c is None or c.groups != 1:
        return None

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = c.with_args(a0=d.cut(c.X, 1, lo, hi, op.scope, pieces),
                          a1=d.cut(c.W, 1, lo, hi, op.scope, pieces),
                          a2=c.bias if i == 0 else None)
        return new, {}, op.target, c.out

    x, w, bb, y, n = c.x, c.w, c.bb, c.y, c.sw[1]
    return Split("i", "the input channels", n, lambda k: (x + w) * frac(n, k) + bb + y,
                 0, piece, "sum", 1)


@register("conv")
def whole_groups(d: Decomposing, op: Op) -> Split | None:
    """Whole groups of a grouped convolution; tiles are concatenated."""
    c = d.read(op, read)
    if c is None or c.groups == 1:
        return None
    opg, ipg = c.sw[0] // c.groups, c.sw[1]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        bias = c.bias
        new = c.with_args(a0=d.cut(c.X, 1, lo * ipg, hi * ipg, op.scope, pieces),
                          a1=d.cut(c.W, 0, lo * opg, hi * opg, op.scope, pieces),
                          a2=d.cut(bias, 0, lo * opg, hi * opg, op.scope, pieces) if bias else None,
                          a6=hi - lo)
        return new, {}, op.target, c.spec(1, (hi - lo) * opg)

    x, w, bb, y, n = c.x, c.w, c.bb, c.y, c.groups
    return Split("g", "the groups", n, lambda k: (x + w + bb + y) * frac(n, k),
                 0, piece, "concat", 1)


@register("conv")
def batch(d: Decomposing, op: Op) -> Split | None:
    """Samples of the batch; tiles are concatenated."""
    c = d.read(op, read)
    if c is None:
        return None

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        return c.with_args(a0=d.cut(c.X, 0, lo, hi, op.scope, pieces)), {}, op.target, c.spec(0, hi - lo)

    x, w, bb, y, n = c.x, c.w, c.bb, c.y, c.sx[0]
    return Split("n", "the batch", n, lambda k: (x + y) * frac(n, k) + w + bb,
                 0, piece, "concat", 0)


@register("conv")
def spatial_strips(d: Decomposing, op: Op) -> Split | None:
    """Strips of the output along its longest spatial dim, each reading its rows of X with a
    halo; W and the bias are read whole by every strip (any groups); tiles are concatenated."""
    c = d.read(op, read)
    windows = c.windows() if c is not None else None
    dim = strip_dim(c.out.shape, windows) if c is not None and windows is not None else None
    if c is None or windows is None or dim is None:
        return None
    j, nd = dim - 2, len(windows)
    _, _, _, stride, _, dilation, _ = c.with_args()

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        start, stop, before, after = windows[j].rows(lo, hi)
        pads = [w.pads for w in windows]
        pads[j] = [before, after]
        new = c.with_args(a0=d.cut(c.X, dim, start, stop, op.scope, pieces), a3=per_dim(stride, nd),
                          a4=pads, a5=per_dim(dilation, nd))
        return new, {}, STRIP, c.spec(dim, hi - lo)

    return halo_strips(windows[j], dim, c.x, c.w + c.bb, c.y, piece)
