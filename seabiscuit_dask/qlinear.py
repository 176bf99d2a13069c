"""``sb.qlinear``: a linear layer over int8 (or uint8) weights with per-column scales.

``qlinear(x, w, scale, zero, bias, columns)`` is ``x @ ((w - zero) * scale).T + bias`` for a
weight ``w`` held as ``[out, in]`` integers, ``scale`` and ``zero`` one per output
column (``None``: none). A float ``x`` gives a float output: weight-only
quantization, as ``DequantizeLinear`` or ``Cast`` + ``Mul`` before a ``MatMul`` say.
An integer ``x`` (zero point already taken off) gives the exact ``int32``
accumulation of ``MatMulInteger`` and ``QLinearMatMul``: products of 8-bit values
summed in float64 are integers below 2**53, so nothing rounds.

The weight stays integer wherever it is held; the kernel dequantizes ``columns``
columns at a time into one slab (0: ``ops.qlinear_columns``'s default, at most 1/16 of
the weight's bytes), so a tile's working set is its 1-byte weights plus one slab, and a
quantized model's tiles carry about four times the parameters of float32 tiles in the
same budget. The decomposer widens the slab to what the budget leaves the tile (up to
``ops.QLINEAR_SLAB``): a tile far below the budget dequantizes in one or a few steps. Output columns
and the reduction cut exactly: scales and zero points go with their columns, and
partial sums over the reduction add up (``decompose.rules.matmul``).

It is a torch op (``torch.ops.sb.qlinear``, with a fake kernel, so ``torch.export`` keeps it as one
node): tracing an ONNX model calls it, and ``lower.kernels`` registers it as the kernel of
``sb.qlinear.default``.
"""

from __future__ import annotations

import torch

from .errors import UnsupportedOp
from .ops import qlinear_columns


@torch.library.custom_op("sb::qlinear", mutates_args=())
def qlinear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
            bias: torch.Tensor | None, columns: int = 0) -> torch.Tensor:
    integer = not x.is_floating_point()
    if integer and (scale is not None or bias is not None):
        raise UnsupportedOp("sb.qlinear over integer inputs accumulates integers: it takes no scale or bias "
                            "(apply them to its int32 output)")
    n, k = w.shape
    dtype = torch.float64 if integer else x.dtype
    xs = x.to(dtype) if integer else x
    step = min(n, columns) if columns > 0 else qlinear_columns(n, k, dtype.itemsize)
    slab = torch.empty((step, k), dtype=dtype, device=x.device)

    def dequantized(a: int, b: int) -> torch.Tensor:
        s = slab[: b - a]
        s.copy_(w[a:b])                  # NOTE: copy_ converts int8 in place, far faster than w.float()
        if zero is not None:
            s.sub_(zero[a:b, None])
        if scale is not None:
            s.mul_(scale[a:b, None].to(dtype))
        return s

    if step >= n and not integer:
        return torch.nn.functional.linear(xs, dequantized(0, n), bias)
    # NOTE: one step's product at a time (ops.scratch counts it), into the output's own dtype
    y = torch.empty((*x.shape[:-1], n), dtype=torch.int32 if integer else dtype, device=x.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        y[..., a:b] = torch.nn.functional.linear(xs, dequantized(a, b))
    if bias is not None:
        y += bias
    return y


@qlinear.register_fake
def _qlinear_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                  bias: torch.Tensor | None, columns: int = 0) -> torch.Tensor:
    dtype = x.dtype if x.is_floating_point() else torch.int32
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=dtype)

