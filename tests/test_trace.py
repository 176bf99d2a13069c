"""Tracing: scopes, shapes, tied weights, meta-device models, and the errors users see."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import seabiscuit_dask as sb
from seabiscuit_dask.models import demo_model

from . import models as M


def test_ops_carry_scope_kind_and_output_specs() -> None:
    g = sb.trace(M.llama(), M.ids())
    q = [op for op in g.ops if op.scope == "model.layers.0.self_attn.q_proj"]
    assert q and q[0].kind == "linear" and q[0].target == "aten.linear.default"
    assert q[0].flops == 2 * M.SEQ * 128 * 128
    for op in g.ops:
        for t in op.outputs:
            assert g.tensors[t].dtype and isinstance(g.tensors[t].shape, tuple)
    assert not any(op.target.startswith("aten._assert") for op in g.ops)


def test_tied_weights_are_one_param() -> None:
    model = M.gpt2()
    g = sb.trace(model, M.ids())
    assert model.lm_head.weight is model.transformer.wte.weight
    keys = [p.source.key for p in g.params.values()]
    tied = {"transformer.wte.weight", "lm_head.weight"}
    assert len(tied & set(keys)) == 1
    (key,) = tied & set(keys)
    users = {op.kind for op in g.ops if key in op.params}
    assert users == {"embedding", "linear"}
    assert list(g.meta["aliases"][key]) == list(tied - {key})


def test_meta_device_model_traces_without_allocating() -> None:
    model, x = demo_model("gpt2-tiny", materialize=False)
    assert all(p.is_meta for p in model.parameters())
    g = sb.trace(model, x)
    assert g.param_bytes > 1_000_000
    assert all(p.source.kind in ("model", "inline") for p in g.params.values())


def test_not_a_module_is_rejected() -> None:
    with pytest.raises(sb.UnsupportedModel, match="got an object of type dict"):
        sb.trace({"weight": torch.zeros(2)}, torch.zeros(1))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:            # data-dependent control flow cannot be exported
            return y
        return -y


def test_export_failure_names_the_module_and_the_error() -> None:
    with pytest.raises(sb.UnsupportedModel, match=r"torch.export failed for DataDependent .*\(2, 4\)"):
        sb.trace(DataDependent(), torch.randn(2, 4))


def test_wrong_example_input_shape_at_trace() -> None:
    with pytest.raises(sb.UnsupportedModel, match=r"Linear with inputs \[\(2, 5\)\]"):
        sb.trace(nn.Linear(4, 4), torch.randn(2, 5))


def test_wrong_input_shape_or_dtype_at_run() -> None:
    model = nn.Linear(4, 3)
    g = sb.trace(model, torch.randn(2, 4))
    with pytest.raises(sb.BadInput, match=r"shape \(3, 4\).*traced for shape \(2, 4\)"):
        sb.run_local(g, torch.randn(3, 4), weights=model)
    with pytest.raises(sb.BadInput, match="dtype float64"):
        sb.run_local(g, torch.randn(2, 4, dtype=torch.float64), weights=model)
    with pytest.raises(sb.BadInput, match=r"1 positional input\(s\) \[.input.\], got 2"):
        sb.run_local(g, torch.randn(2, 4), torch.randn(2, 4), weights=model)


def test_run_without_weights_says_where_to_get_them() -> None:
    g = sb.trace(nn.Linear(4, 3), torch.randn(2, 4))
    with pytest.raises(sb.BadCheckpoint, match="no weights for param"):
        sb.run_local(g, torch.randn(2, 4))
    model, x = demo_model("gpt2-tiny", materialize=False)
    with pytest.raises(sb.BadCheckpoint, match="meta device"):
        sb.run_local(sb.trace(model, x), x, weights=model)


def test_bf16_model_runs_in_its_dtype() -> None:
    model = M.llama().to(torch.bfloat16)
    x = M.ids()
    g = sb.decompose(sb.trace(model, x), "64KiB")
    with torch.no_grad():
        expected = model(x).logits
    got = sb.run_local(g, x, weights=model).logits
    assert got.dtype == torch.bfloat16
    assert M.rel_err(got.float(), expected.float()) <= 2e-2


def test_keyword_inputs_follow_the_traced_order() -> None:
    model = M.bert()
    x = M.ids()
    mask = torch.tensor([[1, 1, 1, 0]])
    types = torch.tensor([[0, 0, 1, 1]])
    g = sb.trace(model, (x,), {"token_type_ids": types, "attention_mask": mask})
    with torch.no_grad():
        expected = model(x, attention_mask=mask, token_type_ids=types).last_hidden_state
    got = sb.run_local(g, x, attention_mask=mask, token_type_ids=types, weights=model)
    assert M.rel_err(got.last_hidden_state, expected) <= 1e-5
    with pytest.raises(sb.BadInput, match=r"\['labels'\] were not traced; traced inputs: \['input_ids'"):
        sb.run_local(g, x, labels=mask, weights=model)


def test_token_ids_outside_the_vocabulary_are_refused_split_or_not() -> None:
    model, x = M.gpt2(), M.ids()
    graph = sb.trace(model, x)
    micro = sb.decompose(graph, "64KiB")
    assert any(op.target == "sb.embedding_rows" for op in micro.ops)     # cut by vocabulary rows
    for g in (graph, micro):
        with pytest.raises(sb.BadInput, match=r"'input_ids' holds id 2048 at position \[0, 2\].*0\.\.2047"):
            sb.run_local(g, torch.tensor([[1, 2, M.VOCAB, 3]]), weights=model)
        with pytest.raises(sb.BadInput, match="id -3"):
            sb.run_local(g, torch.tensor([[1, -3, 4, 5]]), weights=model)
    with torch.no_grad():
        assert M.rel_err(sb.run_local(micro, input_ids=x, weights=model).logits, model(x).logits) <= 1e-4
