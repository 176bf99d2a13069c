"""conv1d/2d/3d: by output channels, input channels, whole groups, or batch."""

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
class Conv:
    """``conv(X, W, bias, stride, padding, dilation, groups)`` with operand sizes in bytes."""

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
        defaults = {3: [1] * nd, 4: [0] * nd, 5: [1] * nd, 6: 1}
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


def read(d: Decomposer, op: Op) -> Conv | None:
    """The convolution in ``op``, or None for an unbatched input (left alone)."""
    args = list(op.attrs["args"])
    X, W = args[0], args[1]
    sx, sw = d.shape(X), d.shape(W)
    if len(sx) != len(sw):
        return None
    out = d.tensors[op.outputs[0]]
    return Conv(args, sx, sw, int(O.operand(args, 6, 1)), d.nbytes(X), d.nbytes(W),
                d.nbytes(O.operand(args, 2)), out.nbytes, out)


@register("conv")
def output_channels(d: Decomposer, op: Op) -> Split | None:
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
    return Split("c", "the output channels", n, lambda k: x + (w + bb + y) * frac(n, k), 2 * y,
                 piece, "concat", 1)


@register("conv")
def input_channels(d: Decomposer, op: Op) -> Split | None:
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
                 max(3 * y, 1.5 * x), piece, "sum", 1)


@register("conv")
def whole_groups(d: Decomposer, op: Op) -> Split | None:
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
                 max(2 * y, 1.5 * x), piece, "concat", 1)


@register("conv")
def batch(d: Decomposer, op: Op) -> Split | None:
    """Samples of the batch; tiles are concatenated."""
    c = d.read(op, read)
    if c is None:
        return None

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        return c.with_args(a0=d.cut(c.X, 0, lo, hi, op.scope, pieces)), {}, op.target, c.spec(0, hi - lo)

    x, w, bb, y, n = c.x, c.w, c.bb, c.y, c.sx[0]
    return Split("n", "the batch", n, lambda k: (x + y) * frac(n, k) + w + bb,
                 max(2 * y, 1.5 * x), piece, "concat", 0)
