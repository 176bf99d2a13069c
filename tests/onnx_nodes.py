"""SeaBiscuit as an ONNX backend for the ONNX node tests (``onnx.backend.test``).

Each case's model is traced at its inputs' shapes, decomposed at a small budget and
run in-process (``sb.run_local``); its outputs are compared with the case's
reference outputs at the case's tolerances. A case whose model holds an op type
SeaBiscuit does not map is *skipped* (``UnsupportedOp``), any other failure *failed*.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

import seabiscuit_dask as sb

BUDGET = "4KiB"
UNSUPPORTED_DTYPES = {"uint16", "uint32", "uint64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int4",
                      "uint4"}
# NOTE: operands SeaBiscuit needs constant for the traced shapes (as TensorRT needs shape tensors):
# a node test feeds them as inputs, so its backend gives them as constants.
SHAPE_OPERANDS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,),
                  "Squeeze": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
                  "ReduceMin": (1,), "Range": (0, 1, 2), "ConstantOfShape": (0,), "Split": (1,),
                  "Clip": (1, 2), "Dropout": (1, 2), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,),
                  "TopK": (1,), "CumSum": (1,), "CumProd": (1,), "OneHot": (1,), "Trilu": (1,),
                  "Compress": (1,), "ReverseSequence": (1,), "CenterCropPad": (1,), "ReduceL1": (1,),
                  "ReduceL2": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,), "ReduceProd": (1,),
                  "ReduceSumSquare": (1,), "Col2Im": (1, 2), "MaxUnpool": (2,), "AffineGrid": (1,),
                  "HannWindow": (0,), "HammingWindow": (0,), "BlackmanWindow": (0,)}
# The op types SeaBiscuit claims: at least 95% of the node test cases of each that run pass
# (cases of dtypes torch does not compute with are skipped, and counted).
CLAIMED = tuple("""
    Abs Add And AveragePool BatchNormalization Cast Ceil Clip Concat Constant ConstantOfShape Conv
    ConvTranspose
    Cos DequantizeLinear Div Dropout DynamicQuantizeLinear Elu Equal Erf Exp Expand Flatten Floor
    Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual
    HardSigmoid Identity InstanceNormalization IsNaN LRN LayerNormalization LeakyRelu Less
    LessOrEqual Log LogSoftmax MatMul MatMulInteger Max MaxPool Mean Min Mul Neg Not Or PRelu Pad
    Pow QLinearMatMul QuantizeLinear Reciprocal ReduceMax ReduceMean ReduceMin ReduceSum Relu
    Reshape Round Selu Shape Sigmoid Sign Sin Size Slice Softmax Softplus Softsign Split Sqrt
    Squeeze Sub Sum Tanh Tile Transpose Unsqueeze Where
    Acos Acosh AffineGrid ArgMax ArgMin Asin Asinh Atan Atanh BitShift BitwiseAnd BitwiseNot BitwiseOr
    BitwiseXor BlackmanWindow CastLike Celu CenterCropPad Col2Im Compress ConvInteger Cosh CumProd CumSum
    DepthToSpace Det Einsum EyeLike GroupNormalization HammingWindow HannWindow HardSwish Hardmax IsInf
    LpNormalization LpPool MaxUnpool MeanVarianceNormalization Mish Mod NegativeLogLikelihoodLoss OneHot
    QLinearConv RMSNormalization Range ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceProd
    ReduceSumSquare Resize ReverseSequence RotaryEmbedding Scatter ScatterElements ScatterND Shrink Sinh
    SoftmaxCrossEntropyLoss SpaceToDepth SwiGLU Swish Tan ThresholdedRelu TopK Trilu Upsample Xor
""".split())


def shape_operands(model: Any) -> set[str]:
    """Graph inputs a node of ``model`` reads as a shape, axes, bounds or sizes operand."""
    return {n.input[i] for n in model.graph.node for i in SHAPE_OPERANDS.get(n.op_type, ())
            if i < len(n.input) and n.input[i]}


def node_cases() -> list[Any]:
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [c for c in load_model_tests(kind="node") if c.model is not None and c.data_sets]


def model_cases(kind: str) -> list[Any]:
    """The cases of a model kind (``pytorch-converted``, ``pytorch-operator``, ...) with their
    model and data sets loaded from disk (the loader leaves both to the runner)."""
    import glob
    import os

    import onnx
    from onnx.backend.test.loader import load_model_tests

    def tensors(folder: str, prefix: str) -> list[Any]:
        files = sorted(glob.glob(os.path.join(folder, f"{prefix}_*.pb")),
                       key=lambda f: int(f.rsplit("_", 1)[1][:-3]))
        return [onnx.load_tensor(f) for f in files]

    cases = []
    for case in load_model_tests(kind=kind):
        if case.model_dir is None or not os.path.isfile(os.path.join(case.model_dir, "model.onnx")):
            continue
        sets = sorted(glob.glob(os.path.join(case.model_dir, "test_data_set_*")))
        case.model = onnx.load(os.path.join(case.model_dir, "model.onnx"))
        case.data_sets = [(tensors(d, "input"), tensors(d, "output")) for d in sets]
        if case.data_sets:
            cases.append(case)
    return sorted(cases, key=lambda c: c.name)


def op_type(case: Any) -> str:
    """The op a case tests: its single node's type (``*_expanded`` cases: the function body's)."""
    ops = [n.op_type for n in case.model.graph.node]
    if case.name.endswith("_expanded") or len(ops) != 1:
        return "expanded"
    return ops[0]


def run_case(case: Any, budget: str = BUDGET, share: float | None = None) -> tuple[str, str]:
    """("passed" | "failed" | "skipped", why); ``share``: decompose at that share of the graph's
    largest op instead (a model's budget: below its largest op, whatever its size)."""
    from onnx import numpy_helper

    from seabiscuit_dask.trace.onnx import load_onnx

    inputs, expected = ([numpy_helper.to_array(v) if hasattr(v, "data_type")
                         else np.asarray(v) if isinstance(v, np.generic) else v for v in vs]
                        for vs in case.data_sets[0])
    if not all(isinstance(x, np.ndarray) for x in [*inputs, *expected]):
        return "skipped", "sequence or optional inputs"
    if any(x.dtype.kind not in "biuf" or x.dtype.name in UNSUPPORTED_DTYPES for x in [*inputs, *expected]):
        return "skipped", "a dtype torch does not compute with"
    names = [i.name for i in case.model.graph.input]
    fixed = {n: x for n, x in zip(names, inputs) if n in shape_operands(case.model)}
    inputs = [x for n, x in zip(names, inputs) if n not in fixed]
    try:
        module = load_onnx(case.model, constants=fixed)
    except sb.UnsupportedOp as e:
        return "skipped", str(e)[:200]
    except Exception as e:  # noqa: BLE001 - reported per case
        return "failed", f"load: {type(e).__name__}: {str(e)[:200]}"
    try:
        xs = tuple(torch.from_numpy(np.array(x, copy=True)) for x in inputs)
        graph = sb.trace(module, xs)
        if share is not None:
            from seabiscuit_dask.decompose import largest_working_set

            budget = str(max(256, int(largest_working_set(graph)[1] * share)))
        micro = sb.decompose(graph, budget, allow_oversize=True)
        got = sb.run_local(micro, *xs, weights=module)
    except sb.UnsupportedOp as e:
        return "skipped", str(e)[:200]
    except Exception as e:  # noqa: BLE001 - reported per case
        return "failed", f"{type(e).__name__}: {str(e)[:200]}"
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    if len(got) != len(expected):
        return "failed", f"{len(got)} outputs, expected {len(expected)}"
    for g, e in zip(got, expected):
        g = g.numpy() if isinstance(g, torch.Tensor) else np.asarray(g)
        if g.shape != e.shape:
            return "failed", f"shape {g.shape}, expected {e.shape}"
        if e.dtype.kind in "fc":
            if not np.allclose(g.astype(np.float64), e.astype(np.float64), rtol=case.rtol, atol=case.atol,
                               equal_nan=True):
                return "failed", f"max abs difference {float(np.nanmax(np.abs(g - e))):.3g}"
        elif not np.array_equal(g.astype(e.dtype), e):
            return "failed", "values differ"
    return "passed", ""


def tally(results: Iterable[tuple[str, str]]) -> dict[str, collections.Counter[str]]:
    """Per op type: how many cases passed, failed and were skipped."""
    out: dict[str, collections.Counter[str]] = {}
    for kind, status in results:
        out.setdefault(kind, collections.Counter())[status] += 1
    return out
