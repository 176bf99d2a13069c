"""How workers hold matmul weights: as traced, or transposed where the kernel runs faster
so (``lower.layout``): the choice, the specs that carry it, and results that do not change."""

from __future__ import annotations

import dask.config
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.lower import layout
from seabiscuit_dask.lower.blocks import BlockSpec, block_specs
from seabiscuit_dask.runtime.client import _with_checksums
from seabiscuit_dask.runtime.generation import decode_rows
from seabiscuit_dask.runtime.worker.resident import ResidentBlocks
from seabiscuit_dask.runtime.worker.store import stored

from . import models as M
from .clusters import seabiscuit_cluster
from .test_runtime_resident import MODEL, Owner, run_all


class TwoLayouts(torch.nn.Module):
    """A linear layer ([out, in]), a GPT-2 style addmm ([in, out]), and a weight read twice."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = torch.nn.Linear(32, 48)
        self.w = torch.nn.Parameter(torch.randn(48, 24, generator=g))
        self.b = torch.nn.Parameter(torch.randn(24, generator=g))
        self.shared = torch.nn.Parameter(torch.randn(24, 24, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.b, self.fc(x).reshape(-1, 48), self.w)
        return torch.mm(h, self.shared) + self.shared.sum()


def resident_run(graph, spec, plan, x) -> tuple[ResidentBlocks, list[BlockSpec], torch.Tensor]:
    """``graph``'s blocks (as ``plan`` places them on ``spec``) run on fresh resident blocks: those
    blocks, the specs, and the output."""
    r = ResidentBlocks(1 << 30)
    r.versions[MODEL] = 0
    specs = block_specs(sb.Plan(graph, spec, plan.device_of), MODEL, 0)
    return r, specs, run_all(r, specs, graph, x)


def test_each_matmul_weight_is_found_with_the_rows_that_multiply_it() -> None:
    graph = sb.trace(TwoLayouts(), (torch.randn(3, 5, 32),))
    cases = layout.matmul_cases(graph)
    names = {graph.params[n].source.key: c for n, c in cases.items()}
    assert names == {
        "fc.weight": layout.Case(15, 32, 48, "float32", True, True),
        "w": layout.Case(15, 48, 24, "float32", False, True),
    }                                               # ``shared`` is read by a sum too: held as traced
    # a generation deployment times the rows of its decode step instead
    assert {c.rows for c in layout.matmul_cases(graph, rows=4).values()} == {4}


def test_the_other_order_is_taken_only_when_it_runs_clearly_faster() -> None:
    graph = sb.trace(TwoLayouts(), (torch.randn(3, 5, 32),))
    cases = layout.matmul_cases(graph)
    fc, w = sorted(cases, key=lambda n: graph.params[n].source.key)
    timings = {cases[fc].key(): (2.0e-3, 1.0e-3),        # twice as fast transposed
               cases[w].key(): (1.05e-3, 1.0e-3)}        # within the margin: a toss-up
    assert layout.choose(cases, timings) == {fc: layout.TRANSPOSED}
    asked: list[list[layout.Case]] = []

    def timer(distinct):
        asked.append(distinct)
        return timings

    assert layout.decide(graph, timer, min_bytes=0) == {fc: layout.TRANSPOSED}
    assert len(asked) == 1 and len(asked[0]) == 2        # each distinct case timed once
    assert layout.decide(graph, timer) == {} and len(asked) == 1    # all under 1 MiB: not timed
    t_io, t_oi = layout.time_case(layout.Case(8, 64, 96, "float32", False, True), reps=2)
    assert t_io > 0 and t_oi > 0


def test_a_tile_held_transposed_has_its_values_and_shape() -> None:
    t = torch.randn(6, 4)
    h = layout.held(t, layout.TRANSPOSED)
    assert torch.equal(h, t) and h.shape == t.shape and h.stride() == (1, 6)
    assert layout.held(t, None) is t
    v = torch.randn(5)
    assert layout.held(v, layout.TRANSPOSED) is v            # only 2-D tiles


def test_specs_carry_the_layouts_and_refuse_an_unknown_one() -> None:
    model, x = M.gpt2(), M.ids()
    graph = sb.decompose(sb.trace(model, x), "64KiB")
    chosen = layout.decide(graph, lambda cases: {c.key(): (2.0, 1.0) for c in cases}, min_bytes=0)
    assert chosen and all(v == layout.TRANSPOSED for v in chosen.values())
    # the tied embedding gathers rows of some of the lm head's tiles: any order serves a gather
    gathered = {p for op in graph.ops if op.target in layout.GATHERS for p in op.params}
    multiplied = {p for op in graph.ops if op.target in layout.MATMULS for p in op.params}
    assert gathered & multiplied and gathered & multiplied <= set(chosen)
    assert "transformer.wpe.weight" not in chosen           # gathered only: nothing to gain
    graph = graph.with_meta(weight_layouts=chosen)
    plan = sb.place(graph, sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB"))
    specs = block_specs(plan, MODEL, 0)
    assert {n for s in specs for n in s.layouts} == set(chosen)
    for s in specs:
        assert BlockSpec.from_dict(s.to_dict()) == s
    bad = specs[0].to_dict()
    bad["layouts"] = {next(iter(specs[0].params)): "sideways"}
    with pytest.raises(sb.BadInput, match="weight layout 'sideways'"):
        BlockSpec.from_dict(bad)
    # another program of the model holds the tiles it shares with the model's graph the same way
    step = _with_checksums(sb.decompose(sb.trace(model, M.ids(seq=3)), "64KiB", like=graph), graph)
    shared = set(step.params) & set(chosen)
    assert shared and step.meta["weight_layouts"] == {n: chosen[n] for n in shared}


@pytest.mark.parametrize("model_fn", [M.llama, M.gpt2], ids=["llama", "gpt2"])
def test_blocks_with_weights_held_transposed_give_the_models_output(model_fn) -> None:
    model, x = model_fn(), M.ids()
    graph = sb.decompose(sb.trace(model, x), "64KiB")
    owner = Owner()
    graph, _ = stored(graph, model, owner)
    chosen = layout.decide(graph, lambda cases: {c.key(): (2.0, 1.0) for c in cases}, min_bytes=0)
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB")
    plan = sb.place(graph, spec)
    with torch.no_grad():
        expected = model(x).logits
    got = {}
    for name, g in (("traced", graph), ("transposed", graph.with_meta(weight_layouts=chosen))):
        r, _, got[name] = resident_run(g, spec, plan, x)
        flipped = {n for p in r.programs.values() for n, t in p.weights.items()
                   if t.dim() == 2 and t.stride() == (1, t.shape[0])}
        assert flipped == (set(chosen) if name == "transposed" else set())
    torch.testing.assert_close(got["transposed"], got["traced"], rtol=1e-5, atol=1e-5)
    assert M.rel_err(got["transposed"], expected) <= 1e-4


def test_decode_rows_follow_the_groups_sessions_decode_in() -> None:
    assert decode_rows(1) == 1 and decode_rows(2) == 1
    assert decode_rows(8) == 4 and decode_rows(5) == 4 and decode_rows(16) == 8 and decode_rows(40) == 32
    with dask.config.set({"seabiscuit.generate.batch-buckets": [1, 2, 4, 8]}):
        assert decode_rows(40) == 8


@pytest.mark.slow
def test_a_deployment_holds_its_weights_as_measured_and_answers_the_same(monkeypatch) -> None:
    model, x = M.gpt2(), M.ids()
    with torch.no_grad():
        expected = model(x).logits

    def strides(dask_worker):
        r = dask_worker.plugins["seabiscuit"].resident
        return {n: tuple(t.stride()) for p in r.programs.values() for n, t in p.weights.items()}

    with seabiscuit_cluster(2, 4_000_000) as client:
        with dask.config.set({"seabiscuit.lower.weight-layout": "transposed"}):
            with sb.distribute(model, client, (x,), budget="256KiB") as dm:
                chosen = dict(dm.graph.meta["weight_layouts"])
                assert chosen and M.rel_err(dm(x).logits, expected) <= 1e-4
                held = {n: s for w in client.run(strides).values() for n, s in w.items()}
                for n in chosen:
                    rows = dm.graph.params[n].shape[0]
                    assert held[n] == (1, rows), n          # transposed on the worker that holds it
        # measured: a model this small is held as traced (its weights are under 1 MiB)
        with sb.distribute(model, client, (x,), budget="256KiB") as dm:
            assert "weight_layouts" not in dm.graph.meta
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
        # timed on a worker when they count: each distinct case, both ways
        timed: list[dict] = []
        choose = layout.choose
        monkeypatch.setattr(layout, "MIN_BYTES", 0)
        monkeypatch.setattr(layout, "choose",
                            lambda cases, timings: timed.append(timings) or choose(cases, timings))
        with sb.distribute(model, client, (x,), budget="256KiB") as dm:
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            distinct = {c.key() for c in layout.matmul_cases(dm.graph).values()}
            assert len(timed) == 1 and set(timed[0]) == distinct
            assert all(a > 0 and b > 0 for a, b in timed[0].values())
        with dask.config.set({"seabiscuit.lower.weight-layout": "sideways"}), \
                pytest.raises(sb.BadInput, match="weight-layout is 'sideways'"):
            sb.distribute(model, client, (x,), budget="256KiB")


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_layer_in_columns_gives_linears_result(rows, bias, dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=g).to(dtype)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    got = layout.columns(x, w, b)
    want = torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape == (1, rows, 96) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # run so only for the rows counts named; any other goes to the kernel it wraps, as it is
    seen: list[int] = []

    def linear(*args: torch.Tensor) -> torch.Tensor:
        seen.append(args[0].shape[-2])
        return torch.nn.functional.linear(*args)

    kernel = layout.columns_kernel([rows], linear)
    torch.testing.assert_close(kernel(x, w, b), want, rtol=tol, atol=tol)
    assert seen == []
    other = torch.randn(1, rows + 1, 64, generator=g).to(dtype)
    assert torch.equal(kernel(other, w, b), torch.nn.functional.linear(other, w, b)) and seen == [rows + 1]
    held = layout.transposed(w)                               # NOTE: a weight held [in, out]: as linear
    assert torch.equal(kernel(x, held, b), torch.nn.functional.linear(x, held, b)) and seen[-1] == rows


def test_columns_are_chosen_for_the_rows_they_run_clearly_faster_in() -> None:
    graph = sb.trace(TwoLayouts(), (torch.randn(3, 5, 32),))
    fc = next(n for n in graph.params if graph.params[n].source.key == "fc.weight")
    asked: list[list[layout.Case]] = []

    def timer(distinct):
        asked.append(distinct)
        return {c.key(): ((2.0, 1.0) if c.rows <= 2 else (1.05, 1.0)) for c in distinct}

    # only ``fc`` is a linear layer's weight: ``w`` is read by an addmm, ``shared`` by a sum too
    with dask.config.set({"seabiscuit.generate.batch-buckets": [1, 2, 4, 8]}):
        assert layout.decide_forms(graph, timer, [1, 2, 4, 3, 16], min_bytes=0) == {fc: [1, 2]}
    # NOTE: rows counts that are not among small_rows() are not timed
    assert len(asked) == 1 and sorted(c.rows for c in asked[0]) == [1, 2, 4]
    assert layout.decide_forms(graph, timer, [1, 2], held={fc: layout.TRANSPOSED}, min_bytes=0) == {}
    assert layout.decide_forms(graph, timer, [1, 2]) == {} and len(asked) == 1   # under 1 MiB: not timed
    t_linear, t_columns = layout.time_columns(layout.Case(2, 64, 96, "float32", True, False), reps=2)
    assert t_linear > 0 and t_columns > 0
    with pytest.raises(sb.BadInput, match="columns form"):
        layout.time_columns(layout.Case(2, 64, 96, "float32", False, False))


def test_the_rows_timed_in_columns_are_the_configured_decode_batches() -> None:
    """The rows counts a weight may run in columns for are ``seabiscuit.generate.batch-buckets``:
    a deployment that decodes 16 rows at once has them timed, and its specs may name them."""
    graph = sb.trace(TwoLayouts(), (torch.randn(3, 5, 32),))
    fc = next(n for n in graph.params if graph.params[n].source.key == "fc.weight")
    asked: list[int] = []

    def timer(distinct):
        asked.extend(c.rows for c in distinct)
        return {c.key(): (2.0, 1.0) for c in distinct}

    with dask.config.set({"seabiscuit.generate.batch-buckets": [1, 2, 4, 8, 16]}):
        assert layout.decide_forms(graph, timer, [16, 32], min_bytes=0) == {fc: [16]} and asked == [16]
        assert layout.check_forms({fc: [16]}, "spec") == {fc: (16,)}
    with dask.config.set({"seabiscuit.generate.batch-buckets": [1, 2, 4, 8]}), \
            pytest.raises(sb.BadInput, match=r"matmul form rows \[16\] .* not among \[1, 2, 4, 8\]"):
        layout.check_forms({fc: [16]}, "spec")


def test_blocks_run_the_linear_layers_their_specs_name_in_columns(monkeypatch) -> None:
    model, x = M.llama(), M.ids(seq=4)
    graph = sb.decompose(sb.trace(model, x), "64KiB")
    owner = Owner()
    graph, _ = stored(graph, model, owner)
    forms = layout.decide_forms(graph, lambda cases: {c.key(): (2.0, 1.0) for c in cases}, [4], min_bytes=0)
    weight = [op.attrs["args"][1]["p"] for op in graph.ops if op.target == layout.LINEAR]
    assert forms and set(forms) <= set(weight) and all(v == [4] for v in forms.values())
    ran: list[tuple[int, ...]] = []
    columns = layout.columns
    monkeypatch.setattr(layout, "columns",
                        lambda x, w, b=None: ran.append(tuple(w.shape)) or columns(x, w, b))
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB")
    plan = sb.place(graph, spec)
    with torch.no_grad():
        expected = model(x).logits
    got = {}
    for name, g in (("linear", graph), ("columns", graph.with_meta(matmul_forms=forms))):
        ran.clear()
        _, specs, got[name] = resident_run(g, spec, plan, x)
        assert {n for s in specs for n in s.forms} == (set(forms) if name == "columns" else set())
        assert len(ran) == (sum(w in forms for w in weight) if name == "columns" else 0)
    torch.testing.assert_close(got["columns"], got["linear"], rtol=1e-5, atol=1e-5)
    assert M.rel_err(got["columns"], expected) <= 1e-4
    # specs carry them whole, and refuse rows counts that are not a decode bucket
    s = block_specs(sb.Plan(graph.with_meta(matmul_forms=forms), spec, plan.device_of), MODEL, 0)[0]
    assert BlockSpec.from_dict(s.to_dict()) == s
    bad = s.to_dict()
    bad["forms"] = {next(iter(s.params)): [3]}
    with pytest.raises(sb.BadInput, match="matmul form rows"):
        BlockSpec.from_dict(bad)


@pytest.mark.slow
def test_a_generation_deployment_runs_in_columns_as_measured_and_answers_as_hugging_face(monkeypatch) -> None:
    from .test_generate import decoder, hf_greedy, padded_batch

    model = decoder("llama")
    ids, mask = padded_batch((9, 4), seed=1)
    want = hf_greedy(model, ids, mask, 8)
    measured: list[dict] = []
    decide = layout.decide_forms

    def faster(graph, timer, rows, *args, **kwargs):
        # NOTE: timed on a worker as ever; then taken as a 2x win, so these small weights run in columns
        def twice(cases):
            measured.append(dict(timer(cases)))
            return {c.key(): (2.0, 1.0) for c in cases}
        return decide(graph, twice, rows, *args, **kwargs)

    monkeypatch.setattr(layout, "MIN_BYTES", 0)
    monkeypatch.setattr(layout, "decide_forms", faster)

    def kernels(dask_worker):
        r = dask_worker.plugins["seabiscuit"].resident
        return sum("columns_kernel" in getattr(fn, "__qualname__", "") for p in r.programs.values()
                   for fn, *_ in p.steps)

    with seabiscuit_cluster(2, 800_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB",
                           sessions=4) as dm:
            forms = dm.graph.meta["matmul_forms"]
            assert forms and {tuple(v) for v in forms.values()} == {(1, 2)}     # decode rows: 2 (4 sessions)
            assert len(measured) == 1 and all(a > 0 and b > 0 for a, b in measured[0].values())
            assert torch.equal(dm.generate(ids, 8, attention_mask=mask, pad_token_id=0), want)
            assert sum(client.run(kernels).values()) > 0
        with dask.config.set({"seabiscuit.lower.matmul-form": "linear"}):
            with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB",
                               sessions=4) as dm:
                assert not dm.graph.meta.get("matmul_forms")
                assert torch.equal(dm.generate(ids, 8, attention_mask=mask, pad_token_id=0), want)
        with dask.config.set({"seabiscuit.lower.matmul-form": "sideways"}), \
                pytest.raises(sb.BadInput, match="matmul-form is 'sideways'"):
            sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB", sessions=4)
