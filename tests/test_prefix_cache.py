"""Prefix caching: finished sessions' caches kept while the KV room has space, and new prompts that
begin as one did start from a copy of its slots; greedy answers stay Hugging Face's."""

from __future__ import annotations

import dask.config
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.lower.kvcache import KVStore
from seabiscuit_dask.runtime.generation import Engine, GenerateArgs, LocalRunner, generate_tokens
from seabiscuit_dask.runtime.generation.prefix import PrefixCache

from .clusters import seabiscuit_cluster
from .test_generate import decoder, hf_greedy, padded_batch


@pytest.fixture(autouse=True)
def _prefix_caching():
    with dask.config.set({"seabiscuit.generate.prefix-caching": True}):
        yield


def test_the_longest_shared_prefix_is_matched_never_the_last_token_and_pinned_caches_stay() -> None:
    cache = PrefixCache(min_tokens=4)
    assert not cache.keep(1, [1, 2, 3], 32)                      # NOTE: too short to be worth a copy
    assert cache.keep(1, list(range(10)), 32) and cache.keep(2, list(range(6)) + [99] * 10, 32)
    assert cache.match([*range(8), 5]) == (1, 8)           # NOTE: 8 shared beats 6
    assert cache.match(list(range(5))) == (2, 4)                 # NOTE: the last token is computed again
    assert cache.match([7, 7, 7, 7, 7]) is None
    assert cache.evict() is None                                 # NOTE: both pinned by a fork under way
    cache.unpin(2)
    assert cache.evict() == (2, 32)
    cache.unpin(1)
    assert cache.evict() == (1, 32) and len(cache) == 0
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (3, 2, 12)


def test_a_fork_copies_the_first_slots_of_every_layer_and_counts_them() -> None:
    asked: list[int] = []
    store = KVStore(lambda n, what: asked.append(n))
    k = torch.randn(2, 40, 4)
    for layer in (0, 1):
        store.write("m", 0, layer, 0, k, -k, 1024)
    asked.clear()
    assert store.fork("m", 0, 5, 33) == 33
    keys, values = store.write("m", 5, 1, 33, k[:, 33:35], -k[:, 33:35], 1024)
    assert torch.equal(keys, k[:, :35]) and torch.equal(values, -k[:, :35])
    assert asked == [2 * 2 * 64 * 4 * 4] * 2          # NOTE: 2 blocks of 32 a layer, keys and values
    assert store.fork("m", 9, 6, 10) == 0 and store.sessions("m") == {0: 40, 5: 35}


def test_the_bytes_a_store_holds_are_counted_as_its_caches_come_grow_and_go() -> None:
    """``KVStore.nbytes`` is kept as caches are written, grown, copied, renamed over another, dropped
    and cleared (not summed each time a cache grows): at every point, the sum of what it holds."""
    store = KVStore()

    def summed() -> int:
        return sum(c.nbytes for layers in store.caches.values() for c in layers.values())

    k = torch.randn(2, 70, 4)
    for layer in (0, 1):
        store.write("m", 0, layer, 0, k[:, :20], -k[:, :20], 1024)
    assert store.nbytes == summed() == 2 * 2 * 32 * 2 * 4 * 4
    for layer in (0, 1):
        store.write("m", 0, layer, 20, k[:, 20:70], -k[:, 20:70], 1024)     # NOTE: grows to 96 slots
    assert store.nbytes == summed()
    store.fork("m", 0, 1, 40)
    store.fork("m", 0, 1, 60)            # NOTE: over the copy before
    store.write("n", 5, 0, 0, k, k)
    assert store.nbytes == summed()
    store.rename("m", 1, 0, 10)          # NOTE: session 0's caches go, 1's become 0's
    assert store.nbytes == summed() and store.sessions("m") == {0: 10}
    assert store.drop("n") > 0 and store.nbytes == summed()
    store.clear()
    assert store.nbytes == 0 == summed()


def test_a_prompt_that_begins_as_a_finished_one_prefills_only_the_rest() -> None:
    """Room for one session of 64 tokens: a 20-token prompt's cache is kept (a block of 32), the
    same prompt with 5 more tokens starts from it; a call that needs the whole room lets both
    kept caches go rather than wait."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=1, context=64, max_chunk=16)
    first, _ = padded_batch((20,), seed=4)
    longer = torch.cat([first, padded_batch((5,), seed=5)[0]], dim=1)
    whole, _ = padded_batch((50,), seed=8)

    def check(ids: torch.Tensor, new: int) -> None:
        args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=new, pad_token_id=0)
        assert torch.equal(generate_tokens(engine, ids, args, torch.ones_like(ids)),
                           hf_greedy(model, ids, torch.ones_like(ids), new))

    check(first, 6)
    check(longer, 6)
    assert engine.stats.prefix_hits == 1 and engine.stats.prefix_tokens >= 20
    load = engine.load()
    assert load["prefix_kept"] == 2 and load["prefix_hit_rate"] == 0.5 and engine.sessions.tokens == 64
    check(whole, 10)                # NOTE: 60 tokens: the room of both kept caches, let go at once
    assert engine.load()["prefix_kept"] == 1 and engine.sessions.tokens == 64
    engine.close()


def test_a_conversation_sent_again_with_one_more_turn_reuses_its_cache_on_a_cluster() -> None:
    """As an OpenAI client sends a chat: the whole conversation each time. The second call's prompt
    is the first's, its answer and a new turn: only the new turn is prefilled on the workers."""
    model = decoder("llama")
    question, _ = padded_batch((18,), seed=6)
    with seabiscuit_cluster(2, 320_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="128KiB",
                           sessions=2, context=64) as dm:
            answer = dm.generate(question, 8, pad_token_id=0, eos_token_id=[])
            assert answer.shape[1] == 26
            again = torch.cat([answer, padded_batch((6,), seed=7)[0]], dim=1)
            got = dm.generate(again, 5, pad_token_id=0)
            assert torch.equal(got, hf_greedy(model, again, torch.ones_like(again), 5))
            stats = dm.generation_stats()
    assert stats["prefix_hits"] == 1 and stats["prefix_tokens"] >= 25      # NOTE: the 18 + 8 - 1 cached
    assert stats["prefix_hit_rate"] == 0.5
