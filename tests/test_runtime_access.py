"""What a peer of the cluster may ask: ids, tokens, paths and ops are checked; models share workers.

In-process clusters only: ``distributed.utils_test.gen_cluster`` for the RPCs, and a
LocalCluster without processes where a test serves a model and holds a load open.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from distributed.utils_test import gen_cluster

import seabiscuit_dask as sb
from seabiscuit_dask.ir import OpGraph
from seabiscuit_dask.runtime.client import claim

from . import models as M
from .clusters import seabiscuit_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

BUDGET = 4_000_000


@pytest.fixture(scope="module")
def client():
    with seabiscuit_cluster(3, BUDGET, processes=False) as c:
        yield c


@pytest.fixture(scope="module")
def llama():
    model, x = M.llama(), M.ids()
    with torch.no_grad():
        return model, x, model(x).logits


@pytest.fixture(scope="module")
def gpt2_graph():
    return sb.decompose(sb.trace(M.gpt2(), M.ids()), "256KiB")


def plan_on(graph: OpGraph, *workers) -> sb.Plan:
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=len(workers), cpu_memory="64MiB")
    return sb.place(graph, sb.ClusterSpec(tuple(replace(d, address=w.address)
                                                for d, w in zip(spec.devices, workers)), spec.links))


async def deploy_rpc(c, **kwargs):
    """The deploy RPC as ``sb.deploy`` makes it: after a claim down the client's own stream."""
    return await c.scheduler.seabiscuit_deploy(claim=claim(c), **kwargs)


def _with_linear(graph: OpGraph, **changes) -> str:
    d = graph.to_dict()
    next(op for op in d["ops"] if op["kind"] == "linear").update(changes)
    return OpGraph.from_dict(d).to_json()


def test_ids_tokens_budgets_and_payloads_from_a_peer_are_checked(gpt2_graph) -> None:
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
    async def check(c, s, a, b) -> None:
        await c.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        plan = plan_on(gpt2_graph, a, b).to_json(stats=False)
        for bad in ("../../etc", "0123456789ABCDEF", "", "0123456789abcdef/.."):
            with pytest.raises(sb.AccessDenied, match="not a model id"):
                await c.scheduler.seabiscuit_block(model=bad, version=0, block=0)
        with pytest.raises(sb.AccessDenied, match="not a model id"):
            await c.rpc(a.address).seabiscuit_sync(model="../x")
        for target in ("aten.from_file.default", "builtins.eval", "os.system"):
            with pytest.raises(sb.UnsupportedOp, match=target.replace(".", r"\.")):
                await deploy_rpc(c, graph=_with_linear(gpt2_graph, target=target), plan=plan)
        d = gpt2_graph.to_dict()
        d["params"][next(iter(d["params"]))]["source"] = {"kind": "safetensors", "key": "x", "slices": None,
                                                          "file": "/etc/shadow", "data": None}
        with pytest.raises(sb.AccessDenied, match="/etc/shadow"):
            await deploy_rpc(c, graph=OpGraph.from_dict(d).to_json(), plan=plan)
        with pytest.raises(sb.AccessDenied, match="checkpoint folder '/etc/ckpt' is outside"):
            await deploy_rpc(c, graph=gpt2_graph.to_json(), plan=plan,
                                                checkpoint_dir="/etc/ckpt")
        assert s.plugins["seabiscuit"].state.models == {}             # nothing was deployed
        assert set(s.plugins["seabiscuit"].state.devices) == {a.address, b.address}   # agents said hello
        assert not await c.scheduler.seabiscuit_hello(address="tcp://10.9.9.9:1", report={"budget_bytes": 1})
        with pytest.raises(sb.AccessDenied, match="no worker of this cluster"):
            await c.scheduler.seabiscuit_pressure(address="tcp://10.9.9.9:1", reason="forged")
        reply = await deploy_rpc(c, graph=gpt2_graph.to_json(), plan=plan)
        model, token = reply["model"], reply["token"]
        for op, extra in (("release", {}), ("drain", {"address": a.address}),
                          ("restore", {"address": a.address}),
                          ("budget", {"address": a.address, "memory_bytes": 10**6})):
            for forged in ("forged", "", None, token.upper()):
                with pytest.raises(sb.AccessDenied, match="token"):
                    await getattr(c.scheduler, f"seabiscuit_{op}")(model=model, token=forged, **extra)
        for bad in (10**15, 0, -5, True):
            with pytest.raises(sb.AccessDenied, match="budget"):
                await c.scheduler.seabiscuit_budget(model=model, token=token, address=a.address,
                                                    memory_bytes=bad)
        assert model in s.plugins["seabiscuit"].state.models
        assert await c.scheduler.seabiscuit_release(model=model, token=token)
        assert s.plugins["seabiscuit"].state.models == {}

    check()


def test_a_checkpoint_folder_outside_the_roots_is_refused_before_anything_deploys(client, llama) -> None:
    model, x, _ = llama
    with pytest.raises(sb.AccessDenied, match="outside the folders"):
        sb.distribute(model, client, (x,), budget="256KiB", checkpoint_dir="/etc/sb-checkpoints")


def test_two_models_share_the_cluster_and_both_answer(client, llama) -> None:
    model, x, expected = llama
    other = M.gpt2()
    with torch.no_grad():
        other_expected = other(x).logits
    with sb.distribute(model, client, (x,), budget="256KiB") as a:
        held = {d.address: float(a.plan.peak_bytes[i]) for i, d in enumerate(a.plan.spec.devices)}
        with sb.distribute(other, client, (x,), budget="256KiB") as b:
            for i, d in enumerate(b.plan.spec.devices):          # placed in what the first model left
                assert d.memory_bytes <= BUDGET - held.get(d.address, 0)
                assert b.plan.peak_bytes[i] + held.get(d.address, 0) <= BUDGET
            assert M.rel_err(a(x).logits, expected) <= 1e-4
            assert M.rel_err(b(x).logits, other_expected) <= 1e-4
            resident = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident_bytes)
            assert all(v <= BUDGET for v in resident.values())


def test_a_worker_answers_rpcs_and_heartbeats_while_a_load_is_held_open(client, llama) -> None:
    model, x, expected = llama
    cluster = client.cluster
    with sb.distribute(model, client, (x,), budget="256KiB") as dm:
        weights = dm.plan.weight_bytes
        addr = max(dm.plan.spec.devices, key=lambda d: weights[dm.plan.spec.index(d.name)]).address
        worker = next(w for w in cluster.workers.values() if w.address == addr)
        resident = worker.plugins["seabiscuit"].resident
        gate, entered = threading.Event(), threading.Event()
        read = resident._read_tile

        def held_read(*args):
            entered.set()
            assert gate.wait(60), "the test never released the load"
            return read(*args)

        resident.clear()
        resident._read_tile = held_read
        done: list[int] = []
        loader = threading.Thread(target=lambda: done.append(
            client.sync(client.rpc(addr).seabiscuit_sync, model=dm.model_id)))
        loader.start()
        try:
            assert entered.wait(60)
            assert client.run(lambda: "pong", workers=[addr]) == {addr: "pong"}
            assert client.sync(client.rpc(addr).seabiscuit_report)["blocks"] == 0
            ws = cluster.scheduler.workers[addr]
            seen = ws.last_seen
            wait_for(lambda: ws.last_seen > seen, "a heartbeat from the worker holding a load")
            assert loader.is_alive() and not done
        finally:
            gate.set()
            loader.join(60)
            resident._read_tile = read
        assert done and done[0] > 0 and resident.resident_bytes > 0
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
