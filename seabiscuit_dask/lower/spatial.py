"""Tile kernels of spatial strips: convolution and pooling with uneven, explicit padding.

A strip of a convolution or pooling (``decompose/rules/conv.py``, ``pool.py``) reads
its rows of the input plus a halo. Where a strip touches the border of the input it
adds the padding the whole op would have added there, on that side only; inside, it
adds none. Padding is therefore given as ``[before, after]`` per spatial dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .registry import register_kernel

Pads = Sequence[Sequence[int]]
"""``[before, after]`` padding per spatial dim, first spatial dim first."""

CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
MAX_POOL: dict[int, Callable[..., Any]] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
AVG_POOL: dict[int, Callable[..., torch.Tensor]] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def pad_uneven(x: torch.Tensor, pads: Pads, value: float) -> tuple[torch.Tensor, list[int]]:
    """``x`` padded with ``value`` along the dims whose padding is uneven, and the even
    padding (one number per dim) left for the op itself to add."""
    even = [int(lo) if lo == hi else 0 for lo, hi in pads]
    flat = [int(v) for lo, hi in reversed(pads) for v in ((0, 0) if lo == hi else (lo, hi))]
    # NOTE: F.pad copies the tile; only strips at a border (or uneven "same" padding) pay it.
    return (F.pad(x, flat, value=value) if any(flat) else x), even


def lowest(x: torch.Tensor) -> float:
    """The padding value max pooling ignores."""
    return float("-inf") if x.is_floating_point() else float(torch.iinfo(x.dtype).min)


@register_kernel("sb.conv_strip")
def conv_strip(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
               pads: Pads, dilation: Sequence[int], groups: int) -> torch.Tensor:
    """``conv{1,2,3}d`` with zero padding ``[before, after]`` per spatial dim."""
    x, even = pad_uneven(x, pads, 0.0)
    return CONV[weight.dim() - 2](x, weight, bias, stride, even, dilation, groups)


@register_kernel("sb.max_pool_strip")
def max_pool_strip(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int], pads: Pads,
                   dilation: Sequence[int]) -> torch.Tensor:
    """``max_pool{1,2,3}d`` (floor mode) with ``-inf`` padding ``[before, after]`` per spatial dim."""
    x, even = pad_uneven(x, pads, lowest(x))
    out: torch.Tensor = MAX_POOL[len(kernel_size)](x, kernel_size, stride, even, dilation)
    return out


@register_kernel("sb.avg_pool_strip")
def avg_pool_strip(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int], pads: Pads,
                   divisor_override: int | None = None) -> torch.Tensor:
    """``avg_pool{1,2,3}d`` (floor mode) with zero padding ``[before, after]`` per spatial dim,
    the padding counted in each window's divisor (``count_include_pad=True``)."""
    nd = len(kernel_size)
    x, even = pad_uneven(x, pads, 0.0)
    if nd == 1:   # NOTE: avg_pool1d has no divisor_override; strips of it never carry one
        return AVG_POOL[1](x, kernel_size, stride, even, False, True)
    return AVG_POOL[nd](x, kernel_size, stride, even, False, True, divisor_override)
