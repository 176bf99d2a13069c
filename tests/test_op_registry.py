"""The op registry: graphs are data, so only registered kernels ever run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import seabiscuit_dask as sb
from seabiscuit_dask import config, templates
from seabiscuit_dask import ops as O
from seabiscuit_dask.errors import SeaBiscuitError, UnsupportedOp
from seabiscuit_dask.ir import Op, OpGraph, TensorSpec
from seabiscuit_dask.lower import (
    SUPPORTED,
    decode_args,
    register_kernel,
    registry,
    require_registered,
    resolve_target,
)
from seabiscuit_dask.lower.blocks import BlockProgram, BlockSpec
from seabiscuit_dask.weights import WeightStore

from . import models as M

FROM_FILE = "aten.from_file.default"
VEC = TensorSpec((4,), "float32")


def from_file_graph(path: Path) -> OpGraph:
    """``x + from_file(path)``: reading the file is the graph's first act."""
    ops = (
        Op("evil", "opaque", FROM_FILE, (), ("y",), attrs={
            "args": [str(path), False, 4], "kwargs": {"dtype": {"dtype": "float32"}}}),
        Op("out", "elementwise", "aten.add.Tensor", ("x", "y"), ("z",),
           attrs={"args": [{"t": "x"}, {"t": "y"}], "kwargs": {}}),
    )
    return OpGraph(ops, {"x": VEC, "y": VEC, "z": VEC}, {}, ("x",), ("z",), {"name": "evil"})


def test_the_from_file_graph_would_read_its_file_if_the_op_were_registered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the control for the tests below: the graph is well formed, only the registry stops it.
    path = tmp_path / "secret.bin"
    torch.arange(4, dtype=torch.float32).numpy().tofile(path)
    monkeypatch.setitem(registry._kernels, FROM_FILE, torch.ops.aten.from_file.default)
    got = sb.run_local(from_file_graph(path), torch.ones(4))
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_run_local_refuses_from_file_before_touching_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist.bin"   # NOTE: reading it would raise a RuntimeError instead
    with pytest.raises(UnsupportedOp, match=r"aten\.from_file\.default") as e:
        sb.run_local(from_file_graph(missing), torch.ones(4))
    assert "ops.OPS" in str(e.value) and "register_kernel" in str(e.value)
    assert not missing.exists()
    listed = r"graph 'evil': 1 target\(s\).*'aten\.from_file\.default' \(op 'evil'\)"
    with pytest.raises(UnsupportedOp, match=listed):
        require_registered(from_file_graph(missing))


def block_of(graph: OpGraph) -> BlockSpec:
    return BlockSpec("evil", 0, 0, "cpu", graph.ops, {}, {"x": VEC}, ("z",), (-1,))


def test_a_worker_refuses_to_compile_a_block_naming_from_file(tmp_path: Path) -> None:
    spec = block_of(from_file_graph(tmp_path / "does-not-exist.bin"))
    wire = json.loads(json.dumps(spec.to_dict()))            # as it arrives by RPC
    with pytest.raises(UnsupportedOp, match=r"aten\.from_file\.default"):
        BlockProgram(BlockSpec.from_dict(wire), {}, torch.device("cpu"))


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def test_a_tampered_template_cache_file_is_refused_not_retraced() -> None:
    x = torch.randn(2, 8)
    graph = sb.trace(small_model(), x)
    key = graph.meta["template_key"]
    path = config.cache_dir() / "templates" / f"{key}.json"
    data = json.loads(path.read_text())
    data["ops"][0]["target"] = FROM_FILE
    path.write_text(json.dumps(data))
    templates.clear_memory()
    with pytest.raises(UnsupportedOp, match=r"template cache file .*aten\.from_file\.default") as e:
        templates.lookup(key)
    assert str(path) in str(e.value)
    with pytest.raises(UnsupportedOp, match="tampered"):
        sb.trace(small_model(), x)


@pytest.mark.parametrize("target", ["os.system", "aten.definitely_not_an_op.default", "builtins.eval",
                                    FROM_FILE, "aten.from_file", "aten.save.default", "", "aten"])
def test_anything_unregistered_is_refused(target: str) -> None:
    with pytest.raises(UnsupportedOp, match="not in SeaBiscuit's op registry"):
        resolve_target(target)
    with pytest.raises(UnsupportedOp, match=f"{len(SUPPORTED)} ops"):
        resolve_target(target, Op("bad", "opaque", target, (), ("y",)))


def test_a_target_that_is_not_a_string_is_refused() -> None:
    op = Op.from_dict({"name": "bad", "kind": "opaque", "target": ["os", "system"],
                       "inputs": [], "outputs": ["y"]})
    with pytest.raises(UnsupportedOp):
        resolve_target(op.target)
    with pytest.raises(UnsupportedOp):
        require_registered([op])


def test_the_check_lists_every_unregistered_target_once() -> None:
    ops = [Op(f"op{i}", "opaque", t, (), (f"y{i}",))
           for i, t in enumerate(["aten.relu.default", "os.system", "builtins.eval", "os.system"])]
    with pytest.raises(UnsupportedOp, match=r"where: 2 target\(s\)") as e:
        require_registered(ops, where="where")
    msg = str(e.value)
    assert "'os.system' (op 'op1')" in msg and "'builtins.eval' (op 'op2')" in msg
    assert "op3" not in msg and "relu" not in msg
    require_registered(ops[:1])


@pytest.mark.parametrize("tagged", [{"dtype": "load"}, {"dtype": "__class__"}, {"layout": "from_file"},
                                    {"memory_format": "os"}, {"float": "__import__"}])
def test_tagged_values_come_only_from_tables(tagged: dict[str, str]) -> None:
    with pytest.raises(UnsupportedOp, match=repr(next(iter(tagged.values())))):
        decode_args([tagged], {}, torch.device("cpu"))


def test_known_tagged_values_and_kwargs_named_like_tags_decode() -> None:
    cpu = torch.device("cpu")
    assert decode_args({"dtype": "bfloat16"}, {}, cpu) is torch.bfloat16
    assert decode_args({"memory_format": "channels_last"}, {}, cpu) is torch.channels_last
    assert decode_args({"dtype": {"dtype": "float16"}}, {}, cpu) == {"dtype": torch.float16}
    assert decode_args({"device": {"device": "meta"}}, {}, cpu) == {"device": cpu}


def test_run_local_refuses_an_unknown_dtype() -> None:
    op = Op("cast", "elementwise", "aten.to.dtype", ("x",), ("y",),
            attrs={"args": [{"t": "x"}, {"dtype": "load"}], "kwargs": {}})
    graph = OpGraph((op,), {"x": VEC, "y": VEC}, {}, ("x",), ("y",))
    with pytest.raises(UnsupportedOp, match="'load'"):
        sb.run_local(graph, torch.ones(4))


def test_a_param_with_an_unknown_dtype_is_refused() -> None:
    spec = sb.ParamSpec("w", (4,), "load", sb.ParamSource("inline", "w", data=(0.0,) * 4))
    with pytest.raises(UnsupportedOp, match="'load'"):
        WeightStore.from_weights(None, torch.device("cpu")).load(spec)


class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erfinv(x)


class WithOddOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.proj(x)))


@pytest.fixture
def erfinv_registered() -> Iterator[str]:
    target = "aten.erfinv.default"
    assert target not in SUPPORTED
    register_kernel(target, torch.ops.aten.erfinv.default)
    try:
        yield target
    finally:
        registry._kernels.pop(target)
        O._ops.pop(target)          # NOTE: its entry of the op table, made by the registration


def test_trace_refuses_an_op_outside_the_registry_and_names_it() -> None:
    with pytest.raises(UnsupportedOp, match=r"op 'erfinv' in module 'inner' calls aten\.erfinv\.default"):
        sb.trace(WithOddOp(), torch.randn(2, 4))
    assert not list((config.cache_dir() / "templates").glob("*.json"))


def test_one_registration_makes_an_op_traceable_and_runnable(erfinv_registered: str) -> None:
    model, x = WithOddOp().eval(), torch.rand(2, 4) * 0.5
    graph = sb.trace(model, x)
    assert erfinv_registered in {op.target for op in graph.ops}
    with torch.no_grad():
        assert torch.allclose(sb.run_local(graph, x, weights=model), model(x))
    with pytest.raises(SeaBiscuitError, match="already has a kernel"):
        register_kernel(erfinv_registered, torch.erfinv)


def test_every_target_the_test_models_trace_to_is_registered() -> None:
    for build, inputs in [(M.gpt2, M.ids), (M.llama, M.ids), (M.convnet, M.image)]:
        graph = sb.trace(build(), inputs())
        for g in (graph, sb.decompose(graph, "64KiB")):
            require_registered(g)
            assert {op.target for op in g.ops} <= set(SUPPORTED)


def test_the_registry_runs_exactly_the_op_table() -> None:
    # NOTE: ops.py says what SeaBiscuit knows of each target; the registry holds the kernel of each
    assert set(O.OPS) == set(SUPPORTED)
    assert set().union(*(targets for targets, _kind in O._KINDS)) <= set(O.OPS)
    assert all(O.OPS[t].kind == O.kind_of(t) for t in O.OPS)
    assert not O.ASSERTS & set(SUPPORTED)     # tracing drops these
