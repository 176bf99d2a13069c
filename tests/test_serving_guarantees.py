"""What serving promises, tried as an adversary would on a cluster of worker processes.

Generation across drains, restores and a SIGKILL with many calls at once; ``close()``
mid-call; a SIGSTOPped (hung, not dead) worker; a second client that forges keys,
pressure reports and session drops; absurd documents and inputs; a client killed
with its weight store on disk.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import dask.config
import pytest
import torch
from distributed import Client, Future
from distributed.protocol import to_serialize

import seabiscuit_dask as sb
from seabiscuit_dask.errors import ModelClosed
from seabiscuit_dask.runtime.client import claim
from seabiscuit_dask.runtime.generation import step_inputs

from .clusters import seabiscuit_cluster, wait_for
from .test_generate import decoder, hf_greedy, kv_bytes, padded_batch

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

BUDGET = 900_000            # per worker: the decoder and 16 sessions of 96 tokens fit on any two of three
TIGHT_BUDGET = 800_000      # the least on which two workers hold the Qwen2 decoder and those sessions
X = torch.zeros(1, 16, dtype=torch.long)
FAST_HANG = {"seabiscuit.runtime.hang-floor": "1s", "seabiscuit.runtime.probe-timeout": "1s",
             "seabiscuit.runtime.sync-timeout": "2s", "seabiscuit.learn.repair": False,
             "seabiscuit.routing.repair": False}


@pytest.fixture(scope="module")
def client():
    with dask.config.set(FAST_HANG), seabiscuit_cluster(3, BUDGET) as c:
        yield c


@pytest.fixture(scope="module")
def model():
    return decoder("llama", seed=2)


@pytest.fixture(autouse=True)
def _fast_hang():
    with dask.config.set(FAST_HANG):
        yield


def plugin(client):
    return client.cluster.scheduler.plugins["seabiscuit"]


def deploy(client, model):
    return sb.distribute(model, client, X, budget="64KiB", sessions=16, context=96)


def pid_of(client, address: str) -> int:
    return client.run(os.getpid, workers=[address])[address]


def kv_worker(dm) -> str:
    prog = dm._step_program(1, 1)
    return next(s.address for s in prog.specs if any(op.kind == "kv_attention" for op in s.ops))


def run_calls(dm, prompts, new: int) -> tuple[dict, dict, list]:
    got: dict = {}
    errors: dict = {}

    def call(i: int) -> None:
        try:
            got[i] = dm.generate(prompts[i], new, pad_token_id=0, eos_token_id=[])
        except BaseException as e:  # noqa: BLE001 - collected and asserted on
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return got, errors, threads


def hf(model, prompt, new):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                              do_sample=False, pad_token_id=0, eos_token_id=None)


# --- generation across plan changes ------------------------------------------------------------
def test_sixteen_calls_survive_drains_restores_and_a_kill(client, model) -> None:
    prompts = [padded_batch((k,), seed=k)[0] for k in range(3, 19)]
    want = [hf(model, p, 24) for p in prompts]
    with deploy(client, model) as dm:
        dm.generate(prompts[0], 2, pad_token_id=0)           # the step programs are built
        before = {k: p["tasks"] for k, p in dm.generation_stats()["programs"].items()}
        got, errors, threads = run_calls(dm, prompts, 24)
        steps = dm.generation_stats()["decode_steps"]
        wait_for(lambda: dm.generation_stats()["decode_steps"] >= steps + 2, "decoding under way")
        for w in [d.address for d in dm.plan.spec.devices][:2]:
            dm.drain(w)
            dm.restore(w)
        steps = dm.generation_stats()["decode_steps"]
        wait_for(lambda: dm.generation_stats()["decode_steps"] >= steps + 2, "decoding after the repairs")
        os.kill(pid_of(client, kv_worker(dm)), signal.SIGKILL)
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(torch.equal(got[i], want[i]) for i in range(len(prompts)))
        assert dm.version >= 3                      # two drains and a kill, at least
        after = {k: p["tasks"] for k, p in dm.generation_stats()["programs"].items()}
        # NOTE: a step program follows the model's plan: it is not cut op by op after repairs (hundreds of
        # tasks). Its blocks are its own ops' runs per device under the repaired plan, which a repair that
        # moved ops one by one (``handover.rather``: when it simulates no slower) may split once more than
        # the model's own graph (seen: 4 against the plan's 3), so within twice the cut before or the plan's
        cut = len(dm.plan.block_device)
        assert all(after[k] <= 2 * max(before[k], cut) for k in before), (before, after, cut)
    # NOTE: the next test deploys on every worker: the killed one restarts and reports first
    wait_for(lambda: len(plugin(client).state.devices) == 3, "the killed worker back")


@pytest.mark.parametrize("prompt_tokens, new_tokens", [(66, 30), (70, 26)])
def test_sessions_times_context_as_declared_always_fit(prompt_tokens: int, new_tokens: int) -> None:
    """16 sessions of 96 tokens, as the deployment declared, on the least room that holds them: every
    one of 16 calls at once answers as Hugging Face does. A cache grew to twice its size, past the
    context (a session of 66 tokens asked for 128 slots), and calls failed with ClusterTooSmall."""
    model = decoder("qwen2", seed=2)
    prompts = [padded_batch((prompt_tokens,), seed=k)[0] for k in range(16)]
    want = [hf(model, p, new_tokens) for p in prompts]
    with seabiscuit_cluster(2, TIGHT_BUDGET) as two, deploy(two, model) as dm:
        dm.generate(prompts[0][:, :4], 2, pad_token_id=0)           # the step programs are built
        got, errors, threads = run_calls(dm, prompts, new_tokens)
        for t in threads:
            t.join()
    assert not errors, errors
    assert all(torch.equal(got[i], want[i]) for i in range(16))


@pytest.mark.parametrize("fraction", [0.3, 0.1])
def test_a_budget_cut_under_load_loses_no_call(client, model, fraction: float) -> None:
    """16 calls decode while the KV worker's budget for the model is cut to a fraction of what it
    holds: the model moves, every call answers as Hugging Face does. (At 10%, 8 of 16 calls failed
    with ClusterTooSmall: the caches rebuilt elsewhere grew past the room kept for them.)"""
    prompts = [padded_batch((k % 20 + 30,), seed=k)[0] for k in range(16)]      # NOTE: each past 64 tokens
    want = [hf(model, p, 40) for p in prompts]
    with deploy(client, model) as dm:
        dm.generate(prompts[0][:, :4], 2, pad_token_id=0)
        victim = kv_worker(dm)
        held = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident.resident_bytes,
                          workers=[victim])[victim]
        got, errors, threads = run_calls(dm, prompts, 40)
        steps = dm.generation_stats()["decode_steps"]
        wait_for(lambda: dm.generation_stats()["decode_steps"] >= steps + 3, "decoding under way")
        dm.set_budget(victim, int(held * fraction))
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(torch.equal(got[i], want[i]) for i in range(16))
        assert kv_worker(dm) != victim


def test_two_models_on_one_cluster_lose_no_call_through_a_kill(client, model) -> None:
    """Two models share the workers, 8 calls each decode, and the worker holding the first one's
    caches is killed: every call of both answers as Hugging Face does."""
    other = decoder("qwen2", seed=3)
    prompts = [padded_batch((k % 12 + 6,), seed=k)[0] for k in range(8)]
    want = {name: [hf(m, p, 32) for p in prompts] for name, m in (("a", model), ("b", other))}
    with sb.distribute(model, client, X, budget="64KiB", sessions=8, context=48) as a, \
            sb.distribute(other, client, X, budget="64KiB", sessions=8, context=48) as b:
        for dm in (a, b):
            dm.generate(prompts[0][:, :4], 2, pad_token_id=0)
        runs = {name: run_calls(dm, prompts, 32) for name, dm in (("a", a), ("b", b))}
        steps = a.generation_stats()["decode_steps"]
        wait_for(lambda: a.generation_stats()["decode_steps"] >= steps + 3, "decoding under way")
        os.kill(pid_of(client, kv_worker(a)), signal.SIGKILL)
        for _, _, threads in runs.values():
            for t in threads:
                t.join()
        for name, (got, errors, _) in runs.items():
            assert not errors, (name, errors)
            assert all(torch.equal(got[i], want[name][i]) for i in range(8)), name
    wait_for(lambda: len(plugin(client).state.devices) == 3, "the killed worker back")


def test_close_ends_calls_in_flight_with_a_typed_error(client, model) -> None:
    prompts = [padded_batch((k,), seed=k)[0] for k in (4, 5, 6)]
    dm = deploy(client, model)
    got, errors, threads = run_calls(dm, prompts, 64)
    streamed: list = []
    stream_error: list = []

    def stream() -> None:
        try:
            streamed.extend(dm.stream(prompts[0], 64, pad_token_id=0, eos_token_id=[]))
        except BaseException as e:  # noqa: BLE001 - asserted on
            stream_error.append(e)

    forward_error: list = []

    def forward() -> None:
        try:
            while True:
                dm(X)
        except BaseException as e:  # noqa: BLE001 - asserted on
            forward_error.append(e)

    reader, caller = threading.Thread(target=stream), threading.Thread(target=forward)
    reader.start()
    caller.start()
    wait_for(lambda: dm.generation_stats().get("decode_steps", 0) >= 3, "decoding under way")
    dm.close()
    for t in [*threads, reader, caller]:
        t.join()
    assert len(forward_error) == 1 and isinstance(forward_error[0], ModelClosed)
    assert not got                                        # no call returned a short answer
    assert len(errors) == 3 and all(isinstance(e, ModelClosed) for e in errors.values())
    assert all(dm.model_id in str(e) for e in errors.values())
    assert len(stream_error) == 1 and isinstance(stream_error[0], ModelClosed) and len(streamed) < 64
    with pytest.raises(ModelClosed):
        dm(X)


# --- a hung worker --------------------------------------------------------------------------------
def test_a_stopped_worker_is_fenced_and_no_answer_changes(client, model) -> None:
    prompt = padded_batch((6,), seed=4)[0]
    want = hf(model, prompt, 64)
    with torch.no_grad():
        expected = model(X).logits
    with deploy(client, model) as dm:
        for _ in range(3):                            # the usual time of a request
            torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)
        victim = dm.specs[-1].address            # it runs the last block of every request
        pid = pid_of(client, victim)
        os.kill(pid, signal.SIGSTOP)
        try:
            torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)   # while it is stopped
            assert victim in plugin(client).state.fencing
            assert victim not in {d.address for d in dm.plan.spec.devices}
            assert dm.drain(victim)["fenced"]                # returns at once: nothing runs there now
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: victim not in plugin(client).state.fencing, "the fenced worker taken back")
        wait_for(lambda: victim in plugin(client).state.devices, "the worker placed on again")

        out = []
        victim = kv_worker(dm)
        pid = pid_of(client, victim)
        try:
            # NOTE: stopped at the first token, 63 steps before the workers' loop can end: were it
            # stopped later, a quick loop could have made every token already and nothing would hang
            for i, row in enumerate(dm.stream(prompt, 64, pad_token_id=0, eos_token_id=[])):
                out.append(row)
                if i == 0:
                    os.kill(pid, signal.SIGSTOP)
            assert torch.equal(torch.cat([prompt, torch.stack(out, 1)], 1), want)
            assert victim in plugin(client).state.fencing
        finally:
            os.kill(pid, signal.SIGCONT)
        assert dm.generation_stats()["replays"] >= 1
        wait_for(lambda: victim not in plugin(client).state.fencing, "the fenced worker taken back")


def test_a_model_stranded_by_a_hung_worker_serves_again_once_it_answers(model) -> None:
    """Two workers, a model that needs both: one stops answering mid-answer, is fenced, and the model
    is stranded (calls fail at once, naming why). Once it answers again the model serves again,
    and the worker drops the caches of the sessions that ended while it was fenced. (It stayed
    stranded for good: the newcomer's links on a host of one device came out as a bandwidth of 0.)"""
    from seabiscuit_dask.serve.app import Server, make_app
    from seabiscuit_dask.serve.models import ServedModel
    from seabiscuit_dask.serve.server import running

    prompt = padded_batch((6,), seed=4)[0]
    with torch.no_grad():
        expected = model(X).logits
    with dask.config.set(FAST_HANG), seabiscuit_cluster(2, BUDGET) as two, deploy(two, model) as dm:
        assert len({s.address for s in dm.specs}) == 2
        served = ServedModel("tiny", dm, None, "generate", 96)
        served.ready.set()
        with running(make_app(Server([served]))) as url:
            assert health(url) == (200, "ok")
            victim = kv_worker(dm)
            pid = pid_of(two, victim)
            stream = dm.stream(prompt, 64, pad_token_id=0, eos_token_id=[])
            next(stream)
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(sb.WorkerLost, match="cannot hold model"):
                    list(stream)                         # its session ends while the worker is fenced
                assert victim in plugin(two).state.fencing and plugin(two).state.models[dm.model_id].stranded
                with pytest.raises(sb.WorkerLost, match="cannot hold model"):
                    dm(X)
                status, body = health(url)
                assert status == 503 and "cannot hold model" in body["unavailable"]["tiny"]
            finally:
                os.kill(pid, signal.SIGCONT)
            state = plugin(two).state
            wait_for(lambda: victim not in state.fencing and not state.models[dm.model_id].stranded,
                     "the model holding again")
            assert health(url) == (200, "ok")
            torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)
            wait_for(lambda: two.run(kv_bytes, workers=[victim])[victim] == 0,
                     "the ended session's cache freed")
            assert torch.equal(dm.generate(prompt, 8, pad_token_id=0, eos_token_id=[]), hf(model, prompt, 8))
            dm.close()
            status, body = health(url)
            assert status == 503 and "is closed" in body["unavailable"]["tiny"]


def health(url: str) -> tuple[int, Any]:
    """GET /health: (status, its JSON's status field, or the whole JSON where the status is not 200)."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + "/health", timeout=60) as r:
            return r.status, json.loads(r.read())["status"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_long_prompt_sent_to_a_hung_worker_is_prefilled_again_and_no_token_changes(client, model) -> None:
    prompt = padded_batch((40,), seed=6)[0]              # chunks of 16, 16 and 8, sent at once
    want = hf(model, prompt, 4)
    with deploy(client, model) as dm:
        dm.generate(prompt[:, :12], 2, pad_token_id=0, eos_token_id=[])     # the usual time of a chunk
        victim = kv_worker(dm)
        pid = pid_of(client, victim)
        os.kill(pid, signal.SIGSTOP)
        try:
            assert torch.equal(dm.generate(prompt, 4, pad_token_id=0, eos_token_id=[]), want)
            assert victim in plugin(client).state.fencing
        finally:
            os.kill(pid, signal.SIGCONT)
        assert dm.generation_stats()["prefill_ahead"] == 0     # the chunks sent at once failed: one by one
        wait_for(lambda: victim not in plugin(client).state.fencing, "the fenced worker taken back")
        wait_for(lambda: dm.prefill_stages > 1, "the client's plan spanning two workers again")
        assert torch.equal(dm.generate(prompt, 4, pad_token_id=0, eos_token_id=[]), want)
        assert dm.generation_stats()["prefill_ahead"] == 2


def test_a_drained_worker_is_restored_while_the_clients_view_lists_no_workers(client, model,
                                                                            monkeypatch) -> None:
    """The client's shared copy of the scheduler's identity may list no workers for a moment (its
    periodic update carries totals only): a drained worker, no longer in the plan, is found anyway."""
    with deploy(client, model) as dm:
        victim = dm.specs[-1].address
        dm.drain(victim)
        monkeypatch.setattr(client, "scheduler_info", lambda *a, **k: {"workers": {}})
        dm.restore(victim)
        assert victim not in plugin(client).state.drained


def test_draining_a_hung_worker_returns_without_it(client, model) -> None:
    with torch.no_grad():
        expected = model(X).logits
    with deploy(client, model) as dm:
        victim = dm.plan.spec.devices[0].address
        pid = pid_of(client, victim)
        os.kill(pid, signal.SIGSTOP)
        try:
            reply = dm.drain(victim)            # its sync runs in the background, bounded
            assert reply["versions"][dm.model_id] == dm.version
            torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)
        finally:
            os.kill(pid, signal.SIGCONT)


# --- another client -------------------------------------------------------------------------------
def _zeros(*args):
    return {}


def _first(outputs):
    return next(iter(outputs.values()))


def test_another_client_cannot_reach_the_model(client, model) -> None:
    from seabiscuit_dask.runtime.worker.tasks import run_block_task

    prompt = padded_batch((6,), seed=9)[0]
    with torch.no_grad():
        expected = model(X).logits
    # NOTE: the task data plane, whose block outputs are Dask futures another client could name
    with dask.config.set({"seabiscuit.runtime.data-plane": "tasks"}), deploy(client, model) as dm, \
            Client(client.scheduler.address) as other:
        mine = dm.model_id
        first = dm.plan.spec.devices[0].address
        # forged keys of the model's next requests, with empty block outputs
        forged = {(f"sb-{mine}", dm.version, n << 32 | r, b): (_zeros,) for n in range(4) for r in range(4)
                  for b in range(len(dm.specs))}
        futures = other.get(forged, list(forged), sync=False)
        for f in futures:
            with pytest.raises(Exception, match="AccessDenied|another client deployed|cancel"):
                f.result()
        torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)
        # a block output the owner holds: neither a Future of its key nor a task reading it
        held = dm.submit_step(1, 16, lambda: step_inputs([(99, 0, list(range(3, 19)))], 1, 16))
        held.futures[0].result()                   # in memory, held by the owner
        key = held.futures[0].key
        stolen = Future(key, client=other)
        with pytest.raises(Exception, match="AccessDenied|another client deployed|cancel"):
            other.submit(_first, stolen).result()
        with pytest.raises(Exception, match="AccessDenied|another client deployed|cancel"):
            stolen.result()
        assert held.futures[0].status == "finished"   # the owner's future is untouched
        dm.discard(held)
        dm.end_sessions([99])
        # its blocks under a key of the other client's own
        with pytest.raises(sb.AccessDenied, match="runs only as its own task"):
            other.submit(run_block_task, mine, dm.version, 0, 0, {}, key="not-a-block").result()
        version = dm.version
        for call, kwargs in (("pressure", {"address": first, "reason": "fake"}),
                             ("pressure", {"address": first, "reason": "fake", "secret": "x" * 64}),
                             ("end_sessions", {"model": mine, "sessions": [0, 1]}),
                             ("block", {"model": mine, "version": 0, "block": 0, "address": first}),
                             ("owned", {"model": mine, "address": first}),
                             ("plan", {"model": mine}), ("runs", {"model": mine}),
                             ("learned", {"model": mine})):
            with pytest.raises(sb.AccessDenied):
                other.sync(getattr(other.scheduler, f"seabiscuit_{call}"), **kwargs)
        assert plugin(client).state.models[mine].version == version      # no drain, no change
        with dm.session() as chat:                    # a foreign session drop leaves the cache alone
            one = chat.generate(prompt, 4, pad_token_id=0, eos_token_id=[])
            for w in [d.address for d in dm.plan.spec.devices]:
                with pytest.raises(sb.AccessDenied, match="secret"):
                    other.sync(other.rpc(w).seabiscuit_drop_sessions, model=mine, sessions=[0, 1, 2])
            more = padded_batch((3,), seed=10)[0]
            two = chat.generate(more, 4, pad_token_id=0, eos_token_id=[])
            whole = torch.cat([one, more], 1)
            assert torch.equal(two[:, -4:], hf_greedy(model, whole, torch.ones_like(whole), 4)[:, -4:])
        # a deploy in someone else's name: no claim came on the caller's stream
        with pytest.raises(sb.AccessDenied, match="claim"):
            other.sync(other.scheduler.seabiscuit_deploy, graph=dm.graph.to_json(),
                       plan=dm.plan.to_json(stats=False), claim="f" * 32)
        theirs = sb.distribute(torch.nn.Linear(8, 8), other, torch.zeros(2, 8), budget="64KiB")
        assert plugin(client).state.models[theirs.model_id].owner == other.id
    wait_for(lambda: theirs.model_id not in plugin(client).state.models, "the other client's model released")


def test_a_model_dropped_unclosed_is_released(model) -> None:
    """A notebook cell that deploys again: the model it dropped without ``close()`` frees what it
    held, so the cluster, with room for two, takes a third, fourth and fifth."""
    import gc

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with seabiscuit_cluster(2, 2 * weights) as small:
        ids = []
        for _ in range(5):
            dm = sb.distribute(model, small, X, budget="64KiB")
            assert dm(X).logits.shape[-1] == model.config.vocab_size
            ids.append(dm.model_id)
            del dm
            gc.collect()
        wait_for(lambda: set(ids[:-1]).isdisjoint(plugin(small).state.models), "the dropped models released")
        talks = sb.distribute(model, small, X, budget="64KiB", sessions=1, context=32)
        talks.generate(X, 2, pad_token_id=0)
        gone = talks.model_id
        del talks
        gc.collect()                             # NOTE: its engine's thread lets go of it once idle
        wait_for(lambda: gc.collect() >= 0 and gone not in plugin(small).state.models,
                 "a dropped model that generated released")


def test_a_distribute_whose_room_another_model_took_meanwhile_places_again(model, monkeypatch) -> None:
    """Two clients measured an empty cluster with room for one model, then deployed: the second
    plan is refused on the scheduler (``RoomTaken``), and ``distribute`` measures and places once
    more, which finds no room: a plain ``ClusterTooSmall``, nothing overcommitted."""
    import seabiscuit_dask.runtime.client.deployment as rc

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with seabiscuit_cluster(2, int(0.8 * weights)) as small:
        stale = sb.measure_cluster(small)
        with sb.distribute(model, small, X, budget="64KiB") as first:
            measured = iter([stale])
            real = rc.measure_cluster
            monkeypatch.setattr(rc, "measure_cluster", lambda client, device=None: next(measured, None)
                                or real(client, device=device))
            said: list[str] = []
            with pytest.raises(sb.ClusterTooSmall) as refused:
                sb.distribute(model, small, X, budget="64KiB", progress=said.append)
            assert not isinstance(refused.value, sb.RoomTaken)
            assert any("another model was deployed there since the plan was made" in line and "placing again"
                       in line for line in said)
            assert list(plugin(small).state.models) == [first.model_id]
            torch.testing.assert_close(first(X).logits, model(X).logits, rtol=1e-4, atol=1e-5)


def test_another_client_cannot_use_the_data_plane(client, model) -> None:
    import concurrent.futures

    from seabiscuit_dask.runtime.dataplane import Tensors
    from seabiscuit_dask.runtime.dataplane.client import _follow

    with torch.no_grad():
        expected = model(X).logits
    with deploy(client, model) as dm, Client(client.scheduler.address) as other:
        assert dm.p2p
        torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)
        first = dm.specs[0]
        rpc = other.rpc(first.address)
        request = 1 << 40
        forged = {"model": dm.model_id, "version": dm.version, "request": request}
        zeros = to_serialize(Tensors({t: torch.zeros(1) for t in first.imports}))
        for ticket in ("", "0" * 64, dm._token):       # NOTE: nor the control token: a ticket is its own
            with pytest.raises(sb.AccessDenied, match="ticket"):
                other.sync(rpc.seabiscuit_dp_feed, **forged, ticket=ticket, inputs=[[first.index, zeros]],
                           collect=[first.index])
            with pytest.raises(sb.AccessDenied, match="ticket"):
                other.sync(rpc.seabiscuit_dp_push, **forged, ticket=ticket, block=first.index,
                           tensors=to_serialize(Tensors({})))
            with pytest.raises(sb.AccessDenied, match="ticket"):
                other.sync(rpc.seabiscuit_dp_forget, model=dm.model_id, ticket=ticket, requests=[request])
        # NOTE: nor follow a decode loop's steps; a follow naming what is not a step is refused (the
        # caller hears of it: nothing else would answer)
        follow = {"model": dm.model_id, "ticket": "0" * 64, "version": dm.version, "requests": [request],
                  "blocks": [first.index], "tokens": ""}
        with pytest.raises(sb.AccessDenied, match="not a model id"):
            other.sync(_follow, other, first.address, {**follow, "model": "../etc", "ticket": ""},
                       [concurrent.futures.Future()])
        with pytest.raises(sb.AccessDenied, match="ticket"):
            other.sync(_follow, other, first.address, follow, [concurrent.futures.Future()])
        with pytest.raises(sb.BadInput, match="names requests"):
            other.sync(_follow, other, first.address, {**follow, "requests": ["x"]},
                       [concurrent.futures.Future()])
        with pytest.raises(sb.BadInput, match="at most"):
            other.sync(_follow, other, first.address, {**follow, "requests": list(range(1 << 17))},
                       [concurrent.futures.Future()])
        torch.testing.assert_close(dm(X).logits, expected, rtol=1e-4, atol=1e-5)
        assert dm.run_counts()["re_executed"] == 0


# --- documents and inputs -----------------------------------------------------------------------
def test_absurd_inputs_and_plans_are_refused_before_any_work(client, model, caplog) -> None:
    from dataclasses import replace

    with deploy(client, model) as dm:
        with pytest.raises(sb.BadInput, match="128 positions"):
            dm(torch.zeros(1, 10**6, dtype=torch.long))
        with pytest.raises(sb.BadInput, match="max-input-elements"):
            dm(torch.zeros(5000, 5000, dtype=torch.long))
        with pytest.raises(sb.BadInput, match="id 999999"):
            dm.generate(torch.tensor([[5, 999999, 7]]), 4)
        with pytest.raises(sb.BadInput, match="id -3"):
            dm(torch.full((1, 16), -3, dtype=torch.long))
        assert dm.generation_stats()["programs"] == {}     # nothing was traced for them
        with pytest.raises(sb.BadInput, match="sessions"):
            sb.distribute(model, client, X, sessions="abc")
        d = dm.graph.to_dict()
        name = next(iter(d["params"]))
        d["params"][name]["shape"] = [-1024, 512]          # would count as -512 KiB planned on a worker
        with pytest.raises(sb.SeaBiscuitError, match=name.replace(".", r"\.")):
            client.sync(client.scheduler.seabiscuit_deploy, graph=json.dumps(d),
                        plan=dm.plan.to_json(stats=False), claim=claim(client))
        assert len(plugin(client).state.models) == 1
        # a plan that gives a worker more than its measured budget
        spec = dm.plan.spec
        big = replace(spec.devices[0], memory_bytes=spec.devices[0].memory_bytes * 10**6)
        bad = sb.Plan(dm.plan.graph, spec.with_changes(big.name, memory_bytes=big.memory_bytes),
                      dm.plan.device_of, dm.plan.method, 0.0, {})
        caplog.clear()
        with caplog.at_level(logging.INFO):
            with pytest.raises(sb.ClusterTooSmall, match="measured budget"):
                sb.deploy(bad, client, weights=model)
            with pytest.raises(sb.ClusterTooSmall):  # some worker cannot take the rest: a refusal
                for w in [d.address for d in dm.plan.spec.devices]:
                    dm.set_budget(w, 1)
        assert not [r for r in caplog.records if r.exc_info or "Exception while handling" in r.getMessage()]
        assert any("refused" in r.getMessage() for r in caplog.records)
        torch.testing.assert_close(dm(X).logits, model(X).logits, rtol=1e-4, atol=1e-5)


# --- nothing left behind --------------------------------------------------------------------------
CLIENT = """
import sys, torch, seabiscuit_dask as sb
from distributed import Client, Future
c = Client(sys.argv[1])
dm = sb.distribute(torch.nn.Linear(64, 64), c, torch.zeros(2, 64), budget="64KiB")
print(dm.graph.params[next(iter(dm.graph.params))].source.file, flush=True)
sys.stdin.read()
"""


def test_a_killed_client_leaves_no_weight_store(client) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, client.scheduler.address], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        store = Path(proc.stdout.readline().strip()).parent
        assert store.name.startswith("seabiscuit-store-") and store.exists()
        models = set(plugin(client).state.models)
        assert models
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not store.exists(), "the dead client's store removed")
    wait_for(lambda: not set(plugin(client).state.models) & models, "the dead client's model released")


def test_a_store_whose_writer_is_gone_is_removed_by_the_next(tmp_path) -> None:
    import json
    import socket

    from seabiscuit_dask.runtime.worker.store import OWNER, remove_orphans

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    with dask.config.set({"seabiscuit.runtime.store-directory": str(tmp_path)}):
        for name, pid in (("seabiscuit-store-dead", int(gone.stdout)),
                          ("seabiscuit-store-live", os.getpid())):
            (tmp_path / name).mkdir()
            (tmp_path / name / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
        assert [p.name for p in remove_orphans()] == ["seabiscuit-store-dead"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["seabiscuit-store-live"]
