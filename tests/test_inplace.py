"""Models that write in place (``x[:, 1:] = y``, ``masked_fill_``, ``copy_``, ``x[mask] = v``) are
traced into graphs of side-effect-free ops (``slice_scatter``, ``masked_fill``, ``index_put``, ...),
cut and run equal to eager torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import seabiscuit_dask as sb
from seabiscuit_dask.config import to_bytes

from . import models as M

BUDGETS = ["1MiB", "64KiB"]


def in_place(graph: sb.OpGraph) -> list[str]:
    """Targets of ``graph`` that write into an operand (ATen's trailing underscore)."""
    return sorted({op.target for op in graph.ops if op.target.split(".")[1].endswith("_")
                   and not op.target.split(".")[1].startswith("_")})


def run_cut(model: nn.Module, inputs: tuple[torch.Tensor, ...],
            budget: str) -> tuple[sb.OpGraph, sb.OpGraph, object]:
    """``model`` traced, cut at ``budget`` (checked) and run: (graph, micro-op graph, outputs)."""
    graph = sb.verify(sb.trace(model, inputs))
    micro = sb.decompose(graph, budget)
    sb.verify(micro, budget=to_bytes(budget))
    return graph, micro, sb.run_local(micro, *inputs, weights=model)


def assert_equal_outputs(got: object, want: object, tol: float = 1e-4) -> None:
    """Every tensor the model returns, within ``tol`` relative to its largest value."""
    got_leaves = [t for t in pytree.tree_leaves(tuple(got.values()) if isinstance(got, dict) else got)
                  if isinstance(t, torch.Tensor)]
    want_leaves = [t for t in pytree.tree_leaves(tuple(want.values()) if isinstance(want, dict) else want)
                   if isinstance(t, torch.Tensor)]
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert M.rel_err(g.float(), w.float()) <= tol


# --- a module of the patterns ------------------------------------------------------------------------
class Writes(nn.Module):
    """Slice, element, mask and index assignment, ``masked_fill_``, ``copy_`` into a slice, an
    in-place op on a view, ``zero_`` and ``fill_``: each writes through a view of another tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, 1:] = x[:, :-1]
        y.masked_fill_(y == 0, 5)
        y[:, 0] = 7
        y[y < -1] = -1.0
        z = torch.zeros_like(x)
        z[:, :8].copy_(x[:, 8:16])
        z[torch.tensor([1, 3])] = 2.0
        z[:, -4:].zero_()
        z[2].fill_(-3.0)
        y[:, 2:6].mul_(2)
        y[0] += 1
        return y + z


def writes_input() -> torch.Tensor:
    return torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).round()


@pytest.mark.parametrize("budget", ["1MiB", "4KiB"])
def test_writes_through_views_are_traced_out_of_place_and_run_equal_to_eager(budget: str) -> None:
    model, x = Writes(), writes_input()
    want = model(x)
    graph, micro, got = run_cut(model, (x,), budget)
    assert not in_place(graph), in_place(graph)
    targets = {op.target for op in graph.ops}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default", "aten.index_put.default",
            "aten.masked_fill.Scalar", "aten.copy.default"} <= targets
    if budget == "4KiB":
        assert len(micro.ops) > len(graph.ops)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)


class ZeroWhereLarge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[x > 0.5] = 0.0
        return y


def test_a_write_through_a_boolean_mask_is_cut_into_strips_with_its_mask() -> None:
    """``x[mask] = v`` (``index_put`` with a mask as large as ``x``) cut to a quarter of its working
    set: strips of ``x`` and of the mask along the same dim."""
    model, x = ZeroWhereLarge(), torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    graph = sb.trace(model, x)
    (put,) = [op for op in graph.ops if op.target == "aten.index_put.default"]
    budget = graph.working_set(put) // 4
    micro = sb.decompose(graph, budget)
    sb.verify(micro, budget=budget)
    assert sum(op.target == "aten.index_put.default" for op in micro.ops) >= 4
    assert torch.equal(sb.run_local(micro, x, weights=model), model(x))


class ScaleAView(nn.Module):
    """An in-place op on a view (``y[:, 0] *= 2`` as ``mul_`` on ``select``) and ``relu_``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y[:, 0].mul_(2)
        return y.relu_() + 1


def test_an_in_place_op_on_a_view_keeps_its_write_when_the_graph_is_cut() -> None:
    model, x = ScaleAView(), torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    want = model(x)
    graph, micro, got = run_cut(model, (x,), "16KiB")
    assert len(micro.ops) > len(graph.ops)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    assert not in_place(graph), in_place(graph)


class Residual(nn.Module):
    """A block as ResNets write it: ``h += x`` and ``relu_`` on a tensor it has just made."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.norm.running_mean.uniform_(-1, 1)
        self.norm.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x))
        h += x
        return h.relu_()


def test_writes_into_fresh_tensors_keep_the_ops_around_them_as_exported() -> None:
    """No functionalization pass: the batch norm stays one op that rules cut (functionalized, it
    would be a three-output op that none does)."""
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(2, 8, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(x)
    graph, micro, got = run_cut(model, (x,), "8KiB")
    assert not in_place(graph), in_place(graph)
    targets = {op.target for op in graph.ops}
    assert {"aten.batch_norm.default", "aten.add.Tensor", "aten.relu.default"} <= targets
    assert len(micro.ops) > len(graph.ops)
    assert_equal_outputs(got, want)


class BumpsItsInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2


def test_a_write_into_an_input_is_no_output_and_runs_no_in_place_op() -> None:
    model, x = BumpsItsInput(), torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    want = model(x.clone())
    graph = sb.trace(model, x)
    given = x.clone()
    assert torch.equal(sb.run_local(graph, given, weights=model), want)
    assert torch.equal(given, x)                     # NOTE: the caller's tensor is left as it was
    assert len(graph.outputs) == 1
    assert not in_place(graph), in_place(graph)


# --- BART: shift_tokens_right writes the decoder's inputs in place -------------------------------------
def bart(kind: str) -> nn.Module:
    import transformers as tf

    cfg = tf.AutoConfig.for_model(
        kind, vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=1, decoder_start_token_id=2)
    torch.manual_seed(0)
    return tf.AutoModelForSeq2SeqLM.from_config(cfg).eval()


def token_ids() -> torch.Tensor:
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(3))
    ids[0, -2:] = 1            # NOTE: padding: the shifted copy keeps it
    return ids


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind", ["bart", "mbart"])
def test_an_encoder_decoder_shifting_its_inputs_in_place_runs_equal_to_eager(kind: str, budget: str) -> None:
    """No ``decoder_input_ids``: the model makes them from ``input_ids`` by slice assignment and
    ``masked_fill_`` (mBART also gathers the last token into the first)."""
    model, ids = bart(kind), token_ids()
    with torch.no_grad():
        want = model(ids, use_cache=False)
    graph, micro, got = run_cut(model, (ids,), budget)
    assert not in_place(graph), in_place(graph)
    assert any(op.target.endswith("_scatter.default") for op in graph.ops)
    if budget == "64KiB":
        assert any(p.is_tile for p in micro.params.values()) and len(micro.ops) > len(graph.ops)
    assert_equal_outputs(got, want)


# --- RT-DETR: anchors and spatial shapes written element by element ------------------------------------
def rt_detr() -> nn.Module:
    import transformers as tf

    backbone = tf.RTDetrResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1],
                                     layer_type="basic", out_features=["stage2", "stage3", "stage4"],
                                     downsample_in_bottleneck=False)
    cfg = tf.RTDetrConfig(backbone_config=backbone, encoder_hidden_dim=32, encoder_in_channels=[32, 64, 64],
                          d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1,
                          decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                          num_queries=20, num_labels=5, decoder_in_channels=[32, 32, 32],
                          num_feature_levels=3, decoder_n_points=2, anchor_image_size=None)
    torch.manual_seed(0)
    return tf.RTDetrForObjectDetection(cfg).eval()


def test_rt_detr_writes_its_anchors_in_place_and_runs_equal_to_eager() -> None:
    model, image = rt_detr(), torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(image)
    graph, micro, got = run_cut(model, (image,), "64KiB")
    assert not in_place(graph), in_place(graph)
    assert "aten.select_scatter.default" in {op.target for op in graph.ops}
    assert len(micro.ops) > len(graph.ops)
    assert_equal_outputs(got, want)
