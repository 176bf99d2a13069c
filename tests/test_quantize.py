"""Weight-only int8 quantization (``quantize.py``): the pass, the tiles workers derive from float
weights, the kernel's two ways (the int8 weight-only kernel for few rows, bf16 GEMMs for many),
the budget arithmetic, and a quantized deployment whose result is its local graph's."""

from __future__ import annotations

import copy

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.errors import BadInput, InvalidGraph
from seabiscuit_dask.ir import OpGraph, ParamSource, ParamSpec
from seabiscuit_dask.ops import QLINEAR_SLAB, qlinear_columns, qlinear_slab
from seabiscuit_dask.qlinear import (
    PACK_ROWS,
    Q4_GEMM_ROWS,
    bf16_gemms,
    dequantize_int4,
    dequantized_t,
    pack_int4,
    q4linear_dequantized,
    q4linear_gemm,
    q4linear_kernel,
    qlinear_kernel,
    unpack_int4,
)
from seabiscuit_dask.quantize import (
    check_scheme,
    held_bytes,
    int4_fits,
    names_of,
    quantize,
    quantize_groups,
    quantize_rows,
)
from seabiscuit_dask.runtime.generation import Engine, GenerateArgs, LocalRunner, generate_tokens
from seabiscuit_dask.runtime.local import run_local
from seabiscuit_dask.weights import WeightStore

from .clusters import seabiscuit_cluster
from .test_generate import decoder, padded_batch

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]


def logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def close_to(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """Every value within ``rel`` of the largest magnitude of ``want``."""
    return bool((got - want).abs().max() <= rel * want.abs().max())


def test_rows_quantize_symmetrically_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g)
    w[3] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (40,)
    assert int(q.abs().max()) == 127
    assert float(scale[3]) == 1.0 and not q[3].any()
    err = (q.float() * scale.float()[:, None] - w).abs()
    assert bool((err <= scale.float()[:, None] / 2 + 1e-6).all())


def test_the_pass_turns_linear_layers_and_embeddings_int8_and_a_tied_table_is_held_once() -> None:
    model = decoder("llama")              # NOTE: its head is tied to the embedding
    ids, _ = padded_batch((7,), seed=1)
    graph = sb.trace(model, (ids,))
    q = quantize(graph, "int8")
    linears = [op for op in graph.ops if op.target == "aten.linear.default"]
    embed = next(op.params[0] for op in graph.ops if op.target == "aten.embedding.default")
    weights = {op.params[0] for op in linears}
    assert embed in weights                                   # NOTE: one param, read by both
    assert q.meta["quantize"] == "int8" and q.meta["quantized"] == len(weights) > 0
    assert not any(op.target == "aten.linear.default" for op in q.ops)
    qname, sname = names_of(embed)
    assert embed not in q.params                              # NOTE: no float copy of the table
    lookups = [op for op in q.ops if op.target == "aten.embedding.default"]
    assert sorted(op.params for op in lookups) == [(qname,), (sname + "2d",)]
    assert q.params[qname].dtype == "int8" and q.params[qname].source.key == embed
    assert q.params[sname].shape == (q.params[qname].shape[0],) and q.params[sname + "2d"].shape[1] == 1
    table_scales = 4 * q.params[sname].shape[0]          # NOTE: in the table's dtype
    assert q.param_bytes == graph.param_bytes - sum(graph.params[w].nbytes for w in weights) \
        + sum(n * k + 2 * n for n, k in (graph.params[w].shape for w in weights)) + table_scales
    want = logits(model(ids)).detach()
    got = logits(run_local(q, (ids,), weights=model))
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9
    assert quantize(q, "int8") is q and quantize(graph, None) is graph
    assert OpGraph.from_json(q.to_json()).params == q.params
    with pytest.raises(BadInput, match="int8"):
        check_scheme("int3")
    with pytest.raises(BadInput, match="already decomposed"):
        quantize(sb.decompose(graph, "64KiB"), "int8")


def test_tiles_of_a_quantized_weight_hold_the_whole_weights_integers() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(30, 20, generator=g)
    q, scale = quantize_rows(w)
    store = WeightStore({"w": w})
    src = ParamSource("model", "w", quant="int8", whole=(30, 20))
    whole = store.load(ParamSpec("w:int8", (30, 20), "int8", src))
    assert torch.equal(whole, q)
    tile = src.sliced(0, 10, 25, (30, 20)).sliced(1, 5, 12, (15, 20))       # rows, then the reduction
    assert torch.equal(store.load(ParamSpec("t", (15, 7), "int8", tile)), q[10:25, 5:12])
    scales = ParamSource("model", "w", quant="int8-scale", whole=(30, 20)).sliced(0, 4, 9, (30,))
    assert torch.equal(store.load(ParamSpec("s", (5,), "bfloat16", scales)), scale[4:9])
    with pytest.raises(InvalidGraph, match="int8"):
        ParamSpec.from_dict("x", {"shape": [3], "dtype": "int8",
                                  "source": {"kind": "model", "key": "w", "quant": "int4", "whole": [3, 2]}})


@pytest.mark.parametrize("n,k", [(96, 64), (3000, 64)])         # one slab; several, the last short
@pytest.mark.parametrize("rows", [1, PACK_ROWS, PACK_ROWS + 1, 40])   # the int8 kernel; bf16 GEMMs
def test_the_kernel_multiplies_int8_weights_in_bf16_either_way(n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    q, scale = quantize_rows(torch.randn(n, k, generator=g))
    x, bias = torch.randn(2, rows, k, generator=g), torch.randn(n, generator=g)
    want = x @ (q.float() * scale.float()[:, None]).T + bias
    got = qlinear_kernel(x, q, scale, None, bias, 0, True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert close_to(got, want, 1e-2)
    step = qlinear_columns(n, k, 2, QLINEAR_SLAB)
    assert torch.equal(qlinear_kernel(x, q, scale, None, bias, step, True), got)
    assert torch.equal(torch.ops.sb.qlinear(x, q, scale, None, bias, 0, True), got)
    exact = qlinear_kernel(x, q, scale, None, bias)              # NOTE: without bf16: in x's own dtype
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-4)


def test_a_bf16_qlinear_counts_its_bf16_rows_slab_and_product() -> None:
    def spec(ref):
        return {"x": ((7, 576), "float32")}.get(ref.get("t")) if isinstance(ref, dict) else None

    slab = qlinear_slab([{"t": "x"}, None, None, None, None, 0, True], [(7, 1536)], spec)
    assert slab is not None and slab.bf16 and slab.itemsize == 2
    assert slab.columns == qlinear_columns(1536, 576, 2, QLINEAR_SLAB) < 1536
    assert slab.scratch() == (7 + slab.columns) * 576 * 2 + 7 * 1536 * 2


def test_held_bytes_counts_what_a_quantized_deployment_holds() -> None:
    model = decoder("llama")
    ids, _ = padded_batch((7,), seed=1)
    floats = sum(p.numel() * 4 for p in model.parameters())
    assert held_bytes(model, None) == floats
    q = quantize(sb.trace(model, (ids,)), "int8")
    buffers = sum(p.nbytes for p in q.params.values() if p.source.kind == "inline")     # NOTE: rotary's
    assert held_bytes(model, "int8") == q.param_bytes - buffers
    with torch.device("meta"):          # NOTE: a folder's skeleton, as serve sizes budgets from
        skeleton = type(model)(model.config)
    assert held_bytes(skeleton, "int8") == held_bytes(model, "int8")
    assert held_bytes(skeleton, None) == floats


def test_the_template_cache_keeps_float_and_quantized_decompositions_apart() -> None:
    model = decoder("llama")
    ids, _ = padded_batch((6,), seed=3)
    graph = sb.trace(model, (ids,))
    want = logits(model(ids)).detach()
    first = sb.decompose(quantize(graph, "int8"), "64KiB")
    again = sb.decompose(graph, "64KiB")
    assert any(op.target == "sb.qlinear.default" for op in first.ops)
    assert not any(op.target == "sb.qlinear.default" for op in again.ops)
    torch.testing.assert_close(logits(run_local(again, (ids,), weights=model)), want, rtol=1e-4, atol=1e-5)


def test_a_decomposed_quantized_graph_is_its_graph_up_to_bf16_and_follows_the_float_model() -> None:
    model = decoder("llama")
    ids, _ = padded_batch((12,), seed=4)
    graph = quantize(sb.trace(model, (ids,)), "int8")
    want = logits(model(ids)).detach()
    whole = logits(run_local(graph, (ids,), weights=model))
    cut = sb.decompose(graph, "16KiB")
    assert sum(op.target == "sb.qlinear.default" for op in cut.ops) > graph.meta["quantized"]
    assert close_to(logits(run_local(cut, (ids,), weights=model)), whole, 2e-2)
    # NOTE: this decoder's large weights amplify every error (~3.5% here); a wrong scale or row: 100%
    assert float((whole - want).abs().mean() / want.abs().mean()) < 0.06
    assert float((whole.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_deployment_answers_as_its_local_graph_and_holds_quantized_tiles(scheme: str) -> None:
    model = decoder("llama")
    ids, _ = padded_batch((9,), seed=1)
    with seabiscuit_cluster(2, 400_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB",
                           quantize=scheme) as dm:
            assert dm.graph.meta["quantize"] == scheme
            held = client.run(lambda dask_worker: sorted({str(t.dtype) for ts in dask_worker.plugins[
                "seabiscuit"].resident.tiles.values() for t in ts.values()}))
            dtypes = {d for ds in held.values() for d in ds}
            assert "torch.int8" in dtypes and ("torch.uint8" in dtypes) == (scheme == "int4")
            x = torch.zeros(1, 16, dtype=torch.long)
            x[0, 7:] = ids[0]
            assert torch.equal(logits(dm(x)), logits(run_local(dm.graph, (x,), weights=model)))
            got = dm.generate(ids, 8, pad_token_id=0, eos_token_id=[])
            steps = dm.generation_stats()["programs"]
    engine = Engine(LocalRunner(model, "64KiB", quantize=scheme), max_sessions=2, context=64, max_chunk=16)
    args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=8, pad_token_id=0,
                             eos_token_id=[])
    assert torch.equal(got, generate_tokens(engine, ids, args))
    assert steps and all(p["build_s"] >= 0 for p in steps.values())


@pytest.mark.parametrize("k", [24, 40, 200])      # NOTE: the int8 kernel reads blocks of 16 (else garbage)
def test_a_reduction_the_int8_kernel_cannot_read_takes_the_gemm_path(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    q, scale = quantize_rows(torch.randn(40, k, generator=g))
    x = torch.randn(1, k, generator=g)
    want = x @ (q.float() * scale.float()[:, None]).T
    assert close_to(qlinear_kernel(x, q, scale, None, None, 0, True), want, 1e-2)


def test_derived_tiles_load_right_from_many_threads_at_once() -> None:
    """One store serves a worker's loads on several threads: each load's rows are its own."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(5)
    weights = {f"w{i}": torch.randn(64, 32, generator=g) * (i + 1) for i in range(4)}
    store = WeightStore(weights)
    specs, want = [], []
    for key, w in weights.items():
        q, scale = quantize_rows(w)
        for a in range(0, 64, 16):
            src = ParamSource("model", key, quant="int8", whole=(64, 32)).sliced(0, a, a + 16, (64, 32))
            specs.append(ParamSpec("t", (16, 32), "int8", src))
            want.append(q[a:a + 16])
            rows = ParamSource("model", key, quant="int8-scale", whole=(64, 32)).sliced(0, a, a + 16, (64,))
            specs.append(ParamSpec("s", (16,), "bfloat16", rows))
            want.append(scale[a:a + 16])
    order = [i % len(specs) for i in range(40 * len(specs))]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: store.load(specs[i]), order))
    assert all(torch.equal(t, want[i]) for t, i in zip(got, order))


def test_a_tied_tables_two_scales_are_two_tiles_and_survive_a_copy_to_the_store() -> None:
    from seabiscuit_dask.runtime.worker.resident import tile_key
    from seabiscuit_dask.runtime.worker.store import copied_if_unreadable

    model = decoder("llama")
    ids, _ = padded_batch((7,), seed=1)
    q = quantize(sb.trace(model, (ids,)), "int8")
    table = next(p for n, p in q.params.items() if n.endswith("scale2d")).source.key
    scales = [p for p in q.params.values() if p.source.quant == "int8-scale" and p.source.key == table]
    assert len(scales) == 2 and tile_key(scales[0]) != tile_key(scales[1])
    # NOTE: a file the workers may not read: its params are copied to the store from the module
    far = "/proc/not-a-root.safetensors"
    outside = {n: ParamSpec(n, p.shape, p.dtype, ParamSource("safetensors", p.source.key, p.source.slices,
                                                             far, quant=p.source.quant, whole=p.source.whole))
               for n, p in q.params.items() if p.source.kind == "model"}
    copied = copied_if_unreadable(type(q)(q.ops, q.tensors, {**q.params, **outside}, q.inputs, q.outputs,
                                          q.meta), model)
    assert all(copied.params[n].source.kind == "model" and copied.params[n].source.quant == p.source.quant
               for n, p in outside.items())


def test_a_half_precision_tables_rows_stay_half() -> None:
    model = decoder("llama").half()
    ids, _ = padded_batch((5,), seed=2)
    q = quantize(sb.trace(model, (ids,)), "int8")
    lookup = next(op for op in q.ops if op.name.endswith(".scaled"))
    assert q.tensors[lookup.outputs[0]].dtype == "float16"
    assert all(q.tensors[t].dtype == "float16" for t in lookup.inputs)
    table_scale = next(p for n, p in q.params.items() if n.endswith("scale2d"))
    assert WeightStore.from_weights(model).load(table_scale).dtype == torch.float16


# --- int4 ------------------------------------------------------------------------------------------
def int4_reference(model: torch.nn.Module, group: int = 32) -> torch.nn.Module:
    """``model`` with the weights an int4 deployment holds, dequantized exactly: int4 linear layers,
    the rest of its linear layers and its tables int8 (``quantize``'s choice)."""
    ref = copy.deepcopy(model)
    tables = {id(m.weight) for m in ref.modules() if isinstance(m, torch.nn.Embedding)}
    vocab = {m.weight.shape[0] for m in ref.modules() if isinstance(m, torch.nn.Embedding)}
    done: set[int] = set()
    with torch.no_grad():
        for m in ref.modules():
            if not isinstance(m, torch.nn.Linear | torch.nn.Embedding):
                continue
            w = m.weight
            if isinstance(m, torch.nn.Linear) and id(w) not in tables and w.shape[0] not in vocab \
                    and int4_fits(*w.shape, group):
                q, sz = quantize_groups(w, group)
                scale, zero = (sz[..., i].t().float().repeat_interleave(group, 1) for i in (0, 1))
                w.copy_((q.float() - 8) * scale + zero)
            elif id(w) not in done:       # NOTE: a tied weight once
                q8, s8 = quantize_rows(w)
                w.copy_(q8.float() * s8.float()[:, None])
            done.add(id(w))
    return ref


def test_groups_quantize_asymmetrically_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) + torch.linspace(-3, 3, 96)
    w[5, 32:64] = 0.25
    q, sz = quantize_groups(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) == 15
    assert sz.shape == (3, 64, 2) and sz.dtype == torch.bfloat16
    scale, zero = (sz[..., i].t().float().repeat_interleave(32, 1) for i in (0, 1))
    assert bool(((q.float() - 8) * scale + zero - w).abs().le(scale / 2 + 1e-6).all())
    assert float(sz[1, 5, 0]) == 1.0 and bool((q[5, 32:64] == 8).all())      # NOTE: a constant group
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("rows", [1, 5, 145])
def test_the_int4_kernel_is_the_dequantized_product_on_a_cpu_and_slab_by_slab(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(192, 128, generator=g), torch.randn(192, generator=g)
    q, sz = quantize_groups(w, 64)
    packed = pack_int4(q)
    x = torch.randn(1, rows, 128, generator=g)
    want = x @ dequantize_int4(packed, sz, 64, torch.float32).T + bias
    got = q4linear_kernel(x, packed, sz, bias, 64)
    assert close_to(got, want, 1e-2)
    torch.testing.assert_close(q4linear_dequantized(x, packed, sz, bias, 64, step=64), want)
    # NOTE: many rows (a prefill chunk) on a CPU with bf16 GEMMs: slabs of the weight in bf16
    gemm = q4linear_gemm(x, packed, sz, bias, 64, step=64)
    assert close_to(gemm, want, 1e-2) and gemm.dtype == x.dtype
    whole = q4linear_gemm(x, packed, sz, bias, 64)
    assert close_to(whole, gemm, 1e-3)
    assert torch.equal(got, whole) == (rows >= Q4_GEMM_ROWS and bf16_gemms())      # NOTE: the path taken
    # NOTE: a tile cut along the reduction (whole groups): its slabs read its own columns' scales
    part = q4linear_gemm(x[..., 64:], packed[:, 64:], sz[1:], None, 64, step=64)
    assert close_to(part, x[..., 64:] @ dequantize_int4(packed[:, 64:], sz[1:], 64, torch.float32).T, 1e-2)


def test_an_int4_slab_dequantizes_to_its_weights_transposed_in_bf16() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 96, generator=g)
    q, sz = quantize_groups(w, 32)
    t = dequantized_t(pack_int4(q), sz[..., 0].contiguous(), sz[..., 1].contiguous(), 32)
    assert t.shape == (96, 128) and t.dtype == torch.bfloat16
    exact = dequantize_int4(pack_int4(q), sz, 32, torch.float32).T
    # NOTE: rounded to bf16 once: within half a bf16 step of the exact weight
    assert bool(((t.float() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all())


def test_int4_linear_layers_and_int8_tables_answer_as_their_weights_dequantized() -> None:
    model = decoder("llama")              # NOTE: k_proj and v_proj have 32 rows: not a block of 64
    ids, _ = padded_batch((12,), seed=4)
    graph = sb.trace(model, (ids,))
    q = quantize(graph, "int4")
    assert q.meta["int4"] == 10 and q.meta["quantized"] == 15     # NOTE: 2 x (q, o, gate, up, down) ...
    int4 = {op.params[0] for op in q.ops if op.target == "sb.q4linear.default"}
    assert len(int4) == 10 and all(q.params[p].dtype == "uint8" for p in int4)
    assert not any("embed" in p or "k_proj" in p for p in int4)   # NOTE: ... the table and head int8
    buffers = sum(p.nbytes for p in q.params.values() if p.source.kind == "inline")
    assert held_bytes(model, "int4") == q.param_bytes - buffers < held_bytes(model, "int8")
    want = logits(int4_reference(model)(ids)).detach()
    whole = logits(run_local(q, (ids,), weights=model))
    assert close_to(whole, want, 2e-2)                            # NOTE: bf16 activations
    cut = sb.decompose(q, "12KiB")
    tiles = [p for p in cut.params.values() if p.source.quant == "int4-g32"]
    assert len(tiles) > len(int4)
    for p in tiles:                       # NOTE: whole blocks of 64 rows, whole groups of the reduction
        (_, _), (c0, c1), _ = p.source.slices or ((0, p.shape[0]), (0, p.shape[1]), (0, 32))
        assert c0 % 32 == 0 and c1 % 32 == 0
    assert close_to(logits(run_local(cut, (ids,), weights=model)), whole, 2e-2)
    assert OpGraph.from_json(cut.to_json()).params == cut.params


def test_a_malformed_int4_param_is_refused() -> None:
    from seabiscuit_dask.ir import check_param

    src = ParamSource("model", "w", quant="int4-g32", whole=(96, 64))      # NOTE: 96 rows: 1.5 blocks
    with pytest.raises(InvalidGraph, match="blocks of 64 rows"):
        check_param(ParamSpec("w:int4", (96, 32), "uint8", src))
    src = ParamSource("model", "w", quant="int4-g32-sz", whole=(64, 64))
    with pytest.raises(InvalidGraph, match="bfloat16"):
        check_param(ParamSpec("w:int4.sz", (2, 64, 2), "float32", src))
    check_param(ParamSpec("w:int4.sz", (2, 64, 2), "bfloat16", src))


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_a_bf16_model_is_served_in_bf16_with_no_float32_weight_on_a_worker(scheme: str | None) -> None:
    model = decoder("llama").to(torch.bfloat16)
    ids, _ = padded_batch((9,), seed=1)
    x = torch.zeros(1, 16, dtype=torch.long)
    x[0, 7:] = ids[0]
    with seabiscuit_cluster(2, 400_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB",
                           quantize=scheme) as dm:
            held = client.run(lambda dask_worker: sorted({str(t.dtype) for ts in dask_worker.plugins[
                "seabiscuit"].resident.tiles.values() for t in ts.values()}))
            dtypes = {d for ds in held.values() for d in ds}
            assert "torch.bfloat16" in dtypes and "torch.float32" not in dtypes, dtypes
            got = logits(dm(x))
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, logits(run_local(dm.graph, (x,), weights=model)))
            out = dm.generate(ids, 6, pad_token_id=0, eos_token_id=[])
    if scheme is None:        # NOTE: the same greedy tokens as Hugging Face in bf16
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
        assert torch.equal(out, want)


def test_int4_tiles_cut_along_a_long_reduction_bind_to_a_checkpoint(tmp_path) -> None:
    """A scale-and-zero tile counts groups (here 128 of them over a weight of 64 rows): binding checks
    it against the weight's columns, not its rows."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(9)
    layer = torch.nn.Linear(4096, 64, bias=False).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 4096, generator=g))
    x = torch.randn(2, 4096, generator=g)
    cut = sb.decompose(quantize(sb.trace(layer, (x,)), "int4"), "96KiB")
    assert any(p.source.quant == "int4-g32-sz" and p.source.slices and p.source.slices[0][1] > 64
               for p in cut.params.values())
    save_file({"weight": layer.weight.detach().contiguous()}, str(tmp_path / "model.safetensors"))
    bound = sb.bind_checkpoint(cut, tmp_path / "model.safetensors")
    assert {p.source.kind for p in bound.params.values()} == {"safetensors"}
    assert torch.equal(run_local(bound, (x,)), run_local(cut, (x,), weights=layer))


def test_the_int4_bytes_are_the_kernels_own_packing_here() -> None:
    from seabiscuit_dask.qlinear import kernel_reads_packed

    q = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(3))
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2).reshape(-1)
    assert kernel_reads_packed() == torch.equal(theirs, pack_int4(q).reshape(-1))


def test_int4_scales_wait_for_their_param_a_bounded_while() -> None:
    from seabiscuit_dask.weights import INT4_WAITING

    g = torch.Generator().manual_seed(4)
    store = WeightStore({"w": torch.randn(64 * 12, 64, generator=g)})
    q, sz = quantize_groups(store.tensors["w"], 32)

    def spec(block: int, scales: bool) -> ParamSpec:
        kind = "int4-g32-sz" if scales else "int4-g32"
        src = ParamSource("model", "w", quant=kind, whole=(64 * 12, 64))
        if scales:
            tile = src.sliced(1, 64 * block, 64 * (block + 1), (2, 768, 2))
            return ParamSpec("s", (2, 64, 2), "bfloat16", tile)
        return ParamSpec("w", (1, 64, 32), "uint8", src.sliced(0, block, block + 1, (12, 64, 32)))

    assert torch.equal(store.load(spec(0, False)), pack_int4(q[:64]))
    assert torch.equal(store.load(spec(0, True)), sz[:, :64]) and not store._scales     # NOTE: taken
    for b in range(12):                       # NOTE: weights whose scales are read elsewhere
        store.load(spec(b, False))
    assert len(store._scales) == INT4_WAITING
    assert torch.equal(store.load(spec(1, True)), sz[:, 64:128])     # NOTE: dropped: read again, same
