"""Both data planes (``seabiscuit.runtime.data-plane``: ``p2p`` and ``tasks``) give the same
answers: forward passes, greedy, sampled and batched generation, and bfloat16 models."""

from __future__ import annotations

import threading

import dask.config
import pytest
import torch

import seabiscuit_dask as sb

from .clusters import seabiscuit_cluster, wait_for
from .test_generate import decoder, hf_greedy, local_greedy, padded_batch

PLANES = ("p2p", "tasks")


@pytest.fixture(scope="module")
def client():
    with seabiscuit_cluster(3, 900_000) as c:
        yield c


@pytest.fixture(scope="module")
def model():
    return decoder("llama", seed=3)


def deploy(client, model, plane: str, x: torch.Tensor | None = None):
    x = x if x is not None else torch.zeros(1, 16, dtype=torch.long)
    with dask.config.set({"seabiscuit.runtime.data-plane": plane}):
        dm = sb.distribute(model, client, x, budget="64KiB", sessions=16, context=96)
    assert dm.p2p == (plane == "p2p") and len({s.address for s in dm.specs}) >= 2
    return dm


@pytest.mark.parametrize("plane", PLANES)
def test_forward_and_greedy_generation_equal_the_model(client, model, plane: str) -> None:
    ids, mask = padded_batch((5, 9, 3), seed=1)
    x = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(x).logits
    with deploy(client, model, plane) as dm:
        torch.testing.assert_close(dm(x).logits, expected, rtol=1e-4, atol=1e-5)
        got = dm.generate(ids, 12, attention_mask=mask, pad_token_id=0, eos_token_id=[])
        assert torch.equal(got, hf_greedy(model, ids, mask, 12))
        if dm.p2p:      # NOTE: the steps after the first were fed by the workers (a decode loop)
            fed = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].dataplane.counters[
                "loop_steps"])
            assert sum(fed.values()) >= 10
            # NOTE: workers send to each other down one stream per peer, not an RPC per activation
            links = client.run(lambda dask_worker: {a: link.broken is None for a, link in
                                                    dask_worker.plugins["seabiscuit"]._links._links.items()})
            assert any(links.values()) and all(all(v.values()) for v in links.values())
        assert dm.run_counts()["re_executed"] == 0


def test_sampling_logprobs_rules_and_concurrent_calls_give_the_same_tokens_on_both_planes(client, model
                                                                                        ) -> None:
    prompts = [padded_batch((k,), seed=10 + k)[0] for k in (4, 7, 11, 6)]
    answers: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    lanes: dict[str, int] = {}
    for plane in PLANES:
        with deploy(client, model, plane) as dm:
            sampled = dm.generate(prompts[0], 10, do_sample=True, temperature=0.9, top_k=40, top_p=0.95,
                                  generator=torch.Generator().manual_seed(7), pad_token_id=0, eos_token_id=[])
            # NOTE: log-probabilities and logit rules: on p2p picked where the lanes' logits are made
            stream = dm.stream(prompts[1], 8, pad_token_id=0, eos_token_id=[2], logprobs=3,
                               repetition_penalty=1.3, min_new_tokens=4, presence_penalty=0.5)
            shaped, lps = [], []
            for row in stream:
                shaped.append(row)
                lps.append(stream.logprobs[0])
            logprobs[plane] = lps
            lanes[plane] = dm.generation_stats()["lane_starts"]
            out: dict[int, torch.Tensor] = {}

            def call(i: int, dm=dm) -> None:
                out[i] = dm.generate(prompts[i], 8, pad_token_id=0, eos_token_id=[])

            threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            answers[plane] = [sampled, torch.stack(shaped, dim=1), *[out[i] for i in range(len(prompts))]]
    assert lanes["p2p"] >= 2 and lanes["tasks"] == 0
    for a, b in zip(answers["p2p"], answers["tasks"]):
        assert torch.equal(a, b)
    for a, b in zip(logprobs["p2p"], logprobs["tasks"]):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for p, got in zip(prompts, answers["p2p"][2:]):       # and the batched calls are Hugging Face's
        assert torch.equal(got, hf_greedy(model, p, torch.ones_like(p), 8))


def test_a_bfloat16_model_is_served_on_both_planes(client) -> None:
    model = decoder("llama", seed=5).to(torch.bfloat16)
    x = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(6))
    ids = x[:, :9]
    got = {}
    for plane in PLANES:
        with deploy(client, model, plane) as dm:
            assert {dm.graph.tensors[t].dtype for t in dm.graph.leaf_outputs} == {"bfloat16"}
            logits = dm(x).logits
            got[plane] = (logits, dm.generate(ids, 10, pad_token_id=0, eos_token_id=[]))
    with torch.no_grad():
        expected = model(x).logits
    assert got["p2p"][0].dtype == torch.bfloat16
    torch.testing.assert_close(got["p2p"][0].float(), expected.float(), rtol=0.05, atol=0.05)
    assert torch.equal(got["p2p"][0], got["tasks"][0]) and torch.equal(got["p2p"][1], got["tasks"][1])
    # NOTE: the step programs' bf16 arithmetic is not eager torch's (tiles, fused attention), and a
    # bf16 argmax flips on the difference: the answer is the one the same programs give in one process
    assert torch.equal(got["p2p"][1], local_greedy(model, ids, None, 10))


def test_a_call_that_arrives_mid_loop_joins_and_both_answers_stand(client, model) -> None:
    first, second = padded_batch((6,), seed=21)[0], padded_batch((9,), seed=22)[0]
    with deploy(client, model, "p2p") as dm:
        stream = dm.stream(first, 30, pad_token_id=0, eos_token_id=[])
        head = [next(stream) for _ in range(3)]           # NOTE: its decode loop runs ahead now
        joined = dm.generate(second, 12, pad_token_id=0, eos_token_id=[])
        rest = list(stream)
        got = torch.cat([first, torch.stack(head + rest, dim=1)], dim=1)
        assert torch.equal(got, hf_greedy(model, first, torch.ones_like(first), 30))
        assert torch.equal(joined, hf_greedy(model, second, torch.ones_like(second), 12))
        assert dm.generation_stats()["replays"] == 0


def _count_calls(dask_worker) -> bool:
    """Count the calls of the caller's follow of a decode loop (``seabiscuit_dp_follow``), and
    how many are running now."""
    calls = dask_worker._sb_calls = {"follow": 0, "following": 0}
    handler = dask_worker.handlers["seabiscuit_dp_follow"]

    async def counted(comm=None, **kwargs):
        calls["follow"] += 1
        calls["following"] += 1
        try:
            return await handler(comm=comm, **kwargs)
        finally:
            calls["following"] -= 1
    dask_worker.handlers["seabiscuit_dp_follow"] = counted
    return True


def test_a_decode_loops_steps_reach_the_caller_down_one_comm(client, model, monkeypatch) -> None:
    # Each step's tokens come as they are made, with no call per step, and the caller makes no
    # inputs for the steps the workers feed; a caller that lets go mid-loop ends the worker's
    # side too.
    from seabiscuit_dask.runtime.generation import executor

    ids = padded_batch((7,), seed=31)[0]
    with deploy(client, model, "p2p") as dm:
        dm.generate(ids, 2, pad_token_id=0, eos_token_id=[])       # NOTE: built, before counting
        client.run(_count_calls)
        feeds, made, lane_made = [], executor.step_inputs, executor.lane_inputs
        monkeypatch.setattr(executor, "step_inputs", lambda rows, *a: feeds.append(rows) or made(rows, *a))
        monkeypatch.setattr(executor, "lane_inputs", lambda rows, *a: feeds.append(
            [r for r in rows if r is not None]) or lane_made(rows, *a))
        got = dm.generate(ids, 12, pad_token_id=0, eos_token_id=[])
        assert torch.equal(got, hf_greedy(model, ids, torch.ones_like(ids), 12))
        calls = client.run(lambda dask_worker: dict(dask_worker._sb_calls))
        assert sum(c["follow"] for c in calls.values()) == 1
        assert [len(toks) for rows in feeds for _, _, toks in rows] == [7, 1]    # NOTE: prompt, first step
        monkeypatch.undo()
        stream = dm.stream(ids, 40, pad_token_id=0, eos_token_id=[])
        head = [next(stream) for _ in range(3)]
        stream.close()
        wait_for(lambda: not any(client.run(lambda dask_worker: dask_worker._sb_calls["following"]).values()),
                 "the worker's follow of an abandoned decode loop to end")
        assert torch.equal(torch.stack(head, dim=1), got[:, ids.shape[1]:ids.shape[1] + 3])
