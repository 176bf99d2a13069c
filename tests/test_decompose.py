"""Each decomposition rule, forced by a budget, is exact and respects the budget."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import seabiscuit_dask as sb
from seabiscuit_dask.decompose import Split
from seabiscuit_dask.decompose.rules import RULES, register
from seabiscuit_dask.decompose.split import frac
from seabiscuit_dask.ir import TensorSpec, fmt_bytes

from . import models as M


class Fn(nn.Module):
    def __init__(self, fn, **mods: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        for k, v in mods.items():
            setattr(self, k, v)

    def forward(self, *xs):
        return self.fn(self, *xs)


def split(model: nn.Module, xs: tuple[torch.Tensor, ...], budget: str) -> sb.OpGraph:
    graph = sb.trace(model, xs)
    micro = sb.decompose(graph, budget)
    sb.verify(micro, budget=sb.config.to_bytes(budget))
    with torch.no_grad():
        expected = model(*xs)
    got = sb.run_local(micro, *xs, weights=model)
    assert M.rel_err(got, expected) <= 1e-5
    return micro


def tags(graph: sb.OpGraph) -> set[str]:
    return {t for op in graph.ops for t in re.findall(r"\.([a-z])\d+(?=\.|$)", op.name)}


def test_linear_by_reduction_dim_puts_bias_on_first_tile() -> None:
    lin = nn.Linear(8192, 2)
    g = split(lin, (torch.randn(1, 8192),), "48KiB")
    assert tags(g) == {"r"}
    tiles = [op for op in g.ops if op.kind == "linear"]
    assert len(tiles) >= 2
    biased = [op for op in tiles if any(p.startswith("bias") for p in op.params)]
    assert biased == tiles[:1]
    assert any(op.kind == "sum" for op in g.ops)


def test_linear_by_output_columns_slices_weight_and_bias() -> None:
    lin = nn.Linear(64, 512)
    g = split(lin, (torch.randn(2, 64),), "64KiB")
    assert tags(g) == {"c"}
    w_tiles = [p for p in g.params.values() if p.source.key == "weight"]
    assert len(w_tiles) >= 2
    covered = sorted(p.source.slices[0] for p in w_tiles)
    assert covered[0][0] == 0 and covered[-1][1] == 512
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))   # disjoint, no gap


def test_addmm_and_matmul_with_activation_operands() -> None:
    def fn(self, a, b):
        return torch.addmm(self.bias, a, self.w) + torch.matmul(a, b).sum()

    m = Fn(fn)
    m.w = nn.Parameter(torch.randn(256, 256))
    m.bias = nn.Parameter(torch.randn(256))
    split(m, (torch.randn(4, 256), torch.randn(256, 8)), "96KiB")


def test_grouped_conv_splits_whole_groups_then_channels() -> None:
    conv = nn.Conv2d(64, 256, 3, padding=1, groups=2)
    g = split(conv, (torch.randn(1, 64, 4, 4),), "64KiB")
    names = [op.name for op in g.ops if op.kind == "conv"]
    assert any(re.search(r"\.g\d+\.c\d+$", n) for n in names), names   # hierarchical


def test_conv_by_input_channels() -> None:
    conv = nn.Conv2d(4096, 2, 1)
    g = split(conv, (torch.randn(1, 4096, 1, 1),), "32KiB")
    assert "i" in tags(g)


def test_embedding_by_vocabulary_rows_and_by_columns() -> None:
    rows = nn.Embedding(4096, 16)     # tall: rows of the vocabulary, masked and summed
    x = torch.tensor([[0, 17, 4095, 2048, 17]])
    g = split(rows, (x,), "64KiB")
    assert "v" in tags(g) and any(op.target == "sb.embedding_rows" for op in g.ops)
    wide = nn.Embedding(64, 256)      # wide: columns, concatenated
    g = split(wide, (torch.tensor([[1, 63, 5]]),), "40KiB")
    assert tags(g) == {"d"}


def test_a_transposed_weight_is_cut_as_its_weight_tiles() -> None:
    proj = Fn(lambda self, x: x @ self.fc.weight.T, fc=nn.Linear(64, 256, bias=False))   # as Falcon's MLP
    g = split(proj, (torch.randn(1, 4, 64),), "40KiB")
    assert any(op.target == "aten.numpy_T.default" for op in g.ops) and len(g.params) > 1


def test_index_select_of_a_table_is_cut_as_an_embedding_lookup() -> None:
    table = Fn(lambda self, i: torch.index_select(self.pos.weight, 0, i.reshape(-1)),
               pos=nn.Embedding(2048, 16))
    g = split(table, (torch.tensor([[0, 17, 2047, 1024, 17]]),), "48KiB")
    assert "v" in tags(g) and sum(op.target == "sb.embedding_rows" for op in g.ops) > 1


def sdpa_module(**kw):
    def fn(self, q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kw)
    return Fn(fn)


@pytest.mark.parametrize("mask_heads", [None, 1, 8])
def test_attention_by_heads(mask_heads) -> None:
    q, k, v = (torch.randn(1, 8, 16, 32) for _ in range(3))
    xs = (q, k, v) + ((torch.randn(1, mask_heads, 16, 16),) if mask_heads else ())
    g = split(sdpa_module(), xs, "48KiB")
    assert "h" in tags(g)


def test_attention_grouped_query_heads_stay_with_their_kv_head() -> None:
    q = torch.randn(1, 8, 16, 32)
    k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    g = split(sdpa_module(enable_gqa=True), (q, k, v), "32KiB")
    tiles = [op for op in g.ops if op.kind == "attention"]
    assert len(tiles) == 2
    for op in tiles:
        qs, ks = (sb.ir.view_shape(r, g.tensors[r["t"]].shape)[1] for r in op.attrs["args"][:2])
        assert qs == 4 * ks


def test_attention_by_query_rows() -> None:
    q, k, v = (torch.randn(1, 1, 64, 32) for _ in range(3))
    g = split(sdpa_module(), (q, k, v), "28KiB")
    assert "q" in tags(g)


@pytest.mark.parametrize("causal, mask, kv_heads", [(True, None, 4), (False, "bool", 2), (False, "float", 4)])
def test_attention_by_query_and_key_chunks(causal, mask, kv_heads) -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 4, 96, 16)
    k, v = torch.randn(1, kv_heads, 96, 16), torch.randn(1, kv_heads, 96, 16)
    extra: tuple[torch.Tensor, ...] = ()
    if mask == "bool":   # padding: the last 20 keys are masked for every query
        extra = (torch.arange(96).view(1, 1, 1, 96).expand(1, 1, 96, 96) < 76,)
    elif mask == "float":
        extra = (torch.randn(1, 1, 96, 96),)
    kw = {"is_causal": causal, "enable_gqa": kv_heads != 4}
    g = split(sdpa_module(**kw), (q, k, v, *extra), "16KiB")   # one head's scores: 36 KiB
    assert all(sb.ir.scratch_bytes(op, g.tensors) < 16 * 1024 for op in g.ops)
    if causal:   # a chunk of queries never reads the keys all its rows are masked from
        tiles = [op for op in g.ops if op.kind == "attention"]
        keys = [sb.ir.view_shape(op.attrs["args"][1], g.tensors[op.attrs["args"][1]["t"]].shape)[2]
                for op in tiles]
        assert tiles and min(keys) < 96 and sum(keys) < 0.75 * 96 * len(tiles)


def test_attention_over_many_keys_merges_key_chunks() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 2048, 16), torch.randn(1, 2, 2048, 16)
    g = split(sdpa_module(), (q, k, v), "16KiB")        # keys and values: 512 KiB
    assert "k" in tags(g)
    assert any(op.target == "sb.attention_merge" for op in g.ops)
    assert "xs_1" in g.tilings                            # fed as tiles by the caller


def test_elementwise_and_norm_ops_split_in_strips() -> None:
    add = Fn(lambda self, a, b: a + b)
    g = split(add, (torch.randn(1, 64, 64), torch.randn(1, 64, 64)), "40KiB")
    assert tags(g) == {"s"}
    ln = nn.LayerNorm(64)
    g = split(ln, (torch.randn(1, 64, 64),), "32KiB")
    assert tags(g) == {"s"}
    # layer norm must never be cut along the normalised (last) dim
    for op in g.ops:
        if op.kind == "norm":
            assert g.tensors[op.outputs[0]].shape[-1] == 64


def test_softmax_keeps_its_reduction_dim_whole() -> None:
    sm = Fn(lambda self, a, b: torch.softmax(a + b, dim=1))
    g = split(sm, (torch.randn(64, 64), torch.randn(64, 64)), "40KiB")
    for op in g.ops:
        if op.kind == "norm":
            assert g.tensors[op.outputs[0]].shape[1] == 64


@pytest.mark.parametrize("dims", [1, (0, 1), -2])
def test_a_reduction_that_drops_its_dims_is_cut_along_the_dims_after_them(dims) -> None:
    mean = Fn(lambda self, a: (a * 2).mean(dim=dims))
    x = torch.randn(4, 32, 256)
    g = split(mean, (x,), "24KiB")
    cut = [op for op in g.ops if op.target == "aten.mean.dim"]
    assert len(cut) > 1 and all(g.tensors[op.outputs[0]].shape[-1] < 256 for op in cut)


def test_a_reduction_over_its_last_dim_without_keepdim_is_cut_along_the_dims_it_keeps() -> None:
    x = torch.randn(4, 32, 256)
    model = Fn(lambda self, a: (a * 2).sum(dim=-1))
    micro = sb.decompose(sb.trace(model, (x,)), "24KiB")
    sb.verify(micro, budget=24 << 10)
    sums = [op for op in micro.ops if op.target == "aten.sum.dim_IntList"]
    assert len(sums) > 1 and all(micro.tensors[op.inputs[0]].shape[-1] == 256 for op in sums)
    assert torch.equal(sb.run_local(micro, x), model(x))        # NOTE: whole rows: the same sums


def test_decompose_never_edits_its_input() -> None:
    model = M.gpt2()
    graph = sb.trace(model, M.ids())
    before = graph.to_json()
    sb.decompose(graph, "64KiB")
    assert graph.to_json() == before


def test_hierarchy_is_readable_from_names() -> None:
    model = M.llama()
    g = sb.decompose(sb.trace(model, M.ids()), "64KiB")
    up = [op for op in g.ops if ".mlp.up_proj." in op.name and op.kind == "linear"]
    assert up and all(re.match(r"model\.layers\.\d+\.mlp\.up_proj\.linear_\d+\.c\d+$", op.name)
                      for op in up)
    assert all(op.scope.startswith("model.layers.") and re.search(r"\.c\d+$", op.scope) for op in up)


def test_budget_too_small_names_the_op_and_the_numbers() -> None:
    graph = sb.trace(nn.LayerNorm(1024), (torch.randn(8, 1024),))
    with pytest.raises(sb.BudgetTooSmall) as e:
        sb.decompose(graph, "8KiB")
    msg = str(e.value)
    ws = (2 * 1024 + 2 * 8 * 1024) * 4
    assert "budget of 8.0 KiB" in msg
    assert ("op 'layer_norm' (aten.layer_norm.default, output (8, 1024) float32, "
            f"working set {fmt_bytes(ws)})") in msg
    assert "its piece 'layer_norm.s0' needs 16.0 KiB" in msg   # one row of 1024 is as small as it gets
    assert "Use a budget of at least 16.0 KiB (16384 bytes)" in msg


def suggested_budget(graph: sb.OpGraph, budget: str) -> tuple[int, str]:
    """The budget (bytes, and as printed) that ``BudgetTooSmall`` suggests for ``graph``."""
    with pytest.raises(sb.BudgetTooSmall) as e:
        sb.decompose(graph, budget)
    m = re.search(r"at least (\S+ \S+) \((\d+) bytes\)", str(e.value))
    assert m, str(e.value)
    return int(m.group(2)), m.group(1)


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.LayerNorm(1024))


@pytest.mark.parametrize("build, inputs, budget", [(wide_mlp, lambda: torch.randn(8, 64), "8KiB"),
                                                   (M.convnet, M.image, "1KiB")])
def test_the_suggested_budget_is_the_smallest_that_works(build, inputs, budget) -> None:
    model, x = build(), inputs()
    graph = sb.trace(model, x)
    need, printed = suggested_budget(graph, budget)
    assert need > sb.config.to_bytes(budget)
    micro = sb.decompose(graph, need)
    sb.verify(micro, budget=need)
    with torch.no_grad():
        expected = M.first(model(x))
    assert M.rel_err(M.first(sb.run_local(micro, x, weights=model)), expected) <= 1e-4
    assert sb.config.to_bytes(printed) >= need    # the rounded figure is enough too
    sb.decompose(graph, printed)
    with pytest.raises(sb.BudgetTooSmall):
        sb.decompose(graph, need - 1)


def product_of_kind(kind: str) -> tuple[tuple[torch.Tensor, torch.Tensor], sb.OpGraph]:
    """A traced ``a * b`` whose op is relabelled with ``kind`` (no template key: not cached)."""
    xs = (torch.randn(64, 64), torch.randn(64, 64))
    g = sb.trace(Fn(lambda self, a, b: a * b), xs)
    ops = tuple(dataclasses.replace(op, kind=kind) for op in g.ops)
    meta = {k: v for k, v in g.meta.items() if k != "template_key"}
    return xs, sb.OpGraph(ops, g.tensors, g.params, g.inputs, g.outputs, meta)


def test_a_rule_registered_for_a_new_kind_is_used(monkeypatch) -> None:
    xs, graph = product_of_kind("rows_only")
    with pytest.raises(sb.BudgetTooSmall, match=r"no rule splits aten\.mul\.Tensor"):
        sb.decompose(graph, "40KiB")
    monkeypatch.setitem(RULES, "rows_only", [])

    @register("rows_only")
    def rows(d, op):
        out = d.tensors[op.outputs[0]]
        n, y = out.shape[0], out.nbytes

        def piece(i, lo, hi, pieces):
            args = [d.cut(a, 0, lo, hi, op.scope, pieces) for a in op.attrs["args"]]
            return args, {}, op.target, TensorSpec((hi - lo, *out.shape[1:]), out.dtype)
        return Split("w", "the rows", n, lambda k: 3 * y * frac(n, k), 2 * y, piece, "concat", 0)

    micro = sb.decompose(graph, "40KiB")
    sb.verify(micro, budget=40 * 1024)
    assert tags(micro) == {"w"} and "rows_only" in {op.kind for op in micro.ops}
    assert torch.equal(sb.run_local(micro, *xs), xs[0] * xs[1])


def test_allow_oversize_lists_what_does_not_fit() -> None:
    x = torch.randn(8, 1024)
    g = sb.decompose(sb.trace(nn.LayerNorm(1024), (x,)), "8KiB", allow_oversize=True)
    oversize = g.meta["oversize"]
    assert len(oversize) == 8 and all(ws == 16 * 1024 for _, ws in oversize)   # one row each
    assert M.rel_err(sb.run_local(g, x, weights=nn.LayerNorm(1024)), nn.LayerNorm(1024)(x)) < 1e-5


@pytest.mark.parametrize("bad", ["lots", -5, 0, "0B", True])
def test_bad_budget_is_rejected(bad) -> None:
    graph = sb.trace(nn.Linear(4, 4), (torch.randn(1, 4),))
    with pytest.raises(sb.SeaBiscuitError, match="budget"):
        sb.decompose(graph, bad)


def test_a_tied_weight_is_held_in_one_set_of_tiles() -> None:
    model = M.gpt2()                        # the embedding and the output projection share a table
    x = M.ids(seq=32)
    graph = sb.trace(model, (x,))
    micro = sb.decompose(graph, "32KiB")
    assert micro.param_bytes == graph.param_bytes
    with torch.no_grad():
        assert M.rel_err(M.first(sb.run_local(micro, x, weights=model)), model(x).logits) <= 1e-5


@pytest.mark.parametrize("fn", [
    lambda self, x: [t + 1 for t in x.split(3, dim=2)],             # sizes along the split dim
    lambda self, x: [t * 2 for t in x.split([2, 4], dim=2)],
    lambda self, x: x[:, 5:2] + 0,                                   # an empty slice
    lambda self, x: x[:, -4:] - 1,
])
def test_slices_and_splits_of_tiled_tensors(fn) -> None:
    x = torch.randn(6, 8, 6)
    model = Fn(fn)
    micro = sb.decompose(sb.trace(model, (x,)), "1KiB")
    assert micro.tilings                                           # the input arrives as tiles
    got, expected = sb.run_local(micro, x, weights=model), model(x)
    for g, e in zip(got if isinstance(got, (list, tuple)) else [got], expected if isinstance(expected, list)
                    else [expected]):
        assert g.shape == e.shape and torch.allclose(g, e)


def test_a_decomposed_graph_is_not_decomposed_again() -> None:
    micro = sb.decompose(sb.trace(M.gpt2(), (M.ids(seq=32),)), "32KiB")
    with pytest.raises(sb.InvalidGraph, match="already decomposed"):
        sb.decompose(micro, "16KiB")


def test_repeat_broadcast_to_and_full_like_are_cut_into_strips() -> None:
    """As WavLM's relative-position bias: a bias repeated per head, broadcast, and an int table
    made ``full_like`` another."""
    def bias(self, x):
        table = torch.full_like(x, 3, dtype=torch.long) + x.long()
        return (x * 2).repeat(4, 1, 1).broadcast_to(2, 4, 128, 64) + table
    g = split(Fn(bias), (torch.randn(1, 128, 64),), "48KiB")
    for target in ("aten.repeat.default", "aten.broadcast_to.default", "aten.full_like.default"):
        assert sum(op.target == target for op in g.ops) > 1, target


def test_a_weight_gathered_by_a_1d_index_is_cut_along_the_dims_after_it() -> None:
    """As a mixture of experts' batched matmuls: each token-expert pair's weights, ``W[ids]``;
    the index (here as long as the last dim) is never cut with them."""
    experts = Fn(lambda self, ids: self.w.weight.reshape(8, 64, 16)[ids] * 2, w=nn.Linear(16, 8 * 64))
    ids = torch.tensor([3, 0, 7, 7, 1, 2, 5, 4, 6, 0, 1, 3, 2, 2, 5, 6])
    g = split(experts, (ids,), "32KiB")
    assert sum(op.target == "aten.index.Tensor" for op in g.ops) > 1


def test_baddbmm_is_cut_by_rows_its_reduction_whole() -> None:
    """As WavLM's attention scores: ``baddbmm(bias, q, k)`` per head, cut into rows of every
    sample (equal to eager: ``split`` checks); each piece reads all of k, the reduction."""
    scores = Fn(lambda self, bias, q, k: torch.baddbmm(bias, q, k.transpose(1, 2)))
    xs = (torch.randn(8, 32, 32), torch.randn(8, 32, 16), torch.randn(8, 32, 16))
    g = split(scores, xs, "40KiB")
    cut = [op for op in g.ops if op.target == "aten.baddbmm.default"]
    assert len(cut) > 1 and all(g.tensors[op.outputs[0]].shape[1] < 32 for op in cut)
    ks = [op.attrs["args"][2] for op in cut]
    assert all(sb.ir.view_shape(k, g.tensors[k["t"]].shape)[1:] == (16, 32) for k in ks)


def test_group_norm_is_cut_by_whole_groups() -> None:
    norm = nn.GroupNorm(8, 64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    g = split(norm, (torch.randn(1, 64, 16, 16),), "40KiB")
    cut = [op for op in g.ops if op.target == "aten.group_norm.default"]
    assert len(cut) > 1 and all(g.tensors[op.outputs[0]].shape[1] % 8 == 0 for op in cut)


class MLP(nn.Module):
    def __init__(self, d: int = 64, h: int = 256) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, h), nn.GELU(approximate="tanh"), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act(self.fc(x)))


def test_an_mlp_in_column_tiles_sums_partial_products_over_them() -> None:
    # Megatron's form: each column tile of the first linear gets its activation and its slice of
    # the second linear's reduction, one sum at the end; no join of the tiles anywhere.
    torch.manual_seed(0)
    g = split(MLP().eval(), (torch.randn(1, 16, 64),), "64KiB")
    assert [op.name for op in g.ops] == ["fc.linear.c0", "fc.linear.c1", "act.gelu.s0", "act.gelu.s1",
                                         "proj.linear_1.r0", "proj.linear_1.r1", "proj.linear_1.sum1.0",
                                         "add"]
    assert not any(op.kind == "concat" for op in g.ops)
    fc = {op.name[-2:]: op.outputs[0] for op in g.ops if op.name.startswith("fc.")}
    act = {op.name[-2:]: op.inputs for op in g.ops if op.name.startswith("act.")}
    assert act == {"s0": (fc["c0"],), "s1": (fc["c1"],)}        # each activation reads its tile alone


def test_an_op_over_more_or_smaller_tiles_than_it_follows_reads_them_joined() -> None:
    # Ten column tiles: the activation (which fits whole) runs once, on their join, rather than
    # as ten small ops.
    torch.manual_seed(0)
    g = split(MLP(64, 1024).eval(), (torch.randn(1, 4, 64),), "32KiB")
    fc = [op for op in g.ops if op.name.startswith("fc.")]
    assert len(fc) > 8
    assert [(op.kind, op.name) for op in g.ops if op.name.startswith("act.")] == [
        ("concat", "act.cat:linear.joined"), ("elementwise", "act.gelu")]
    # Two tiles of one row each (a decode step): under 1/32 of the budget, so joined once too.
    g = split(MLP().eval(), (torch.randn(1, 1, 64),), "64KiB")
    assert len([op for op in g.ops if op.name.startswith("fc.")]) == 2
    assert [(op.kind, op.name) for op in g.ops if op.name.startswith("act.")] == [
        ("concat", "act.cat:linear.joined"), ("elementwise", "act.gelu")]
