"""The ONNX op table: one small torch function per ONNX op type (``ONNX_OPS``), and the numpy
functions that fold constants computed from initializers alone (``FOLDS``).

A function takes the ``Node`` and its input values (a ``torch.Tensor`` when traced, an
``np.ndarray`` when constant) and returns its outputs. Shape arithmetic folds in numpy for the
shapes being traced, so ``torch.export`` sees only the tensor ops. An op type is registered
once (``onnx_op``); a second registration is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import qlinear as _qlinear_op  # noqa: F401  (defines torch.ops.sb.qlinear)
from ..errors import UnsupportedOp

if TYPE_CHECKING:
    from onnx import NodeProto

Value = Any              # a torch.Tensor (traced) or an np.ndarray (a constant, folded)
OpFn = Callable[["Node", list[Value]], list[Value]]

ONNX_OPS: dict[str, OpFn] = {}        # ONNX op type -> its torch implementation
FOLDS: dict[str, OpFn] = {}           # ONNX op type -> its numpy implementation, for constants
def onnx_op(*names: str, fold: bool = False) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` for ONNX op types ``names`` (for constants too, when ``fold``)."""
    def deco(fn: OpFn) -> OpFn:
        for n in names:
            if n in ONNX_OPS:
                raise ValueError(f"ONNX op type {n!r} is registered twice")
            ONNX_OPS[n] = fn
            if fold:
                FOLDS[n] = fn
        return fn
    return deco


class QuantWeight(NamedTuple):
    """An integer weight ``[out, in]`` with a scale and zero point per output column (or None),
    given to a MatMul-like node's function in place of its B operand."""

    w: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)


class QuantSlot(NamedTuple):
    """Which input of a node is a quantized weight, and the buffers that hold it."""

    input: int
    w: str
    scale: str | None
    zero: str | None


# NOTE: the B input of these op types, and its zero point (MatMulInteger, QLinearMatMul)
B_SLOTS = {"MatMul": (1, None), "Gemm": (1, None), "MatMulInteger": (1, 3), "QLinearMatMul": (3, 5)}


@dataclass(frozen=True, eq=False)
class Node:
    """One ONNX node as the op functions see it: its type, name, attributes and outputs, and what
    the patterns found of it (``trace/onnx_patterns.py``: passes return new nodes)."""

    op_type: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    domain: str
    attrs: Mapping[str, Any]
    opset: int = 13
    weight_t: bool = False               # MatMul, Gemm: its B input is a weight held transposed
    quant: QuantSlot | None = None       # its B input is an integer weight, held as such

    @classmethod
    def of(cls, proto: NodeProto, opset: int = 13) -> Node:
        from onnx import helper

        return cls(str(proto.op_type), str(proto.name) or f"{proto.op_type}({', '.join(proto.output)})",
                   tuple(str(i) for i in proto.input), tuple(str(o) for o in proto.output), str(proto.domain),
                   {a.name: helper.get_attribute_value(a) for a in proto.attribute}, opset)

    def attr(self, name: str, default: Any = None) -> Any:
        v = self.attrs.get(name, default)
        return v.decode() if isinstance(v, bytes) else v

    def fail(self, what: str) -> UnsupportedOp:
        return UnsupportedOp(f"ONNX node {self.name!r} ({self.op_type}): {what}")


# --- helpers for the op functions -------------------------------------------------------------
def _tensor(v: Value) -> torch.Tensor:
    """A traced tensor as it is; a folded constant as a tensor (lifted into the graph, or inlined)."""
    if isinstance(v, torch.Tensor):
        return v
    return torch.from_numpy(np.array(v, copy=True, order="C"))


def _ints(v: Value) -> list[int]:
    if isinstance(v, torch.Tensor):
        raise UnsupportedOp("a shape, axes or index operand depends on the inputs' values; "
                            "SeaBiscuit needs it constant for the traced shapes")
    return [int(x) for x in np.asarray(v).reshape(-1)]


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


def _np_dtype(onnx_type: int) -> np.dtype:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(int(onnx_type)))


def _torch_dtype(onnx_type: int) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dtype=_np_dtype(onnx_type))).dtype


# --- elementwise -----------------------------------------------------------------------------
def _int_div(a: Any, b: Any) -> Any:
    """ONNX Div: integer division truncates."""
    if np.asarray(a).dtype.kind in "iu":
        return np.trunc(np.asarray(a) / b).astype(np.asarray(a).dtype)
    return np.divide(a, b)


def _tdiv(x: Any, y: Any) -> Any:
    ref = x if isinstance(x, torch.Tensor) else y
    if isinstance(ref, torch.Tensor) and not ref.is_floating_point():
        return torch.div(x, y, rounding_mode="trunc")
    return x / y


_CMP: set[Any] = {np.equal, np.less, np.greater, np.less_equal, np.greater_equal,
                  np.logical_and, np.logical_or, np.logical_xor}

for _name, _np, _t in [
    ("Add", np.add, lambda x, y: x + y), ("Sub", np.subtract, lambda x, y: x - y),
    ("Mul", np.multiply, lambda x, y: x * y), ("Div", _int_div, _tdiv),
    ("Pow", np.power, lambda x, y: torch.pow(x, y)),
    ("Equal", np.equal, lambda x, y: x == y), ("Less", np.less, lambda x, y: x < y),
    ("Greater", np.greater, lambda x, y: x > y), ("LessOrEqual", np.less_equal, lambda x, y: x <= y),
    ("GreaterOrEqual", np.greater_equal, lambda x, y: x >= y),
    ("And", np.logical_and, lambda x, y: x & y), ("Or", np.logical_or, lambda x, y: x | y),
    ("Xor", np.logical_xor, lambda x, y: x ^ y), ("BitwiseAnd", np.bitwise_and, lambda x, y: x & y),
    ("BitwiseOr", np.bitwise_or, lambda x, y: x | y), ("BitwiseXor", np.bitwise_xor, lambda x, y: x ^ y),
]:
    def _mk(np_fn: Any = _np, t_fn: Any = _t) -> OpFn:
        def run(node: Node, vals: list[Value]) -> list[Value]:
            a, b = vals[0], vals[1]
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
                out = np_fn(a, b)
                return [np.asarray(out if np_fn in _CMP else np.asarray(out).astype(np.result_type(a, b)))]
            return [t_fn(_operand(a, b), _operand(b, a))]
        return run
    onnx_op(_name, fold=True)(_mk())


def _operand(v: Value, other: Value) -> Any:
    """A constant operand as a Python scalar (no lifted tensor) when it is one, else a tensor."""
    if isinstance(v, np.ndarray):
        if v.size == 1 and v.ndim == 0 and isinstance(other, torch.Tensor):
            x = v.item()
            return x
        return _tensor(v)
    return v


def _unary(fn: Callable[..., torch.Tensor]) -> OpFn:
    return lambda node, vals: [fn(_tensor(vals[0]))]


for _name, _fn in [
    ("Relu", torch.relu), ("Sigmoid", torch.sigmoid), ("Tanh", torch.tanh), ("Exp", torch.exp),
    ("Log", torch.log), ("Sqrt", torch.sqrt), ("Abs", torch.abs), ("Erf", torch.erf),
    ("Reciprocal", torch.reciprocal), ("Sin", torch.sin), ("Cos", torch.cos),
    ("Softsign", lambda x: x / (1 + x.abs())),
    ("Floor", torch.floor), ("Ceil", torch.ceil), ("Round", torch.round), ("Sign", torch.sign),
    ("IsNaN", lambda x: x != x), ("Tan", torch.tan), ("Asin", torch.asin), ("Acos", torch.acos),
    ("Atan", torch.atan), ("Sinh", torch.sinh), ("Cosh", torch.cosh), ("Asinh", torch.asinh),
    ("Acosh", torch.acosh), ("Atanh", torch.atanh), ("HardSwish", F.hardswish), ("Mish", F.mish),
    ("BitwiseNot", torch.bitwise_not),
]:
    onnx_op(_name)(_unary(_fn))  # type: ignore[arg-type]


@onnx_op("Identity", fold=True)
def _identity(node: Node, vals: list[Value]) -> list[Value]:
    return [vals[0]]


@onnx_op("Neg", fold=True)
def _neg(node: Node, vals: list[Value]) -> list[Value]:
    v = vals[0]
    return [np.negative(v) if isinstance(v, np.ndarray) else -v]


@onnx_op("Not", fold=True)
def _not(node: Node, vals: list[Value]) -> list[Value]:
    v = vals[0]
    return [np.logical_not(v) if isinstance(v, np.ndarray) else torch.logical_not(v)]


@onnx_op("Gelu")
def _gelu(node: Node, vals: list[Value]) -> list[Value]:
    return [F.gelu(_tensor(vals[0]), approximate=node.attr("approximate", "none"))]


@onnx_op("LeakyRelu")
def _leaky(node: Node, vals: list[Value]) -> list[Value]:
    return [F.leaky_relu(_tensor(vals[0]), float(node.attr("alpha", 0.01)))]


@onnx_op("Elu")
def _elu(node: Node, vals: list[Value]) -> list[Value]:
    return [F.elu(_tensor(vals[0]), float(node.attr("alpha", 1.0)))]


@onnx_op("HardSigmoid")
def _hsig(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    return [torch.clamp(x * float(node.attr("alpha", 0.2)) + float(node.attr("beta", 0.5)), 0.0, 1.0)]


@onnx_op("PRelu")
def _prelu(node: Node, vals: list[Value]) -> list[Value]:
    x, slope = _tensor(vals[0]), _tensor(vals[1])
    if slope.dim() == 1 and x.dim() > 2 and slope.shape[0] == x.shape[1] != x.shape[-1]:
        slope = slope.reshape(-1, *([1] * (x.dim() - 2)))     # NOTE: one slope per channel (opset < 7)
    return [torch.where(x < 0, x * slope, x)]


@onnx_op("Selu")
def _selu(node: Node, vals: list[Value]) -> list[Value]:
    alpha = float(node.attr("alpha", 1.67326319217681884765625))
    gamma = float(node.attr("gamma", 1.05070102214813232421875))
    return [F.elu(_tensor(vals[0]), alpha) * gamma]


@onnx_op("Softplus")
def _softplus(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    return [torch.relu(x) + torch.log(torch.exp(-torch.abs(x)) + 1.0)]     # NOTE: exp never overflows


@onnx_op("InstanceNormalization")
def _instance_norm(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])       # NOTE: one group per channel: group_norm is instance norm
    eps = float(node.attr("epsilon", 1e-5))
    return [F.group_norm(x, x.shape[1], _tensor(vals[1]), _tensor(vals[2]), eps)]


@onnx_op("Pad")
def _pad_op(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    rank = x.dim()
    pads = _ints(vals[1]) if len(vals) > 1 and vals[1] is not None else list(node.attr("pads"))
    value = vals[2] if len(vals) > 2 and vals[2] is not None else node.attr("value", 0.0)
    if isinstance(value, torch.Tensor):
        raise node.fail("a Pad value that depends on the inputs is not supported")
    value = np.asarray(value).reshape(-1)[0].item() if np.asarray(value).size else 0
    axes = _ints(vals[3]) if len(vals) > 3 and vals[3] is not None else list(range(rank))
    mode = node.attr("mode", "constant")
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise node.fail(f"Pad mode {mode!r} is not supported")
    half = len(pads) // 2
    for a, before, after in zip(axes, pads[:half], pads[half:]):
        a = _axis(a, rank)
        if before < 0 or after < 0:     # NOTE: negative pads crop
            x = x.narrow(a, max(0, -before), x.shape[a] - max(0, -before) - max(0, -after))
            before, after = max(0, before), max(0, after)
        if not before and not after:
            continue
        n = x.shape[a]
        if mode == "constant":
            parts = [torch.full((*x.shape[:a], w, *x.shape[a + 1:]), value, dtype=x.dtype)
                     for w in (before, after)]
            x = torch.cat([parts[0], x, parts[1]] if before and after else
                          [parts[0], x] if before else [x, parts[1]], dim=a)
            continue
        if mode == "reflect" and (before >= n or after >= n):
            raise node.fail(f"reflect padding of {before}, {after} needs more than {n} elements on axis {a}")
        inner = list(range(n))
        if mode == "edge":
            idx = [0] * before + inner + [n - 1] * after
        elif mode == "reflect":
            idx = list(range(before, 0, -1)) + inner + list(range(n - 2, n - 2 - after, -1))
        else:
            idx = [(i - before) % n for i in range(before)] + inner + [i % n for i in range(after)]
        x = torch.index_select(x, a, torch.from_numpy(np.asarray(idx, dtype=np.int64)))
    return [x]


@onnx_op("Clip")
def _clip(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    lo = vals[1] if len(vals) > 1 else node.attr("min")
    hi = vals[2] if len(vals) > 2 else node.attr("max")
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        raise node.fail("Clip bounds that depend on the inputs are not supported")
    lo = None if lo is None else np.asarray(lo).reshape(()).item()
    hi = None if hi is None else np.asarray(hi).reshape(()).item()
    return [x if lo is None and hi is None else torch.clamp(x, lo, hi)]


@onnx_op("Max", "Min", "Sum", "Mean", fold=True)
def _variadic(node: Node, vals: list[Value]) -> list[Value]:
    if all(isinstance(v, np.ndarray) for v in vals):
        f = {"Max": np.maximum, "Min": np.minimum, "Sum": np.add, "Mean": np.add}[node.op_type]
        out = vals[0]
        for v in vals[1:]:
            out = f(out, v)
        return [out / len(vals) if node.op_type == "Mean" else out]
    ts = [_tensor(v) for v in vals]
    out = ts[0]
    for t in ts[1:]:
        out = {"Max": torch.maximum, "Min": torch.minimum}.get(node.op_type, torch.add)(out, t)
    return [out / len(ts) if node.op_type == "Mean" else out]


@onnx_op("Where", fold=True)
def _where(node: Node, vals: list[Value]) -> list[Value]:
    c, a, b = vals
    if all(isinstance(v, np.ndarray) for v in vals):
        return [np.where(c, a, b)]
    tc = _tensor(c).bool()
    if isinstance(a, np.ndarray) and a.size == 1 and isinstance(b, torch.Tensor):
        return [torch.where(tc, float(a.reshape(())) if b.is_floating_point() else int(a.reshape(())), b)]
    if isinstance(b, np.ndarray) and b.size == 1 and isinstance(a, torch.Tensor):
        return [torch.where(tc, a, float(b.reshape(())) if a.is_floating_point() else int(b.reshape(())))]
    return [torch.where(tc, _tensor(a), _tensor(b))]


@onnx_op("Cast", fold=True)
def _cast(node: Node, vals: list[Value]) -> list[Value]:
    to = int(node.attr("to"))
    v = vals[0]
    if isinstance(v, np.ndarray):
        return [v.astype(_np_dtype(to))]
    return [v.to(_torch_dtype(to))]


# --- shapes ----------------------------------------------------------------------------------
@onnx_op("Shape", fold=True)
def _shape(node: Node, vals: list[Value]) -> list[Value]:
    shape = list(vals[0].shape)
    start, end = node.attr("start", 0), node.attr("end", None)
    return [np.asarray(shape[start:end] if end is not None else shape[start:], dtype=np.int64)]


@onnx_op("Size", fold=True)
def _size(node: Node, vals: list[Value]) -> list[Value]:
    return [np.asarray(int(np.prod(list(vals[0].shape))), dtype=np.int64)]


@onnx_op("Constant", fold=True)
def _constant(node: Node, vals: list[Value]) -> list[Value]:
    from onnx import numpy_helper

    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in node.attrs:
            v = node.attrs[key]
            if key == "value":
                return [np.asarray(numpy_helper.to_array(v))]
            dtype = np.float32 if "float" in key else np.int64
            return [np.asarray(v, dtype=dtype)]
    raise node.fail("only tensor, float(s) and int(s) constants are supported")


@onnx_op("ConstantOfShape", fold=True)
def _const_of_shape(node: Node, vals: list[Value]) -> list[Value]:
    from onnx import numpy_helper

    shape = _ints(vals[0])
    value = node.attrs.get("value")
    fill = np.asarray(numpy_helper.to_array(value)).reshape(-1)[0] if value is not None else np.float32(0)
    return [np.full(shape, fill, dtype=np.asarray(fill).dtype)]


@onnx_op("Range", fold=True)
def _range(node: Node, vals: list[Value]) -> list[Value]:
    start, limit, delta = (np.asarray(v).reshape(()) for v in vals)
    dtype = np.result_type(start, limit, delta)
    return [np.arange(start.item(), limit.item(), delta.item()).astype(dtype)]


def _reshape_target(shape: list[int], src: Sequence[int], allowzero: bool) -> list[int]:
    """ONNX Reshape's target: a 0 copies the input's dim there, unless ``allowzero``."""
    return [src[i] if (d == 0 and not allowzero) else d for i, d in enumerate(shape)]


@onnx_op("Reshape", fold=True)
def _reshape(node: Node, vals: list[Value]) -> list[Value]:
    x = vals[0]
    return [x.reshape(_reshape_target(_ints(vals[1]), list(x.shape), bool(node.attr("allowzero", 0))))]


@onnx_op("Flatten", fold=True)
def _flatten(node: Node, vals: list[Value]) -> list[Value]:
    x = vals[0]
    axis = _axis(int(node.attr("axis", 1)), len(x.shape))
    lead = int(np.prod(list(x.shape[:axis]))) if axis else 1
    return [x.reshape(lead, -1)]


@onnx_op("Transpose", fold=True)
def _transpose(node: Node, vals: list[Value]) -> list[Value]:
    x = vals[0]
    perm = node.attr("perm") or list(range(len(x.shape)))[::-1]
    if isinstance(x, np.ndarray):
        return [np.transpose(x, perm)]
    return [x.permute(*perm)]


def _axes(node: Node, vals: list[Value], index: int) -> list[int] | None:
    if len(vals) > index and vals[index] is not None:
        return _ints(vals[index])
    a = node.attr("axes")
    return list(a) if a is not None else None


@onnx_op("Unsqueeze", fold=True)
def _unsqueeze(node: Node, vals: list[Value]) -> list[Value]:
    x = vals[0]
    axes = _axes(node, vals, 1) or []
    rank = len(x.shape) + len(axes)
    for a in sorted(_axis(a, rank) for a in axes):
        x = np.expand_dims(x, a) if isinstance(x, np.ndarray) else x.unsqueeze(a)
    return [x]


@onnx_op("Squeeze", fold=True)
def _squeeze(node: Node, vals: list[Value]) -> list[Value]:
    x = vals[0]
    axes = _axes(node, vals, 1)
    if axes is None:
        axes = [i for i, s in enumerate(x.shape) if s == 1]
    for a in sorted((_axis(a, len(x.shape)) for a in axes), reverse=True):
        x = np.squeeze(x, a) if isinstance(x, np.ndarray) else x.squeeze(a)
    return [x]


@onnx_op("Concat", fold=True)
def _concat(node: Node, vals: list[Value]) -> list[Value]:
    axis = int(node.attr("axis"))
    vs = [v for v in vals if v is not None and (0 not in tuple(v.shape) or len(v.shape) > 1)]
    if all(isinstance(v, np.ndarray) for v in vs):
        return [np.concatenate(vs, axis=axis)]
    ts = [_tensor(v) for v in vs]
    dtype = next(t.dtype for t, v in zip(ts, vs) if isinstance(v, torch.Tensor))
    return [torch.cat([t.to(dtype) for t in ts], dim=axis)]


@onnx_op("Slice", fold=True)
def _slice(node: Node, vals: list[Value]) -> list[Value]:
    x = vals[0]
    rank = len(x.shape)
    if len(vals) > 1:
        starts, ends = _ints(vals[1]), _ints(vals[2])
        axes = _ints(vals[3]) if len(vals) > 3 and vals[3] is not None else list(range(len(starts)))
        steps = _ints(vals[4]) if len(vals) > 4 and vals[4] is not None else [1] * len(starts)
    else:
        starts, ends = list(node.attr("starts")), list(node.attr("ends"))
        axes = list(node.attr("axes") or range(len(starts)))
        steps = [1] * len(starts)
    index: list[Any] = [slice(None)] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, rank)
        n = x.shape[a]
        if st > 0:
            s = max(0, min(n, s + n if s < 0 else s))
            e = max(0, min(n, e + n if e < 0 else e))
        else:
            s = max(-1, min(n - 1, s + n if s < 0 else s))
            e = max(-1, min(n - 1, e + n if e < 0 else e))
        index[a] = (s, e, st)
    if isinstance(x, np.ndarray):
        return [x[tuple(slice(*i) if isinstance(i, tuple) else i for i in index)]]
    out = x
    for a, i in enumerate(index):
        if not isinstance(i, tuple):
            continue
        s, e, st = i
        if st > 0:
            out = out[(slice(None),) * a + (slice(s, e, st),)]
        else:
            # NOTE: a negative step: torch slices forward only, so flip the selected range
            lead = (slice(None),) * a
            out = out[(*lead, slice(e + 1, s + 1))].flip(a)[(*lead, slice(0, None, -st))]
    return [out]


@onnx_op("Expand", fold=True)
def _expand(node: Node, vals: list[Value]) -> list[Value]:
    x, shape = vals[0], _ints(vals[1])
    target = list(np.broadcast_shapes(tuple(x.shape), tuple(shape)))
    if isinstance(x, np.ndarray):
        return [np.broadcast_to(x, target).copy()]
    return [x.expand(*target)]


@onnx_op("Tile", fold=True)
def _tile(node: Node, vals: list[Value]) -> list[Value]:
    x, reps = vals[0], _ints(vals[1])
    return [np.tile(x, reps) if isinstance(x, np.ndarray) else x.repeat(*reps)]


@onnx_op("Gather", fold=True)
def _gather(node: Node, vals: list[Value]) -> list[Value]:
    data, idx = vals
    axis = _axis(int(node.attr("axis", 0)), len(data.shape))
    if isinstance(data, np.ndarray) and isinstance(idx, np.ndarray):
        return [np.take(data, idx.astype(np.int64), axis=axis)]
    n = data.shape[axis]
    if isinstance(idx, np.ndarray):
        ix = np.where(idx < 0, idx + n, idx).astype(np.int64)
        if ix.ndim == 0:
            return [_tensor(data).select(axis, int(ix))]
        flat = torch.from_numpy(ix.reshape(-1).copy())
    else:
        ix_t = idx.long()
        if axis == 0 and isinstance(data, torch.Tensor) and data.dim() == 2 and data.is_floating_point():
            return [F.embedding(ix_t, data)]          # NOTE: a table lookup: the embedding rule splits it
        flat = torch.where(ix_t < 0, ix_t + n, ix_t).reshape(-1)
    t = _tensor(data)
    out = torch.index_select(t, axis, flat)
    shape = list(t.shape[:axis]) + list(idx.shape) + list(t.shape[axis + 1:])
    return [out.reshape(shape)]


@onnx_op("GatherND")
def _gather_nd(node: Node, vals: list[Value]) -> list[Value]:
    if int(node.attr("batch_dims", 0)):
        raise node.fail("GatherND with batch_dims > 0 is not supported")
    data, ix = _tensor(vals[0]), _tensor(vals[1]).long()
    return [data[tuple(ix[..., i] for i in range(ix.shape[-1]))]]


# --- linear algebra and layers ----------------------------------------------------------------
@onnx_op("MatMul")
def _matmul(node: Node, vals: list[Value]) -> list[Value]:
    a, b = vals
    if isinstance(b, QuantWeight):
        return [_qlinear(_tensor(a), b)]
    if node.weight_t:          # NOTE: B is a weight, held transposed: a linear layer the decomposer tiles
        return [F.linear(_tensor(a), _tensor(b))]
    return [torch.matmul(_tensor(a), _tensor(b))]


@onnx_op("Gemm")
def _gemm(node: Node, vals: list[Value]) -> list[Value]:
    a = _tensor(vals[0])
    c = _tensor(vals[2]) if len(vals) > 2 and vals[2] is not None else None
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    if node.attr("transA", 0):
        a = a.t()
    if isinstance(vals[1], QuantWeight):
        y = _qlinear(a, vals[1])
    else:
        b = _tensor(vals[1])
        y = F.linear(a, b if node.attr("transB", 0) or node.weight_t else b.t())   # NOTE: [out, in]
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return [y]


def _qlinear(x: torch.Tensor, q: QuantWeight) -> torch.Tensor:
    """``x @ ((w - zero) * scale).T`` over the integer weight, as one op the decomposer tiles."""
    return torch.ops.sb.qlinear(x, q.w, q.scale, q.zero, None, 0)


def _pads_full(node: Node, rank: int, shape: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
               dilations: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begin, end) padding per spatial dim, from ``pads`` or ``auto_pad``."""
    auto = node.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        total = []
        for i in range(rank):
            want = (shape[i] + strides[i] - 1) // strides[i]
            total.append(max(0, (want - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - shape[i]))
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        return (small, big) if auto == "SAME_UPPER" else (big, small)
    if auto == "VALID":
        return [0] * rank, [0] * rank
    pads = list(node.attr("pads") or [0] * (2 * rank))
    return pads[:rank], pads[rank:]


def _pad(x: torch.Tensor, begin: Sequence[int], end: Sequence[int], value: float) -> torch.Tensor:
    """``x`` padded on its spatial dims (2..) with ``value``, by concatenation (ops the registry runs)."""
    for i, (b, e) in enumerate(zip(begin, end)):
        d = 2 + i
        parts = []
        for n in (b, e):
            shape = list(x.shape)
            shape[d] = n
            parts.append(torch.full(shape, value, dtype=x.dtype) if n else None)
        x = torch.cat([p for p in (parts[0], x, parts[1]) if p is not None], dim=d)
    return x


def _spatial(node: Node, x: torch.Tensor, kernel: Sequence[int], strides: Sequence[int],
             dil: Sequence[int], value: float) -> tuple[torch.Tensor, list[int]]:
    """``x`` with uneven padding applied, and the even padding left for the op itself."""
    rank = x.dim() - 2
    begin, end = _pads_full(node, rank, list(x.shape[2:]), kernel, strides, dil)
    if begin == end and all(b <= k // 2 for b, k in zip(begin, kernel)):
        return x, begin
    return _pad(x, begin, end, value), [0] * rank


@onnx_op("Conv")
def _conv(node: Node, vals: list[Value]) -> list[Value]:
    x, w = _tensor(vals[0]), _tensor(vals[1])
    b = _tensor(vals[2]) if len(vals) > 2 and vals[2] is not None else None
    rank = x.dim() - 2
    kernel = list(w.shape[2:])
    strides = list(node.attr("strides") or [1] * rank)
    dil = list(node.attr("dilations") or [1] * rank)
    x, pads = _spatial(node, x, [(k - 1) * d + 1 for k, d in zip(kernel, dil)], strides, [1] * rank, 0.0)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(rank)
    if fn is None:
        raise node.fail(f"{rank}-d convolution is not supported")
    return [fn(x, w, b, strides, pads, dil, int(node.attr("group", 1)))]


@onnx_op("ConvTranspose")
def _conv_transpose(node: Node, vals: list[Value]) -> list[Value]:
    x, w = _tensor(vals[0]), _tensor(vals[1])
    b = _tensor(vals[2]) if len(vals) > 2 and vals[2] is not None else None
    rank = x.dim() - 2
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}.get(rank)
    if fn is None:
        raise node.fail(f"{rank}-d transposed convolution is not supported")
    size = list(x.shape[2:])
    kernel = list(node.attr("kernel_shape") or w.shape[2:])
    strides = list(node.attr("strides") or [1] * rank)
    dil = list(node.attr("dilations") or [1] * rank)
    extra = list(node.attr("output_padding") or [0] * rank)[:rank]
    full = [s * (n - 1) + (k - 1) * d + 1 for s, n, k, d in zip(strides, size, kernel, dil)]
    shape, pads, auto = node.attr("output_shape"), node.attr("pads"), node.attr("auto_pad", "NOTSET")
    if pads is None and auto in ("SAME_UPPER", "SAME_LOWER"):
        want = list(shape) if shape is not None else [n * s for n, s in zip(size, strides)]
        total = [f + e - o for f, e, o in zip(full, extra, want)]
        small = [t // 2 for t in total]
        begin = small if auto == "SAME_UPPER" else [t - h for t, h in zip(total, small)]
    else:
        pads = list(pads or [0] * (2 * rank))
        begin = pads[:rank]
        want = list(shape) if shape is not None else [f + e - a - z for f, e, a, z in
                                                       zip(full, extra, pads[:rank], pads[rank:])]
    if any(v < 0 for v in [*begin, *want]):
        raise node.fail(f"negative padding or output size (pads {begin}, output {want}) is not supported")
    # NOTE: the whole transposed convolution, then its window [begin, begin + want) per dim (zeros
    # past its end: output_padding); the bias after
    y = fn(x, w, None, strides, 0, 0, int(node.attr("group", 1)), dil)
    short = [max(0, a + o - f) for a, o, f in zip(begin, want, full)]
    if any(short):
        y = _pad(y, [0] * rank, short, 0.0)
    for i, (a, o) in enumerate(zip(begin, want)):
        if a or o != y.shape[2 + i]:
            y = y[(slice(None),) * (2 + i) + (slice(a, a + o),)]     # NOTE: a slice: a window of tiles
    return [y if b is None else y + b.reshape(-1, *([1] * rank))]


@onnx_op("MaxPool", "AveragePool")
def _pool(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    rank = x.dim() - 2
    kernel = list(node.attr("kernel_shape"))
    strides = list(node.attr("strides") or [1] * rank)
    dil = list(node.attr("dilations") or [1] * rank)
    ceil = bool(node.attr("ceil_mode", 0))
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    if node.op_type == "MaxPool":
        if len(node.outputs) > 1 and node.outputs[1]:
            raise node.fail("MaxPool's indices output is not supported")
        x, pads = _spatial(node, x, span, strides, [1] * rank, float("-inf"))
        maxpool: Any = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[rank]
        return [maxpool(x, kernel, strides, pads, dil, ceil)]
    if any(d != 1 for d in dil):
        raise node.fail("dilated average pooling is not supported")
    avgpool: Any = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[rank]
    include = bool(node.attr("count_include_pad", 0))
    padded, pads = _spatial(node, x, span, strides, [1] * rank, 0.0)
    if padded is x or include:
        return [avgpool(padded, kernel, strides, pads, ceil, include)]
    # NOTE: uneven padding not counted: the padded sum over the count of real elements
    begin, end = _pads_full(node, rank, list(x.shape[2:]), span, strides, [1] * rank)
    ones = _pad(torch.ones_like(x), begin, end, 0.0)
    total = avgpool(padded, kernel, strides, pads, ceil, True)
    return [total / avgpool(ones, kernel, strides, pads, ceil, True)]


@onnx_op("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    dims = list(range(2, x.dim()))
    if node.op_type == "GlobalAveragePool":
        return [x.mean(dim=dims, keepdim=True)]
    return [x.amax(dim=dims, keepdim=True)]


@onnx_op("BatchNormalization")
def _batch_norm(node: Node, vals: list[Value]) -> list[Value]:
    if node.attr("training_mode", 0):
        raise node.fail("BatchNormalization in training mode is not supported (inference only)")
    x, scale, bias, mean, var = (_tensor(v) for v in vals[:5])
    return [F.batch_norm(x, mean, var, scale, bias, False, 0.0, float(node.attr("epsilon", 1e-5)))]


@onnx_op("LayerNormalization")
def _layer_norm(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    scale = _tensor(vals[1])
    bias = _tensor(vals[2]) if len(vals) > 2 and vals[2] is not None else None
    axis = _axis(int(node.attr("axis", -1)), x.dim())
    eps = float(node.attr("epsilon", 1e-5))
    y = F.layer_norm(x, list(x.shape[axis:]), scale, bias, eps)
    if len(node.outputs) == 1 or not any(node.outputs[1:]):
        return [y]
    dims = list(range(axis, x.dim()))          # NOTE: the statistics, as ONNX returns them
    mean = x.mean(dim=dims, keepdim=True)
    inv = torch.rsqrt(((x - mean) * (x - mean)).mean(dim=dims, keepdim=True) + eps)
    return [y, mean, inv]


@onnx_op("Softmax", "LogSoftmax")
def _softmax(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    default = -1 if node.opset >= 13 else 1
    axis = _axis(int(node.attr("axis", default)), x.dim())
    if node.opset < 13 and axis != x.dim() - 1:
        # NOTE: before opset 13 the input is coerced to 2-D at ``axis``
        lead = list(x.shape[:axis])
        y = x.reshape(int(np.prod(lead)) if lead else 1, -1)
        fn = torch.softmax if node.op_type == "Softmax" else torch.log_softmax
        return [fn(y, -1).reshape(x.shape)]
    fn = torch.softmax if node.op_type == "Softmax" else torch.log_softmax
    return [fn(x, axis)]


@onnx_op("LRN")
def _lrn(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    size = int(node.attr("size"))
    alpha, beta = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    sq = (x * x).unsqueeze(1)                                # N, 1, C, H, W
    pad = (size - 1) // 2
    summed = F.avg_pool3d(sq, (size, 1, 1), stride=1, padding=(pad, 0, 0), count_include_pad=True)
    if size % 2 == 0:
        raise node.fail(f"LRN of even size {size} is not supported")
    div = (summed.squeeze(1) * alpha + bias) ** beta
    return [x / div]


@onnx_op("Dropout")
def _dropout(node: Node, vals: list[Value]) -> list[Value]:
    training = vals[2] if len(vals) > 2 else None
    if isinstance(training, torch.Tensor) or (training is not None and bool(np.asarray(training).any())):
        raise node.fail("Dropout in training mode is not supported (inference only)")
    x = _tensor(vals[0])
    return [x, torch.ones_like(x, dtype=torch.bool)]         # NOTE: inference: nothing dropped


@onnx_op("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")
def _reduce(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    from_input = node.opset >= (13 if node.op_type == "ReduceSum" else 18)   # NOTE: axes became an input
    axes = (_ints(vals[1]) if len(vals) > 1 and vals[1] is not None else None) if from_input \
        else (list(node.attr("axes")) if node.attr("axes") is not None else None)
    keep = bool(node.attr("keepdims", 1))
    if axes is None or not axes:
        if axes is not None and node.attr("noop_with_empty_axes", 0):
            return [x]
        axes = list(range(x.dim()))
    dims = [_axis(a, x.dim()) for a in axes]
    if node.op_type in ("ReduceMax", "ReduceMin") and any(x.shape[d] == 0 for d in dims):
        # NOTE: an empty reduction is the identity of max (-inf) or min (+inf), as ONNX defines it
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if keep else \
            [n for d, n in enumerate(x.shape) if d not in dims]
        if x.dtype == torch.bool:
            return [torch.full(shape, node.op_type == "ReduceMin", dtype=torch.bool)]
        big = float("inf") if x.is_floating_point() else torch.iinfo(x.dtype).max
        return [torch.full(shape, -big if node.op_type == "ReduceMax" else big, dtype=x.dtype)]
    if node.op_type == "ReduceMean":
        return [x.mean(dim=dims, keepdim=keep)]
    if node.op_type == "ReduceSum":
        return [x.sum(dim=dims, keepdim=keep)]
    fn = torch.amax if node.op_type == "ReduceMax" else torch.amin
    return [fn(x, dim=dims, keepdim=keep)]


@onnx_op("Split")
def _split(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    axis = _axis(int(node.attr("axis", 0)), x.dim())
    if len(vals) > 1 and vals[1] is not None:
        sizes = _ints(vals[1])
    elif node.attr("split") is not None:
        sizes = list(node.attr("split"))
    else:
        n = len(node.outputs)
        step = -(-x.shape[axis] // n)
        sizes = [min(step, x.shape[axis] - i * step) for i in range(n)]
    return list(torch.split(x, sizes, dim=axis))


@onnx_op("GatherElements")
def _gather_elements(node: Node, vals: list[Value]) -> list[Value]:
    data, idx = _tensor(vals[0]), _tensor(vals[1]).long()
    axis = _axis(int(node.attr("axis", 0)), data.dim())
    n = data.shape[axis]
    return [torch.gather(data, axis, torch.where(idx < 0, idx + n, idx))]


# --- quantized operations ----------------------------------------------------------------------
# Integer arithmetic stays integer: a matmul of int8 operands accumulates in int32 (so a split
# of its reduction into int32 partial sums is exact), and scales apply after it.
def _per_axis(v: torch.Tensor, like: torch.Tensor, axis: int) -> torch.Tensor:
    """A scale or zero point of one value per slice along ``axis`` of ``like``, broadcastable to it."""
    if v.dim() == 0 or v.numel() == 1:
        return v.reshape(())
    shape = [1] * like.dim()
    shape[_axis(axis, like.dim())] = v.numel()
    return v.reshape(shape)


_RANGES = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int16: (-32768, 32767),
           torch.int32: (-(2 ** 31), 2 ** 31 - 1)}


QuantOperands = tuple[torch.Tensor, torch.Tensor, int, "torch.Tensor | None"]


def _quant_operands(node: Node, vals: list[Value]) -> QuantOperands:
    """(x, scale, axis, zero point or None) of a DequantizeLinear or QuantizeLinear."""
    if node.attr("block_size", 0):
        raise node.fail("blocked quantization (block_size) is not supported")
    zp = _tensor(vals[2]) if len(vals) > 2 and vals[2] is not None else None
    return _tensor(vals[0]), _tensor(vals[1]), int(node.attr("axis", 1)), zp


@onnx_op("DequantizeLinear")
def _dequantize(node: Node, vals: list[Value]) -> list[Value]:
    x, scale, axis, zp = _quant_operands(node, vals)
    q = x.to(torch.int32) if zp is None else x.to(torch.int32) - _per_axis(zp, x, axis).to(torch.int32)
    return [q.to(scale.dtype) * _per_axis(scale, x, axis)]


@onnx_op("QuantizeLinear")
def _quantize(node: Node, vals: list[Value]) -> list[Value]:
    x, scale, axis, zp = _quant_operands(node, vals)
    dtype = zp.dtype if zp is not None else torch.uint8
    if dtype not in _RANGES:
        raise node.fail(f"quantizing to {dtype} is not supported")
    lo, hi = _RANGES[dtype]
    q = torch.round(x / _per_axis(scale, x, axis))          # NOTE: half to even, as ONNX rounds
    if zp is not None:
        q = q + _per_axis(zp, x, axis).to(q.dtype)
    return [torch.clamp(q, lo, hi).to(dtype)]


@onnx_op("DynamicQuantizeLinear")
def _dynamic_quantize(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    lo = torch.clamp(-(-x).amax(), max=0.0)
    hi = torch.clamp(x.amax(), min=0.0)
    scale = (hi - lo) / 255.0
    zp = torch.clamp(torch.round(-lo / scale), 0, 255)
    y = torch.clamp(torch.round(x / scale) + zp, 0, 255)
    return [y.to(torch.uint8), scale, zp.to(torch.uint8)]


@onnx_op("MatMulInteger")
def _matmul_integer(node: Node, vals: list[Value]) -> list[Value]:
    a = _tensor(vals[0]).to(torch.int32)
    if len(vals) > 2 and vals[2] is not None:          # NOTE: per row of A, or one for all
        azp = _tensor(vals[2]).to(torch.int32)
        a = a - (azp.reshape(-1, 1) if azp.numel() > 1 else azp.reshape(()))
    if isinstance(vals[1], QuantWeight):               # NOTE: its zero point is in it
        return [_qlinear(a, vals[1])]
    b = _tensor(vals[1]).to(torch.int32)
    if len(vals) > 3 and vals[3] is not None:          # NOTE: per column of B, or one for all
        bzp = _tensor(vals[3]).to(torch.int32)
        b = b - (bzp.reshape(-1) if bzp.numel() > 1 else bzp.reshape(()))
    return [torch.matmul(a, b)]


@onnx_op("QLinearMatMul")
def _qlinear_matmul(node: Node, vals: list[Value]) -> list[Value]:
    a, a_scale, a_zp, b_scale, y_scale, y_zp = (_tensor(vals[i]) for i in (0, 1, 2, 4, 6, 7))
    if isinstance(vals[3], QuantWeight):               # NOTE: its zero point is in it
        acc = _qlinear(a.to(torch.int32) - a_zp.to(torch.int32), vals[3])
    else:
        b, b_zp = _tensor(vals[3]), _tensor(vals[5])
        acc = torch.matmul(a.to(torch.int32) - a_zp.to(torch.int32), b.to(torch.int32) - b_zp.to(torch.int32))
    scale = (a_scale * b_scale / y_scale).to(torch.float32)
    q = torch.round(acc.to(torch.float32) * scale) + y_zp.to(torch.float32)
    lo, hi = _RANGES[y_zp.dtype]
    return [torch.clamp(q, lo, hi).to(y_zp.dtype)]


# --- more elementwise, reductions and selections ---------------------------------------------
@onnx_op("Celu")
def _celu(node: Node, vals: list[Value]) -> list[Value]:
    return [F.celu(_tensor(vals[0]), float(node.attr("alpha", 1.0)))]


@onnx_op("ThresholdedRelu")
def _thresholded_relu(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    return [torch.where(x > float(node.attr("alpha", 1.0)), x, 0.0)]


@onnx_op("Shrink")
def _shrink(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    lambd, bias = float(node.attr("lambd", 0.5)), float(node.attr("bias", 0.0))
    return [torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, 0.0)).to(x.dtype)]


@onnx_op("Swish")
def _swish(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    return [x * torch.sigmoid(x * float(node.attr("alpha", 1.0)))]


@onnx_op("SwiGLU")
def _swiglu(node: Node, vals: list[Value]) -> list[Value]:
    a, b = _tensor(vals[0]), _tensor(vals[1])
    return [a * torch.sigmoid(a * float(node.attr("alpha", 1.0))) * b]


@onnx_op("IsInf")
def _isinf(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    hits = [x == s for s, on in ((float("inf"), node.attr("detect_positive", 1)),
                                 (float("-inf"), node.attr("detect_negative", 1))) if on]
    if not hits:
        return [torch.zeros_like(x, dtype=torch.bool)]
    return [hits[0] | hits[1] if len(hits) == 2 else hits[0]]


@onnx_op("Mod")
def _mod(node: Node, vals: list[Value]) -> list[Value]:
    a, b = _tensor(vals[0]), _tensor(vals[1])      # NOTE: fmod: C's sign (of a); else Python's (of b)
    return [torch.fmod(a, b) if node.attr("fmod", 0) else torch.remainder(a, b)]


@onnx_op("BitShift")
def _bitshift(node: Node, vals: list[Value]) -> list[Value]:
    a, b = _tensor(vals[0]), _tensor(vals[1])      # NOTE: torch's out-of-range shifts are ONNX's
    return [a << b if node.attr("direction") == "LEFT" else a >> b]


@onnx_op("CastLike", fold=True)
def _cast_like(node: Node, vals: list[Value]) -> list[Value]:
    v, like = vals[0], vals[1]
    if isinstance(v, np.ndarray) and isinstance(like, np.ndarray):
        return [v.astype(like.dtype)]
    return [_tensor(v).to(like.dtype if isinstance(like, torch.Tensor) else _tensor(like).dtype)]


@onnx_op("ArgMax", "ArgMin")
def _arg_extreme(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    axis = _axis(int(node.attr("axis", 0)), x.dim())
    keep = bool(node.attr("keepdims", 1))
    fn = torch.argmax if node.op_type == "ArgMax" else torch.argmin
    if not node.attr("select_last_index", 0):
        return [fn(x, axis, keepdim=keep)]
    return [x.shape[axis] - 1 - fn(x.flip(axis), axis, keepdim=keep)]     # NOTE: the last of equal ones


def _reduce_axes(node: Node, vals: list[Value], rank: int) -> list[int] | None:
    """The dims a Reduce* node reduces (axes an input from opset 18, an attribute before);
    None: none (an empty axes with ``noop_with_empty_axes``)."""
    axes = _axes(node, vals, 1) if node.opset >= 18 else node.attr("axes")
    if not axes:
        return None if axes is not None and node.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(_axis(a, rank) for a in axes)


def _prod(x: torch.Tensor, dims: list[int], keep: bool) -> torch.Tensor:
    for d in reversed(dims):
        x = x.prod(d, keepdim=keep)
    return x


_REDUCERS: dict[str, Callable[[torch.Tensor, list[int], bool], torch.Tensor]] = {
    "ReduceL1": lambda x, d, k: x.abs().sum(d, keepdim=k),
    "ReduceL2": lambda x, d, k: torch.sqrt((x * x).sum(d, keepdim=k)),
    "ReduceSumSquare": lambda x, d, k: (x * x).sum(d, keepdim=k),
    "ReduceLogSum": lambda x, d, k: torch.log(x.sum(d, keepdim=k)),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
    "ReduceProd": _prod,
}


@onnx_op(*_REDUCERS)
def _reduce_more(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    dims = _reduce_axes(node, vals, x.dim())
    if dims is None:
        return [x]
    return [_REDUCERS[node.op_type](x, dims, bool(node.attr("keepdims", 1))).to(x.dtype)]


@onnx_op("Hardmax")
def _hardmax(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    if node.opset < 13:
        raise node.fail("Hardmax before opset 13 (the input coerced to 2-D) is not supported")
    axis = _axis(int(node.attr("axis", -1)), x.dim())
    shape = [1] * x.dim()
    shape[axis] = x.shape[axis]
    hot = x.argmax(axis, keepdim=True) == torch.arange(x.shape[axis]).reshape(shape)
    return [hot.to(x.dtype)]


@onnx_op("TopK")
def _topk(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    k = _ints(vals[1])[0] if len(vals) > 1 else int(node.attr("k"))
    axis = _axis(int(node.attr("axis", -1)), x.dim())
    # NOTE: a stable sort: of equal values the one of lower index comes first, as ONNX asks
    y, idx = torch.sort(x, stable=True, dim=axis, descending=bool(node.attr("largest", 1)))
    return [y.narrow(axis, 0, k), idx.narrow(axis, 0, k)]


@onnx_op("CumSum", "CumProd")
def _cumulative(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    axis = _axis(_ints(vals[1])[0], x.dim())
    reverse, exclusive = bool(node.attr("reverse", 0)), bool(node.attr("exclusive", 0))
    x = x.flip(axis) if reverse else x
    y = (torch.cumsum if node.op_type == "CumSum" else torch.cumprod)(x, axis, dtype=x.dtype)
    if exclusive:          # NOTE: shifted by one: the identity first, the last total dropped
        first = (torch.zeros_like if node.op_type == "CumSum" else torch.ones_like)(y.narrow(axis, 0, 1))
        y = torch.cat([first, y.narrow(axis, 0, y.shape[axis] - 1)], dim=axis)
    return [y.flip(axis) if reverse else y]


@onnx_op("Trilu")
def _trilu(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    k = _ints(vals[1])[0] if len(vals) > 1 and vals[1] is not None else 0
    return [torch.triu(x, k) if node.attr("upper", 1) else torch.tril(x, k)]


@onnx_op("EyeLike", fold=True)
def _eye_like(node: Node, vals: list[Value]) -> list[Value]:
    shape = list(vals[0].shape)
    if len(shape) != 2:
        raise node.fail(f"EyeLike of a {len(shape)}-d input is not supported (2-d only)")
    eye, to = np.eye(shape[0], shape[1], k=int(node.attr("k", 0))), node.attr("dtype")
    if to is not None:
        return [eye.astype(_np_dtype(to))]
    return [eye.astype(vals[0].dtype) if isinstance(vals[0], np.ndarray) else _tensor(eye).to(vals[0].dtype)]


@onnx_op("OneHot")
def _one_hot(node: Node, vals: list[Value]) -> list[Value]:
    idx, values = _tensor(vals[0]), _tensor(vals[2])
    depth = _ints(vals[1])[0]
    axis = _axis(int(node.attr("axis", -1)), idx.dim() + 1)
    shape = [1] * (idx.dim() + 1)
    shape[axis] = depth
    idx = torch.where(idx < 0, idx + depth, idx).unsqueeze(axis)
    hot = idx == torch.arange(depth, dtype=idx.dtype).reshape(shape)
    return [torch.where(hot, values[1], values[0])]


@onnx_op("Compress")
def _compress(node: Node, vals: list[Value]) -> list[Value]:
    if isinstance(vals[1], torch.Tensor):
        raise node.fail("a Compress condition that depends on the inputs is not supported (its output "
                        "shape would depend on values)")
    x, keep = _tensor(vals[0]), np.flatnonzero(np.asarray(vals[1]))
    axis = node.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    return [torch.index_select(x, _axis(int(axis), x.dim()), torch.from_numpy(keep.astype(np.int64)))]


@onnx_op("ReverseSequence")
def _reverse_sequence(node: Node, vals: list[Value]) -> list[Value]:
    x, lens = _tensor(vals[0]), _ints(vals[1])
    b, t = int(node.attr("batch_axis", 1)), int(node.attr("time_axis", 0))
    steps = np.arange(x.shape[t])
    src = np.stack([np.where(steps < n, n - 1 - steps, steps) for n in lens], axis=1 if b > t else 0)
    shape = [1] * x.dim()
    shape[b], shape[t] = len(lens), x.shape[t]
    idx = torch.from_numpy(src.reshape(shape).astype(np.int64)).expand(*x.shape)
    return [torch.gather(x, t, idx)]


@onnx_op("ScatterElements", "Scatter")
def _scatter_elements(node: Node, vals: list[Value]) -> list[Value]:
    data, idx, upd = _tensor(vals[0]), _tensor(vals[1]).long(), _tensor(vals[2])
    axis = _axis(int(node.attr("axis", 0)), data.dim())
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    return [_scatter(node, data, axis, idx, upd)]


_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter(node: Node, data: torch.Tensor, axis: int, idx: torch.Tensor, upd: torch.Tensor) -> torch.Tensor:
    how = node.attr("reduction", "none")
    if how == "none":
        return data.scatter(axis, idx, upd)
    if how not in _SCATTER_REDUCE:
        raise node.fail(f"reduction {how!r} is not supported")
    return data.scatter_reduce(axis, idx, upd, _SCATTER_REDUCE[how], include_self=True)


@onnx_op("ScatterND")
def _scatter_nd(node: Node, vals: list[Value]) -> list[Value]:
    data, idx, upd = _tensor(vals[0]), _tensor(vals[1]).long(), _tensor(vals[2])
    k = idx.shape[-1]          # NOTE: an index names a slice data[i_0, .., i_k-1]: a row of [lead, rest]
    lead, rest = list(data.shape[:k]), list(data.shape[k:])
    dims = torch.tensor(lead, dtype=torch.long)
    strides = torch.tensor([int(np.prod(lead[i + 1:])) for i in range(k)], dtype=torch.long)
    rows = (torch.where(idx < 0, idx + dims, idx) * strides).sum(-1).reshape(-1, *([1] * len(rest)))
    flat, upd = data.reshape(-1, *rest), upd.reshape(-1, *rest)
    return [_scatter(node, flat, 0, rows.expand(*upd.shape), upd).reshape(data.shape)]


# --- layout and normalization ----------------------------------------------------------------
@onnx_op("DepthToSpace", "SpaceToDepth")
def _depth_space(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    b, crd = int(node.attr("blocksize")), node.attr("mode", "DCR") == "CRD"
    n, c, h, w = x.shape
    if node.op_type == "DepthToSpace":
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3) if crd else \
            x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
        return [y.reshape(n, c // (b * b), h * b, w * b)]
    y = x.reshape(n, c, h // b, b, w // b, b)
    y = y.permute(0, 1, 3, 5, 2, 4) if crd else y.permute(0, 3, 5, 1, 2, 4)
    return [y.reshape(n, c * b * b, h // b, w // b)]


@onnx_op("CenterCropPad")
def _center_crop_pad(node: Node, vals: list[Value]) -> list[Value]:
    x, sizes = _tensor(vals[0]), _ints(vals[1])
    axes = node.attr("axes") or list(range(x.dim()))
    for a, want in zip((_axis(a, x.dim()) for a in axes), sizes):
        have = x.shape[a]
        if want < have:
            x = x.narrow(a, (have - want) // 2, want)
        elif want > have:
            before = (want - have) // 2
            shape = list(x.shape)
            parts = []
            for m in (before, want - have - before):
                shape[a] = m
                parts.append(torch.zeros(shape, dtype=x.dtype))
            x = torch.cat([parts[0], x, parts[1]], dim=a)
    return [x]


@onnx_op("GroupNormalization")
def _group_norm(node: Node, vals: list[Value]) -> list[Value]:
    x, scale, bias = (_tensor(v) for v in vals[:3])
    groups = int(node.attr("num_groups"))
    if scale.numel() == groups != x.shape[1]:       # NOTE: opset 18: one scale and bias per group
        scale, bias = (v.repeat_interleave(x.shape[1] // groups) for v in (scale, bias))
    return [F.group_norm(x, groups, scale, bias, float(node.attr("epsilon", 1e-5)))]


@onnx_op("RMSNormalization")
def _rms_norm(node: Node, vals: list[Value]) -> list[Value]:
    x, scale = _tensor(vals[0]), _tensor(vals[1])
    axis = _axis(int(node.attr("axis", -1)), x.dim())
    return [F.rms_norm(x, list(x.shape[axis:]), None, float(node.attr("epsilon", 1e-5))) * scale]


@onnx_op("LpNormalization")
def _lp_normalization(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    axis, p = int(node.attr("axis", -1)), int(node.attr("p", 2))
    if p not in (1, 2):
        raise node.fail(f"p={p} is not supported (1 or 2)")
    norm = x.abs().sum(axis, keepdim=True) if p == 1 else torch.sqrt((x * x).sum(axis, keepdim=True))
    return [torch.where(norm == 0, 0.0, x / norm)]       # NOTE: a zero vector stays zero


@onnx_op("MeanVarianceNormalization")
def _mvn(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    dims = [_axis(a, x.dim()) for a in node.attr("axes", [0, 2, 3])]
    mean = x.mean(dims, keepdim=True)
    std = torch.sqrt((x * x).mean(dims, keepdim=True) - mean * mean)     # NOTE: ONNX's formula, as it is
    return [(x - mean) / (std + 1e-9)]


@onnx_op("LpPool", "GlobalLpPool")
def _lp_pool(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    p = float(node.attr("p", 2))
    xp = x.abs() ** p
    if node.op_type == "GlobalLpPool":
        return [xp.sum(list(range(2, x.dim())), keepdim=True) ** (1.0 / p)]
    if node.attr("ceil_mode", 0):
        raise node.fail("LpPool with ceil_mode is not supported")
    rank = x.dim() - 2
    kernel = list(node.attr("kernel_shape"))
    strides, dil = list(node.attr("strides") or [1] * rank), list(node.attr("dilations") or [1] * rank)
    conv: Any = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    # NOTE: a window's sum as a convolution by ones per channel (dilated windows too)
    xp, pads = _spatial(node, xp, [(k - 1) * d + 1 for k, d in zip(kernel, dil)], strides, [1] * rank, 0.0)
    ones = torch.ones(x.shape[1], 1, *kernel, dtype=x.dtype)
    return [conv(xp, ones, None, strides, pads, dil, x.shape[1]) ** (1.0 / p)]


# --- linear algebra --------------------------------------------------------------------------
@onnx_op("Einsum")
def _einsum(node: Node, vals: list[Value]) -> list[Value]:
    return [torch.einsum(str(node.attr("equation")).replace(" ", ""), *(_tensor(v) for v in vals))]


@onnx_op("Det")
def _det(node: Node, vals: list[Value]) -> list[Value]:
    return [torch.linalg.det(_tensor(vals[0]))]


# --- resizing: one axis at a time, by a constant [out, in] matrix (nearest: an index) --------
def _resize_coords(ctm: str, n_in: int, n_out: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """Where each output position samples the input (ONNX Resize's coordinate_transformation_mode)."""
    y = np.arange(n_out, dtype=np.float64)
    wide = scale * n_in
    if ctm == "align_corners":
        return y * 0.0 if wide == 1 else y * (n_in - 1) / (wide - 1)
    if ctm == "asymmetric":
        return y / scale
    if ctm == "tf_crop_and_resize":
        span = (roi[1] - roi[0]) * (n_in - 1)
        return roi[0] * (n_in - 1) + (y * 0.0 + span / 2 if wide == 1 else y * span / (wide - 1))
    if ctm == "pytorch_half_pixel":
        return y * 0.0 - 0.5 if wide == 1 else (y + 0.5) / scale - 0.5
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        return n_in / 2 * (1 - n_out / wide) + (y + 0.5) / scale - 0.5
    raise ValueError(f"coordinate_transformation_mode {ctm!r} is not supported")


def _legacy_resize(node: Node) -> bool:
    """Upsample, and Resize before opset 11: sampled at ``out / scale``, nearest rounding down."""
    return node.op_type == "Upsample" or node.opset < 11


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _resize_taps(node: Node, ratio: float, scale: float) -> np.ndarray:
    """The weights of an output position's neighbours, ``ratio`` past the one on its left."""
    mode = node.attr("mode", "nearest")
    if mode == "nearest":
        if ratio == 1.0:
            return np.array([0.0, 1.0])
        how = node.attr("nearest_mode", "floor" if _legacy_resize(node) else "round_prefer_floor")
        right = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5, "floor": False,
                 "ceil": True}[how]
        return np.array([0.0, 1.0]) if right else np.array([1.0, 0.0])
    reach = {"linear": 1, "bilinear": 1, "cubic": 2}[mode]
    s = min(scale, 1.0) if node.attr("antialias", 0) else 1.0      # NOTE: antialias widens when shrinking
    start = int(np.floor(-reach / s) + 1)
    x = (np.arange(start, 2 - start) - ratio) * s
    w = np.clip(1 - np.abs(x), 0, 1) if reach == 1 else _cubic(x, float(node.attr("cubic_coeff_a", -0.75)))
    return w / w.sum() if s != 1.0 else w


def _resize_matrix(node: Node, n_in: int, n_out: int, scale: float,
                   roi: tuple[float, float]) -> tuple[np.ndarray, np.ndarray | None]:
    """(the [out, in] matrix of one axis, the outputs that take the extrapolation value or None),
    as the ONNX reference resizes (``onnx.reference.ops.op_resize``)."""
    ctm = node.attr("coordinate_transformation_mode", "asymmetric" if _legacy_resize(node) else "half_pixel")
    x = _resize_coords(ctm, n_in, n_out, scale, roi)
    out = (x < 0) | (x > n_in - 1) if ctm == "tf_crop_and_resize" else None
    w = np.zeros((n_out, n_in))
    for i, xi in enumerate(x):
        left = np.floor(xi)
        taps = _resize_taps(node, 1.0 if xi == left else float(xi - left), scale)
        n = len(taps)
        pad = -(-n // 2)       # NOTE: the n nearest positions of the edge-padded input, the left one on ties
        p = np.floor(xi + pad)
        frac = xi + pad - p
        first = p + (-(n // 2) + (frac != 0) if n % 2 == 0 else -((n - 1) // 2) + (frac > 0.5)) - pad
        idx = int(first) + np.arange(n)
        if node.attr("exclude_outside", 0):
            taps = np.where((idx < 0) | (idx >= n_in), 0.0, taps)
            taps = taps / (taps.sum() or 1.0)
        np.add.at(w[i], np.clip(idx, 0, n_in - 1), taps)
    return w, (out if out is not None and out.any() else None)


def _resize_plan(node: Node, vals: list[Value],
                 shape: list[int]) -> tuple[list[float], list[int], list[float]]:
    """(scale, output size, roi start and end) per dim of a Resize or Upsample node."""
    rank = len(shape)
    if node.op_type == "Upsample":
        scales = [float(s) for s in (np.asarray(vals[1]) if len(vals) > 1 else node.attr("scales"))]
        return scales, [int(n * s) for n, s in zip(shape, scales)], [0.0] * rank + [1.0] * rank
    given = [v if v is not None and np.prod(v.shape) else None for v in [*vals[1:], None, None, None][:3]]
    if any(isinstance(v, torch.Tensor) for v in given):
        raise node.fail("roi, scales and sizes that depend on the inputs are not supported; "
                        "SeaBiscuit needs them constant")
    if node.opset < 11:
        given = [None, given[0], None]
    axes = [_axis(a, rank) for a in (node.attr("axes") or range(rank))]
    roi = [0.0] * rank + [1.0] * rank
    if given[0] is not None:
        r = [float(v) for v in np.asarray(given[0]).reshape(-1)]
        for i, a in enumerate(axes):
            roi[a], roi[rank + a] = r[i], r[len(axes) + i]
    scales, sizes = [1.0] * rank, list(shape)
    if given[1] is not None:
        for a, s in zip(axes, np.asarray(given[1]).reshape(-1)):
            scales[a], sizes[a] = float(s), int(np.floor(shape[a] * float(s)))
        return scales, sizes, roi
    want = _ints(given[2])
    ratios = [w / shape[a] for a, w in zip(axes, want)]
    policy = node.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        s = min(ratios) if policy == "not_larger" else max(ratios)
        ratios, want = [s] * len(axes), [int(s * shape[a] + 0.5) for a in axes]
    for a, s, w in zip(axes, ratios, want):
        scales[a], sizes[a] = s, w
    return scales, sizes, roi


@onnx_op("Resize", "Upsample")
def _resize(node: Node, vals: list[Value]) -> list[Value]:
    x = _tensor(vals[0])
    mode = node.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic", "bilinear"):
        raise node.fail(f"mode {mode!r} is not supported")
    if not x.is_floating_point() and mode != "nearest":
        raise node.fail(f"{mode} resizing of {x.dtype} is not supported")
    scales, sizes, roi = _resize_plan(node, vals, list(x.shape))
    rank = x.dim()
    for a in range(rank):
        if sizes[a] == x.shape[a] and scales[a] == 1.0 and (roi[a], roi[rank + a]) == (0.0, 1.0):
            continue               # NOTE: the identity, as the reference skips it
        w, out = _resize_matrix(node, x.shape[a], sizes[a], scales[a], (roi[a], roi[rank + a]))
        if mode == "nearest":
            x = torch.index_select(x, a, torch.from_numpy(w.argmax(1)))
        else:
            wt = _tensor(w.T if x.dtype == torch.float64 else w.T.astype(np.float32)).to(x.dtype)
            x = torch.matmul(x.transpose(a, -1), wt).transpose(a, -1)
        if out is not None:
            mask = out.reshape([-1 if d == a else 1 for d in range(rank)])
            x = torch.where(torch.from_numpy(mask), float(node.attr("extrapolation_value", 0.0)), x)
    return [x]


# --- more layers, windows and losses ---------------------------------------------------------
@onnx_op("HannWindow", "HammingWindow", "BlackmanWindow", fold=True)
def _window(node: Node, vals: list[Value]) -> list[Value]:
    size = _ints(vals[0])[0]
    a = 2 * np.pi * np.arange(size) / (size if node.attr("periodic", 1) else size - 1)
    w = {"HannWindow": lambda: 0.5 - 0.5 * np.cos(a), "HammingWindow": lambda: (25 - 21 * np.cos(a)) / 46,
         "BlackmanWindow": lambda: 0.42 - 0.5 * np.cos(a) + 0.08 * np.cos(2 * a)}[node.op_type]()
    return [w.astype(_np_dtype(node.attr("output_datatype", 1)))]


@onnx_op("MaxUnpool")
def _max_unpool(node: Node, vals: list[Value]) -> list[Value]:
    x, idx = _tensor(vals[0]), _tensor(vals[1]).long()
    rank = x.dim() - 2
    kernel = list(node.attr("kernel_shape"))
    strides, pads = list(node.attr("strides") or [1] * rank), list(node.attr("pads") or [0] * (2 * rank))
    full = [*x.shape[:2], *((n - 1) * s - b - e + k for n, s, b, e, k in
                             zip(x.shape[2:], strides, pads[:rank], pads[rank:], kernel))]
    # NOTE: an index counts over the whole (inferred) output, as MaxPool's indices do
    y = torch.zeros(int(np.prod(full)), dtype=x.dtype).scatter(0, idx.reshape(-1), x.reshape(-1))
    y = y.reshape(full)
    want = _ints(vals[2]) if len(vals) > 2 and vals[2] is not None else full
    return [_pad(y, [0] * rank, [w - f for w, f in zip(want[2:], full[2:])], 0.0)]


@onnx_op("Col2Im")
def _col2im(node: Node, vals: list[Value]) -> list[Value]:
    x, image, block = _tensor(vals[0]), _ints(vals[1]), _ints(vals[2])
    rank, k = len(block), int(np.prod(block))
    strides, dil = list(node.attr("strides") or [1] * rank), list(node.attr("dilations") or [1] * rank)
    pads = list(node.attr("pads") or [0] * (2 * rank))
    fn: Any = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}.get(rank)
    if fn is None:
        raise node.fail(f"{rank}-d Col2Im is not supported")
    blocks = [(n + b + e - d * (m - 1) - 1) // s + 1
              for n, b, e, d, m, s in zip(image, pads[:rank], pads[rank:], dil, block, strides)]
    # NOTE: each column adds its block back in place: a transposed convolution by one-hot kernels
    channels = x.shape[1] // k
    w = np.tile(np.eye(k).reshape(k, 1, *block), (channels, *([1] * (rank + 1))))
    x = x.reshape(x.shape[0], x.shape[1], *blocks)
    y = fn(x, _tensor(w).to(x.dtype), None, strides, 0, 0, channels, dil)
    for i, (b, n) in enumerate(zip(pads[:rank], image)):
        y = y.narrow(2 + i, b, n)
    return [y]


@onnx_op("AffineGrid")
def _affine_grid(node: Node, vals: list[Value]) -> list[Value]:
    theta, size = _tensor(vals[0]), _ints(vals[1])
    spatial = size[2:]
    axes = [np.linspace(-1, 1, n) if node.attr("align_corners", 0) else (2 * np.arange(n) + 1) / n - 1
            for n in spatial]
    # NOTE: (x, y[, z], 1) per output position: x runs along the last dim
    grid = np.stack([*np.meshgrid(*axes, indexing="ij")[::-1], np.ones(spatial)], axis=-1)
    base = _tensor(grid.reshape(-1, len(spatial) + 1).astype(np.float32)).to(theta.dtype)
    return [torch.matmul(base, theta.transpose(1, 2)).reshape(theta.shape[0], *spatial, len(spatial))]


@onnx_op("RotaryEmbedding")
def _rotary(node: Node, vals: list[Value]) -> list[Value]:
    x, cos, sin = (_tensor(v) for v in vals[:3])
    shape = x.shape
    x = x.transpose(1, 2) if x.dim() == 4 else x.reshape(*shape[:2], int(node.attr("num_heads")), -1)
    if len(vals) > 3 and vals[3] is not None:          # NOTE: [batch, seq] positions into the caches
        pos = _tensor(vals[3]).long()
        cos, sin = F.embedding(pos, cos), F.embedding(pos, sin)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    dim = int(node.attr("rotary_embedding_dim", 0)) or x.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    inter = bool(node.attr("interleaved", 0))
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if inter else (rot[..., :dim // 2], rot[..., dim // 2:])
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rot = torch.stack([real, imag], dim=-1).reshape(rot.shape) if inter else torch.cat([real, imag], dim=-1)
    y = torch.cat([rot, rest], dim=-1)
    return [y.transpose(1, 2) if len(shape) == 4 else y.reshape(shape)]


@onnx_op("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
def _nll_loss(node: Node, vals: list[Value]) -> list[Value]:
    x, t = _tensor(vals[0]), _tensor(vals[1]).long()
    if node.op_type == "SoftmaxCrossEntropyLoss":
        x = torch.log_softmax(x, 1)
    ignore = node.attr("ignore_index")
    keep = t != ignore if ignore is not None else None
    t = torch.where(keep, t, 0) if keep is not None else t
    loss = -x.gather(1, t.unsqueeze(1)).squeeze(1)
    w = _tensor(vals[2])[t] if len(vals) > 2 and vals[2] is not None else None
    if keep is not None:
        w = torch.where(keep, w, 0.0) if w is not None else keep.to(x.dtype)
    loss = loss * w if w is not None else loss
    how = node.attr("reduction", "mean")
    if how == "mean" and w is not None:        # NOTE: a weighted mean: an ignored target weighs 0
        loss = loss.sum() / w.sum()
    elif how in ("mean", "sum"):
        loss = loss.sum() / loss.numel() if how == "mean" else loss.sum()
    return [loss, x][:len(node.outputs)]


@onnx_op("ConvInteger")
def _conv_integer(node: Node, vals: list[Value]) -> list[Value]:
    x, w = _tensor(vals[0]).to(torch.float64), _tensor(vals[1]).to(torch.float64)   # NOTE: exact in float64
    if len(vals) > 2 and vals[2] is not None:
        x = x - _tensor(vals[2]).to(torch.float64)
    if len(vals) > 3 and vals[3] is not None:
        zw = _tensor(vals[3]).to(torch.float64)
        w = w - (zw.reshape(-1, *([1] * (w.dim() - 1))) if zw.numel() > 1 else zw)
    return [_conv(node, [x, w])[0].to(torch.int32)]


@onnx_op("QLinearConv")
def _qlinear_conv(node: Node, vals: list[Value]) -> list[Value]:
    x_scale, w_scale, y_scale, y_zp = (_tensor(vals[i]) for i in (1, 4, 6, 7))
    acc = _conv_integer(node, [vals[0], vals[3], vals[2], vals[5]])[0]
    if len(vals) > 8 and vals[8] is not None:
        acc = acc + _tensor(vals[8]).reshape(-1, *([1] * (acc.dim() - 2)))
    per_channel = w_scale.reshape(-1, *([1] * (acc.dim() - 2))) if w_scale.numel() > 1 else w_scale
    scale = x_scale * per_channel / y_scale
    q = torch.round(acc.to(torch.float32) * scale.to(torch.float32)) + y_zp.to(torch.float32)
    lo, hi = _RANGES[y_zp.dtype]
    return [torch.clamp(q, lo, hi).to(y_zp.dtype)]
