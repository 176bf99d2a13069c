"""GGUF files read in place (``gguf.py``): a GGUF written here with the ``gguf`` package (Q4_0, Q4_1
and Q8_0 tensors, llama's permuted attention rows), traced from the file, its tiles against the
file's own de-quantized weights, and a quantized deployment of it against its local graph."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.errors import BadCheckpoint
from seabiscuit_dask.gguf import open_gguf
from seabiscuit_dask.qlinear import dequantize_int4, unpack_int4
from seabiscuit_dask.quantize import quantize
from seabiscuit_dask.runtime.local import run_local
from seabiscuit_dask.weights import WeightStore

from .clusters import seabiscuit_cluster

gguf = pytest.importorskip("gguf")
pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]

LAYERS, HIDDEN, FFN, HEADS, KV, VOCAB = 2, 64, 128, 4, 2, 256
TYPES = {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_1", "ffn_down": "Q4_1"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows as llama.cpp's converter stores a llama attention q or k weight."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with tied embeddings as a GGUF: linear weights Q4_0, Q4_1 or Q8_0, the table
    Q8_0, norms F32."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=VOCAB,
                         max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.3,
                         rms_norm_eps=1e-6)
    model = tf.LlamaForCausalLM(cfg).eval()
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    T = gguf.GGMLQuantizationType

    def put(name: str, value: np.ndarray, kind: str) -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        if kind == "F32":
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, gguf.quants.quantize(value, T[kind]), raw_dtype=T[kind])

    put("token_embd.weight", sd["model.embed_tokens.weight"], "Q8_0")
    put("output_norm.weight", sd["model.norm.weight"], "F32")
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
    for i in range(LAYERS):
        put(f"blk.{i}.attn_norm.weight", sd[f"model.layers.{i}.input_layernorm.weight"], "F32")
        put(f"blk.{i}.ffn_norm.weight", sd[f"model.layers.{i}.post_attention_layernorm.weight"], "F32")
        for g, h in hf.items():
            value = sd[f"model.layers.{i}.{h}.weight"]
            value = permute(value, HEADS) if g == "attn_q" else permute(value, KV) if g == "attn_k" else value
            put(f"blk.{i}.{g}.weight", value, TYPES[g])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def dequantized(gguf_file: Path) -> torch.nn.Module:
    """The GGUF as transformers loads it: every tensor de-quantized to float32."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(os.fspath(gguf_file.parent), gguf_file=gguf_file.name,
                                                   dtype=torch.float32).eval()


def ids(n: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_gguf_traced_from_its_file_is_the_model_transformers_loads(gguf_file: Path,
                                                                     dequantized: torch.nn.Module) -> None:
    x = ids()
    graph = sb.trace(os.fspath(gguf_file), (x,))
    kinds = {p.source.kind for p in graph.params.values() if p.source.kind != "inline"}
    assert kinds == {"gguf"}
    heads = {p.source.key: p.source.heads for p in graph.params.values() if p.source.heads}
    assert heads == {f"blk.{i}.attn_{t}.weight": h for i in range(LAYERS)
                     for t, h in (("q", HEADS), ("k", KV))}
    want = dequantized(x).logits.detach()
    assert torch.equal(run_local(graph, (x,)).logits, want)
    cut = sb.decompose(graph, "24KiB")        # NOTE: tiles read their own rows (permuted ones too)
    torch.testing.assert_close(run_local(cut, (x,)).logits, want, rtol=1e-4, atol=1e-4)


def test_q4_blocks_become_int4_tiles_that_are_the_files_weights(gguf_file: Path,
                                                                dequantized: torch.nn.Module) -> None:
    x = ids()
    graph = quantize(sb.trace(os.fspath(gguf_file), (x,)), "int4")
    cut = sb.decompose(graph, "12KiB")
    store = WeightStore({})
    f = open_gguf(os.fspath(gguf_file))
    sd = dequantized.state_dict()
    checked = set()
    for name, p in cut.params.items():
        if p.source.quant != "int4-g32":
            continue
        sz_name = next(n for n, q in cut.params.items() if q.source.quant == "int4-g32-sz"
                       and q.source.key == p.source.key and q.source.slices is not None
                       and p.source.slices is not None and q.source.slices[1] == (p.source.slices[0][0] * 64,
                                                                                   p.source.slices[0][1] * 64)
                       and q.source.slices[0] == (p.source.slices[1][0] // 32, p.source.slices[1][1] // 32)) \
            if p.source.slices is not None else name.replace(":int4", ":int4.sz")
        w, sz = store.load(p), store.load(cut.params[sz_name])
        hf = next(k for k, v in graph.meta["param_shapes"].items() if k + ":int4" == name.split("@")[0])
        (r0, r1), (c0, c1), _ = p.source.slices or ((0, p.shape[0]), (0, p.shape[1]), (0, 32))
        want = sd[hf][r0 * 64:r1 * 64, c0:c1]
        got = dequantize_int4(w, sz, 32, torch.float32)
        # NOTE: up to the bf16 rounding of each block's scale and of its value of 8
        assert bool(((got - want).abs() <= sz[..., 1].t().float().abs().repeat_interleave(32, 1) / 128
                     + sz[..., 0].t().float().abs().repeat_interleave(32, 1) * 8 / 128 + 1e-6).all())
        assert f.info(p.source.key).type in ("Q4_0", "Q4_1") and unpack_int4(w).max() <= 15
        checked.add(p.source.key)
    # NOTE: every Q4 tensor of whole blocks of 64 rows: attn_k is Q8_0, attn_v's 32 rows are int8
    assert checked == {f"blk.{i}.{t}.weight" for i in range(LAYERS)
                       for t in ("attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert not any(p.source.quant == "int4-g32" and f.info(p.source.key).type == "Q8_0"
                   for p in cut.params.values())


def test_a_quantized_gguf_deployment_answers_as_its_local_graph(gguf_file: Path) -> None:
    x = ids(16, seed=3)
    prompt = ids(7, seed=4)
    with seabiscuit_cluster(2, 400_000) as client:
        with sb.distribute(os.fspath(gguf_file), client, torch.zeros(1, 16, dtype=torch.long),
                           budget="64KiB", quantize="int4") as dm:
            held = client.run(lambda dask_worker: sorted({str(t.dtype) for ts in dask_worker.plugins[
                "seabiscuit"].resident.tiles.values() for t in ts.values()}))
            assert "torch.uint8" in {d for ds in held.values() for d in ds}
            assert "torch.float32" in {d for ds in held.values() for d in ds}    # NOTE: norms
            got = dm(x)
            got = got.logits if hasattr(got, "logits") else got
            assert torch.equal(got, run_local(dm.graph, (x,)).logits)
            out = dm.generate(prompt, 6, pad_token_id=0, eos_token_id=[])
    assert out.shape == (1, 13) and torch.equal(out[:, :7], prompt)
    # NOTE: its first token is the quantized graph's at the prompt, run here from the file
    first = run_local(quantize(sb.trace(os.fspath(gguf_file), (prompt,)), "int4"), (prompt,)).logits
    assert int(out[0, 7]) == int(first[0, -1].argmax())


def test_a_gguf_that_does_not_match_the_model_is_refused(gguf_file: Path, tmp_path: Path) -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * FFN,
                         num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=VOCAB,
                         tie_word_embeddings=True)
    graph = sb.trace(tf.LlamaForCausalLM(cfg).eval(), (ids(),))
    with pytest.raises(BadCheckpoint, match="shape mismatch"):
        sb.bind_checkpoint(graph, os.fspath(gguf_file))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(BadCheckpoint, match="cannot be read as GGUF"):
        open_gguf(os.fspath(bad))


def test_a_column_tile_reads_only_its_blocks_and_is_the_files_columns(gguf_file: Path) -> None:
    f = open_gguf(os.fspath(gguf_file))
    for name in ("token_embd.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight"):    # Q8_0, Q4_1, Q4_0
        heads = HEADS if "attn_q" in name else 0
        whole = f.rows(name, (3, 40), heads)
        for cols in ((0, 64), (5, 37), (32, 64), (17, 18)):
            assert torch.equal(f.rows(name, (3, 40), heads, cols), whole[:, cols[0]:cols[1]])
    norm = f.rows("output_norm.weight", (0, 1), 0)
    assert torch.equal(f.rows("output_norm.weight", (0, 1), 0, (10, 20)), norm[:, 10:20])
    with pytest.raises(BadCheckpoint, match="outside"):
        f.rows("token_embd.weight", (0, 1), 0, (60, 70))


def test_permuted_rows_are_read_from_gguf_sources_only() -> None:
    from seabiscuit_dask.errors import InvalidGraph
    from seabiscuit_dask.ir import ParamSource, ParamSpec, check_param

    with pytest.raises(InvalidGraph, match="permuted"):
        check_param(ParamSpec("w", (64, 64), "float32", ParamSource("safetensors", "w", file="m.st",
                                                                      heads=4)))
    src = ParamSource("gguf", "blk.0.attn_q.weight", file="m.gguf", heads=4)
    check_param(ParamSpec("w", (64, 64), "float32", src))


def test_a_permuted_bias_is_read_in_the_models_order(tmp_path: Path) -> None:
    """llama.cpp stores a q or k bias permuted per head as it does the weight's rows."""
    from seabiscuit_dask.gguf import load
    from seabiscuit_dask.ir import ParamSource, ParamSpec

    bias = np.arange(HIDDEN, dtype=np.float32)
    path = tmp_path / "bias.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_tensor("blk.0.attn_q.bias", permute(bias, HEADS))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = ParamSource("gguf", "blk.0.attn_q.bias", file=os.fspath(path), heads=HEADS)
    assert torch.equal(load(ParamSpec("b", (HIDDEN,), "float32", src)), torch.from_numpy(bias))
    tile = src.sliced(0, 8, 40, (HIDDEN,))
    assert torch.equal(load(ParamSpec("b", (32,), "float32", tile)), torch.from_numpy(bias[8:40]))


def small_gguf(path: Path, kinds: dict[str, str]) -> Path:
    """A GGUF of a few tensors (name -> type), random values: enough for its types to be read."""
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    rng = np.random.default_rng(0)
    for name, kind in kinds.items():
        value = rng.standard_normal((64, 64) if name.endswith(".weight") and "norm" not in name else 64)
        value = np.ascontiguousarray(value, dtype=np.float32)
        T = gguf.GGMLQuantizationType
        w.add_tensor(name, value if kind == "F32" else gguf.quants.quantize(value, T[kind]),
                     raw_dtype=None if kind == "F32" else T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_is_served_as_quantized_as_its_file_unless_asked_otherwise(gguf_file: Path,
                                                                        tmp_path: Path) -> None:
    """The scheme a served GGUF keeps: int4 when most layer weights are 4-bit (Q4_0 / Q4_1 held as they
    are, the rest named in a notice), int8 for 8-bit files, none for float ones; ``--quantize`` or
    ``--dequantize`` (config) decide instead when given."""
    import dask

    from seabiscuit_dask.gguf import kept_scheme
    from seabiscuit_dask.models import gguf_scheme

    kept = kept_scheme(os.fspath(gguf_file))
    # NOTE: q, o, gate, up and down of 2 layers are its blocks; the Q8_0 table and attn_k, and attn_v's
    # Q4_1 (32 rows: not whole blocks of 64, so int8) are not
    assert kept == type(kept)("int4", 10, (("Q4_1", 2), ("Q8_0", 3)))
    notice = kept.notice("tiny.gguf")
    assert "Q4_1 (2 tensors), Q8_0 (3 tensors) de-quantized and held as int4 (linear) or int8 per row" \
        in notice
    eight = small_gguf(tmp_path / "q8.gguf", {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q8_0",
                                              "blk.0.ffn_up.weight": "Q4_1", "blk.0.attn_norm.weight": "F32"})
    assert kept_scheme(os.fspath(eight)) == type(kept)("int8", 0, (("Q4_1", 1), ("Q8_0", 2)))
    floats = small_gguf(tmp_path / "f32.gguf", {"blk.0.attn_q.weight": "F32", "blk.0.attn_k.weight": "F32"})
    assert kept_scheme(os.fspath(floats)) == type(kept)(None, 0, ())
    scheme, lines = gguf_scheme(os.fspath(gguf_file))
    assert scheme == "int4" and "kept quantized as the file is" in lines[0] and "Q8_0" in lines[1]
    assert gguf_scheme(os.fspath(floats))[0] is None
    with dask.config.set({"seabiscuit.dequantize-gguf": True}):
        scheme, lines = gguf_scheme(os.fspath(gguf_file))
        assert scheme is None and "de-quantising GGUF to float32" in lines[0]
    with dask.config.set({"seabiscuit.quantize": "int8"}):
        scheme, lines = gguf_scheme(os.fspath(gguf_file))
        assert scheme == "int8" and lines == ["reading tiny.gguf in place (int8) ..."]


def test_a_gguf_that_cannot_be_read_in_place_is_served_in_float32_and_dequantize_wins(
        gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF whose tensors transformers changes on load (gemma's norms, bloom's fused qkv) is served
    de-quantized, as before, with a line saying why; asked to quantize it, the error says what to do
    instead. ``--dequantize`` wins over a scheme the config names."""
    import dask

    from seabiscuit_dask import cli, demo
    from seabiscuit_dask import gguf as G
    from seabiscuit_dask.errors import UnsupportedModel
    from seabiscuit_dask.models import gguf_scheme

    assert G.not_in_place(os.fspath(gguf_file)) == ""
    monkeypatch.setattr(G, "not_in_place", lambda path: "transformers' Gemma2TensorProcessor changes its "
                                                        "tensors on load")
    scheme, lines = gguf_scheme(os.fspath(gguf_file))
    assert scheme is None and "float32: transformers' Gemma2TensorProcessor changes its tensors" in lines[0]
    asked = dask.config.set({"seabiscuit.quantize": "int4"})
    with asked, pytest.raises(UnsupportedModel, match="--dequantize"):
        gguf_scheme(os.fspath(gguf_file))
    seen: list[tuple[object, object]] = []
    monkeypatch.setattr(demo, "run_generate", lambda *a, **kw: seen.append(
        (sb.config.get("quantize"), sb.config.get("dequantize-gguf"))) or 0)
    with dask.config.set({"seabiscuit.quantize": "int8"}):
        assert cli.main(["generate", "--dequantize"]) == 0
        assert cli.main(["generate"]) == 0
    assert seen == [(None, True), ("int8", False)]


def test_a_gguf_name_map_is_made_once_for_each_version_of_its_file(gguf_file: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers takes seconds to map a GGUF's names (4 s for SmolLM2), and every step program binds
    to the file again: the map is kept per file version, made afresh once the file changes."""
    import shutil

    from transformers import modeling_gguf_pytorch_utils as gu

    from seabiscuit_dask.gguf import weights_map

    made: list[int] = []
    real = gu.get_gguf_hf_weights_map
    monkeypatch.setattr(gu, "get_gguf_hf_weights_map", lambda *a, **kw: made.append(1) or real(*a, **kw))
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_file, copy)
    first = weights_map(os.fspath(copy))
    calls = len(made)                                     # NOTE: transformers' map recurses into submodules
    assert calls > 0 and first["model.layers.0.self_attn.q_proj.weight"] == ("blk.0.attn_q.weight", HEADS)
    first["model.norm.weight"] = ("changed", 0)           # NOTE: a caller's copy: the kept map is untouched
    again = weights_map(os.fspath(copy))
    assert again["model.norm.weight"] == ("output_norm.weight", 0) and len(made) == calls
    os.utime(copy, ns=(1, 1))                              # NOTE: another version of the file
    assert weights_map(os.fspath(copy)) == again and len(made) == 2 * calls
