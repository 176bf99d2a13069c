"""The IR: frozen, JSON round trip exact, verify() catches broken invariants."""

from __future__ import annotations

import dataclasses
import json

import pytest

import seabiscuit_dask as sb
from seabiscuit_dask.ir import Op, OpGraph, TensorSpec

from . import models as M


@pytest.fixture(scope="module")
def graphs() -> tuple[OpGraph, OpGraph]:
    g = sb.trace(M.gpt2(), M.ids())
    return g, sb.decompose(g, "64KiB")


def test_json_round_trip_is_exact(graphs) -> None:
    for g in graphs:
        text = g.to_json()
        back = OpGraph.from_json(text)
        assert back == g
        assert back.to_json() == text
        d = json.loads(text)
        assert d["schema"] == 2 and set(d) == {"schema", "inputs", "outputs", "tilings", "meta",
                                               "tensors", "params", "ops"}


def test_graph_and_ops_are_frozen(graphs) -> None:
    g, _ = graphs
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.ops = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        g.tensors["x"] = TensorSpec((1,), "float32")  # type: ignore[index]
    with pytest.raises(TypeError):
        g.ops[0].attrs["args"] = []  # type: ignore[index]


def test_tiles_are_slices_of_the_original_weight(graphs) -> None:
    g, micro = graphs
    tiles = [p for p in micro.params.values() if p.is_tile]
    assert tiles
    for p in tiles:
        full = g.params[p.source.key].shape
        assert all(0 <= a < b <= s for (a, b), s in zip(p.source.slices, full))


def test_summary_reports_kinds_params_largest_and_over_budget(graphs) -> None:
    _, micro = graphs
    text = micro.summary()
    for needle in ("linear", "embedding", "params:", "largest op:", "over budget (64.0 KiB): 0"):
        assert needle in text
    assert "over budget (1.0 KiB):" in micro.summary(budget=1024)


def broken(g: OpGraph, **changes) -> OpGraph:
    fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
    fields.update(changes)
    return OpGraph(**fields)


def test_verify_catches_broken_invariants(graphs) -> None:
    g, micro = graphs
    sb.verify(g)
    with pytest.raises(sb.InvalidGraph, match="before anything produces it"):
        sb.verify(broken(g, ops=tuple(reversed(g.ops))))
    with pytest.raises(sb.InvalidGraph, match="used twice"):
        sb.verify(broken(g, ops=g.ops + g.ops[-1:]))
    with pytest.raises(sb.InvalidGraph, match="never produced"):
        sb.verify(broken(g, outputs=("nope",)))
    op = g.ops[3]
    bad = dataclasses.replace(op, inputs=("ghost",))
    with pytest.raises(sb.InvalidGraph, match="ghost"):
        sb.verify(broken(g, ops=(*g.ops[:3], bad, *g.ops[4:])))
    cat = next(o for o in micro.ops if o.kind == "concat")
    short = dataclasses.replace(cat, inputs=cat.inputs[:-1],
                                attrs={**cat.attrs, "args": [[{"t": t} for t in cat.inputs[:-1]],
                                                              cat.attrs["args"][1]]})
    with pytest.raises(sb.InvalidGraph, match=f"concat {cat.name!r} joins"):
        sb.verify(broken(micro, ops=tuple(short if o is cat else o for o in micro.ops)))
    with pytest.raises(sb.InvalidGraph, match="budget is 1.0 KiB"):
        sb.verify(g, budget=1024)


def test_unknown_schema_is_rejected(graphs) -> None:
    g, _ = graphs
    d = g.to_dict()
    d["schema"] = 99
    with pytest.raises(sb.InvalidGraph, match="schema 99"):
        OpGraph.from_dict(d)
    with pytest.raises(sb.InvalidGraph, match="not an OpGraph JSON"):
        OpGraph.from_json("{not json")


def test_op_cost() -> None:
    g = sb.trace(M.bert(), M.ids())
    op = next(o for o in g.ops if o.kind == "linear")
    c = g.cost(op)
    assert c.param_bytes == (128 * 128 + 128) * 4
    assert c.working_set_bytes == c.param_bytes + c.input_bytes + c.output_bytes
    assert isinstance(op, Op)


def test_an_inline_constant_cut_into_tiles_carries_each_tiles_own_values() -> None:
    import numpy as np

    from seabiscuit_dask.ir import ParamSource

    full = np.arange(5 * 4 * 3).reshape(5, 4, 3)
    src = ParamSource("inline", "w", data=tuple(full.ravel().tolist()))
    rows = src.sliced(0, 1, 4, full.shape)                    # w[1:4]
    cols = rows.sliced(1, 2, 4, full.shape)                   # w[1:4][:, 2:4]
    assert rows.slices == ((1, 4), (0, 4), (0, 3)) and cols.slices == ((1, 4), (2, 4), (0, 3))
    assert list(rows.data) == full[1:4].ravel().tolist()
    assert list(cols.data) == full[1:4, 2:4].ravel().tolist()
    assert ParamSource.from_dict(cols.to_dict()) == cols


def test_a_meta_update_keeps_the_graph_frozen_and_no_view_derived_from_the_old_meta(graphs) -> None:
    """``with_meta`` freezes only what it adds, keeps the views that read no meta, and drops those
    that do: the placement workload charges a layer's KV room from the meta."""
    from seabiscuit_dask.placement.workload import workload

    model = M.llama()
    g = sb.decompose(sb.trace(model, M.ids()), "64KiB")
    before, views = workload(g), g.op_by_name
    reserved = g.with_meta(kv_reserve_bytes=1000, note={"a": [1, 2]})
    layers = model.config.num_hidden_layers
    assert int(workload(reserved).weight_bytes.sum()) == int(before.weight_bytes.sum()) + 1000 * layers
    assert reserved.meta["note"]["a"] == (1, 2) and reserved.meta["name"] == g.meta["name"]
    with pytest.raises(TypeError):
        reserved.meta["note"]["b"] = 3  # type: ignore[index]
    assert reserved.op_by_name is views and "kv_reserve_bytes" not in g.meta
