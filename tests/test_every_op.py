"""Every op of the registry can be cut: a case per registered target, whose working set is four
times the budget it is decomposed at; the pieces fit and give the op's own result. An op that
cannot be cut is declared so, with its reason (``ops.INDIVISIBLE``), and the error then names
the smallest budget that works; a tile op that only rules make (``ops.PIECES``) is checked in
the decompositions that make it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn

import seabiscuit_dask as sb
from seabiscuit_dask import ops as O
from seabiscuit_dask.decompose import largest_working_set
from seabiscuit_dask.lower.registry import SUPPORTED
from seabiscuit_dask.qlinear import pack_int4
from seabiscuit_dask.quantize import quantize_groups

A = torch.ops.aten
R, C = 64, 256          # NOTE: a 64 KiB float32 activation


def fx() -> torch.Tensor:
    return torch.randn(R, C, generator=torch.Generator().manual_seed(0))


def pos() -> torch.Tensor:
    return torch.rand(R, C, generator=torch.Generator().manual_seed(1)) + 0.5


def ix(lo: int = -50, hi: int = 50, shape: tuple[int, ...] = (R, C)) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(2))


def mask() -> torch.Tensor:
    return torch.rand(R, C, generator=torch.Generator().manual_seed(3)) > 0.5


def img(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4))


@dataclass
class Case:
    """``fn(*inputs, *params)``: params are the module's weights (tiled like any weight)."""

    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    exact: bool = True          # NOTE: False: partial sums of a cut reduction, to float tolerance
    values: bool = True         # NOTE: False: the op's values are undefined (empty): shapes only
    # NOTE: computed in bf16 by a path its rows choose (``qlinear.Q4_GEMM_ROWS``): a piece of fewer rows
    # may take the other, so pieces agree with the whole within bf16's precision, not float32's
    bf16: bool = False


class OneOp(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.fn = case.fn
        for k, v in case.params.items():
            self.register_buffer(k, v)
        self.names = list(case.params)

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.fn(*xs, *[getattr(self, k) for k in self.names])


CASES: dict[str, Case] = {}


def case(target: str, fn: Callable[..., Any], *inputs: torch.Tensor, **kw: Any) -> None:
    assert target not in CASES, target
    CASES[target] = Case(fn, inputs, **kw)


def _overload(target: str) -> Any:
    _, name, overload = target.split(".")
    return getattr(getattr(A, name), overload)


def _with(target: str, *extra: Any) -> Callable[..., Any]:
    """``target(x, *extra)``."""
    f = _overload(target)
    return lambda x: f(x, *extra)


# --- elementwise -------------------------------------------------------------------------------
for _t, _make in [
    ("neg.default", fx), ("exp.default", fx), ("log.default", pos), ("sqrt.default", pos),
    ("rsqrt.default", pos), ("reciprocal.default", pos), ("abs.default", fx), ("cos.default", fx),
    ("sin.default", fx), ("tanh.default", fx), ("erf.default", fx), ("sigmoid.default", fx),
    ("relu.default", fx), ("gelu.default", fx), ("silu.default", fx), ("hardtanh.default", fx),
    ("hardswish.default", fx), ("hardsigmoid.default", fx), ("leaky_relu.default", fx),
    ("elu.default", fx), ("round.default", fx), ("floor.default", fx), ("ceil.default", fx),
    ("sign.default", fx), ("square.default", fx), ("clone.default", fx), ("contiguous.default", fx),
    ("lift_fresh_copy.default", fx), ("logical_not.default", mask), ("bitwise_not.default", ix),
]:
    case(f"aten.{_t}", _overload(f"aten.{_t}"), _make())
case("aten.alias.default", lambda x: A.alias.default(x) + 1, fx())
case("aten.detach.default", lambda x: A.detach.default(x) + 1, fx())
case("aten.dropout.default", lambda x: A.dropout.default(x, 0.1, False), fx())
case("aten.clamp.default", lambda x: A.clamp.default(x, -0.5, 0.5), fx())
case("aten.clamp_min.default", lambda x: A.clamp_min.default(x, 0.1), fx())
case("aten.to.dtype", lambda x: A.to.dtype(x, torch.float64), fx())
case("aten.to.dtype_layout", lambda x: A.to.dtype_layout(x, dtype=torch.float64), fx())
case("aten.to.device", lambda x: A.to.device(x, torch.device("cpu"), torch.float64), fx())
case("aten._to_copy.default", lambda x: A._to_copy.default(x, dtype=torch.float64), fx())
case("aten.type_as.default", lambda x, y: A.type_as.default(x, y), fx(), fx().double())
for _t in ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "minimum.default", "maximum.default",
           "max.other", "min.other", "multiply.Tensor", "eq.Tensor", "ne.Tensor", "gt.Tensor", "ge.Tensor",
           "lt.Tensor", "le.Tensor"):
    case(f"aten.{_t}", _overload(f"aten.{_t}"), fx(), fx().flip(0))
case("aten.pow.Tensor_Tensor", A.pow.Tensor_Tensor, pos(), fx())
case("aten.div.Tensor_mode", lambda x, y: A.div.Tensor_mode(x, y, rounding_mode="floor"), fx(), pos())
case("aten.floor_divide.default", A.floor_divide.default, ix(), ix(1, 9))
case("aten.__and__.Tensor", A.__and__.Tensor, mask(), mask().flip(0))
case("aten.__or__.Tensor", A.__or__.Tensor, mask(), mask().flip(0))
for _t, _v in [("add.Scalar", 2.0), ("sub.Scalar", 2.0), ("rsub.Scalar", 2.0), ("mul.Scalar", 3.0),
               ("div.Scalar", 3.0), ("pow.Tensor_Scalar", 3), ("eq.Scalar", 0), ("ne.Scalar", 0),
               ("gt.Scalar", 0.1), ("ge.Scalar", 0.1), ("lt.Scalar", 0.1), ("le.Scalar", 0.1)]:
    case(f"aten.{_t}", _with(f"aten.{_t}", _v), ix(-3, 3) if "eq" in _t or "ne" in _t else fx())
case("aten.pow.Scalar", lambda x: A.pow.Scalar(2.0, x), fx())
case("aten.where.self", A.where.self, mask(), fx(), fx().flip(0))
case("aten.where.ScalarOther", lambda m, x: A.where.ScalarOther(m, x, 0.5), mask(), fx())
case("aten.where.ScalarSelf", lambda m, x: A.where.ScalarSelf(m, 0.5, x), mask(), fx())
case("aten.masked_fill.Scalar", lambda x, m: A.masked_fill.Scalar(x, m, -1.0), fx(), mask())
case("aten.masked_fill.Tensor", lambda x, m: A.masked_fill.Tensor(x, m, torch.tensor(-1.0)), fx(), mask())

# --- what in-place writes become out of place (tracing functionalises them) ---------------------------
case("aten.copy.default", A.copy.default, fx(), ix())             # NOTE: into x's dtype
case("aten.fill.Scalar", lambda x: A.fill.Scalar(x, 2.5), fx())
case("aten.fill.Tensor", A.fill.Tensor, fx(), torch.tensor(2.5))
case("aten.zero.default", A.zero.default, fx())
case("aten.slice_scatter.default", lambda x, y: A.slice_scatter.default(x, y, 1, 8, 200), fx(), img(R, 192))
case("aten.select_scatter.default", lambda x, y: A.select_scatter.default(x, y, 1, 3), img(4, R, C),
     img(4, C))
case("aten.index_put.default", lambda x, i, v: A.index_put.default(x, [i], v), fx(),
     torch.randperm(R, generator=torch.Generator().manual_seed(5))[:32], img(32, C))

# --- normalisation, softmax ----------------------------------------------------------------------
_w, _b = torch.rand(C) + 0.5, torch.randn(C)
case("aten.layer_norm.default", lambda x, w, b: A.layer_norm.default(x, [C], w, b, 1e-5), fx(),
     params={"w": _w, "b": _b}, exact=False)
case("aten.rms_norm.default", lambda x, w: A.rms_norm.default(x, [C], w, 1e-6), fx(), params={"w": _w},
     exact=False)
_ch = torch.rand(16) + 0.5
case("aten.batch_norm.default",
     lambda x, w, b, m, v: A.batch_norm.default(x, w, b, m, v, False, 0.1, 1e-5, False),
     img(4, 16, 16, 16), params={"w": _ch, "b": _ch - 1, "m": _ch / 3, "v": _ch + 1})
case("aten._native_batch_norm_legit_no_training.default",
     lambda x, w, b, m, v: A._native_batch_norm_legit_no_training.default(x, w, b, m, v, 0.1, 1e-5)[0],
     img(4, 16, 16, 16), params={"w": _ch, "b": _ch - 1, "m": _ch / 3, "v": _ch + 1})
case("aten.group_norm.default", lambda x, w, b: A.group_norm.default(x, 4, w, b, 1e-5, False),
     img(2, 16, 16, 32), params={"w": _ch, "b": _ch - 1}, exact=False)
for _t in ("softmax.int", "log_softmax.int"):
    case(f"aten.{_t}", _with(f"aten.{_t}", -1), fx(), exact=False)
for _t in ("_softmax.default", "_log_softmax.default"):
    case(f"aten.{_t}", _with(f"aten.{_t}", -1, False), fx(), exact=False)
case("aten._weight_norm.default", lambda x, v, g: x @ A._weight_norm.default(v, g, 0).t(), fx(),
     params={"v": torch.randn(128, C), "g": torch.rand(128, 1) + 0.5}, exact=False)

# --- reductions ------------------------------------------------------------------------------------
case("aten.sum.default", A.sum.default, fx(), exact=False)
case("aten.sum.dim_IntList", lambda x: A.sum.dim_IntList(x, [1]), fx(), exact=False)
case("aten.mean.dim", lambda x: A.mean.dim(x, [1], True), fx(), exact=False)
case("aten.amax.default", lambda x: A.amax.default(x, [1]), fx())
case("aten.max.dim", lambda x: A.max.dim(x, 1)[0], fx())
case("aten.argmax.default", lambda x: A.argmax.default(x, 1), fx())
case("aten.cumsum.default", lambda x: A.cumsum.default(x, 1), fx(), exact=False)
case("aten.diff.default", lambda x: A.diff.default(x, 1, 1), fx())
case("aten.max.default", A.max.default, fx())
case("aten.min.default", A.min.default, fx())
case("aten.topk.default", lambda x: A.topk.default(x, 4, 1)[0], fx())
case("aten.sort.default", lambda x: A.sort.default(x, 1)[0], fx())
case("aten.histc.default", lambda x: A.histc.default(x, 16, -2.0, 2.0), fx())
case("aten.item.default", lambda x: A.item.default(x.sum()), fx())
case("aten.all.dim", lambda m: A.all.dim(m, 1), mask() | (torch.arange(R) % 2 == 0)[:, None])

# --- pooling -----------------------------------------------------------------------------------------
case("aten.max_pool1d.default", lambda x: A.max_pool1d.default(x, [3], [2], [1]), img(4, 16, 512))
case("aten.max_pool2d.default", lambda x: A.max_pool2d.default(x, [3, 3], [2, 2], [1, 1]), img(2, 8, 32, 64))
case("aten.max_pool3d.default", lambda x: A.max_pool3d.default(x, [2, 2, 2], [2, 2, 2]), img(2, 4, 8, 16, 32))
case("aten.avg_pool1d.default", lambda x: A.avg_pool1d.default(x, [3], [2], [1]), img(4, 16, 512),
     exact=False)
case("aten.avg_pool2d.default", lambda x: A.avg_pool2d.default(x, [3, 3], [2, 2], [1, 1]), img(2, 8, 32, 64),
     exact=False)
case("aten.avg_pool3d.default", lambda x: A.avg_pool3d.default(x, [2, 2, 2], [2, 2, 2]),
     img(2, 4, 8, 16, 32), exact=False)
case("aten.adaptive_avg_pool1d.default", lambda x: A.adaptive_avg_pool1d.default(x, [8]), img(4, 16, 512),
     exact=False)
case("aten.adaptive_avg_pool2d.default", lambda x: A.adaptive_avg_pool2d.default(x, [4, 4]),
     img(2, 8, 32, 64), exact=False)
case("aten.adaptive_avg_pool3d.default", lambda x: A.adaptive_avg_pool3d.default(x, [2, 2, 2]),
     img(2, 4, 8, 16, 32), exact=False)
case("aten.adaptive_max_pool2d.default", lambda x: A.adaptive_max_pool2d.default(x, [4, 4])[0],
     img(2, 8, 32, 64))

# --- views, joins, padding -----------------------------------------------------------------------------
case("aten.view.default", lambda x: A.view.default(x * 2, [R * 2, C // 2]), fx())
case("aten.reshape.default", lambda x: A.reshape.default(x * 2, [R * 2, C // 2]), fx())
case("aten._unsafe_view.default", lambda x: A._unsafe_view.default(x * 2, [R * 2, C // 2]), fx())
case("aten.transpose.int", lambda x: A.transpose.int(x, 0, 1) * 2, fx())
case("aten.t.default", lambda x: A.t.default(x) * 2, fx())
case("aten.numpy_T.default", lambda x: A.numpy_T.default(x) * 2, fx())
case("aten.permute.default", lambda x: A.permute.default(x, [1, 0]) * 2, fx())
case("aten.unsqueeze.default", lambda x: A.unsqueeze.default(x, 1) * 2, fx())
case("aten.squeeze.dim", lambda x: A.squeeze.dim(x, 1) * 2, img(R, 1, C))
case("aten.squeeze.default", lambda x: A.squeeze.default(x) * 2, img(R, 1, C))
case("aten.expand.default", lambda x: A.expand.default(x * 2, [4, R, C]), fx())
case("aten.broadcast_to.default", lambda x: A.broadcast_to.default(x * 2, [4, R, C]), fx())
case("aten.slice.Tensor", lambda x: A.slice.Tensor(x, 1, 8, 200) * 2, fx())
case("aten.select.int", lambda x: A.select.int(x, 0, 3) * 2, img(4, R, C))
case("aten.narrow.default", lambda x: A.narrow.default(x, 1, 8, 192) * 2, fx())
case("aten.flatten.using_ints", lambda x: A.flatten.using_ints(x, 0, 1) * 2, img(4, R, C))
case("aten.unflatten.int", lambda x: A.unflatten.int(x, 1, [4, C // 4]) * 2, fx())
case("aten.split.Tensor", lambda x: A.split.Tensor(x, 100, 1)[1] * 2, fx())
case("aten.split_with_sizes.default", lambda x: A.split_with_sizes.default(x, [56, 200], 1)[1] * 2, fx())
case("aten.chunk.default", lambda x: A.chunk.default(x, 4, 1)[2] * 2, fx())
case("aten.unbind.int", lambda x: A.unbind.int(x, 0)[1] * 2, img(4, R, C))
case("aten.repeat.default", lambda x: A.repeat.default(x, [1, 2]), fx())
case("aten.repeat_interleave.self_int", lambda x: A.repeat_interleave.self_int(x, 2, 0), fx())
case("aten.cat.default", lambda x, y: A.cat.default([x, y], 1), fx(), pos())
case("aten.concat.default", lambda x, y: A.concat.default([x, y], 1), fx(), pos())
case("aten.stack.default", lambda x, y: A.stack.default([x, y], 0), fx(), pos())
case("aten.reshape_as.default", lambda x, y: A.reshape_as.default(x * 2, y), fx(), img(R * 2, C // 2))
case("aten.pad.default", lambda x: A.pad.default(x, [2, 3, 1, 1], "constant", 0.5), img(4, R, C))
case("aten.constant_pad_nd.default", lambda x: A.constant_pad_nd.default(x, [2, 3, 1, 1], 0.5), img(4, R, C))
case("aten.upsample_nearest2d.vec", lambda x: A.upsample_nearest2d.vec(x, [48, 96], None), img(2, 8, 32, 64))
case("aten.upsample_bilinear2d.vec", lambda x: A.upsample_bilinear2d.vec(x, [48, 96], False, None),
     img(2, 8, 32, 64), exact=False)
case("aten.upsample_bicubic2d.vec", lambda x: A.upsample_bicubic2d.vec(x, [48, 96], False, None),
     img(2, 8, 32, 64), exact=False)
case("aten.meshgrid.indexing", lambda x, y: A.meshgrid.indexing([x, y], indexing="ij")[0] * 2,
     torch.arange(256.0), torch.arange(128.0))
case("aten.outer.default", A.outer.default, torch.randn(256), torch.randn(128))
case("aten.im2col.default", lambda x: A.im2col.default(x, [3, 3], [1, 1], [1, 1], [1, 1]),
     img(8, 4, 16, 16))        # NOTE: cut by samples of the batch

# --- creation: sizes and values from the graph (the input only feeds the graph) -----------------
case("aten.arange.default", lambda x: A.arange.default(R * C), fx())
case("aten.arange.start", lambda x: A.arange.start(3, R * C + 3), fx())
case("aten.arange.start_step", lambda x: A.arange.start_step(0, 2 * R * C, 2), fx())
for _t, _fn in [("full.default", lambda x: A.full.default([R, C], 2.0)),
                ("zeros.default", lambda x: A.zeros.default([R, C])),
                ("ones.default", lambda x: A.ones.default([R, C])),
                ("new_ones.default", lambda x: A.new_ones.default(x, [R * 4, C])),
                ("new_zeros.default", lambda x: A.new_zeros.default(x, [R * 4, C])),
                ("full_like.default", lambda x: A.full_like.default(x, 2.0)),
                ("zeros_like.default", lambda x: A.zeros_like.default(x)),
                ("ones_like.default", lambda x: A.ones_like.default(x)),
                ("scalar_tensor.default", lambda x: A.scalar_tensor.default(3.0)),
                ("empty.memory_format", lambda x: A.empty.memory_format([R, C]))]:
    case(f"aten.{_t}", _fn, fx()[:1, :1] if _t.startswith("new_") else fx(),
         values=_t != "empty.memory_format")

# --- indexing -----------------------------------------------------------------------------------------
case("aten.index.Tensor", lambda x, i: A.index.Tensor(x, [i]), fx(), ix(0, R, (R * 2,)))
case("aten.gather.default", lambda x, i: A.gather.default(x, 1, i), fx(), ix(0, C, (R, C)))
case("aten.index_select.default", lambda x, i: A.index_select.default(x, 0, i), fx(), ix(0, R, (R * 2,)))
case("aten.embedding.default", lambda i, w: A.embedding.default(w, i), ix(0, 512, (4, 64)),
     params={"w": torch.randn(512, 128)})

# --- linear algebra, convolution, attention -------------------------------------------------------------
_W = torch.randn(192, C) / 16
case("aten.linear.default", lambda x, w, b: A.linear.default(x, w, b), fx(), params={"w": _W, "b": _W[:, 0]},
     exact=False)
case("aten.addmm.default", lambda x, b, w: A.addmm.default(b, x, w), fx(),
     params={"b": _W[:, 0], "w": _W.t()}, exact=False)
case("aten.mm.default", lambda x, w: A.mm.default(x, w), fx(), params={"w": _W.t().contiguous()}, exact=False)
case("aten.matmul.default", lambda x, y: A.matmul.default(x, y), fx(), img(C, 96), exact=False)
case("aten.bmm.default", lambda x, y: A.bmm.default(x, y), img(4, 32, 128), img(4, 128, 64), exact=False)
# NOTE: one sample, cut by rows: the reduction (128) is as long as the rows, and must stay whole
case("aten.baddbmm.default", lambda b, x, y: A.baddbmm.default(b, x, y), img(1, 128, 64), img(1, 128, 128),
     img(1, 128, 64), exact=False)
_K = torch.randn(16, 8, 3, 3) / 8
case("aten.conv1d.default", lambda x, w: A.conv1d.default(x, w, None, [1], [1]), img(2, 8, 512),
     params={"w": torch.randn(16, 8, 3) / 8}, exact=False)
case("aten.conv2d.default", lambda x, w: A.conv2d.default(x, w, None, [1, 1], [1, 1]), img(2, 8, 32, 32),
     params={"w": _K}, exact=False)
case("aten.conv3d.default", lambda x, w: A.conv3d.default(x, w, None, [1, 1, 1], [1, 1, 1]),
     img(1, 4, 8, 16, 16), params={"w": torch.randn(8, 4, 3, 3, 3) / 8}, exact=False)
case("aten.conv1d.padding", lambda x, w: A.conv1d.padding(x, w, None, [1], "same"), img(2, 8, 512),
     params={"w": torch.randn(16, 8, 3) / 8}, exact=False)
case("aten.conv2d.padding", lambda x, w: A.conv2d.padding(x, w, None, [1, 1], "same"), img(2, 8, 32, 32),
     params={"w": _K}, exact=False)
case("aten.conv3d.padding", lambda x, w: A.conv3d.padding(x, w, None, [1, 1, 1], "same"),
     img(1, 4, 8, 16, 16), params={"w": torch.randn(8, 4, 3, 3, 3) / 8}, exact=False)
case("aten.conv_transpose1d.default", lambda x, w: A.conv_transpose1d.default(x, w, None, [2]),
     img(2, 16, 256), params={"w": torch.randn(16, 8, 3) / 8}, exact=False)
case("aten.conv_transpose2d.input", lambda x, w: A.conv_transpose2d.input(x, w, None, [2, 2]),
     img(2, 16, 16, 32), params={"w": _K}, exact=False)
case("aten.conv_transpose3d.input", lambda x, w: A.conv_transpose3d.input(x, w, None, [2, 2, 2]),
     img(1, 8, 4, 8, 16), params={"w": torch.randn(8, 4, 3, 3, 3) / 8}, exact=False)
case("aten.scaled_dot_product_attention.default",
     lambda q, k, v: A.scaled_dot_product_attention.default(q, k, v, None, 0.0, True),
     img(1, 4, 128, 32), img(1, 4, 128, 32) / 2, img(1, 4, 128, 32), exact=False)
_Q = torch.randint(-127, 128, (192, C), dtype=torch.int8)
case("sb.qlinear.default", lambda x, w, s: torch.ops.sb.qlinear(x, w, s, None, None, 16), fx(),
     params={"w": _Q, "s": torch.rand(192) / 100}, exact=False)
_Q4, _SZ = quantize_groups(torch.randn(192, C), 32)
case("sb.q4linear.default", lambda x, w, sz: torch.ops.sb.q4linear(x, w, sz, None, 32), fx(),
     params={"w": pack_int4(_Q4), "sz": _SZ}, exact=False, bf16=True)   # NOTE: tiles: slices of the bytes

# --- what ONNX graphs add --------------------------------------------------------------------------
for _t, _make in [("tan.default", fx), ("asin.default", lambda: fx().clamp(-0.9, 0.9)),
                  ("acos.default", lambda: fx().clamp(-0.9, 0.9)), ("atan.default", fx),
                  ("sinh.default", fx), ("cosh.default", fx), ("asinh.default", fx),
                  ("acosh.default", lambda: pos() + 1), ("atanh.default", lambda: fx().clamp(-0.9, 0.9)),
                  ("mish.default", fx), ("celu.default", fx)]:
    case(f"aten.{_t}", _overload(f"aten.{_t}"), _make())
case("aten.fmod.Tensor", A.fmod.Tensor, fx(), pos())
case("aten.remainder.Tensor", A.remainder.Tensor, fx(), pos())
case("aten.__xor__.Tensor", A.__xor__.Tensor, mask(), mask().flip(0))
case("aten.__lshift__.Tensor", A.__lshift__.Tensor, ix(0, 100), ix(0, 4))
case("aten.__rshift__.Tensor", A.__rshift__.Tensor, ix(0, 100), ix(0, 4))
case("aten.argmin.default", lambda x: A.argmin.default(x, 1), fx())
case("aten.prod.dim_int", lambda x: A.prod.dim_int(x, 0), pos() / 1.2, exact=False)
case("aten.logsumexp.default", lambda x: A.logsumexp.default(x, [1]), fx(), exact=False)
case("aten.cumprod.default", lambda x: A.cumprod.default(x, 1), pos() / 1.2, exact=False)
case("aten.sort.stable", lambda x: A.sort.stable(x, stable=True, dim=1)[0], fx())
case("aten.flip.default", lambda x: A.flip.default(x, [1]), fx())
case("aten.triu.default", lambda x: A.triu.default(x, 1), img(4, R, C))
case("aten.tril.default", lambda x: A.tril.default(x, -1), img(4, R, C))
case("aten.scatter.src", lambda x, i, v: A.scatter.src(x, 1, i, v), fx(), torch.argsort(fx(), 1), pos())
case("aten.scatter_reduce.two", lambda x, i, v: A.scatter_reduce.two(x, 1, i, v, "sum"), fx(),
     ix(0, C), pos(), exact=False)
case("aten.einsum.default", lambda x, y: A.einsum.default("ij,jk->ik", [x, y]), fx(), img(C, 96), exact=False)
case("aten.linalg_det.default", A.linalg_det.default, img(256, 8, 8), exact=False)
case("aten.grid_sampler.default", lambda x, g: A.grid_sampler.default(x, g, 0, 0, False), img(2, 8, 32, 64),
     img(2, 24, 24, 2).tanh())

# NOTE: refused at trace, with its reason: it reads a tensor's value into Python (UnsupportedModel)
REFUSED_AT_TRACE = {"aten.item.default": "not a tensor"}


def _run(target: str) -> None:
    c = CASES[target]
    model = OneOp(c).eval()
    if target in REFUSED_AT_TRACE:
        with pytest.raises(sb.UnsupportedModel, match=REFUSED_AT_TRACE[target]):
            sb.trace(model, c.inputs)
        return
    graph = sb.trace(model, c.inputs)
    assert target in {op.target for op in graph.ops}, f"tracing {target}'s case does not emit it"
    ws = max(graph.working_set(op) for op in graph.ops if op.target == target)
    assert largest_working_set(graph)[1] == ws, "the case's largest op is another op"
    budget = max(1, ws // 4)
    if target in O.INDIVISIBLE:
        with pytest.raises(sb.BudgetTooSmall, match=r"Use a budget of at least") as e:
            sb.decompose(graph, budget)
        assert O.INDIVISIBLE[target] in str(e.value)       # NOTE: the reason, in the error
        return
    micro = sb.decompose(graph, budget)
    sb.verify(micro, budget=budget)
    with torch.no_grad():
        want = model(*c.inputs)
    got = sb.run_local(micro, *c.inputs, weights=model)
    assert got.shape == want.shape and got.dtype == want.dtype
    if not c.values:
        return
    if c.exact:
        assert torch.equal(got, want)
    elif c.bf16:
        assert float((got - want).norm() / want.norm()) < 2**-7
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", sorted(CASES))
def test_every_registered_op_is_cut_to_a_quarter_of_its_working_set_or_says_why_not(target: str) -> None:
    _run(target)


def test_every_registered_op_has_a_case() -> None:
    """A new entry of the registry comes with its case here (or is a tile op only rules make)."""
    missing = sorted(t for t in SUPPORTED if t not in CASES and t not in O.PIECES)
    assert not missing, f"registered ops with no case: {missing}"
    stale = sorted(t for t in (*CASES, *O.INDIVISIBLE, *O.PIECES) if t not in SUPPORTED)
    assert not stale, f"cases or declarations of ops that are not registered: {stale}"


class _Rows(nn.Module):
    """A linear layer cut into column tiles, then a softmax over whole rows of it (assembled
    from the tiles), and a few of its columns as an output (a region of one tile)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024, C) / 16, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.w.t()
        return torch.softmax(y, -1), y[:, 3:50]


def test_every_tile_op_is_made_by_the_rule_that_says_it_makes_it() -> None:
    from seabiscuit_dask.trace.decoder import trace_step

    from . import models as M

    made: set[str] = set()
    graphs = [sb.trace(OneOp(CASES[t]), CASES[t].inputs) for t in (
        "aten.scaled_dot_product_attention.default", "aten.conv2d.default", "aten.max_pool2d.default",
        "aten.avg_pool2d.default")]
    graphs.append(sb.trace(OneOp(Case(lambda i, w: A.embedding.default(w, i), (ix(0, 8192, (2, 16)),),
                                      {"w": torch.randn(8192, 8)})), (ix(0, 8192, (2, 16)),)))
    graphs.append(sb.trace(_Rows(), (fx(),)))
    for g in graphs:
        ws = largest_working_set(g)[1]
        for share in (4, 16):
            made |= {op.target for op in sb.decompose(g, ws // share).ops}
    made |= {op.target for op in trace_step(M.llama(), 1, 4).ops}
    assert set(O.PIECES) <= made, f"tile ops no rule made: {set(O.PIECES) - made}"
