"""The op table: what SeaBiscuit knows of each operation target, without importing torch.

One entry per target (``OPS``, an ``OpInfo``): its kind (which decomposition rules serve it),
its flops, the scratch memory it needs beyond its operands, and, for the few that no rule cuts,
why; ``row_split_forbidden_dims`` and ``operand_dim`` say how it is cut into strips. The kernel
registry (``lower/registry.py``) runs exactly the ATen targets of this table, the cost model and
the working sets read its flops and scratch, the decomposer its kinds: a new op is an entry here
(and a case in ``tests/test_every_op.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

LINEAR = {"aten.linear.default", "aten.addmm.default", "sb.qlinear.default", "sb.q4linear.default"}
MATMUL = {"aten.mm.default", "aten.matmul.default", "aten.bmm.default"}
# NOTE: ``.padding`` overloads take "same" / "valid"; ``sb.conv_strip`` takes explicit (before, after)
# padding per spatial dim (a strip of a convolution, its halo cut from the input).
CONV = {"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.conv1d.padding",
        "aten.conv2d.padding", "aten.conv3d.padding", "sb.conv_strip"}
CONV_TRANSPOSE = {"aten.conv_transpose1d.default", "aten.conv_transpose2d.input",
                  "aten.conv_transpose3d.input"}
EMBEDDING = {"aten.embedding.default", "sb.embedding_rows"}
ATTENTION = {"aten.scaled_dot_product_attention.default", "sb.attention", "sb.attention_part"}

ELEMENTWISE = {
    f"aten.{n}"
    for n in (
        "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "mul.Tensor",
        "mul.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode", "pow.Tensor_Scalar",
        "pow.Tensor_Tensor", "neg.default", "exp.default", "log.default", "sqrt.default",
        "rsqrt.default", "tanh.default", "sigmoid.default", "relu.default",
        "gelu.default", "silu.default", "hardtanh.default", "abs.default",
        "cos.default", "sin.default", "erf.default", "clamp.default", "clamp_min.default",
        "where.self", "masked_fill.Scalar", "masked_fill.Tensor", "dropout.default",
        "to.dtype", "to.dtype_layout", "to.device", "_to_copy.default", "type_as.default",
        "eq.Tensor", "eq.Scalar", "ne.Scalar", "ne.Tensor", "ge.Scalar", "le.Tensor",
        "lt.Scalar", "gt.Scalar", "__and__.Tensor", "__or__.Tensor", "logical_not.default",
        "bitwise_not.default", "hardswish.default", "hardsigmoid.default", "leaky_relu.default",
        "elu.default", "minimum.default", "maximum.default", "reciprocal.default",
        "contiguous.default", "clone.default", "alias.default", "detach.default",
        "round.default", "floor.default", "ceil.default", "sign.default",
        "pow.Scalar", "square.default", "max.other", "min.other", "multiply.Tensor",
        "gt.Tensor", "ge.Tensor", "lt.Tensor", "le.Scalar", "where.ScalarOther", "where.ScalarSelf",
        "floor_divide.default", "lift_fresh_copy.default",
        "tan.default", "asin.default", "acos.default",
        "atan.default", "sinh.default", "cosh.default", "asinh.default", "acosh.default", "atanh.default",
        "mish.default", "celu.default", "fmod.Tensor", "remainder.Tensor", "__xor__.Tensor",
        "__lshift__.Tensor", "__rshift__.Tensor",
        # NOTE: what in-place writes become out of place (trace/inplace.py)
        "copy.default", "fill.Scalar", "fill.Tensor", "zero.default",
    )
}
NORM = {
    "aten.layer_norm.default", "aten.batch_norm.default", "aten.group_norm.default",
    "aten.rms_norm.default", "aten.softmax.int", "aten._softmax.default",
    "aten.log_softmax.int", "aten._log_softmax.default",
    "aten._native_batch_norm_legit_no_training.default",
}
REDUCTION = {"aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default", "aten.cumsum.default",
             "aten.max.dim", "aten.argmax.default", "aten.diff.default", "aten.sum.default",
             "aten.max.default", "aten.min.default", "aten.argmin.default", "aten.prod.dim_int",
             "aten.logsumexp.default", "aten.cumprod.default", "aten.histc.default",
             "aten.all.dim"}
# NOTE: reductions over some dims: (dims, keepdim) from their args (``reduced``)
DIM_REDUCTIONS = {"aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default", "aten.argmax.default",
                  "aten.argmin.default", "aten.prod.dim_int", "aten.logsumexp.default", "aten.all.dim"}
POOL = {
    "aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
    "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default",
    "aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default",
    "aten.adaptive_avg_pool3d.default", "aten.adaptive_max_pool2d.default",
    "sb.max_pool_strip", "sb.avg_pool_strip",
}
VIEW = {
    f"aten.{n}"
    for n in (
        "view.default", "reshape.default", "_unsafe_view.default", "transpose.int",
        "permute.default", "unsqueeze.default", "squeeze.dim", "squeeze.default",
        "expand.default", "slice.Tensor", "select.int", "flatten.using_ints",
        "split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int",
        "t.default", "numpy_T.default", "broadcast_to.default", "narrow.default", "unflatten.int",
        "repeat.default", "reshape_as.default",
    )
}
CONCAT = {"aten.cat.default", "aten.concat.default", "aten.stack.default"}
CREATION = {
    f"aten.{n}"
    for n in ("arange.default", "arange.start", "arange.start_step", "full.default",
              "zeros.default", "ones.default", "new_ones.default", "new_zeros.default",
              "full_like.default", "zeros_like.default", "ones_like.default", "scalar_tensor.default",
              "empty.memory_format")
}
INDEX = {"aten.index.Tensor", "aten.gather.default", "aten.index_select.default"}
LIKE = {"aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default"}   # x's shape only
PAD = {"aten.pad.default", "aten.constant_pad_nd.default"}
# NOTE: images resampled to another size: every sample and channel on its own
RESAMPLE = {"aten.upsample_nearest2d.vec", "aten.upsample_bilinear2d.vec", "aten.upsample_bicubic2d.vec"}
# NOTE: registered ops of no kind above: the rules that serve "opaque" ops cut them (strips), or
# none does (INDIVISIBLE)
OPAQUE = PAD | RESAMPLE | {
    f"aten.{n}"
    for n in ("baddbmm.default", "_weight_norm.default", "repeat_interleave.self_int", "im2col.default",
              "sort.default", "sort.stable", "topk.default", "item.default", "einsum.default",
              "linalg_det.default", "scatter.src", "scatter_reduce.two", "flip.default", "triu.default",
              "tril.default", "meshgrid.indexing", "outer.default", "grid_sampler.default",
              "slice_scatter.default", "select_scatter.default", "index_put.default")
} | {"sb.attention_merge", "sb.attention_finish", "sb.region", "sb.assemble", "sb.kv_attention"}

_KINDS: list[tuple[set[str], str]] = [
    (LINEAR, "linear"), (MATMUL, "matmul"), (CONV, "conv"), (CONV_TRANSPOSE, "conv_transpose"),
    (EMBEDDING, "embedding"),
    (ATTENTION, "attention"), (ELEMENTWISE, "elementwise"), (NORM, "norm"),
    (REDUCTION, "reduction"), (POOL, "pool"), (VIEW, "view"), (CONCAT, "concat"),
    (CREATION, "creation"), (INDEX, "index"),
]


@dataclass(frozen=True)
class MatmulOperands:
    """Where the operands of ``y = A @ B (+ bias)`` sit in a matmul's arguments."""

    a: int                  # NOTE: the input rows
    b: int                  # NOTE: the other operand (a weight, for a layer)
    bias: int | None        # NOTE: None: the op takes no bias
    b_out_in: bool          # NOTE: B held [N, K] (nn.Linear's [out, in]); else [..., K, N]


# NOTE: the decomposer cuts these by columns, rows or the reduction, and the weight layout
# (lower/layout.py) times the 2-D ones with a float weight
MATMUL_OPERANDS: Mapping[str, MatmulOperands] = MappingProxyType({
    "aten.linear.default": MatmulOperands(0, 1, 2, True),
    "aten.addmm.default": MatmulOperands(1, 2, 0, False),
    "aten.mm.default": MatmulOperands(0, 1, None, False),
    "aten.matmul.default": MatmulOperands(0, 1, None, False),
    "aten.bmm.default": MatmulOperands(0, 1, None, False),
    "sb.qlinear.default": MatmulOperands(0, 1, 4, True),
})

# NOTE: ops that read only the rows they look up of their table (a lookup, not a stream of it):
# the cost model counts a weight's gathered rows only, and any order of a weight serves them
GATHERS = frozenset(EMBEDDING | {"aten.index_select.default"})

# Ops that check metadata and produce nothing; tracing drops them.
ASSERTS = {
    "aten._assert_tensor_metadata.default", "aten._assert_async.msg",
    "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default",
    "aten._functional_assert_async.msg",
}


def kind_of(target: str) -> str:
    """Canonical kind of a target (its entry's); ``opaque`` when decomposition knows nothing of it."""
    info = _ops.get(target)
    return info.kind if info is not None else "opaque"


def _norm_dims(dims: Sequence[int] | int, rank: int) -> set[int]:
    if isinstance(dims, int):
        dims = [dims]
    return {d % rank for d in dims} if rank else set()


def row_split_forbidden_dims(target: str, args: Sequence[Any], out_rank: int) -> set[int] | None:
    """Output dims along which ``target`` may NOT be cut into strips.

    ``None`` means the op cannot be strip-split at all. Strip splitting slices the
    activation inputs that broadcast (right-aligned) along the chosen dim, runs the
    op on each strip and concatenates the strips: exact for these ops.
    """
    if target in ELEMENTWISE or target in LIKE:
        return set()
    written = _written_forbidden_dims(target, args, out_rank)
    if written is not None:
        return written
    if target in {"aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int",
                  "aten._log_softmax.default"}:
        return _norm_dims(args[1], out_rank)
    if target in {"aten.layer_norm.default", "aten.rms_norm.default"}:
        n = len(args[1])
        return set(range(out_rank - n, out_rank))
    if target in {"aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default",
                  "aten.group_norm.default"}:
        # NOTE: per-channel params are not right-aligned, so never cut the channel dim.
        return {1} | ({*range(2, out_rank)} if target == "aten.group_norm.default" else set())
    if target in POOL:
        return set(range(out_rank - pool_nd(target, args), out_rank))
    if target in PAD:                   # NOTE: (before, after) pairs from the last dim backwards
        return set(range(out_rank - len(args[1]) // 2, out_rank))
    if target == "aten.index.Tensor":           # NOTE: x[idx]: the dims after the indexed first one
        idx = operand(args, 1, [])
        return {0} if len(idx) == 1 and ref_name(idx[0]) is not None else None
    if target in STRIP_OPERANDS:                 # NOTE: every dim, each cutting only its operands
        return set()
    if target in RESAMPLE:
        return set(range(2, out_rank))
    if target == "aten._weight_norm.default":     # NOTE: a norm per index of dim, over the rest
        dim = int(operand(args, 2, 0)) % out_rank
        return set(range(out_rank)) - {dim}
    if target in DIM_REDUCTIONS:
        dims, keep = reduced(args, out_rank)
        if dims is None:
            return None                 # NOTE: every dim reduced: reduce_parts cuts it instead
        # NOTE: without keepdim, output dim d is the d-th kept input dim (operand_dim)
        return dims if keep else set()
    if target in {"aten.cumsum.default", "aten.cumprod.default", "aten.gather.default",
                  "aten.index_select.default", "aten.scatter.src", "aten.scatter_reduce.two"}:
        return _norm_dims(args[1], out_rank)            # NOTE: the dim it runs, picks or scatters along
    if target == "aten.diff.default":
        return _norm_dims(operand(args, 2, -1), out_rank)
    if target == "aten.repeat_interleave.self_int":
        dim = operand(args, 2)
        return None if dim is None else _norm_dims(dim, out_rank)
    if target == "aten.flip.default":
        return _norm_dims(args[1], out_rank)
    if target in {"aten.triu.default", "aten.tril.default"}:
        return set(range(max(0, out_rank - 2), out_rank))
    if target in LEADING:
        return set(range(LEADING[target], out_rank))
    return None


def _written_forbidden_dims(target: str, args: Sequence[Any], out_rank: int) -> set[int] | None:
    """``row_split_forbidden_dims`` of the ops that write one tensor into another, and of
    ``grid_sampler``; None for any other op (``STRIP_OPERANDS`` says which operands a dim cuts)."""
    if target == "aten.slice_scatter.default":      # NOTE: src is base's shape but along dim
        return _norm_dims(operand(args, 2, 0), out_rank)
    if target == "aten.select_scatter.default":     # NOTE: src is base less dim (operand_dim)
        return _norm_dims(args[2], out_rank)
    if target == "aten.index_put.default":          # NOTE: the dims its indices address
        return set(range(len(args[1]))) | set(range(EVERY_DIM, out_rank))
    if target == "aten.grid_sampler.default":       # NOTE: each output pixel reads anywhere
        return set(range(2, out_rank))
    return None


EVERY_DIM = 8        # NOTE: the dims an every-dim entry of STRIP_OPERANDS lists (no traced tensor has more)
# NOTE: ops whose strips along an output dim cut only some operands (by position), the others
# whole: baddbmm(input, b1, b2) by samples (all three), by rows (input and b1: b2's rows are the
# reduction) or by columns (input and b2)
STRIP_OPERANDS: Mapping[str, Mapping[int, tuple[int, ...]]] = MappingProxyType({
    "aten.baddbmm.default": MappingProxyType({0: (0, 1, 2), 1: (0, 1), 2: (0, 2)}),
    "aten.outer.default": MappingProxyType({0: (0,), 1: (1,)}),      # NOTE: a's rows, b's columns
    # NOTE: samples cut the input and its grid, channels the input alone
    "aten.grid_sampler.default": MappingProxyType({0: (0, 1), 1: (0,)}),
    # NOTE: x and its values, never the indices (right-aligned, an index could match by chance)
    "aten.index_put.default": MappingProxyType({d: (0, 2) for d in range(EVERY_DIM)}),
})


# NOTE: ops whose first ``n`` output dims are their input's first dims (left-aligned), the rest
# made from the input's other dims: im2col (the batch), a determinant (the batch of matrices)
LEADING = {"aten.im2col.default": 1, "aten.linalg_det.default": 1 << 30}


def reduced(args: Sequence[Any], out_rank: int) -> tuple[set[int] | None, bool]:
    """``(input dims reduced, keepdim)`` of a reduction over some dims (``DIM_REDUCTIONS``);
    ``None`` dims: every dim."""
    dims, keep = operand(args, 1), bool(operand(args, 2, False))
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return None, keep
    n = 1 if isinstance(dims, int) else len(dims)
    return _norm_dims(dims, out_rank if keep else out_rank + n), keep


def operand_dim(target: str, args: Sequence[Any], out_rank: int, dim: int, rank: int) -> int | None:
    """The dim of an operand of rank ``rank`` that output dim ``dim`` of a strip-cut op lines up
    with: right-aligned broadcasting, but the kept dims of a reduction without keepdim, the
    leading dims of ``LEADING`` ops and the source of ``select_scatter``; None when none does."""
    if target in DIM_REDUCTIONS:
        dims, keep = reduced(args, out_rank)
        if dims is not None and not keep and rank == out_rank + len(dims):
            return [i for i in range(rank) if i not in dims][dim]
    if target in LEADING:
        return dim if dim < rank else None
    if target == "aten.outer.default":          # NOTE: each vector is one dim of the output
        return 0
    if target == "aten.select_scatter.default" and rank == out_rank - 1:   # NOTE: src: base less dim
        at = int(args[2]) % out_rank
        return dim if dim < at else dim - 1
    d = dim - (out_rank - rank)
    return d if d >= 0 else None


def pool_nd(target: str, args: Sequence[Any]) -> int:
    """Spatial dims a pooling op slides over: the last 1, 2 or 3 dims of its input."""
    for nd in (1, 2, 3):
        if f"pool{nd}d" in target:
            return nd
    return len(args[1])   # NOTE: sb.*_pool_strip: kernel sizes, one per spatial dim


def operand(args: Sequence[Any], i: int, default: Any = None) -> Any:
    """Positional argument ``i`` of a normalised argument list, or ``default``."""
    return args[i] if i < len(args) else default


def ref_name(value: Any) -> tuple[str, str] | None:
    """``("t", name)`` / ``("p", name)`` when ``value`` is an operand reference."""
    if not isinstance(value, (dict, MappingProxyType)):
        return None
    if len(value) == 1:
        (tag, name), = value.items()
        if tag in ("t", "p"):
            return tag, name
    elif len(value) == 2 and "t" in value and "view" in value:
        return "t", value["t"]
    return None


# Ops no rule cuts, and why: ``decompose`` names the reason when one of them is over the budget
# (with the smallest budget that works). Every other registered op is cut to any budget
# (``tests/test_every_op.py``).
_TWO = "it has {} outputs and rules cut ops with one output"
INDIVISIBLE: Mapping[str, str] = MappingProxyType({
    "aten.max.dim": _TWO.format("two (values and indices)"),
    "aten.topk.default": _TWO.format("two (values and indices)"),
    "aten.sort.default": _TWO.format("two (values and indices)"),
    "aten.sort.stable": _TWO.format("two (values and indices)"),
    "aten.adaptive_max_pool2d.default": _TWO.format("two (values and indices)"),
    "aten._native_batch_norm_legit_no_training.default": _TWO.format("three (the output, its mean and "
                                                                     "its inverse deviation)"),
    "aten.unbind.int": _TWO.format("one per index of its dim"),
    "aten.meshgrid.indexing": _TWO.format("one per input"),
    "aten.einsum.default": "an einsum is an equation over all its operands; no rule reads one",
    "aten.scalar_tensor.default": "it makes a single number",
})

# Tile ops that only decomposition rules (or generation's step trace) make, each piece cut to fit
# when it is made, never in a traced graph: what makes them.
PIECES: Mapping[str, str] = MappingProxyType({
    "sb.attention": "decompose/rules/attention.py: query rows",
    "sb.attention_part": "decompose/rules/attention.py: blocks of keys",
    "sb.attention_merge": "decompose/rules/attention.py: blocks of keys, merged",
    "sb.attention_finish": "decompose/rules/attention.py: blocks of keys, normalised",
    "sb.conv_strip": "decompose/rules/conv.py: spatial strips",
    "sb.max_pool_strip": "decompose/rules/pool.py: spatial strips",
    "sb.avg_pool_strip": "decompose/rules/pool.py: spatial strips",
    "sb.embedding_rows": "decompose/rules/embedding.py: blocks of the table's rows",
    "sb.region": "decompose/decomposer.py: a region of a tiled tensor another cut needs",
    "sb.assemble": "decompose/decomposer.py: tiles joined for an op that reads them whole",
    "sb.kv_attention": "trace/decoder.py: a generation step's attention over its KV cache, kept whole "
                       "beside the cache",
})



# --- flops ------------------------------------------------------------------------------------
ShapeOf = Callable[[Any], "tuple[int, ...] | None"]
"""``shape_of(arg)``: the shape of an operand reference (its view's, for a view), else None."""
FlopsFn = Callable[[str, Sequence[Any], Sequence[tuple[int, ...]], ShapeOf], int]
"""``flops(target, args, out_shapes, shape_of)``: flops of one call."""


def _numel(shapes: Sequence[tuple[int, ...]]) -> int:
    return math.prod(shapes[0]) if shapes else 0


def _per_output(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    return _numel(outs)


def _free(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    return 0


def _dot(operand_i: int) -> FlopsFn:
    """A multiply-add per output and element of the reduced (last) dim of operand ``operand_i``."""
    def flops(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
        a = shape_of(args[operand_i]) if operand_i < len(args) else None
        return 2 * _numel(outs) * (a[-1] if a else 1)
    return flops


def _conv(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    w = shape_of(args[1])
    return 2 * _numel(outs) * (math.prod(w[1:]) if w else 1)


def _conv_transpose(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]],
                    shape_of: ShapeOf) -> int:
    x, w = shape_of(args[0]), shape_of(args[1])   # NOTE: each input element meets C_out/groups x kernel
    return 2 * math.prod(x) * math.prod(w[1:]) if x and w else _numel(outs)


def _attention(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    q, k = shape_of(args[0]), shape_of(args[1])
    if not q or not k:
        return _numel(outs)
    return 4 * math.prod(q[:-1]) * k[-2] * q[-1]       # NOTE: QK^T and AV, 2 * L * S * E each


def _norm(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    return 5 * _numel(outs)


def _pool(target: str, args: Sequence[Any], outs: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    """One flop per input element each output's window reads."""
    out = outs[0] if outs else ()
    nd = pool_nd(target, args)
    if "adaptive" in target:
        x = shape_of(args[0])
        window = math.prod(x[-nd:]) // max(math.prod(out[-nd:]), 1) if x else 1
    else:
        sizes = [args[1]] if isinstance(args[1], int) else list(args[1])
        window = math.prod(sizes) ** (nd if len(sizes) == 1 else 1)   # NOTE: one size serves every dim
    return _numel(outs) * window


FLOPS_BY_KIND: Mapping[str, FlopsFn] = MappingProxyType({
    "linear": _dot(1), "matmul": _dot(0), "conv": _conv, "conv_transpose": _conv_transpose,
    "attention": _attention, "norm": _norm, "pool": _pool, "view": _free, "creation": _free,
})
# NOTE: sb.q4linear holds its weight as [n, k / 2] bytes: the reduction is its input's last dim
FLOPS_BY_TARGET: Mapping[str, FlopsFn] = MappingProxyType({"aten.addmm.default": _dot(1),
                                                            "sb.q4linear.default": _dot(0)})


# --- scratch: memory beyond the operands -----------------------------------------------------------
SpecOf = Callable[[Any], "tuple[tuple[int, ...], str] | None"]
"""``spec_of(arg)``: ``(shape, dtype)`` of an operand reference (its view's shape), else None."""
ScratchFn = Callable[[Sequence[Any], Sequence[tuple[int, ...]], SpecOf], int]
"""``scratch(args, out_shapes, spec_of)``: bytes one call needs beyond its operands."""

ATTENTION_SCORES = 4   # NOTE: bytes per attention score: kernels compute scores in float32
QLINEAR = "sb.qlinear.default"
QLINEAR_SLAB = 1 << 20     # NOTE: most bytes of weight sb.qlinear dequantizes at once (larger: no faster)
QLINEAR_SHARE = 16         # NOTE: ... and at most 1/16 of the tile's 1-byte weight, so its tiles hold ~4x
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def _scores(args: Sequence[Any], outs: Sequence[tuple[int, ...]], spec_of: SpecOf) -> int:
    """The score matrix of an attention op."""
    q, k = (spec_of(args[0]), spec_of(args[1])) if len(args) > 1 else (None, None)
    if q is None or k is None or len(q[0]) < 2 or len(k[0]) < 2:
        return 0
    return math.prod(q[0][:-1]) * k[0][-2] * ATTENTION_SCORES


def qlinear_columns(n: int, k: int, itemsize: int, room: int = 0) -> int:
    """Columns of an ``[n, k]`` 1-byte weight that ``sb.qlinear`` dequantizes at once into
    ``itemsize``-byte elements: ``n * k / QLINEAR_SHARE`` bytes of them, or as many as ``room``
    bytes hold when that is more (the budget a tile's working set leaves it), at most
    ``QLINEAR_SLAB``; whole multiples of 16 columns where that many fit, at least one column."""
    cap = min(QLINEAR_SLAB, max(n * k // QLINEAR_SHARE, room))
    cols = cap // max(1, k * itemsize)
    return max(1, min(n, cols // 16 * 16 if cols >= 16 else cols))


def qlinear_scratch(n: int, k: int, itemsize: int, columns: int, rows: int, integer: bool) -> int:
    """Bytes ``sb.qlinear`` needs beyond its operands, over ``rows`` rows of an ``[n, k]`` weight:
    its slab of ``columns``, an integer input in float64, and one step's product (when it takes
    several steps, or converts to int32)."""
    x = rows * k * 8 if integer else 0
    step = rows * columns * itemsize if integer or columns < n else 0
    return columns * k * itemsize + x + step


@dataclass(frozen=True)
class QlinearSlab:
    """What an ``sb.qlinear`` op dequantizes: an ``[n, k]`` weight, ``columns`` at a time into
    ``itemsize``-byte elements, for ``rows`` rows of an input that is ``integer`` or float."""

    n: int
    k: int
    itemsize: int
    columns: int
    rows: int
    integer: bool
    bf16: bool = False      # NOTE: float rows multiplied in bf16 (its ``bf16`` argument, ``qlinear.py``)

    def scratch(self, columns: int | None = None) -> int:
        cols = self.columns if columns is None else columns
        if self.bf16:       # NOTE: the rows in bf16, a bf16 slab, the whole bf16 product (the int8 kernel's)
            return ((self.rows + cols) * self.k + self.rows * self.n) * 2
        return qlinear_scratch(self.n, self.k, self.itemsize, cols, self.rows, self.integer)


def qlinear_slab(args: Sequence[Any], outs: Sequence[tuple[int, ...]], spec_of: SpecOf) -> QlinearSlab | None:
    """The slab of an ``sb.qlinear`` call (columns: as its ``columns`` argument says, else
    ``qlinear_columns``), or None when its operands are unknown."""
    x = spec_of(args[0]) if args else None
    if x is None or not outs:
        return None
    shape, dtype = x
    integer = not dtype.startswith(("float", "bfloat"))
    itemsize = 8 if integer else _ITEMSIZE.get(dtype, 4)
    n, k = outs[0][-1], shape[-1]
    given = args[5] if len(args) > 5 and isinstance(args[5], int) and args[5] > 0 else 0
    bf16 = bool(len(args) > 6 and args[6]) and dtype in ("float32", "bfloat16")
    if bf16:
        itemsize = 2
    columns = min(n, given) if given else qlinear_columns(n, k, itemsize, QLINEAR_SLAB if bf16 else 0)
    return QlinearSlab(n, k, itemsize, columns, math.prod(shape[:-1]), integer, bf16)


def _slab(args: Sequence[Any], outs: Sequence[tuple[int, ...]], spec_of: SpecOf) -> int:
    """The dequantized slab of an ``sb.qlinear`` (and its float64 input, when integer)."""
    slab = qlinear_slab(args, outs, spec_of)
    return slab.scratch() if slab is not None else 0


SCRATCH_BY_KIND: Mapping[str, ScratchFn] = MappingProxyType({"attention": _scores})
def _q4(args: Sequence[Any], outs: Sequence[tuple[int, ...]], spec_of: SpecOf) -> int:
    """An ``sb.q4linear``'s rows and product in bf16 (the int4 kernel's), and where a device has no
    int4 kernel the slab of rows it dequantizes at once (``qlinear.q4_rows``; counted on every device:
    a plan may move)."""
    x = spec_of(args[0]) if args else None
    if x is None or not outs:
        return 0
    return q4linear_scratch(math.prod(x[0][:-1]), x[0][-1], outs[0][-1], _ITEMSIZE.get(x[1], 4))


def q4linear_scratch(rows: int, k: int, n: int, itemsize: int) -> int:
    """``_q4`` for ``rows`` rows of ``itemsize`` bytes an element over an ``[n, k]`` int4 weight: the
    rows and product in bf16, and the larger of a slab de-quantized into ``itemsize`` (a device with
    no int4 kernel) and a slab of ``q4_gemm_rows`` rows for bf16 GEMMs (``qlinear.q4linear_gemm``: the
    slab in bf16 and the GEMM's packed copy of it, or its integers while it is made, 2 bytes a weight
    each; its scales and zeros, an eighth of a byte a weight at most; its product in bf16)."""
    gemm = q4_gemm_rows(n, k)
    return (rows * k + rows * n) * 2 + max(q4_rows(n, k, itemsize) * (k + rows) * itemsize,
                                           gemm * (4 * k + -(-k // 8) + 2 * rows))


Q4_GEMM_SLAB = 2 << 20
"""Most bytes of bf16 weight ``qlinear.q4linear_gemm`` de-quantizes at once: SmolLM2's largest int4
weights in one slab (each slab is a GEMM of its own; 4 slabs took 20% longer than one)."""


def q4_gemm_rows(n: int, k: int) -> int:
    """Rows of an ``[n, k]`` int4 weight de-quantized to bf16 at once for many rows' GEMMs: whole
    blocks of 64 within ``Q4_GEMM_SLAB`` bytes, at least one."""
    return min(n, max(64, Q4_GEMM_SLAB // max(1, k * 2) // 64 * 64))


def q4_rows(n: int, k: int, itemsize: int) -> int:
    """Rows of an ``[n, k]`` int4 weight dequantized at once into ``itemsize``-byte elements where a
    device has no int4 kernel: whole blocks of 64 within ``QLINEAR_SLAB`` bytes, at least one."""
    return min(n, max(64, QLINEAR_SLAB // max(1, k * itemsize) // 64 * 64))


Q4LINEAR = "sb.q4linear.default"
Q4_BLOCK = 64
"""Rows of an int4 weight the CPU kernel's layout interleaves (``qlinear.unpack_int4``): an int4
tile's rows are whole multiples of it."""
SCRATCH_BY_TARGET: Mapping[str, ScratchFn] = MappingProxyType({QLINEAR: _slab, Q4LINEAR: _q4})


# --- the table ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpInfo:
    """What SeaBiscuit knows of one target."""

    target: str
    kind: str
    flops: FlopsFn = _per_output
    scratch: ScratchFn | None = None
    indivisible: str = ""        # NOTE: why no rule cuts it ("" : rules do)
    made_by: str = ""            # NOTE: a tile op only rules make: which


def _info(target: str, kind: str) -> OpInfo:
    return OpInfo(target, kind, FLOPS_BY_TARGET.get(target) or FLOPS_BY_KIND.get(kind, _per_output),
                  SCRATCH_BY_TARGET.get(target) or SCRATCH_BY_KIND.get(kind),
                  INDIVISIBLE.get(target, ""), PIECES.get(target, ""))


_ops: dict[str, OpInfo] = {}
for _targets, _kind in [*_KINDS, (OPAQUE, "opaque")]:
    for _t in sorted(_targets):
        _ops.setdefault(_t, _info(_t, _kind))          # NOTE: the first group naming a target sets its kind
OPS: Mapping[str, OpInfo] = MappingProxyType(_ops)     # NOTE: a live view: declare() adds to it


def declare(target: str, kind: str = "opaque") -> OpInfo:
    """The entry of ``target``, made (of ``kind``) if it has none: a kernel registered at run time
    (``lower.register_kernel``) is an op of the table, run whole unless rules serve its kind."""
    if target not in _ops:
        _ops[target] = _info(target, kind)
    return _ops[target]


def flops(target: str, args: Sequence[Any], out_shapes: Sequence[tuple[int, ...]], shape_of: ShapeOf) -> int:
    """Flops of one call of ``target``."""
    info = _ops.get(target)
    fn = info.flops if info is not None else _per_output
    return int(fn(target, args, out_shapes, shape_of))


def scratch(target: str, kind: str, args: Sequence[Any], out_shapes: Sequence[tuple[int, ...]],
            spec_of: SpecOf) -> int:
    """Bytes one call of ``target`` (an op of ``kind``) needs beyond its operands."""
    info = _ops.get(target)
    fn = info.scratch if info is not None else SCRATCH_BY_KIND.get(kind)
    return int(fn(args, out_shapes, spec_of)) if fn is not None else 0


def registry_hint() -> str:
    """What an ``UnsupportedOp`` message tells its reader to do."""
    return (f"SeaBiscuit supports {len(_ops)} ops (the op table, seabiscuit_dask.ops.OPS); a graph naming "
            "anything else is refused, since graphs are data, never code. To run another op, add its "
            "entry to seabiscuit_dask/ops.py or call seabiscuit_dask.lower.register_kernel(target, fn) on "
            "the client and on every worker")
