"""Runs of a block's small ops run as one kernel each (``lower.patterns``): the same numbers, fewer calls."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.ir import Op
from seabiscuit_dask.lower.blocks import BlockProgram, block_specs
from seabiscuit_dask.lower.kvcache import KVStore, using
from seabiscuit_dask.lower.layout import held
from seabiscuit_dask.lower.patterns import _rotary_kernel, _Signed, op_groups, writes_in_place
from seabiscuit_dask.quantize import quantize
from seabiscuit_dask.runtime.generation import step_inputs
from seabiscuit_dask.trace.decoder import trace_step
from seabiscuit_dask.weights import WeightStore

from . import models as M


def one_block(model, rows: int, length: int, scheme: str | None, budget: str = "16MiB"):
    """The decode step program of ``model`` (``rows`` x ``length`` tokens) decomposed for ``budget``, as
    one block, and its weights."""
    graph = sb.decompose(quantize(trace_step(model, rows, length), scheme), budget)
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=1, cpu_memory="64GiB")
    plan = sb.Plan(graph, spec, np.zeros(len(graph.ops), dtype=int), "one", 0.0, {})
    (block,) = block_specs(plan, "0" * 16)
    load = WeightStore.from_weights(model).load
    return graph, block, {n: held(load(p), block.layouts.get(n)) for n, p in block.params.items()}


def steps(graph, block, weights, fuse_ops: bool, rows: int, length: int) -> tuple[BlockProgram, list]:
    """Three steps of ``rows`` sessions, ``length`` tokens each, on a fresh KV store: every export."""
    program = BlockProgram(block, weights, torch.device("cpu"), fuse_ops=fuse_ops)
    store, got = KVStore(), []
    for at in (0, length, 2 * length):
        feed = step_inputs([(s, at, [(7 * s + 3 * at + j) % M.VOCAB for j in range(length)])
                            for s in range(rows)], rows, length)
        with using(store, "m"):
            got.append(program.run({n: feed[n] for n in graph.inputs}))
    return program, got


@pytest.mark.parametrize("scheme,rows,length,budget", [
    (None, 1, 1, "16MiB"), (None, 2, 5, "16MiB"), ("int4", 1, 1, "16MiB"), ("int4", 3, 2, "16MiB"),
    ("int8", 2, 1, "16MiB"), (None, 2, 5, "64KiB"), ("int4", 3, 2, "64KiB")])
def test_fused_runs_give_the_same_bits_in_fewer_calls(scheme, rows, length, budget) -> None:
    graph, block, weights = one_block(M.llama(), rows, length, scheme, budget)
    plain, want = steps(graph, block, weights, False, rows, length)
    fused, got = steps(graph, block, weights, True, rows, length)
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    layers = 2
    assert plain.op_groups == {}
    if budget != "16MiB":
        # NOTE: cut into tiles, a run is split across tiles and joins (a query's heads in two): the runs
        # left whole are fused, the rest run op by op, and every bit is the same
        assert fused.op_groups["rms_norm"] >= 1 and len(fused.steps) < len(plain.steps)
        return
    assert fused.op_groups["rms_norm"] == 2 * layers + 1          # two a layer and the final norm
    assert fused.op_groups["rotary"] == 2 * layers                # the query and key of each layer
    assert fused.op_groups.get("q4_inputs", 0) == (2 * layers if scheme == "int4" else 0)
    assert len(fused.steps) < len(plain.steps) - 12 * 2 * layers


def test_a_run_whose_inner_tensor_leaves_the_block_is_not_fused() -> None:
    _, block, _ = one_block(M.llama(), 1, 1, None)
    groups = op_groups(block.ops, block.exports)
    norm = next(g for g in groups if g.kind == "rms_norm")
    rsqrt = next(i for i in norm.ops if block.ops[i].target == "aten.rsqrt.default")
    inner = block.ops[rsqrt].outputs[0]
    again = op_groups(block.ops, (*block.exports, inner))        # exported: another block reads it
    assert all(rsqrt not in g.ops for g in again)
    norms = [g for g in groups if g.kind == "rms_norm"]
    assert len([g for g in again if g.kind == "rms_norm"]) == len(norms) - 1
    # a reader outside the run (here: an op added after it reading the inner tensor) keeps it apart too
    extra = Op("extra", "call_function", "aten.neg.default", (inner,), ("extra_out",),
               attrs={"args": ({"t": inner},)})
    assert all(rsqrt not in g.ops for g in op_groups((*block.ops, extra), block.exports))


def test_a_block_that_writes_in_place_is_left_as_it_is() -> None:
    _, block, _ = one_block(M.llama(), 1, 1, None)
    first = block.ops[0]
    inplace = dataclasses.replace(first, name="w", target="aten.add_.Tensor")
    assert writes_in_place(inplace) and not writes_in_place(first)
    assert not writes_in_place(dataclasses.replace(first, target="aten._to_copy.default"))
    assert op_groups((*block.ops, inplace), block.exports) == []


def test_the_rotary_kernel_is_the_graphs_formula_for_any_width() -> None:
    torch.manual_seed(0)
    # NOTE: (10, 4): a half that is not half the width, computed as the graph's own steps
    for width, half in ((64, 32), (10, 4)):
        q = torch.randn(1, 3, 5, width).transpose(1, 2)
        cos, sin = torch.randn(1, 5, 1, width), torch.randn(1, 5, 1, width)
        want = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
        signed = _Signed()
        run = _rotary_kernel(half, 3, True, signed)
        (got,) = run(q, cos, sin)
        assert torch.equal(got, want)
        (again,) = run(q * 2, cos, sin)           # NOTE: the signed table is made once for this sin
        q2 = q * 2
        assert torch.equal(again, q2 * cos + torch.cat((-q2[..., half:], q2[..., :half]), -1) * sin)
        (other,) = run(q, cos, sin * 3)           # NOTE: and again for another
        assert torch.equal(other, q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * (sin * 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_kernel_is_the_graphs_formula_in_either_dtype(dtype) -> None:
    from seabiscuit_dask.lower.patterns import _rms_kernel

    x = (torch.randn(3, 7, 96) * torch.logspace(-2, 2, 7).unsqueeze(1)).to(dtype)
    w = torch.randn(96).to(dtype)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got, kept = _rms_kernel(torch.float32, 1e-6, dtype, True)(x, w)
    assert torch.equal(got, want) and torch.equal(kept, h)
    (plain,) = _rms_kernel(None, 1e-6, None, False)(x)
    assert torch.equal(plain, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_a_torch_whose_rms_norm_differs_is_not_used(monkeypatch) -> None:
    from seabiscuit_dask.lower import patterns

    monkeypatch.setattr(patterns, "_SAME_NORM", {})
    real = torch.rms_norm
    monkeypatch.setattr(torch, "rms_norm", lambda x, shape, w, eps: real(x, shape, w, eps) * (1 + 2 ** -20))
    x = torch.randn(4, 80)
    assert not patterns.same_norm(x, 1e-5)
    (got,) = patterns._rms_kernel(None, 1e-5, None, False)(x)
    assert torch.equal(got, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def _rotary_ops(sin: str = "sin", dim: int = -1, cat_dim: int = -1) -> list[Op]:
    """``q * cos + cat(-q[half:], q[:half]) * <sin>`` as a graph's ops, a half of 4."""
    def op(name: str, target: str, args: tuple, out: str) -> Op:
        inputs = tuple(dict.fromkeys(a["t"] for a in _refs(args)))
        return Op(name, "call_function", target, inputs, (out,), attrs={"args": args})
    return [op("s1", "aten.slice.Tensor", ({"t": "q"}, dim, 0, 4), "x1"),
            op("s2", "aten.slice.Tensor", ({"t": "q"}, dim, 4, 2 ** 63 - 1), "x2"),
            op("n", "aten.neg.default", ({"t": "x2"},), "n"),
            op("c", "aten.cat.default", ([{"t": "n"}, {"t": "x1"}], cat_dim), "ct"),
            op("ms", "aten.mul.Tensor", ({"t": "ct"}, {"t": sin}), "ms"),
            op("mc", "aten.mul.Tensor", ({"t": "q"}, {"t": "cos"}), "mc"),
            op("ad", "aten.add.Tensor", ({"t": "mc"}, {"t": "ms"}), "out")]


def _refs(args):
    for a in args:
        if isinstance(a, dict) and "t" in a:
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _refs(a)


def _run_both(ops: list[Op], feed: dict[str, torch.Tensor]) -> tuple[BlockProgram, torch.Tensor,
                                                                     torch.Tensor]:
    from seabiscuit_dask.ir import TensorSpec
    from seabiscuit_dask.lower.blocks import BlockSpec

    imports = {n: TensorSpec(tuple(t.shape), "float32") for n, t in feed.items()}
    spec = BlockSpec("m", 0, 0, "cpu", tuple(ops), {}, imports, ("out",), tuple(-1 for _ in imports))
    plain = BlockProgram(spec, {}, torch.device("cpu"), fuse_ops=False).run(feed)["out"]
    fused = BlockProgram(spec, {}, torch.device("cpu"), fuse_ops=True)
    return fused, plain, fused.run(feed)["out"]


def test_a_rotary_run_is_fused_only_with_cos_and_sin_from_outside_it() -> None:
    torch.manual_seed(1)
    feed = {"q": torch.randn(2, 3, 5, 8), "cos": torch.randn(1, 1, 5, 8), "sin": torch.randn(1, 1, 5, 8)}
    program, plain, fused = _run_both(_rotary_ops(), feed)
    assert program.op_groups == {"rotary": 1} and len(program.steps) == 1 and torch.equal(plain, fused)
    # NOTE: the slices along dim 3 of a 4-d q: the same run
    program, plain, fused = _run_both(_rotary_ops(dim=3), feed)
    assert program.op_groups == {"rotary": 1} and torch.equal(plain, fused)
    # NOTE: ``cat(...) * cat(...)``, ``cat(...) * q``: a factor made inside the run, or q itself; not a rotary
    # embedding, run op by op (and so for ``cat(...) * -q[half:]``, which no shape could run)
    assert op_groups(_rotary_ops(sin="n"), ("out",)) == []
    for sin in ("ct", "q"):
        feed_ = {k: v for k, v in feed.items() if k != "sin"}
        program, plain, fused = _run_both(_rotary_ops(sin=sin), feed_)
        assert program.op_groups == {} and torch.equal(plain, fused), sin
    # NOTE: joined along another dimension: not the rotation either
    assert op_groups(_rotary_ops(cat_dim=2), ("out",)) == []


def test_the_signed_table_is_made_once_for_each_sin() -> None:
    signed = _Signed()
    sin = torch.randn(1, 5, 1, 8)
    first = signed(sin, 4)
    assert signed(sin, 4) is first and torch.equal(first, torch.cat((-sin[..., :4], sin[..., 4:]), -1))
    assert signed(sin.clone(), 4) is not first


def test_ops_that_write_in_place_are_named() -> None:
    def op(target: str, kwargs: dict | None = None) -> Op:
        attrs = {"args": ({"t": "x"},), **({"kwargs": kwargs} if kwargs else {})}
        return Op("o", "call_function", target, ("x",), ("y",), attrs=attrs)
    for target in ("aten.add_.Tensor", "aten._index_put_impl_.default", "aten.__iand__.Tensor",
                   "aten.copy_.default"):
        assert writes_in_place(op(target)), target
    for target in ("aten.add.Tensor", "aten.__and__.Tensor", "aten._to_copy.default", "sb.kv_attention"):
        assert not writes_in_place(op(target)), target
    assert writes_in_place(op("aten.add.out", {"out": {"t": "z"}}))
