"""Linear tiles of one block fused into one kernel over weights packed at load (``lower.fuse``)."""

from __future__ import annotations

import dask.config
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.lower.blocks import block_specs
from seabiscuit_dask.lower.fuse import linear_groups, pack_rows, should_fuse, span
from seabiscuit_dask.runtime.worker.resident import ResidentBlocks
from seabiscuit_dask.runtime.worker.store import stored

from . import models as M
from .test_runtime_resident import MODEL, Owner, run_all


def test_groups_are_linear_tiles_over_one_input() -> None:
    graph = sb.decompose(sb.trace(M.llama(), M.ids()), "64KiB")
    shapes = {n: tuple(p.shape) for n, p in graph.params.items()}
    groups = linear_groups(graph.ops, shapes)
    names = {graph.ops[i].name for g in groups for i in g.ops}
    # the query tiles and the key and value projections of layer 0 read one normalised input
    assert {"model.layers.0.self_attn.q_proj.linear.c0", "model.layers.0.self_attn.q_proj.linear.c1",
            "model.layers.0.self_attn.k_proj.linear_1", "model.layers.0.self_attn.v_proj.linear_2"} <= names
    for g in groups:
        inputs = {str(graph.ops[i].attrs["args"][0]) for i in g.ops}
        assert len(inputs) == 1 and len(g.ops) >= 2
        assert list(g.sizes) == [shapes[w][0] for w in g.weights]
        assert len({shapes[w][1] for w in g.weights}) == 1


def test_packed_tiles_are_views_of_one_buffer_and_span_finds_it() -> None:
    a, b, c = torch.randn(3, 5), torch.randn(4, 5), torch.randn(2, 5)
    views = pack_rows([a, b, c])
    assert all(torch.equal(v, t) for v, t in zip(views, (a, b, c)))
    whole = span(views)
    assert whole is not None and whole.shape == (9, 5) and whole.data_ptr() == views[0].data_ptr()
    assert torch.equal(whole, torch.cat([a, b, c]))
    assert span([a, b]) is None                        # separate tensors: no buffer to run on
    assert span([views[1], views[0]]) is None          # out of order
    assert span([views[0], pack_rows([b])[0]]) is None        # views of two buffers


def test_fuse_setting() -> None:
    assert should_fuse(torch.device("cuda"), "auto") and not should_fuse(torch.device("cpu"), "auto")
    assert should_fuse(torch.device("cpu"), True) and not should_fuse(torch.device("cuda"), "false")


@pytest.mark.parametrize("model_fn", [M.llama, M.gpt2], ids=["llama", "gpt2"])
def test_fused_blocks_give_the_models_output_with_fewer_kernels(model_fn) -> None:
    model, x = model_fn(), M.ids()
    graph = sb.decompose(sb.trace(model, x), "64KiB")
    owner = Owner()
    graph, _ = stored(graph, model, owner)
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB")    # blocks on several devices
    specs = block_specs(sb.place(graph, spec), MODEL, 0)
    with torch.no_grad():
        expected = model(x).logits
    results = {}
    for fuse in (False, True):
        with dask.config.set({"seabiscuit.lower.fuse-tiles": fuse}):
            r = ResidentBlocks(1 << 30)
            r.versions[MODEL] = 0
            got = run_all(r, specs, graph, x)
            results[fuse] = (got, sum(len(p.steps) for p in r.programs.values()),
                             sum(p.fused_groups for p in r.programs.values()), r.weight_bytes)
    (plain, plain_steps, none, plain_bytes), (fused, fused_steps, groups, fused_bytes) = \
        results[False], results[True]
    if model_fn is M.gpt2:
        # NOTE: its only linear layers are its tied lm head's tiles, which the embedding's block reads
        # first: a tile another block loaded stays where it is, and its group runs tile by tile
        assert none == 0 and groups == 0 and fused_steps == plain_steps
    else:
        assert none == 0 and groups > 0 and fused_steps < plain_steps
    assert fused_bytes == plain_bytes                   # tiles are views of the packed buffers
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert M.rel_err(fused, expected) <= 1e-4
