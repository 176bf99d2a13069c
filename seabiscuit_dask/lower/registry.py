"""The op registry: the only operations a graph may make a worker run.

Graphs are data, never code. A graph, a template cache file or a deploy RPC names
its operations by string (``"aten.linear.default"``); a string is turned into a
callable only by looking it up in ``KERNELS``, a table built from the explicit list
of names below plus SeaBiscuit's own tile kernels (``sb.*``, registered in
``kernels.py``). Anything else, ``aten.from_file.default`` or ``os.system``
alike, is refused with ``UnsupportedOp`` before any op of the graph runs.

Tagged values in op arguments (``{"dtype": "float32"}``) are decoded through the
same kind of tables, never by ``getattr`` on a module.

Adding a kernel is one entry: an ATen overload is one more name in
``ATEN_TARGETS``; any other callable is one ``register_kernel`` call:

>>> @register_kernel("sb.my_tile_op")                        # doctest: +SKIP
... def my_tile_op(x, n): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from ..errors import SeaBiscuitError, UnsupportedOp
from ..ir import DTYPE_BYTES, Op, OpGraph

F = TypeVar("F", bound=Callable[..., Any])

# NOTE: every ATen overload SeaBiscuit runs: what tracing the supported model families emits
# (GPT-2, Llama, BERT, conv nets, GPT-NeoX, Mistral, Qwen2, Phi, OPT, GPT-J, Bloom, Falcon,
# RoBERTa, DistilBERT, Gemma, ViT) and what decomposition adds. Pure tensor computations
# only: nothing here reads or writes files, sockets or other processes.
ATEN_TARGETS: tuple[str, ...] = tuple(f"aten.{n}" for n in (
    # linear algebra, convolution, embedding, attention
    "linear.default", "addmm.default", "mm.default", "matmul.default", "bmm.default",
    "baddbmm.default", "conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding",
    "conv2d.padding", "conv3d.padding", "conv_transpose1d.default", "conv_transpose2d.input",
    "conv_transpose3d.input",
    "embedding.default", "scaled_dot_product_attention.default",
    # elementwise arithmetic and activations
    "add.Tensor", "add.Scalar", "add_.Tensor", "sub.Tensor", "sub.Scalar", "rsub.Scalar",
    "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "neg.default", "exp.default", "log.default",
    "sqrt.default", "rsqrt.default", "reciprocal.default", "abs.default", "cos.default",
    "sin.default", "tanh.default", "erf.default", "sigmoid.default", "relu.default",
    "relu_.default", "gelu.default", "silu.default", "silu_.default", "hardtanh.default",
    "hardswish.default", "hardsigmoid.default", "leaky_relu.default", "elu.default",
    "clamp.default", "clamp_min.default", "minimum.default", "maximum.default",
    "dropout.default", "round.default", "floor.default", "ceil.default", "sign.default",
    "pow.Scalar", "square.default", "max.other", "min.other", "multiply.Tensor", "div_.Tensor",
    "mul_.Tensor", "tan.default", "asin.default", "acos.default", "atan.default", "sinh.default",
    "cosh.default", "asinh.default", "acosh.default", "atanh.default", "mish.default", "celu.default",
    "fmod.Tensor", "remainder.Tensor", "__xor__.Tensor", "__lshift__.Tensor", "__rshift__.Tensor",
    # comparisons, logic, selection
    "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "gt.Tensor", "gt.Scalar",
    "ge.Tensor", "ge.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor", "le.Scalar",
    "__and__.Tensor", "__or__.Tensor", "logical_not.default", "bitwise_not.default",
    "where.self", "where.ScalarOther", "where.ScalarSelf", "masked_fill.Scalar",
    "masked_fill.Tensor",
    # dtype and memory: the device argument is always replaced by the worker's own
    "to.dtype", "to.dtype_layout", "to.device", "_to_copy.default", "type_as.default",
    "contiguous.default", "clone.default", "alias.default", "detach.default", "detach_.default",
    "lift_fresh_copy.default",
    # normalisation and softmax
    "layer_norm.default", "batch_norm.default", "group_norm.default", "rms_norm.default",
    "_native_batch_norm_legit_no_training.default", "softmax.int", "_softmax.default",
    "log_softmax.int", "_log_softmax.default",
    # reductions
    "sum.default", "sum.dim_IntList", "mean.dim", "amax.default", "max.dim",
    "argmax.default", "cumsum.default", "diff.default", "max.default", "min.default", "topk.default",
    "sort.default", "floor_divide.default", "histc.default", "argmin.default", "prod.dim_int",
    "logsumexp.default", "cumprod.default", "sort.stable",
    "item.default",
    # weight normalisation (of a convolution's weight, from its parametrization)
    "_weight_norm.default",
    # pooling
    "max_pool1d.default", "max_pool2d.default", "max_pool3d.default", "avg_pool1d.default",
    "avg_pool2d.default", "avg_pool3d.default", "adaptive_avg_pool1d.default",
    "adaptive_avg_pool2d.default", "adaptive_avg_pool3d.default", "adaptive_max_pool2d.default",
    # views and shape changes
    "view.default", "reshape.default", "_unsafe_view.default", "transpose.int", "t.default",
    "numpy_T.default", "permute.default", "unsqueeze.default", "squeeze.dim", "squeeze.default",
    "expand.default", "slice.Tensor", "select.int", "narrow.default", "flatten.using_ints",
    "unflatten.int", "split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int",
    "repeat.default", "repeat_interleave.self_int", "cat.default", "stack.default",
    "reshape_as.default", "broadcast_to.default", "pad.default", "constant_pad_nd.default", "im2col.default",
    "flip.default", "triu.default", "tril.default",
    # creation (sizes and values come from the graph, never data from outside it)
    "arange.default", "arange.start", "arange.start_step", "full.default", "zeros.default",
    "ones.default", "new_ones.default", "new_zeros.default", "full_like.default",
    "zeros_like.default", "ones_like.default", "scalar_tensor.default", "empty.memory_format",
    # indexing
    "index.Tensor", "gather.default", "index_select.default", "scatter.src", "scatter_reduce.two",
    # linear algebra on small matrices, and einsum (run whole)
    "einsum.default", "linalg_det.default",
))

# NOTE: dtype names are the IR's vocabulary (ir.DTYPE_BYTES); layouts and memory formats are
# the few that tracing records.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({n: getattr(torch, n) for n in DTYPE_BYTES})
LAYOUTS: Mapping[str, torch.layout] = MappingProxyType({"strided": torch.strided})
MEMORY_FORMATS: Mapping[str, torch.memory_format] = MappingProxyType({
    "contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d,
})
TAGGED: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS,
})

_kernels: dict[str, Callable[..., Any]] = {}
KERNELS: Mapping[str, Callable[..., Any]] = MappingProxyType(_kernels)
SUPPORTED = KERNELS.keys()     # a live view: names registered later are in it too


def register_kernel(target: str, fn: F | None = None, *, replace: bool = False) -> Any:
    """Make ``target`` runnable by ``fn``; with no ``fn``, a decorator that registers.

    A target is registered once; ``replace=True`` swaps its kernel on purpose.
    Register in a module every worker imports too: each process has its own registry.

    Examples
    --------
    >>> register_kernel("aten.erfinv.default", torch.ops.aten.erfinv.default)   # doctest: +SKIP
    """
    if fn is None:
        return lambda f: register_kernel(target, f, replace=replace)
    if not isinstance(target, str) or target.count(".") not in (1, 2) or not callable(fn):
        raise SeaBiscuitError(f"register_kernel: expected a target 'ns.op[.overload]' and a callable, "
                              f"got {target!r} and {type(fn).__name__}")
    if target in _kernels and not replace and _kernels[target] is not fn:
        raise SeaBiscuitError(f"register_kernel: {target} already has a kernel; pass replace=True")
    _kernels[target] = fn
    return fn


def _aten(target: str) -> Callable[..., Any]:
    _ns, name, overload = target.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)  # NOTE: names from ATEN_TARGETS only


for _t in ATEN_TARGETS:
    register_kernel(_t, _aten(_t))


def registry_hint() -> str:
    """What an ``UnsupportedOp`` message tells its reader to do."""
    return (f"SeaBiscuit supports {len(SUPPORTED)} ops (see seabiscuit_dask.lower.kernels.SUPPORTED); "
            "a graph naming anything else is refused, since graphs are data, never code. To run "
            "another op, add its name to seabiscuit_dask.lower.registry.ATEN_TARGETS or call "
            "seabiscuit_dask.lower.register_kernel(target, fn) on the client and on every worker")


def resolve_target(target: str, op: Op | None = None) -> Callable[..., Any]:
    """The registered kernel of ``target``; ``UnsupportedOp`` for anything else.

    ``op``, when given, is named in the error.
    """
    fn = _kernels.get(target) if isinstance(target, str) else None
    if fn is None:
        what = (f"op {op.name!r} ({op.scope or 'no scope'}) names {target!r}, which is" if op is not None
                else f"target {target!r} is")
        raise UnsupportedOp(f"{what} not in SeaBiscuit's op registry. {registry_hint()}")
    return fn


def require_registered(ops: OpGraph | Iterable[Op], where: str = "") -> None:
    """Refuse ``ops`` (a graph or its ops) if any names a target outside the registry.

    Run it before anything of a graph runs. The error lists every unregistered
    target once, with the first op that names it; ``where`` says whose ops they
    are (default: the graph's name).

    >>> require_registered(graph, where="template cache file t-1.json")   # doctest: +SKIP
    """
    if isinstance(ops, OpGraph):
        where = where or f"graph {ops.meta.get('name', '')!r}"
        ops = ops.ops
    unknown: dict[str, str] = {}
    for op in ops:
        target = op.target if isinstance(op.target, str) else repr(op.target)
        if target not in _kernels and target not in unknown:
            unknown[target] = op.name
    if unknown:
        listed = ", ".join(f"{t!r} (op {name!r})" for t, name in unknown.items())
        raise UnsupportedOp(f"{where or 'ops'}: {len(unknown)} target(s) not in SeaBiscuit's op registry: "
                            f"{listed}. {registry_hint()}")


def tagged_value(tag: str, name: Any) -> Any:
    """``("dtype", "float32")`` -> ``torch.float32``, through ``TAGGED`` only."""
    table = TAGGED[tag]
    value = table.get(name) if isinstance(name, str) else None
    if value is None:
        raise UnsupportedOp(f"{tag} {name!r} is not one SeaBiscuit knows; known {tag}s: "
                            f"{', '.join(table)}")
    return value


def torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype of an IR dtype name; ``UnsupportedOp`` for any other string."""
    dtype: torch.dtype = tagged_value("dtype", name)
    return dtype
