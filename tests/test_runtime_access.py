"""What a peer of the cluster may ask: ids, tokens, paths and ops are checked; models share workers.

In-process clusters (one event loop for the scheduler and the workers), so a test
can reach a worker's plugin and hold a load open.
"""

from __future__ import annotations

import threading

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.ir import OpGraph

from . import models as M
from .clusters import seabiscuit_cluster, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

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


def test_only_the_deploying_client_may_release_drain_or_rebudget(client, llama) -> None:
    from distributed import Client

    model, x, expected = llama
    with sb.distribute(model, client, (x,), budget="256KiB") as dm, \
            Client(client.scheduler.address) as other:
        worker = dm.plan.spec.devices[0].address
        for op, extra in (("release", {}), ("drain", {"address": worker}), ("restore", {"address": worker}),
                          ("budget", {"address": worker, "memory_bytes": 10**6})):
            with pytest.raises(sb.AccessDenied, match="token"):
                other.sync(getattr(other.scheduler, f"seabiscuit_{op}"), model=dm.model_id, token="forged",
                           **extra)
        assert M.rel_err(dm(x).logits, expected) <= 1e-4          # untouched


def test_ids_paths_and_budgets_from_a_peer_are_checked(client, llama) -> None:
    model, x, _ = llama
    with sb.distribute(model, client, (x,), budget="256KiB") as dm:
        for bad in ("../../etc", "0123456789ABCDEF", "", dm.model_id + "/.."):
            with pytest.raises(sb.AccessDenied, match="not a model id"):
                client.sync(client.scheduler.seabiscuit_block, model=bad, version=0, block=0)
        worker = dm.plan.spec.devices[0].address
        with pytest.raises(sb.AccessDenied, match="not a model id"):
            client.sync(client.rpc(worker).seabiscuit_sync, model="../x")
        for bad in (10**15, 0, -5, True):
            with pytest.raises(sb.AccessDenied, match="budget"):
                client.sync(client.scheduler.seabiscuit_budget, model=dm.model_id, token=dm._token,
                            address=worker, memory_bytes=bad)
        with pytest.raises(sb.AccessDenied, match="outside the folders"):
            sb.distribute(model, client, (x,), budget="256KiB", checkpoint_dir="/etc/sb-checkpoints")


def _graph_with(graph: OpGraph, **changes) -> str:
    d = graph.to_dict()
    for op in d["ops"]:
        if op["kind"] == "linear":
            op.update(changes)
            break
    return OpGraph.from_dict(d).to_json()


def test_a_graph_naming_an_unregistered_op_or_a_foreign_file_is_refused_at_deploy(client, tmp_path) -> None:
    model, x = M.gpt2(), M.ids()
    graph = sb.decompose(sb.trace(model, x), "256KiB")
    plan = sb.place(graph, sb.measure_cluster(client, probe=False))
    secret = tmp_path / "secret.txt"
    for target in ("aten.from_file.default", "builtins.eval", "os.system"):
        with pytest.raises(sb.UnsupportedOp, match=target.replace(".", r"\.")):
            client.sync(client.scheduler.seabiscuit_deploy, graph=_graph_with(graph, target=target),
                        plan=plan.to_json(stats=False))
    d = graph.to_dict()
    name = next(iter(d["params"]))
    d["params"][name]["source"] = {"kind": "safetensors", "key": "x", "slices": None,
                                   "file": "/etc/shadow", "data": None}
    with pytest.raises(sb.AccessDenied, match="/etc/shadow"):
        client.sync(client.scheduler.seabiscuit_deploy, graph=OpGraph.from_dict(d).to_json(),
                    plan=plan.to_json(stats=False))
    assert not secret.exists()


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
