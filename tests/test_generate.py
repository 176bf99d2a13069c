"""Generation: step programs over a KV cache, the same tokens as Hugging Face, sessions and limits.

In-process tests run the step programs with ``LocalRunner``; the cluster tests
serve seeded decoders and SmolLM2-135M-Instruct with its real weights.
"""

from __future__ import annotations

import gc
import importlib
import threading
from typing import Any

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.errors import (
    BadInput,
    Busy,
    ClusterTooSmall,
    ModelClosed,
    QueueTimeout,
    RunFailed,
    SessionClosed,
    StaleRun,
)
from seabiscuit_dask.lower.kvcache import CacheLost, KVStore, using
from seabiscuit_dask.placement.follow import follow
from seabiscuit_dask.runtime.generation import (
    Engine,
    GenerateArgs,
    LocalRunner,
    Sampling,
    chunking,
    generate_tokens,
    prefill_buckets,
    stream_tokens,
)
from seabiscuit_dask.runtime.generation import engine as engine_module
from seabiscuit_dask.runtime.generation import executor as executor_module
from seabiscuit_dask.runtime.generation.inputs import step_inputs
from seabiscuit_dask.trace.decoder import trace_step

from .clusters import seabiscuit_cluster, wait_for

VOCAB = 512


def decoder(family: str, seed: int = 0) -> torch.nn.Module:
    """A seeded 2-layer decoder; large initial weights make its greedy tokens vary."""
    import transformers as tf

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "initializer_range": 0.3}
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, bos_token_id=1,
                            eos_token_id=2, **common)
        return tf.GPT2LMHeadModel(cfg).eval()
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}
    # NOTE: a window of 5 tokens: Mistral slides on every layer, this Qwen2 on its second only
    window = {"mistral": {"sliding_window": 5},
              "mixtral": {"sliding_window": 5, "num_local_experts": 4, "num_experts_per_tok": 2},
              "qwen2-window": {"sliding_window": 5, "use_sliding_window": True, "max_window_layers": 1}}
    config, model = cls[family.removesuffix("-window")]
    cfg = config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=family == "llama",
                 **window.get(family, {}), **common)
    return model(cfg).eval()


def padded_batch(lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of ``lengths`` left-padded into one batch, with their attention mask."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros((len(lengths), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, k in enumerate(lengths):
        ids[r, n - k:] = torch.randint(3, VOCAB, (k,), generator=g)
        mask[r, n - k:] = 1
    return ids, mask


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def local_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, new: int,
                 engine: Engine | None = None) -> torch.Tensor:
    engine = engine or Engine(LocalRunner(model, "64KiB"))
    args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=new, pad_token_id=0)
    return generate_tokens(engine, ids, args, mask)


# --- step programs --------------------------------------------------------------------------
def test_step_program_caches_each_kv_head_once() -> None:
    g = trace_step(decoder("llama"), 2, 3)
    assert g.inputs == ("input_ids", "position_ids", "sb_sessions", "sb_start", "sb_valid")
    kv = [op for op in g.ops if op.kind == "kv_attention"]
    assert [op.attrs["args"][6] for op in kv] == [0, 1]
    for op in kv:
        q, k = g.tensors[op.inputs[0]].shape, g.tensors[op.inputs[1]].shape
        assert (q[1], k[1]) == (4, 2)          # GQA: the cache holds the 2 KV heads, not 4 repeats
    assert not any(op.target == "aten.scaled_dot_product_attention.default" for op in g.ops)
    assert g.tensors[g.outputs[0]].shape == (2, 1, VOCAB)    # logits of the last position only
    assert [layer["heads"] for layer in g.meta["kv_layers"]] == [2, 2]
    # the graph round-trips as data, like every graph
    assert sb.OpGraph.from_json(g.to_json()).ops == g.ops


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_greedy_tokens_match_hugging_face(family: str) -> None:
    model = decoder(family)
    ids, mask = padded_batch((11, 5))
    want = hf_greedy(model, ids, mask, 10)
    engine = Engine(LocalRunner(model, "64KiB"))
    assert torch.equal(local_greedy(model, ids, mask, 10, engine), want)
    one = ids[:1]
    alone = hf_greedy(model, one, torch.ones_like(one), 10)
    assert torch.equal(local_greedy(model, one, None, 10, engine), alone)
    # every prompt chunk and decode step ran on a few bucketed programs, none per length
    assert set(engine.runner.programs) <= {(1, 16), (2, 1), (1, 1)}
    assert engine.runner.store.nbytes == 0      # sessions freed their caches


def test_long_prompt_is_prefilled_in_chunks() -> None:
    model = decoder("llama")
    ids, mask = padded_batch((75,), seed=3)
    engine = Engine(LocalRunner(model, "64KiB"), max_chunk=64)
    assert torch.equal(local_greedy(model, ids, None, 6, engine), hf_greedy(model, ids, mask, 6))
    assert engine.stats.prefill_steps == 2      # 64 tokens, then 11 in the program of 16
    assert engine.chunking(75) == [(64, 64), (11, 16)]
    assert Engine(engine.runner, max_chunk=16).chunking(40) == [(16, 16), (16, 16), (8, 16)]
    # NOTE: a chunk costs its padding and a step's fixed cost: one chunk of 152 beats 128 + 24
    wide = Engine(engine.runner)
    assert wide.chunking(145) == [(145, 152)] and wide.chunking(17) == [(17, 24)]
    assert wide.chunking(600) == [(256, 256), (256, 256), (88, 96)]


@pytest.mark.parametrize("family", ["mistral", "qwen2-window", "mixtral"])
def test_sliding_window_decoders_generate_as_hugging_face_past_their_window(family: str) -> None:
    """Prompts longer than the window, prefilled in chunks that start past it, and decoding past
    it: a token sees its latest 5 slots on the sliding layers, all of them on the others.
    (Mixtral's experts trace as plain matmuls, not transformers' grouped-matmul kernel.)"""
    from seabiscuit_dask.trace.decoder import attention_windows

    model = decoder(family, seed=1)
    assert attention_windows(model.config) == ([None, 5] if family == "qwen2-window" else [5, 5])
    ids, mask = padded_batch((23, 9), seed=4)
    want = hf_greedy(model, ids, mask, 12)
    engine = Engine(LocalRunner(model, "64KiB"), max_chunk=16)
    assert torch.equal(local_greedy(model, ids, mask, 12, engine), want)
    kv = [op for op in trace_step(model, 1, 1).ops if op.kind == "kv_attention"]
    assert [op.attrs["args"][8] for op in kv] == attention_windows(model.config)


def test_attention_of_a_kind_generation_cannot_serve_is_refused() -> None:
    import transformers as tf

    from seabiscuit_dask.trace.decoder import attention_windows

    cfg = tf.MistralConfig(sliding_window=8)
    cfg.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(sb.UnsupportedModel, match="chunked_attention"):
        attention_windows(cfg, "Llama4")


def attention_variant(family: str, seed: int = 1) -> torch.nn.Module:
    """A seeded 2-layer decoder whose attention SDPA alone does not compute: Gemma 2 soft-caps
    its attention logits (at 4, which its tokens feel), Bloom, MPT and Falcon add ALiBi."""
    import transformers as tf

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "initializer_range": 0.3}
    if family == "gemma2":
        # NOTE: untied embeddings: tied ones make this tiny Gemma repeat one token
        cfg = tf.Gemma2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=128, sliding_window=5, attn_logit_softcapping=4.0,
                              final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                              tie_word_embeddings=False, **common)
        return tf.Gemma2ForCausalLM(cfg).eval()
    if family == "bloom":
        return tf.BloomForCausalLM(tf.BloomConfig(n_layer=2, hidden_size=64, n_head=4, **common)).eval()
    if family == "mpt":
        cfg = tf.MptConfig(n_layers=2, d_model=64, n_heads=4, max_seq_len=128, **common)
        return tf.MptForCausalLM(cfg).eval()
    cfg = tf.FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, alibi=True, **common)
    return tf.FalconForCausalLM(cfg).eval()


@pytest.mark.parametrize("family", ["gemma2", "bloom", "mpt", "falcon-alibi"])
def test_soft_capped_and_alibi_decoders_generate_as_hugging_face(family: str) -> None:
    """A 40-token prompt prefilled in chunks of 16 beside a padded 9-token one, then decoding:
    the soft-cap (and Gemma 2's query_pre_attn_scalar, its window, its final soft-cap) or the
    ALiBi of each key's position (counted over real tokens, padding never cached) as Hugging Face."""
    model = attention_variant(family)
    ids, mask = padded_batch((40, 9), seed=4)
    want = hf_greedy(model, ids, mask, 10)
    engine = Engine(LocalRunner(model, "64KiB"), max_chunk=16)
    assert torch.equal(local_greedy(model, ids, mask, 10, engine), want)
    kv = [op for op in trace_step(model, 1, 1).ops if op.kind == "kv_attention"]
    assert len(kv) == 2
    if family == "gemma2":
        assert [op.attrs["kwargs"] for op in kv] == [{"softcap": 4.0}] * 2
        assert kv[0].attrs["args"][7] == pytest.approx(24 ** -0.5)
        for layer in model.model.layers:       # the cap matters: without it the tokens differ
            layer.self_attn.attn_logit_softcapping = None
        assert not torch.equal(hf_greedy(model, ids, mask, 10), want)
    else:
        assert [list(op.attrs["kwargs"]["alibi"]) for op in kv] == [[2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]] * 2


def test_attention_variants_generation_cannot_serve_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import transformers as tf

    step_attention = importlib.import_module("seabiscuit_dask.trace.step_attention")
    torch.manual_seed(0)
    sinks = tf.GptOssForCausalLM(tf.GptOssConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB)).eval()
    with pytest.raises(sb.UnsupportedModel, match=r"GptOssForCausalLM.*attention sinks"):
        trace_step(sinks, 1, 1)
    falcon = attention_variant("falcon-alibi")
    falcon.config._attn_implementation = "eager"       # NOTE: its eager path adds the bias twice
    with pytest.raises(sb.UnsupportedModel, match="FalconForCausalLM adds ALiBi in its eager attention"):
        trace_step(falcon, 1, 1)
    falcon.config._attn_implementation = "sdpa"
    # an SDPA whose mask carries a bias SeaBiscuit does not know is refused, not dropped
    monkeypatch.delitem(step_attention.ALIBI, "transformers.models.falcon.modeling_falcon.FalconAttention")
    with pytest.raises(sb.UnsupportedModel, match="adds a float mask"):
        trace_step(falcon, 1, 1)


def test_eager_attention_is_served_after_a_check_on_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model on eager attention traces through SDPA once its own eager attention is seen to
    compute what the cache's attention does; one that computes something else is refused."""
    import transformers.models.llama.modeling_llama as llama

    model = decoder("llama")
    model.set_attn_implementation("eager")
    ids, mask = padded_batch((11, 5))
    assert torch.equal(local_greedy(model, ids, mask, 8), hf_greedy(model, ids, mask, 8))
    own = llama.eager_attention_forward
    monkeypatch.setattr(llama, "eager_attention_forward",
                        lambda *a, **k: (lambda out, w: (out * 1.5, w))(*own(*a, **k)))
    with pytest.raises(sb.UnsupportedModel, match="LlamaAttention computes something other than causal"):
        trace_step(model, 3, 7)        # NOTE: a shape not traced yet (a template is not checked again)


def test_sampling_is_reproducible_from_a_seeded_generator() -> None:
    model = decoder("llama")
    ids, _ = padded_batch((7,))
    engine = Engine(LocalRunner(model, "64KiB"))

    def sample(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        args = GenerateArgs.make(model.generation_config, 7, max_new_tokens=12, do_sample=True,
                                 temperature=0.8, top_k=40, top_p=0.9, generator=g)
        return generate_tokens(engine, ids, args)

    a, b, c = sample(5), sample(5), sample(6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = local_greedy(model, ids, None, 12, engine)
    assert not torch.equal(a, greedy)


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 1.0, -2.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(Sampling(True, 1.0, 2, 1.0, g).pick(logits)) for _ in range(200)}
    assert picks == {0, 1}
    picks = {int(Sampling(True, 1.0, 0, 0.5, g).pick(logits)) for _ in range(200)}
    assert picks == {0}                          # the top token alone holds more than half
    with pytest.raises(BadInput, match="top_p"):
        Sampling(True, 1.0, 0, 1.5)
    for t in (0.0, -1.0, float("nan"), float("inf")):     # inf would sample every token alike
        with pytest.raises(BadInput, match="temperature must be a finite number > 0"):
            Sampling(True, t, 0, 1.0)


# --- the KV store -----------------------------------------------------------------------------
def test_kv_store_writes_once_reads_again_and_refuses_a_gap() -> None:
    asked: list[int] = []
    store = KVStore(lambda n, what: asked.append(n))
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    keys, _ = store.write("m", 0, 0, 0, k, k)
    assert keys.shape == (2, 3, 4) and asked == [2 * 16 * 4 * 4 * 2]
    again, _ = store.write("m", 0, 0, 0, k + 100, k)      # a replay: cached slots are read, not written
    assert torch.equal(again, k)
    with pytest.raises(CacheLost, match="holds 3 cached token"):
        store.write("m", 0, 0, 5, k, k)
    assert store.sessions("m") == {0: 3}
    assert store.drop("m", {0}) == asked[0] and store.nbytes == 0


def test_a_renamed_cache_is_cut_back_and_its_old_session_can_no_longer_write() -> None:
    store = KVStore()
    k = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4)
    for layer in (0, 1):
        store.write("m", 0, layer, 0, k, k)
    assert store.rename("m", 0, 7, 3) == 3 and store.sessions("m") == {7: 3}
    with pytest.raises(CacheLost, match="session 0 of model m: layer 1 holds 0"):    # a step still running
        store.write("m", 0, 1, 5, k[:, :1], k[:, :1])
    assert store.sessions("m") == {7: 3}          # and it left nothing behind
    keys, _ = store.write("m", 7, 0, 3, -k[:, :2], k[:, :2])    # the next turn writes past what was kept
    assert torch.equal(keys[:, :3], k[:, :3]) and torch.equal(keys[:, 3:], -k[:, :2])
    assert store.rename("m", 99, 8, 3) == 0 and store.sessions("m") == {7: 5}


def test_a_cache_grows_by_blocks_never_past_its_declared_context_and_doubles_without_one() -> None:
    """A session of a deployment that declared 96 tokens: 64 slots grow a block (32 tokens) to 96,
    not 128 (placement kept room for 96; the 32 more took another session's room, and its growth
    failed); the caller counts the blocks its tokens fill, and so does the cache."""
    asked: list[int] = []
    store = KVStore(lambda n, what: asked.append(n))
    k = torch.zeros(2, 64, 4)
    store.write("m", 0, 0, 0, k, k, 96)
    store.write("m", 0, 0, 64, k[:, :2], k[:, :2], 96)
    per_token = 2 * 4 * 4 * 2
    assert asked == [64 * per_token, 32 * per_token] and store.caches[("m", 0)][0].k.shape[1] == 96
    store.write("m", 1, 0, 0, k[:, :20], k[:, :20], 24)           # a block stops at the context too
    store.write("m", 1, 0, 20, k[:, :4], k[:, :4], 24)
    assert store.caches[("m", 1)][0].k.shape[1] == 24
    store.write("m", 3, 0, 0, k[:, :40], k[:, :40], 1024)         # 40 tokens fill 2 blocks
    assert store.caches[("m", 3)][0].k.shape[1] == 64
    store.write("m", 2, 0, 0, k, k)                                   # no context declared: doubling
    store.write("m", 2, 0, 64, k[:, :2], k[:, :2])
    assert store.caches[("m", 2)][0].k.shape[1] == 128


def test_a_full_worker_refuses_to_grow_a_cache() -> None:
    from seabiscuit_dask.runtime.worker.resident import ResidentBlocks

    r = ResidentBlocks(10_000, address="w9")
    k = torch.zeros(2, 1, 64)
    with pytest.raises(ClusterTooSmall, match="w9 cannot grow the KV cache of session 4"):
        r.kv.write("m", 4, 0, 0, k, k)


class LosingRunner(LocalRunner):
    """Loses every cache at its ``lose_at``-th step (CacheLost, as a step on a moved block finds),
    then fails the first replay too (RunFailed: sent before the plan was repaired around the
    dead worker); ``recover`` notes what it was given."""

    def __init__(self, model: torch.nn.Module, lose_at: int) -> None:
        super().__init__(model, "64KiB")
        self.calls, self.lose_at, self.recovered = 0, lose_at, []

    def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.lose_at:
            self.store.drop("local", set(self.store.sessions("local")))
            raise CacheLost("every cache was lost with a worker")
        if self.calls == self.lose_at + 1:
            raise RunFailed("worker w1 could not be reached")
        return super().run_step(batch, length, feed)

    def recover(self, error: BaseException) -> None:
        self.recovered.append(type(error).__name__)


def test_a_recovery_that_meets_a_dead_worker_recovers_again() -> None:
    model = decoder("llama")
    ids, mask = padded_batch((7,), seed=2)
    runner = LosingRunner(model, lose_at=4)
    got = local_greedy(model, ids, None, 8, Engine(runner))
    assert torch.equal(got, hf_greedy(model, ids, mask, 8))
    assert runner.recovered == ["CacheLost", "RunFailed"]


class ChunkingRunner(LocalRunner):
    """Takes a prompt's chunks all at once (``pipelines_prefill``), runs each when its result is
    read, and fails the ``fail_at``-th chunk so read (RunFailed: a worker could not be reached)."""

    pipelines_prefill = True

    def __init__(self, model: torch.nn.Module, fail_at: int = 0) -> None:
        super().__init__(model, "64KiB")
        self.fail_at, self.read, self.sent, self.discarded, self.recovered = fail_at, 0, [], [], []
        self.log: list[str] = []

    def submit_chunk(self, length: int, feed: dict[str, torch.Tensor], follows: Any = None) -> Any:
        assert follows is None or follows is self.sent[-1]       # each chunk follows the one before
        self.sent.append((length, feed))
        self.log.append(f"sent {len(self.sent)}")
        return self.sent[-1]

    def step_result(self, handle: Any) -> torch.Tensor:
        self.log.append(f"read {next(i for i, h in enumerate(self.sent) if h is handle) + 1}")
        self.read += 1
        if self.read == self.fail_at:
            raise RunFailed("worker w1 could not be reached")
        return self.run_step(1, *handle)

    def discard(self, handle: Any) -> None:
        self.discarded.append(handle)

    def recover(self, error: BaseException) -> None:
        self.recovered.append(type(error).__name__)


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_long_prompts_chunks_are_sent_at_once_and_run_again_one_by_one_if_that_fails(fail_at: int) -> None:
    model = decoder("llama")
    ids, mask = padded_batch((40,), seed=4)
    runner = ChunkingRunner(model, fail_at)
    engine = Engine(runner, max_chunk=16)
    assert torch.equal(local_greedy(model, ids, None, 5, engine), hf_greedy(model, ids, mask, 5))
    assert [length for length, _ in runner.sent] == [16, 16, 16]
    assert [int(f["sb_start"][0]) for _, f in runner.sent] == [0, 8, 24]       # the smallest chunk first
    assert runner.log[:2] == ["sent 1", "sent 2"]           # the second goes before the first is answered
    if fail_at:       # the first chunk ran, the second failed: all three again, one by one
        assert len(runner.discarded) == 3 and runner.recovered == ["RunFailed"]
        assert engine.stats.prefill_ahead == 0 and engine.stats.prefill_steps == 3
    else:
        assert not runner.discarded and engine.stats.prefill_ahead == 2 and engine.stats.prefill_steps == 3


def test_a_replay_after_a_lost_cache_sends_its_chunks_at_once() -> None:
    class Losing(ChunkingRunner):
        """Loses every cache at the third decode step (CacheLost, as a step on a moved block finds)."""

        steps = 0

        def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
            if length == 1:
                self.steps += 1
                if self.steps == 3:
                    self.store.drop("local", set(self.store.sessions("local")))
                    raise CacheLost("every cache was lost with a worker")
            return super().run_step(batch, length, feed)

    model = decoder("llama")
    ids, mask = padded_batch((40,), seed=4)
    runner = Losing(model)
    engine = Engine(runner, max_chunk=16)
    assert torch.equal(local_greedy(model, ids, None, 6, engine), hf_greedy(model, ids, mask, 6))
    assert runner.recovered == ["CacheLost"] and engine.stats.replays == 1
    # the prompt's 3 chunks, then the replay of its 40 tokens and the 2 made before the loss
    assert [int(f["sb_start"][0]) for _, f in runner.sent] == [0, 8, 24, 0, 10, 26]
    assert int(runner.sent[3][1]["sb_valid"].sum()) == 42 - 32
    assert engine.stats.prefill_steps == 3 and engine.stats.prefill_ahead == 4


def test_a_short_prompt_computes_at_most_a_quarter_more_than_its_tokens() -> None:
    """From 32 tokens on a chunk is padded by at most a quarter of the prompt: a 37-token chat prompt
    computes 40, not 48 (its first token 10% sooner on SmolLM2)."""
    sizes = prefill_buckets()
    assert chunking(37, sizes) == [(37, 40)]
    for n in range(32, 257):
        computed = sum(size for _, size in chunking(n, sizes))
        assert computed <= 1.25 * n, (n, chunking(n, sizes))


def test_a_prompt_prefilled_alone_is_cut_for_the_stages_its_chunks_flow_through() -> None:
    sizes = prefill_buckets()
    assert chunking(200, sizes) == [(200, 208)]
    # two stages: one chunk runs on a stage while the one before runs on the next
    assert chunking(200, sizes, 2) == [(112, 112), (88, 96)]
    assert chunking(400, sizes, 2) == [(152, 152), (152, 152), (96, 96)]
    assert chunking(64, sizes, 2) == [(64, 64)]    # a step's fixed cost outweighs the overlap
    model = decoder("llama")
    ids, mask = padded_batch((120,), seed=6)
    runner = ChunkingRunner(model)
    runner.prefill_stages = 2           # type: ignore[attr-defined]
    engine = Engine(runner, max_chunk=112)
    # prompts prefilled together fill the stages already: each is cut as on one stage
    assert engine.chunking(120, alone=False) == [(96, 96), (24, 24)]
    assert torch.equal(local_greedy(model, ids, None, 2, engine), hf_greedy(model, ids, mask, 2))
    assert [(length, int(f["sb_start"][0]), int(f["sb_valid"].sum())) for length, f in runner.sent] == \
        [(56, 0, 56), (64, 56, 64)]           # the smaller chunk first
    assert engine.stats.prefill_ahead == 1


def test_the_engines_threads_end_at_the_interpreters_exit_before_it_finalises(monkeypatch) -> None:
    """An idle engine's thread ends 2 s after its last call; one that ended as the interpreter
    finalised would free its engine's tensors with no GIL to take and abort the process."""
    monkeypatch.setattr(engine_module, "EXITING", threading.Event())
    monkeypatch.setattr(engine_module, "IDLE_EXIT_S", 600.0)
    model = decoder("llama")
    ids, mask = padded_batch((6,), seed=7)
    engines = [Engine(LocalRunner(model, "64KiB")) for _ in range(2)]
    threads = []
    for engine in engines:
        assert torch.equal(local_greedy(model, ids, None, 2, engine), hf_greedy(model, ids, mask, 2))
        threads.append(engine._thread)
    assert all(t is not None and t.is_alive() for t in threads)      # idle, waiting for a next call
    engine_module.end_threads()
    assert not any(t.is_alive() for t in threads) and all(e._thread is None for e in engines)
    engines[0].submit([[3, 4]], 1, Sampling(), [], 0)
    assert engines[0]._thread is None       # and none starts again for a call made now


def test_a_huge_prompt_has_a_bounded_number_of_chunks_in_flight(monkeypatch) -> None:
    monkeypatch.setattr(executor_module, "CHUNKS_IN_FLIGHT", 2)
    model = decoder("llama")
    ids, mask = padded_batch((40,), seed=4)
    runner = ChunkingRunner(model)
    got = local_greedy(model, ids, None, 2, Engine(runner, max_chunk=16))
    assert torch.equal(got, hf_greedy(model, ids, mask, 2))
    assert runner.log[:6] == ["sent 1", "sent 2", "read 1", "sent 3", "read 2", "read 3"]


def test_limits_are_clear_errors() -> None:
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=2, context=32)
    args = GenerateArgs.make(model.generation_config, 4, max_new_tokens=4)
    with pytest.raises(BadInput, match="3 sessions fill 96 KV tokens and the deployment kept room for 64") \
            as never:                                                    # it can never fit
        engine.submit([[5, 6]] * 3, 4, args.sampling, args.eos, args.pad)
    assert not isinstance(never.value, Busy)
    held = [engine.open_session(), engine.open_session()]
    engine.sessions.max_queued = 0                                       # NOTE: no call may wait
    with pytest.raises(Busy, match="max-queued = 0"):                    # it fits once one ends
        engine.submit([[5, 6]], 4, args.sampling, args.eos, args.pad)
    for s in held:
        engine.close_session(s)
    with pytest.raises(BadInput, match="context of 32"):
        engine.submit([[5] * 30], 4, args.sampling, args.eos, args.pad)
    with pytest.raises(BadInput, match="LongTensor"):
        generate_tokens(engine, torch.zeros(2, 3), args)
    with pytest.raises(BadInput, match="no tokens"):
        generate_tokens(engine, torch.ones(1, 3, dtype=torch.long), args, torch.zeros(1, 3))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_step_programs_follow_the_weights_of_the_deployment(family: str) -> None:
    model = decoder(family)
    graph = sb.decompose(sb.trace(model, torch.zeros(1, 16, dtype=torch.long)), "64KiB")
    spec = sb.ClusterSpec.synthetic(None, hosts=1, gpus_per_host=0, cpus_per_host=3, cpu_memory=300_000)
    plan = sb.place(graph, spec)
    owner = {(p.source.key, p.source.slices): int(d) for op, d in zip(graph.ops, plan.device_of)
             for p in (graph.params[n] for n in op.params)}
    # NOTE: 32 rows: the deployment's LM head tiles, cut for 16 tokens, pass the budget with 32 rows
    # of outputs; the step reads each in parts of its rows, the tile whole (before: cut anew)
    for shape in ((1, 1), (4, 1), (1, 16), (32, 1)):
        step = sb.decompose(trace_step(model, *shape), "64KiB", like=graph)
        if shape == (32, 1):
            feed = step_inputs([(r, 0, [r + 3]) for r in range(32)], 32, 1)
            with using(KVStore(), "m"):
                got = sb.run_local(step, *[feed[n] for n in step.inputs], weights=model)
            want = model(torch.arange(3, 35).reshape(32, 1)).logits[:, -1]
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
        placed = follow(plan, step)
        for op, d in zip(step.ops, placed.device_of):
            for n in op.params:
                p = step.params[n]
                tile = (p.source.key, p.source.slices)     # GPT-2's c_attn: cut at 16 tokens, whole at 1
                assert tile in owner, f"{shape}: {op.name} reads {tile}, a tile the deployment does not hold"
                assert owner[tile] == int(d), (shape, op.name)
        assert placed.fused and len(placed.blocks) <= 2 * len(plan.blocks)


# --- on a cluster -----------------------------------------------------------------------------
@pytest.mark.slow
def kv_bytes(dask_worker) -> int:
    return dask_worker.plugins["seabiscuit"].resident.kv.nbytes


def test_generate_on_a_cluster_matches_hugging_face_and_frees_its_caches() -> None:
    model = decoder("llama")
    ids, mask = padded_batch((9, 4), seed=1)
    want = hf_greedy(model, ids, mask, 12)
    with seabiscuit_cluster(2, 320_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB") as dm:
            weights = sum(p.nbytes for p in dm.graph.params.values())
            assert max(d.memory_bytes for d in dm.plan.spec.devices) < weights
            assert torch.equal(dm.generate(ids, 12, attention_mask=mask, pad_token_id=0), want)
            # a prompt longer than the deployment's input: chunks of 16, 16 and 8, all sent at once
            long, _ = padded_batch((40,), seed=5)
            ahead = dm.generation_stats()["prefill_ahead"]
            assert torch.equal(dm.generate(long, 6, pad_token_id=0, eos_token_id=[]),
                               hf_greedy(model, long, torch.ones_like(long), 6))
            assert dm.generation_stats()["prefill_ahead"] - ahead == 2
            streamed = []
            stream = dm.stream(ids[:1], 12, pad_token_id=0)
            streamed.append(next(stream))
            during = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].metrics())
            assert sum(r["kv_cache_bytes"] for r in during.values()) > 0
            assert all(r["resident_bytes"] <= r["budget_bytes"] for r in during.values())
            streamed.extend(stream)
            assert torch.equal(torch.cat([ids[:1], torch.stack(streamed, 1)], 1),
                               hf_greedy(model, ids[:1], mask[:1], 12))
            after = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident.kv.nbytes)
            assert sum(after.values()) == 0
            with dm.session() as chat:                      # a conversation: the cache stays between turns
                one = chat.generate(ids[:1], 4, pad_token_id=0, eos_token_id=[])
                two = chat.generate(ids[1:, 4:], 4, pad_token_id=0, eos_token_id=[])
                whole = torch.cat([one, ids[1:, 4:]], 1)
                assert torch.equal(two[:, -4:], hf_greedy(model, whole, torch.ones_like(whole), 4)[:, -4:])
                before = torch.tensor([chat.tokens])
                stream = chat.stream(ids[:1, 5:], 8, pad_token_id=0, eos_token_id=[])
                heard = [next(stream) for _ in range(2)]
                stream.close()                              # a turn stopped midway, then the next one
                three = chat.generate(ids[1:, 6:], 4, pad_token_id=0, eos_token_id=[])
                whole = torch.cat([before, ids[:1, 5:], torch.stack(heard, 1), ids[1:, 6:]], 1)
                assert chat.tokens == torch.cat([whole, three[:, -4:]], 1)[0].tolist()
                assert torch.equal(three[:, -4:], hf_greedy(model, whole, torch.ones_like(whole), 4)[:, -4:])
                stream = chat.stream(ids[:1], 60, pad_token_id=0, eos_token_id=[])
                next(stream)
            try:                                            # closed while a turn runs: its caches go
                list(stream)
            except SessionClosed:
                pass
            for _ in range(3):                              # sessions dropped unclosed free theirs too
                assert len(list(dm.session().stream(ids[:1], 3, pad_token_id=0, eos_token_id=[]))) == 3
                dropped = dm.session()
                dropped.generate(ids[:1], 2, pad_token_id=0, eos_token_id=[])
                del dropped
                gc.collect()
            for _ in range(3):                              # streams closed before a token was read
                dm.stream(ids[:1], 40, pad_token_id=0, eos_token_id=[]).close()
            with dm.session() as chat:                      # a turn closed unread: the next turn goes on
                chat.stream(ids[:1], 40, pad_token_id=0, eos_token_id=[]).close()
                after_closed = chat.generate(ids[1:], 2, pad_token_id=0, eos_token_id=[])
                assert after_closed.shape == (1, ids.shape[1] + 2)
            wait_for(lambda: dm._engine.open_sessions == 0, "the dropped sessions' slots given back")
            wait_for(lambda: sum(client.run(kv_bytes).values()) == 0, "the dropped sessions' caches freed")
            after = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident.kv.nbytes)
            assert sum(after.values()) == 0
            stats = dm.generation_stats()
            assert stats["decode_steps"] >= 11 and all(p["tasks"] >= 1 for p in stats["programs"].values())


def test_a_step_program_whose_export_failed_is_traced_again_and_a_second_failure_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.export fails for a while when another thread of the process runs a torch module as
    # it traces (it patches module calls process-wide): a new shape's trace is tried twice.
    decoder_module = importlib.import_module("seabiscuit_dask.trace.decoder")
    model = decoder("llama")
    real, failures = decoder_module.trace_step, [0]

    def flaky(m: Any, batch: int, length: int) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise sb.UnsupportedModel("torch.export failed for LlamaForCausalLM with inputs [(1, 16)]: "
                                      "TypeError: expected an instance of Token")
        return real(m, batch, length)

    short, long = padded_batch((6,), seed=2)[0], padded_batch((20,), seed=3)[0]
    monkeypatch.setattr(decoder_module, "trace_step", flaky)
    with seabiscuit_cluster(2, 450_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 32, dtype=torch.long), budget="64KiB") as dm:
            failures[0] = 1                          # the next trace fails once: it is traced again
            assert torch.equal(dm.generate(short, 3, pad_token_id=0, eos_token_id=[]),
                               hf_greedy(model, short, torch.ones_like(short), 3))
            assert failures[0] == 0
            failures[0] = 2                          # twice: the call fails, saying why and what to do
            with pytest.raises(sb.UnsupportedModel, match=r"1 row\(s\) x 24 token\(s\) did not trace, twice.*"
                                                          r"another thread.*dm\.warm\(\)"):
                dm.generate(long, 3, pad_token_id=0, eos_token_id=[])
            assert torch.equal(dm.generate(long, 3, pad_token_id=0, eos_token_id=[]),     # and next time
                               hf_greedy(model, long, torch.ones_like(long), 3))


def test_steps_of_every_shape_run_on_two_programs_built_once() -> None:
    """A decode program and a prefill program serve every row count and chunk length: calls of
    many prompt lengths and batch sizes, one after another and at once, build nothing more, and
    each answer is Hugging Face's greedy one."""
    model = decoder("llama")
    shapes = [(3,), (7, 12), (16, 5, 9), (11,), (2, 14)]
    calls = [padded_batch(lengths, seed=i) for i, lengths in enumerate(shapes)]
    want = [hf_greedy(model, ids, mask, 6) for ids, mask in calls]
    with seabiscuit_cluster(2, 320_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="128KiB",
                           sessions=4, context=32) as dm:
            before = dm.generation_stats()
            for i in (0, 2):            # NOTE: the second's 3 prompts are prefilled in 2 steps (2 + 1 rows)
                ids, mask = calls[i]
                got0 = dm.generate(ids, 6, attention_mask=mask, pad_token_id=0, eos_token_id=[])
                assert torch.equal(got0, want[i])
                if i == 0:
                    before = dm.generation_stats()
            assert dm.generation_stats()["prefill_steps"] - before["prefill_steps"] == 2
            built = dm.generation_stats()["programs"]
            got: dict[int, Any] = {}

            def call(i: int) -> None:
                ids, mask = calls[i]
                got[i] = dm.generate(ids, 6, attention_mask=mask, pad_token_id=0, eos_token_id=[])

            rest = [1, 3, 4]
            threads = [threading.Thread(target=call, args=(i,)) for i in rest]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(torch.equal(got[i], want[i]) for i in rest)
            stats = dm.generation_stats()
    assert set(built) == set(stats["programs"]) == {"decode", "prefill"}
    assert all(stats["programs"][k]["build_s"] == built[k]["build_s"] for k in built)
    assert stats["rows"] > stats["decode_steps"]        # NOTE: rows of several calls shared steps


def test_step_programs_are_made_while_the_weights_load_as_the_engine_would_make_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``distribute`` traces and decomposes the step programs a generation engine asks for first
    while the workers load the weights: each is the graph the engine makes when asked, the engine's
    first steps trace nothing more, and its answers are Hugging Face's."""
    from seabiscuit_dask.runtime.client.programs import ProgramCache

    decoder_module = importlib.import_module("seabiscuit_dask.trace.decoder")
    model = decoder("llama")
    ids, mask = padded_batch((7, 12), seed=3)
    want = hf_greedy(model, ids, mask, 5)
    with seabiscuit_cluster(2, 320_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="128KiB",
                           sessions=4, context=32) as dm:
            programs = dm._programs
            made = dict(programs.made)
            assert {k[1].decode for k in made if k[0] == "general"} == {True, False}
            fresh = ProgramCache(None, dm.graph, dm.model_id, "")
            fresh.source, fresh.budget = programs.source, programs.budget
            for key, graph in made.items():
                again = fresh._generalized(key[1]) if key[0] == "general" else \
                    fresh._decomposed(fresh._trace_step(*key))
                assert again.to_json() == graph.to_json()
            real, traced = decoder_module.trace_step, []

            def tracing(m: Any, batch: int, length: int) -> Any:
                traced.append((batch, length))
                return real(m, batch, length)

            monkeypatch.setattr(decoder_module, "trace_step", tracing)
            shapes = dm.warm()
            assert programs.made == {} and traced == [] and shapes
            got = dm.generate(ids, 5, attention_mask=mask, pad_token_id=0, eos_token_id=[])
            assert torch.equal(got, want) and traced == []


@pytest.mark.slow
def test_concurrent_calls_batch_into_the_same_steps() -> None:
    model = decoder("gpt2")
    prompts = [padded_batch((k,), seed=k)[0] for k in (3, 6, 9, 12)]
    want = [hf_greedy(model, p, torch.ones_like(p), 10) for p in prompts]
    with seabiscuit_cluster(2, 450_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB",
                           sessions=4, context=32) as dm:
            got: dict[int, torch.Tensor | BaseException] = {}
            start = threading.Barrier(len(prompts))

            def call(i: int) -> None:
                start.wait()
                try:
                    got[i] = dm.generate(prompts[i], 10, pad_token_id=0)
                except BaseException as e:  # noqa: BLE001 - the test reports it
                    got[i] = e

            threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            errors = {i: g for i, g in got.items() if isinstance(g, BaseException)}
            assert not errors and len(got) == len(prompts), errors
            assert all(torch.equal(got[i], want[i]) for i in range(len(prompts)))
            stats = dm.generation_stats()
            assert stats["rows"] > stats["decode_steps"]       # some steps served several sessions


@pytest.mark.slow
def test_a_worker_killed_mid_answer_changes_no_token() -> None:
    import os
    import signal

    import dask.config

    model = decoder("llama", seed=2)
    ids, mask = padded_batch((6,), seed=4)
    want = hf_greedy(model, ids, mask, 48)
    with dask.config.set({"seabiscuit.learn.repair": False}), seabiscuit_cluster(3, 400_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB") as dm:
            prog = dm._step_program(1, 1)
            victim = next(s.address for s in prog.specs if any(op.kind == "kv_attention" for op in s.ops))
            pid = client.run(os.getpid, workers=[victim])[victim]
            out = []
            # NOTE: killed at the first token, 47 steps before the workers' loop can end (later, a
            # quick loop could have made every token already, and nothing would be replayed)
            for i, row in enumerate(dm.stream(ids, 48, pad_token_id=0)):
                out.append(row)
                if i == 0:
                    os.kill(pid, signal.SIGKILL)
            assert torch.equal(torch.cat([ids, torch.stack(out, 1)], 1), want)
            assert dm.version > 0 and victim not in {d.address for d in dm.plan.spec.devices}
            assert dm.generation_stats()["replays"] >= 1


def test_a_step_whose_plan_changes_under_every_try_fails_saying_so() -> None:
    """A step is sent again while the plan changes under it, STALE_TRIES times; then the caller
    hears that the cluster replans faster than the step runs, not the last try's refusal."""
    from seabiscuit_dask.errors import STALE_TRIES
    runner = LocalRunner(decoder("llama"), "64KiB")
    tries: list[int] = []

    def replanned(batch: int, length: int, feed: dict) -> torch.Tensor:
        tries.append(batch)
        raise StaleRun(f"request {len(tries)} names plan v{len(tries)}; a worker holds v{len(tries) + 1}")

    runner.run_step = replanned           # type: ignore[method-assign]
    runner.recover = lambda error: None   # type: ignore[method-assign]  # NOTE: as if a newer plan came
    engine = Engine(runner)
    ids, _ = padded_batch((6,), seed=4)
    args = GenerateArgs.make(runner.model.generation_config, 6, max_new_tokens=3, pad_token_id=0,
                             eos_token_id=[])
    with pytest.raises(StaleRun, match=f"sent {STALE_TRIES + 1} times and the plan changed under every "
                                       f"try, the last time: request {STALE_TRIES + 1} names"):
        list(stream_tokens(engine, ids, args))
    assert len(tries) == STALE_TRIES + 1


def test_a_step_whose_cache_the_plan_moves_at_every_replay_fails_saying_so() -> None:
    """A step that finds its session's cache lost is replayed and sent again, a few times; a
    plan that moves the cache again each time ends in the error that the cluster replans faster
    than the step runs, not the last try's "replay the session's tokens"."""
    runner = LocalRunner(decoder("llama"), "64KiB")
    tries: list[int] = []

    def moved(batch: int, length: int, feed: dict) -> torch.Tensor:
        tries.append(length)
        raise CacheLost(f"session 0: the step starts at token {len(tries)} (its cache was lost with a "
                        "worker; replay the session's tokens)")

    runner.run_step = moved               # type: ignore[method-assign]
    runner.recover = lambda error: None   # type: ignore[method-assign]  # NOTE: as if a newer plan came
    ids, _ = padded_batch((6,), seed=4)
    args = GenerateArgs.make(runner.model.generation_config, 6, max_new_tokens=3, pad_token_id=0,
                             eos_token_id=[])
    with pytest.raises(StaleRun, match="generation step was sent 4 times and the plan changed under every "
                                       "try, the last time: session 0"):
        list(stream_tokens(Engine(runner), ids, args))
    assert len(tries) == 4            # NOTE: the step, then three replays, each failing where it starts


def test_a_session_keeps_its_cache_between_turns() -> None:
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"))
    turn1, _ = padded_batch((6,), seed=7)
    turn2, _ = padded_batch((4,), seed=8)
    args = GenerateArgs.make(model.generation_config, 6, max_new_tokens=5, pad_token_id=0, eos_token_id=[])
    s = engine.open_session()
    first = torch.stack(list(stream_tokens(engine, turn1, args, session=s)), 1)
    cached = engine.runner.store.sessions("local")[s.sid]
    second = torch.stack(list(stream_tokens(engine, turn2, args, session=s)), 1)
    whole = torch.cat([turn1, first, turn2], 1)
    want = hf_greedy(model, whole, torch.ones_like(whole), 5)[:, whole.shape[1]:]
    assert torch.equal(second, want)
    assert cached == 6 + 4                       # the answer's last token is cached by the next turn
    assert engine.stats.prefill_steps == 2       # each turn prefilled its own tokens only
    engine.close_session(s)
    assert engine.runner.store.nbytes == 0


def test_a_turn_past_the_context_is_refused_and_leaves_the_session_as_it_was() -> None:
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), context=16)
    turn1, _ = padded_batch((6,), seed=7)
    args = GenerateArgs.make(model.generation_config, 6, max_new_tokens=5, pad_token_id=0, eos_token_id=[])
    s = engine.open_session()
    list(stream_tokens(engine, turn1, args, session=s))
    before = list(s.tokens)
    with pytest.raises(BadInput, match="would hold 22 tokens, more than the context of 16"):
        next(stream_tokens(engine, turn1, args, session=s))
    assert s.tokens == before                    # the refused turn left nothing behind
    short, _ = padded_batch((2,), seed=9)
    args3 = GenerateArgs.make(model.generation_config, 2, max_new_tokens=3, pad_token_id=0, eos_token_id=[])
    third = torch.stack(list(stream_tokens(engine, short, args3, session=s)), 1)
    whole = torch.cat([torch.tensor([before]), short], 1)
    assert torch.equal(third, hf_greedy(model, whole, torch.ones_like(whole), 3)[:, whole.shape[1]:])
    engine.close_session(s)


def test_a_failed_turn_is_undone_whole_so_sending_it_again_continues_the_conversation() -> None:
    from seabiscuit_dask.errors import SeaBiscuitError
    model = decoder("llama")

    class FailingRunner(LocalRunner):
        fail_at, steps = 0, 0

        def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
            self.steps += 1
            if self.steps == self.fail_at:
                raise SeaBiscuitError("a block failed on worker w1: RuntimeError: out of memory")
            return super().run_step(batch, length, feed)

    runner = FailingRunner(model, "64KiB")
    engine = Engine(runner)
    turn1, _ = padded_batch((6,), seed=7)
    turn2, _ = padded_batch((4,), seed=8)
    args = GenerateArgs.make(model.generation_config, 6, max_new_tokens=5, pad_token_id=0, eos_token_id=[])
    s = engine.open_session()
    first = torch.stack(list(stream_tokens(engine, turn1, args, session=s)), 1)
    before = list(s.tokens)
    runner.fail_at = runner.steps + 3            # the next turn's prefill, a decode step, then a failure
    stream = stream_tokens(engine, turn2, args, session=s)
    heard = [next(stream), next(stream)]
    with pytest.raises(SeaBiscuitError, match="out of memory"):
        list(stream)
    assert len(heard) == 2 and s.tokens == before          # neither its prompt nor its tokens stayed
    again = torch.stack(list(stream_tokens(engine, turn2, args, session=s)), 1)
    whole = torch.cat([turn1, first, turn2], 1)
    assert torch.equal(again, hf_greedy(model, whole, torch.ones_like(whole), 5)[:, whole.shape[1]:])
    engine.close_session(s)
    assert runner.store.nbytes == 0


class HeldRunner(LocalRunner):
    """A ``LocalRunner`` whose ``hold``-th step waits for ``go``: the engine has made more tokens
    than its caller read, and is mid-step, when the caller stops reading."""

    def __init__(self, model: torch.nn.Module, hold: int) -> None:
        super().__init__(model, "64KiB")
        self.hold, self.steps, self.starts = hold, 0, []
        self.held, self.go = threading.Event(), threading.Event()

    def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        self.starts.append((length, int(feed["sb_start"][0])))
        if self.steps == self.hold:
            self.held.set()
            assert self.go.wait(60)
        return super().run_step(batch, length, feed)


def test_a_turn_stopped_midway_keeps_what_was_read_and_a_session_closed_midway_frees_its_caches() -> None:
    model = decoder("llama")
    runner = HeldRunner(model, hold=7)           # the prefill, five decode steps, then held
    engine = Engine(runner)
    turn1, _ = padded_batch((6,), seed=7)
    turn2, _ = padded_batch((4,), seed=8)
    args = GenerateArgs.make(model.generation_config, 6, max_new_tokens=12, pad_token_id=0, eos_token_id=[])
    s = engine.open_session()
    stream = stream_tokens(engine, turn1, args, session=s)
    read = [int(next(stream)[0]) for _ in range(2)]
    assert runner.held.wait(60)                  # six tokens made, two read, a seventh being made
    stream.close()
    first_id = s.sid
    runner.go.set()
    args2 = GenerateArgs.make(model.generation_config, 4, max_new_tokens=5, pad_token_id=0, eos_token_id=[])
    second = torch.stack(list(stream_tokens(engine, turn2, args2, session=s)), 1)
    assert s.tokens[:12] == turn1[0].tolist() + read + turn2[0].tolist() and len(s.tokens) == 17
    whole = torch.cat([turn1, torch.tensor([read]), turn2], 1)
    assert torch.equal(second, hf_greedy(model, whole, torch.ones_like(whole), 5)[:, whole.shape[1]:])
    assert first_id not in runner.store.sessions("local")      # renamed: a late step finds nothing
    prefill = next(st for n, st in reversed(runner.starts) if n > 1)
    assert prefill == 6 + 2                      # its cache cut back to what was read, not rebuilt

    runner.hold, runner.go = runner.steps + 3, threading.Event()
    other = engine.open_session()
    reading = stream_tokens(engine, turn1, args, session=other)
    next(reading)                                # a turn being answered, its stream open
    with pytest.raises(Busy, match="still answering its last turn"):
        next(stream_tokens(engine, turn2, args2, session=other))
    runner.go.set()
    reading.close()
    engine.close_session(other)

    runner.hold, runner.go = runner.steps + 3, threading.Event()
    reading = stream_tokens(engine, turn2, args, session=s)
    next(reading)
    assert runner.held.wait(60)
    engine.close_session(s)                      # closed while its turn runs: the turn ends, caches go
    runner.go.set()
    with pytest.raises(SessionClosed, match="was closed after"):
        list(reading)
    assert runner.store.nbytes == 0
    with pytest.raises(SessionClosed, match="is closed"):
        next(stream_tokens(engine, turn2, args, session=s))


def test_calls_past_the_sessions_wait_their_turn_first_come_first_served() -> None:
    """12 calls from 12 threads on 2 sessions' room all finish, each equal to its own greedy
    answer, admitted in the order they came; one that waits past the queue's time is refused with
    ``QueueTimeout`` (503 over HTTP), and one waiting as the deployment closes hears ``ModelClosed``."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=2, context=32)
    args = GenerateArgs.make(model.generation_config, 2, max_new_tokens=3, pad_token_id=0)
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            call = engine.submit([[5, 6 + i]], 3, args.sampling, args.eos, args.pad)
            got[i] = torch.cat(list(engine.results(call)))
        except BaseException as e:  # noqa: BLE001 - asserted on below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(got) == list(range(12))
    for i, tokens in got.items():
        want = hf_greedy(model, torch.tensor([[5, 6 + i]]), None, 3)[0, 2:]
        assert torch.equal(tokens, want), i
    assert engine.sessions.open == 0 and engine.sessions.queued == 0

    held = [engine.open_session(), engine.open_session()]
    engine.queue_timeout_s = 0.0
    with pytest.raises(QueueTimeout, match="waited 0 s"):
        engine.submit([[5, 6]], 3, args.sampling, args.eos, args.pad)
    assert engine.sessions.queued == 0
    engine.queue_timeout_s = 600.0
    waiting = threading.Thread(target=one, args=(99,))
    waiting.start()
    wait_for(lambda: engine.sessions.queued == 1, "the call to wait for room")
    assert engine.sessions.open == 2
    engine.close()
    waiting.join()
    assert isinstance(errors[-1], ModelClosed), errors
    for s in held:
        engine.close_session(s)


def test_a_later_chunk_attends_causally_from_the_bottom_right_with_no_compiler_import() -> None:
    """A prompt's later chunk sees the cache before it and itself causally, as SDPA's
    ``causal_lower_right`` bias has it; the kernel builds that mask itself: importing the bias took
    torch._dynamo's import (2.3 s on each worker's first later chunk, and a deployment's warm-up)."""
    import subprocess
    import sys

    from torch.nn.attention.bias import causal_lower_right

    from seabiscuit_dask.lower.kvcache import _attend

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 5, 8), torch.randn(2, 12, 8), torch.randn(2, 12, 8)
    got = _attend(q, k, v, 7, None)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=causal_lower_right(5, 12),
        enable_gqa=True)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    code = ("import sys, torch\nfrom seabiscuit_dask.lower.kvcache import _attend\n"
            "_attend(torch.randn(4, 5, 8), torch.randn(2, 12, 8), torch.randn(2, 12, 8), 7, None)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False"


def test_warm_builds_the_next_program_while_the_one_before_runs_once() -> None:
    """A deployment's warm-up builds each step program here while the workers run the one before
    once: the first program's run waits for the next one's build to start (it would wait in vain
    were they one after another), and every program still runs once, in order."""
    class Recording(LocalRunner):
        def __init__(self, model: Any) -> None:
            super().__init__(model, "64KiB")
            self.events: list[tuple[Any, ...]] = []
            self.built = threading.Event()

        def prepare(self, batch: int, length: int) -> Any:
            self.events.append(("build", batch, length))
            if sum(e[0] == "build" for e in self.events) == 2:
                self.built.set()
            return self.program(batch, length)

        def run_step(self, batch: int, length: int, feed: Any) -> torch.Tensor:
            first = not any(e[0] == "run" for e in self.events)
            self.events.append(("run", batch, length, self.built.wait(60) if first else True))
            return super().run_step(batch, length, feed)

    runner = Recording(decoder("llama"))
    engine = Engine(runner)
    assert engine.warm(lengths=[16], batches=[1]) == ["1x16", "1x1"]
    assert [e for e in runner.events if e[0] == "run"] == [("run", 1, 16, True), ("run", 1, 1, True)]
    assert runner.events.index(("build", 1, 1)) < runner.events.index(("run", 1, 16, True))
    assert not runner.store.caches       # NOTE: the warm-up's sessions were freed
    engine.close()
