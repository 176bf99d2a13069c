"""KV room counted on demand and recompute preemption (vLLM's): a new session counts the blocks
its prompt fills and a headroom, a block more as it decodes; where the room runs out mid-answer,
the newest call running is preempted (its caches freed) and recomputed from its prompt and the
tokens it gave once room frees, before any call that waits, and every answer is unchanged."""

from __future__ import annotations

import threading
from typing import Any

import dask.config
import pytest
import torch

from seabiscuit_dask.errors import Busy, ModelClosed, QueueTimeout
from seabiscuit_dask.runtime.generation import Engine, LocalRunner, SessionTable
from seabiscuit_dask.runtime.generation.hf import GenerateArgs, stream_tokens

from .test_generate import decoder, padded_batch
from .test_lanes import hf_no_eos


def test_a_session_grows_a_block_only_where_the_room_holds_it_and_waiters_yield_to_preempted_calls() -> None:
    table = SessionTable(2, "m", max_queued=4, context=64)
    table.reserve(1, 32)
    assert table.grow(64) and table.tokens == 96
    assert not table.grow(64) and table.tokens == 96         # NOTE: 160 > 128: refused, nothing counted
    table.release(1, 96)
    table.held = 1          # NOTE: a preempted call waits: a new call waits behind it, room or not
    cond = threading.Condition()
    with cond, pytest.raises(QueueTimeout, match="waited 0 s"):
        table.wait(1, cond, 0.0, lambda: False, 32)
    table.held = 0
    with cond:
        table.wait(1, cond, 0.0, lambda: False, 32)
    assert table.open == 1 and table.tokens == 32


def run_together(engine: Engine, model: Any, prompts: list[torch.Tensor], new: int) -> dict[int, Any]:
    """Each prompt's answer of ``new`` tokens (no end-of-text), the calls started together."""
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        ids = prompts[i]
        args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=new, pad_token_id=0,
                                 eos_token_id=[])
        start.wait()
        try:
            rows = list(stream_tokens(engine, ids, args, torch.ones_like(ids)))
            got[i] = torch.cat([ids, torch.stack(rows, dim=1)], dim=1)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return got


@pytest.mark.parametrize("lanes", [False, True], ids=["groups", "lanes"])
def test_calls_that_outgrow_the_room_are_preempted_then_recomputed_as_hugging_face(lanes: bool) -> None:
    """Room for 2 sessions of 64 tokens (128): three calls of 40 new tokens start at once, each
    counting 32 (prompt and headroom); as they decode they need 64 each, more than the room holds,
    so the newest is preempted and recomputed after. Every answer is Hugging Face's greedy one,
    token for token as its caller read it, and the room is whole again at the end."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB", lanes=lanes), max_sessions=2, context=64, max_chunk=32)
    assert engine.on_demand and engine.headroom == 16
    prompts = [padded_batch((n,), seed=20 + i)[0] for i, n in enumerate((10, 12, 14))]
    got = run_together(engine, model, prompts, 40)
    for i, ids in enumerate(prompts):
        assert torch.equal(got[i], hf_no_eos(model, ids, 40)), i
    assert engine.stats.preemptions >= 1 and engine.load()["preemptions"] == engine.stats.preemptions
    table = engine.sessions
    assert table.open == 0 and table.tokens == 0 and table.held == 0 and not engine._preempted
    engine.close()


def test_with_the_room_counted_whole_at_the_start_the_third_call_waits_and_none_is_preempted() -> None:
    """``generate.kv-on-demand: false``: each call counts its prompt and all its new tokens as it
    starts (64 each), so the third waits for room and nothing is preempted; the same answers."""
    model = decoder("llama")
    with dask.config.set({"seabiscuit.generate.kv-on-demand": False}):
        engine = Engine(LocalRunner(model, "64KiB"), max_sessions=2, context=64, max_chunk=32)
    prompts = [padded_batch((n,), seed=20 + i)[0] for i, n in enumerate((10, 12, 14))]
    got = run_together(engine, model, prompts, 40)
    for i, ids in enumerate(prompts):
        assert torch.equal(got[i], hf_no_eos(model, ids, 40)), i
    assert not engine.on_demand and engine.stats.preemptions == 0
    engine.close()


def test_a_call_preempted_as_the_deployment_closes_is_told_so() -> None:
    """Room for one session of 64 tokens: two calls count 32 each; as the first grows to 64 the
    second is preempted, and it waits while the first holds the room. Closing the deployment then
    ends it with ``ModelClosed`` instead of leaving it waiting, and the room is whole again."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=1, context=64, max_chunk=32)
    ids = [padded_batch((10,), seed=s)[0] for s in (3, 4)]
    args = GenerateArgs.make(model.generation_config, 10, max_new_tokens=40, pad_token_id=0, eos_token_id=[])
    first, second = (stream_tokens(engine, i, args, torch.ones_like(i)) for i in ids)
    for _ in range(9):      # NOTE: the first grew at its 7th token, so the room was made then
        next(first)
    assert engine.stats.preemptions == 1 and engine.sessions.held == 1
    engine.close()
    with pytest.raises(ModelClosed, match="waited to be recomputed"):
        list(second)
    with pytest.raises(ModelClosed):
        list(first)
    assert engine.sessions.held == 0 and engine.sessions.tokens == 0 and engine.sessions.open == 0


def test_a_call_that_cannot_be_recomputed_while_kept_sessions_hold_the_room_is_told_why() -> None:
    """Room for 2 x 64 tokens: a 2-row call counts 64, then a kept session (``dm.session()``) takes
    the other 64. The call outgrows the room, is preempted, and can never fit while the session is
    open and nothing else runs: it ends with ``Busy`` naming the numbers instead of waiting, and
    the next call runs. A kept session is not opened while a preempted call waits."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=2, context=64, max_chunk=32)
    ids = padded_batch((10, 10), seed=3)[0]
    args = GenerateArgs.make(model.generation_config, 10, max_new_tokens=50, pad_token_id=0, eos_token_id=[])
    stream = stream_tokens(engine, ids, args, torch.ones_like(ids))
    next(stream)
    kept = engine.open_session()
    with pytest.raises(Busy, match=r"needs 128 KV tokens to go on; 64 of 128 are held by sessions kept open"):
        list(stream)
    assert engine.stats.preemptions == 1 and engine.sessions.held == 0 and not engine._preempted
    short = GenerateArgs.make(model.generation_config, 10, max_new_tokens=3, pad_token_id=0, eos_token_id=[])
    one = ids[:1]
    got = torch.stack(list(stream_tokens(engine, one, short, torch.ones_like(one))), dim=1)
    assert torch.equal(torch.cat([one, got], dim=1), hf_no_eos(model, one, 3))
    engine.close_session(kept)
    engine.sessions.held = 1        # NOTE: as while a preempted call waits
    with pytest.raises(Busy, match="waits to be recomputed"):
        engine.open_session()
    engine.sessions.held = 0
    engine.close()


@pytest.mark.parametrize("lanes", [False, True], ids=["groups", "lanes"])
def test_rows_that_ended_before_their_call_was_preempted_leave_no_kept_cache_behind(lanes: bool) -> None:
    """With prefix caching: a 2-row call one row of which met its end-of-text early is preempted (a
    longer call runs beside it) and recomputed. Its ended row's cache went with the preemption, so
    when the call ends only caches that exist are kept for later prompts; a prompt that begins as
    the other row did answers as Hugging Face."""
    model = decoder("llama")
    ids = padded_batch((20, 20), seed=5)[0]
    other = padded_batch((20,), seed=7)[0]
    first, second = (hf_no_eos(model, ids[i:i + 1], 80)[0, 20:].tolist() for i in (0, 1))
    eos = next(t for t in first[1:6] if t not in second)        # NOTE: row 0 ends early, row 1 never
    with dask.config.set({"seabiscuit.generate.prefix-caching": True}):
        engine = Engine(LocalRunner(model, "64KiB", lanes=lanes), max_sessions=2, context=128, max_chunk=32)
    long = GenerateArgs.make(model.generation_config, 20, max_new_tokens=100, pad_token_id=0, eos_token_id=[])
    two = GenerateArgs.make(model.generation_config, 20, max_new_tokens=80, pad_token_id=0,
                            eos_token_id=[eos])
    beside = stream_tokens(engine, other, long, torch.ones_like(other))
    next(beside)
    answers = stream_tokens(engine, ids, two, torch.ones_like(ids))
    reader = threading.Thread(target=lambda: list(beside))
    reader.start()
    rows = torch.stack(list(answers), dim=1)
    reader.join()
    assert engine.stats.preemptions >= 1
    cut = first.index(eos) + 1
    assert rows[1].tolist() == second and rows[0, :cut].tolist() == first[:cut]
    held = engine.runner.store.sessions("local")
    assert all(held.get(sid, 0) >= len(k.tokens) for sid, k in engine.prefixes.kept.items())
    again = torch.tensor([ids[1].tolist() + second[:3] + [5, 6, 7]])
    args = GenerateArgs.make(model.generation_config, again.shape[1], max_new_tokens=4, pad_token_id=0,
                             eos_token_id=[])
    got = torch.stack(list(stream_tokens(engine, again, args, torch.ones_like(again))), dim=1)
    assert torch.equal(torch.cat([again, got], dim=1), hf_no_eos(model, again, 4))
    engine.close()
