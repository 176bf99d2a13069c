"""conv_transpose1d/2d/3d: by output channels (one group), input channels (partial sums) or samples of
the batch.

``conv_transpose(X, W, bias, stride, padding, output_padding, groups, dilation)`` with
``W`` of shape ``[C_in, C_out / groups, *kernel]``: an output channel reads every input
channel and its own slice ``W[:, c]``, so output channels cut exactly (with the bias);
samples of the batch are independent.
"""

from __future__ import annotations

from ... import ops as O
from ...ir import Op, TensorSpec
from ..split import Piece, Pieces, Split, frac
from .registry import Decomposing, register


@register("conv_transpose")
def output_channels(d: Decomposing, op: Op) -> Split | None:
    """Output channels, with their slice of W (dim 1) and of the bias; tiles are concatenated."""
    args = list(op.attrs["args"])
    if len(args) < 2 or int(O.operand(args, 6, 1)) != 1:
        return None
    out = d.tensors[op.outputs[0]]
    bias = O.operand(args, 2)
    n = d.shape(args[1])[1]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(args)
        new[1] = d.cut(args[1], 1, lo, hi, op.scope, pieces)
        if bias is not None:
            new[2] = d.cut(bias, 0, lo, hi, op.scope, pieces)
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec((out.shape[0], hi - lo, *out.shape[2:]),
                                                                   out.dtype)

    x, w, bb, y = d.nbytes(args[0]), d.nbytes(args[1]), d.nbytes(bias), out.nbytes
    return Split("c", "the output channels", n, lambda k: x + (w + bb + y) * frac(n, k), 0, piece,
                 "concat", 1, along=(args[1], 1, 1))


@register("conv_transpose")
def batch(d: Decomposing, op: Op) -> Split | None:
    """Samples of the batch; tiles are concatenated."""
    args = list(op.attrs["args"])
    out = d.tensors[op.outputs[0]]
    n = out.shape[0]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(args)
        new[0] = d.cut(args[0], 0, lo, hi, op.scope, pieces)
        return new, dict(op.attrs["kwargs"]), op.target, TensorSpec((hi - lo, *out.shape[1:]), out.dtype)

    x, w, bb, y = d.nbytes(args[0]), d.nbytes(args[1]), d.nbytes(O.operand(args, 2)), out.nbytes
    return Split("n", "the batch", n, lambda k: (x + y) * frac(n, k) + w + bb, 0, piece, "concat", 0)


@register("conv_transpose")
def input_channels(d: Decomposing, op: Op) -> Split | None:
    """Input channels, with their slice of W (dim 0): each tile's output is a partial sum over its
    channels (a transposed convolution is linear in them), the tiles added and the bias added once."""
    args = list(op.attrs["args"])
    if len(args) < 2 or int(O.operand(args, 6, 1)) != 1 or O.ref_name(args[0]) is None:
        return None
    out = d.tensors[op.outputs[0]]
    bias = O.operand(args, 2)
    n = d.shape(args[1])[0]

    def piece(i: int, lo: int, hi: int, pieces: Pieces) -> Piece:
        new = list(args)
        new[0] = d.cut(args[0], 1, lo, hi, op.scope, pieces)
        new[1] = d.cut(args[1], 0, lo, hi, op.scope, pieces)
        if i > 0 and bias is not None:
            new[2] = None
        return new, dict(op.attrs["kwargs"]), op.target, out

    x, w, bb, y = d.nbytes(args[0]), d.nbytes(args[1]), d.nbytes(bias), out.nbytes
    return Split("i", "the input channels", n, lambda k: (x + w) * frac(n, k) + bb + y, 0, piece, "sum", 1,
                 along=(args[0], 1, 1))
