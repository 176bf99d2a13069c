"""sb.distribute on a LocalCluster of worker processes: same results as the model, weights resident.

One cluster for the module: 4 worker processes x 1 thread, each with a budget
(worker resource MEM) of 1.2 MB, so a 3.7 MB model needs at least three of them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dask
import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.plugins import PluginMissing

from . import models as M
from .clusters import seabiscuit_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

WORKER_BUDGET = 1_200_000
OP_BUDGET = "256KiB"


@pytest.fixture(scope="module")
def client():
    with seabiscuit_cluster(4, WORKER_BUDGET) as c:
        yield c


def shard_accounting(client) -> dict[str, tuple[int, int]]:
    """Per worker: (bytes of resident shards, budget), from the worker plugin itself."""
    def account(dask_worker) -> tuple[int, int]:
        p = dask_worker.plugins["seabiscuit"]
        return p.resident_bytes, p.budget_bytes

    return client.run(account)


def transfer_bytes(client, since: float) -> int:
    """Bytes the workers received from each other in transfers that started after ``since``.

    (Their transfer logs are capped deques, so totals of a whole log do not subtract.)
    """
    def total(dask_worker) -> int:
        return int(sum(e["total"] for e in list(dask_worker.transfer_incoming_log) if e["start"] >= since))

    return sum(client.run(total).values())


CASES = {
    "gpt2": (M.gpt2, M.ids),
    "llama": (M.llama, M.ids),
    "bert": (M.bert, M.ids),
    "convnet": (M.convnet, M.image),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distributed_matches_the_model(client, name: str) -> None:
    build, inputs = CASES[name]
    model, x = build(), inputs()
    with torch.no_grad():
        expected = M.first(model(x))
    with sb.distribute(model, client, (x,), budget=OP_BUDGET) as dm:
        got = M.first(dm(x))
        assert got.shape == expected.shape
        assert M.rel_err(got, expected) <= 1e-4
        assert len(set(dm.plan.block_device.tolist())) >= 2, "the model should need several workers"
        # a second request with other inputs: weights stay, results follow the inputs
        x2 = inputs(seed=1)
        with torch.no_grad():
            assert M.rel_err(M.first(dm(x2)), M.first(model(x2))) <= 1e-4
        # one task per block per request (blocks no output needs are culled), each computed once
        needed, todo = set(), [s.index for s in dm.specs if set(s.exports) & set(dm.graph.leaf_outputs)]
        while todo:
            b = todo.pop()
            if b not in needed:
                needed.add(b)
                todo.extend(dm.specs[b].deps)
        assert dm.run_counts() == {"computed": 2 * len(needed), "resumed": 0, "re_executed": 0}
    # closed: the shards are gone from every worker
    assert all(held == 0 for held, _ in shard_accounting(client).values())


def test_the_halves_of_each_mlp_on_two_workers_give_the_models_answer(client) -> None:
    # Intra-layer parallelism end to end: each MLP's two column tiles (and their parts of the
    # second linear's sum) on two workers at once, activations between them on the data plane.
    from seabiscuit_dask.placement.capacity import weight_capacity
    from seabiscuit_dask.placement.partition import spread_branches
    from seabiscuit_dask.placement.plan import make_plan
    from seabiscuit_dask.placement.workload import workload

    model, x = M.gpt2(), M.ids(seq=16)      # MLP tiles of 16 KiB: at least 1/32 of the budget
    graph = sb.decompose(sb.trace(model, (x,)), OP_BUDGET)
    spec = sb.measure_cluster(client)
    w = workload(graph)
    base = sb.place(graph, spec)
    dev = spread_branches(w, spec, weight_capacity(spec), base.device_of, w.times(spec), 0.0)
    plan = make_plan(graph, spec, dev, "spread", fused=False).check()
    sums = [i for i, op in enumerate(graph.ops) if op.kind == "sum" and ".mlp." in op.name]
    assert sums
    apart = [i for i in sums if len({int(dev[u]) for u in w.preds[i]}) == 2]
    assert len(apart) == len(sums)                       # every MLP's two partial products apart
    with torch.no_grad():
        expected = M.first(model(x))
    with sb.deploy(plan, client, weights=model) as dm:
        assert dm.p2p
        got = M.first(dm(x))
        assert M.rel_err(got, expected) <= 1e-5
        assert torch.equal(M.first(dm(x)), got)           # and the same answer every time
        assert dm.run_counts()["computed"] > 0


def test_long_prompt_with_activations_over_the_budget() -> None:
    model, x = M.llama(), M.ids(seq=64)          # logits 512 KiB: 16 times the budget
    with torch.no_grad():
        expected = model(x).logits
    with seabiscuit_cluster(2, 3_000_000) as client, \
            sb.distribute(model, client, (x,), budget="32KiB") as dm:
        assert len(set(dm.plan.block_device.tolist())) == 2
        assert dm.graph.tilings, "the logits travel as tiles"
        assert max(dm.graph.working_set(op) for op in dm.graph.ops) <= 32 * 1024
        assert M.rel_err(dm(x).logits, expected) <= 1e-4


def test_model_three_times_a_worker_runs_within_every_budget(client) -> None:
    model, x = M.llama(), M.ids()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights >= 3 * WORKER_BUDGET
    with torch.no_grad():
        expected = model(x).logits
    with sb.distribute(model, client, (x,), budget=OP_BUDGET) as dm:
        for _ in range(2):
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
        accounting = shard_accounting(client)
        assert sum(held for held, _ in accounting.values()) >= weights
        for addr, (held, budget) in accounting.items():
            assert budget == WORKER_BUDGET
            assert 0 < held <= budget, f"{addr} holds {held} bytes of shards, budget {budget}"


FETCH_OVERHEAD = 1024   # bytes Dask's size estimate adds to a fetched result (its dict, keys, headers)


def task_transfer_bound(dm) -> int:
    """Bytes Dask moves per request if every block's result (all it exports) is fetched once by
    each other worker that runs a block reading it (a block task's result travels whole), and
    every worker fetches the request's inputs."""
    specs = {s.index: s for s in dm.specs}
    fetched = {(d, s.address) for s in dm.specs for d in s.deps if specs[d].address != s.address}
    results = sum(dm.graph.tensors[t].nbytes + FETCH_OVERHEAD for d, _ in fetched for t in specs[d].exports)
    workers = {s.address for s in dm.specs}
    inputs = sum(dm.graph.tensors[t].nbytes + FETCH_OVERHEAD for t in dm.graph.leaf_inputs) * len(workers)
    return results + inputs


VIEW_OPS = {"aten.expand.default", "aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
            "aten.alias.default", "aten._unsafe_view.default", "aten.squeeze.dim", "aten.slice.Tensor"}


def p2p_bytes(dm, views: bool = True) -> int:
    """Bytes one request moves on the data plane: each block's inputs from another worker, once
    per consuming block, and the caller's inputs of each block that reads them. ``views=False``:
    less a view sent beside the tensor it views (the wire sends one memory once)."""
    specs = {s.index: s for s in dm.specs}
    made_by = {o: op for op in dm.graph.ops for o in op.outputs}

    def counted(t: str, ts: tuple[str, ...]) -> bool:
        op = made_by.get(t)
        return views or op is None or op.target not in VIEW_OPS or not set(op.inputs) & set(ts)

    crossing = sum(dm.graph.tensors[t].nbytes for s in dm.specs for c, addr, ts in s.sends
                   if addr != s.address for t in ts if counted(t, ts))
    fed = sum(dm.graph.tensors[t].nbytes for s in specs.values()
              for t, src in zip(s.imports, s.sources) if src < 0)
    return crossing + fed


def received(client) -> int:
    return sum(client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].dataplane.counters["bytes_in"]
                          ).values())


@pytest.mark.parametrize("plane", ["tasks", "p2p"])
def test_only_activations_travel(client, plane: str) -> None:
    model, x = M.gpt2(), M.ids()
    with dask.config.set({"seabiscuit.runtime.data-plane": plane}), \
            sb.distribute(model, client, (x,), budget=OP_BUDGET) as dm:
        assert dm.p2p == (plane == "p2p")
        dm(x)
        since, before = time.time(), received(client)
        dm(x)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if dm.p2p:      # NOTE: what the plan sends, each tensor once per consumer at most
            moved = received(client) - before
            assert 0 < p2p_bytes(dm, views=False) <= moved <= p2p_bytes(dm)
            assert transfer_bytes(client, since) == 0      # and nothing through Dask
        else:
            moved = transfer_bytes(client, since)
            bound = task_transfer_bound(dm)
            # NOTE: a result may be fetched again (Dask re-fetches data a worker released early)
            assert 0 < moved <= 2 * bound, f"moved {moved} bytes; a fetch of each block per other worker: " \
                f"{bound}"
        assert moved < weights / 20          # no weight ever travels: they are ten times this


def test_concurrent_requests_from_threads(client) -> None:
    model = M.gpt2()
    xs = [M.ids(seed=s) for s in range(6)]
    with torch.no_grad():
        expected = [model(x).logits for x in xs]
    got: dict[int, torch.Tensor] = {}
    with sb.distribute(model, client, (xs[0],), budget=OP_BUDGET) as dm:
        def call(i: int) -> None:
            got[i] = dm(xs[i]).logits

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, e in enumerate(expected):
        assert M.rel_err(got[i], e) <= 1e-4


def test_inputs_of_a_shape_the_model_cannot_take_are_bad_input(client) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
    with sb.distribute(model, client, (torch.randn(2, 16),), budget="4KiB") as dm:
        x = torch.randn(7, 16)
        with torch.no_grad():
            assert torch.allclose(dm(x), model(x), atol=1e-5)          # another batch: traced anew
        with pytest.raises(sb.BadInput, match=r"does not take inputs of shapes \[2, 17\] float32 \(it was "
                                              r"traced with \[2, 16\] float32\).*reduction dim"):
            dm(torch.randn(2, 17))
        assert torch.allclose(dm(x), model(x).detach(), atol=1e-5)


def test_bad_inputs_fail_before_anything_is_submitted(client) -> None:
    model, x = M.gpt2(), M.ids()
    with sb.distribute(model, client, (x,), budget=OP_BUDGET) as dm:
        submitted = []
        real_get = client.get
        client.get = lambda *a, **k: submitted.append(a) or real_get(*a, **k)
        try:
            with pytest.raises(sb.BadInput, match=r"float32.*traced for shape \(1, 4\) and dtype int64"):
                dm(x.float())
            with pytest.raises(sb.BadInput, match=r"1 positional input\(s\) \['input_ids'\], got 2"):
                dm(x, x)
            with pytest.raises(sb.BadInput, match="given twice"):
                dm(x, input_ids=x)
            with pytest.raises(sb.BadInput, match=r"id 2048 at position \[0, 2\].*0\.\.2047"):
                dm(torch.tensor([[1, 2, M.VOCAB, 3]]))
            with pytest.raises(sb.BadInput, match="id -1"):
                dm(torch.tensor([[-1, 2, 3, 4]]))
        finally:
            client.get = real_get
        assert submitted == []
        with torch.no_grad():
            expected = model(x).logits
        assert M.rel_err(dm(x).logits, expected) <= 1e-4     # still serving
        assert M.rel_err(dm(input_ids=x).logits, expected) <= 1e-4     # traced positionally, called by name


def test_a_forward_pass_of_another_size_runs_as_a_program_of_the_deployment(client) -> None:
    model, x = M.gpt2(), M.ids()
    with sb.distribute(model, client, (x,), budget=OP_BUDGET) as dm, torch.no_grad():
        tiles, version = dict(shard_accounting(client)), dm.version
        for seq in (7, 2, 7):
            longer = M.ids(seq=seq, seed=seq)
            assert M.rel_err(dm(longer).logits, model(longer).logits) <= 1e-4
        assert len(dm._shape_programs) == 2                       # traced once per size
        after = shard_accounting(client)                          # the same weight tiles serve them:
        assert sum(b for b, _ in after.values()) == sum(b for b, _ in tiles.values())
        if dm.version == version:     # NOTE: a repair from learned costs may move them meanwhile
            assert after == tiles
        with pytest.raises(sb.BadInput, match=r"id 2048 at position \[0, 1\]"):
            dm(torch.tensor([[1, M.VOCAB, 2, 3, 4, 5, 6]]))      # checked for the new size too


def test_cluster_too_small_names_the_numbers(client) -> None:
    import transformers as tf

    torch.manual_seed(0)
    big = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=768,
                                             num_attention_heads=4, vocab_size=M.VOCAB)).eval()
    with pytest.raises(sb.ClusterTooSmall, match=r"need .* but the cluster's 4 devices hold"):
        sb.distribute(big, client, (M.ids(),), budget=OP_BUDGET)


def test_cluster_spec_from_client_reports_the_workers(client) -> None:
    spec = sb.measure_cluster(client)
    workers = client.scheduler_info()["workers"]
    assert {d.address for d in spec.devices} == set(workers)
    assert all(d.memory_bytes == WORKER_BUDGET for d in spec.devices)
    assert all(d.kind == "cpu" and d.flops_per_s["matmul"] > 1e8 for d in spec.devices)
    # What the block runtime spends on a tiny op and on a view, measured through a block program.
    assert all(d.op_overhead_s > 0 and d.view_overhead_s > 0 for d in spec.devices)
    assert len(spec.groups) == 1                           # one host
    link = spec.links["pcie"]
    assert 0 < link.latency_s < 1 and link.bandwidth_bytes_per_s > 1e6     # measured, not the defaults
    assert link != sb.LinkSpec(2.5e10, 1e-5)
    # Every pair of workers has its measured link, and Dask's own costs were measured too.
    off = ~np.eye(len(spec.devices), dtype=bool)
    assert spec.matrix is not None and (spec.bandwidth[off] == link.bandwidth_bytes_per_s).all()
    d = spec.dask
    assert d != sb.DaskSpec() and all(0 < t < 1 for t in (d.task_s, d.hop_s, d.submit_s, d.gather_s))
    assert d.client_bytes_per_s > 1e6
    reports = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].metrics(dask_worker))
    for r in reports.values():
        assert r["cpu_count"] >= 1 and r["memory_total_bytes"] > 0
        assert r["mem_bytes_per_s"] > 0 and "caches" in r and "numa_nodes" in r


@pytest.mark.parametrize("plane", ["p2p", "tasks"])
def test_links_are_timed_the_way_the_data_plane_moves_activations(client, monkeypatch, plane: str) -> None:
    # On the data plane an activation is a message between two workers: its links are timed by
    # echoes between them, not by a task fetching another's result through the scheduler.
    from seabiscuit_dask.runtime import discover

    used = []

    def counted(name: str) -> Any:
        real = getattr(discover, name)
        return lambda c, a, b: used.append(name) or real(c, a, b)

    for name in ("probe_link", "probe_link_p2p"):
        monkeypatch.setattr(discover, name, counted(name))
    with dask.config.set({"seabiscuit.runtime.data-plane": plane}):
        spec = sb.measure_cluster(client)
    assert set(used) == {"probe_link_p2p" if plane == "p2p" else "probe_link"}
    link = spec.links["pcie"]
    assert np.isfinite(link.bandwidth_bytes_per_s) and link.bandwidth_bytes_per_s > 1e6
    assert 0 < link.latency_s < 1


def test_a_worker_that_just_joined_is_waited_for_and_one_without_an_agent_is_named() -> None:
    """A worker restarted by its nanny is in the scheduler's table before its agent is set up: a
    model deployed then waits for its hello; one that never says hello is named as agentless."""
    from seabiscuit_dask.placement import DeviceLost
    from seabiscuit_dask.plugins.worker import PLUGIN_NAME
    from seabiscuit_dask.runtime.discover import workers_info

    with dask.config.set({"seabiscuit.runtime.sync-timeout": "60s"}), \
            seabiscuit_cluster(2, WORKER_BUDGET, processes=False) as c:
        scheduler = c.cluster.scheduler
        plugin = scheduler.plugins["seabiscuit"]
        worker = next(iter(c.cluster.workers.values()))
        addr = worker.address

        def just_joined() -> object:
            """The worker as it is between joining and its agent's setup; its report handler back."""
            handler = worker.handlers.pop("seabiscuit_report")
            scheduler.workers[addr].metrics.pop(PLUGIN_NAME, None)
            plugin._hellos.pop(addr, None)
            plugin.state.handle(DeviceLost(addr))
            return handler

        wait_for(lambda: addr in plugin._hellos and plugin._hellos[addr].is_set(), "the worker's first hello")
        handler = just_joined()
        got: list = []
        def ask() -> None:
            try:
                got.append(workers_info(c))
            except BaseException as e:  # noqa: BLE001
                got.append(e)

        asking = threading.Thread(target=ask)
        asking.start()
        wait_for(lambda: addr in plugin._hellos, "the scheduler to wait for the worker's hello")
        assert not got
        worker.handlers["seabiscuit_report"] = handler
        worker.loop.add_callback(worker.plugins[PLUGIN_NAME]._hello)
        asking.join()
        (info,) = [i for i in got[0] if i["address"] == addr]
        assert info["report"]["cpu_count"] >= 1 and addr in plugin.state.devices

        just_joined()       # NOTE: and this time no hello comes
        with dask.config.set({"seabiscuit.runtime.sync-timeout": "0.2s"}), \
                pytest.raises(PluginMissing, match=f"workers \\['{addr}'\\] have no SeaBiscuit agent"):
            workers_info(c)


def test_a_cluster_without_the_plugin_says_how_to_install_it() -> None:
    with seabiscuit_cluster(1, WORKER_BUDGET, processes=False, plugin=False) as c:
        with pytest.raises(PluginMissing, match="register_plugin"):
            sb.distribute(M.gpt2(), c, (M.ids(),), budget=OP_BUDGET)
        with pytest.raises(PluginMissing, match="--preload seabiscuit_dask.plugins.preload"):
            sb.measure_cluster(c)


SHUTDOWN = """
import os

import seabiscuit_dask as sb
from tests import models as M
from tests.clusters import seabiscuit_cluster

if __name__ == "__main__":
    model, x = M.llama(), M.ids()
    with seabiscuit_cluster(3, 1_600_000) as c:
        dm = sb.distribute(model, c, (x,), budget="256KiB")
        dm(x)
        print("served from", os.listdir(sb.config.get("runtime.store-directory")), flush=True)
        # the cluster closes with the model still deployed, and dm is never closed
"""


def test_a_normal_shutdown_logs_no_warnings_or_tracebacks_and_leaves_no_store(tmp_path) -> None:
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    root = Path(__file__).resolve().parents[1]
    stores = tmp_path / "stores"
    stores.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root), "DASK_SEABISCUIT__RUNTIME__STORE_DIRECTORY": str(stores)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=root, env=env)
    assert done.returncode == 0 and "served from ['seabiscuit-store-" in done.stdout, done.stderr[-3000:]
    assert list(stores.iterdir()) == []           # the weight store went with the process
    noisy = [line for line in dask_own_close_races(done.stderr).splitlines()
             if "Traceback" in line or " - ERROR - " in line or "Error:" in line
             or (" - WARNING - " in line and "seabiscuit" in line.lower())]
    assert noisy == [], done.stderr[-3000:]


# NOTE: a worker's heartbeat in flight as the scheduler stops (Dask's LocalCluster closes its
# scheduler once its workers are retired; a heartbeat sent just before can find the stream closed)
HEARTBEAT_RACE = "distributed.worker - ERROR - Failed to communicate with scheduler during heartbeat."


def dask_own_close_races(stderr: str) -> str:
    """``stderr`` less the heartbeat race records of Dask's own close whose traceback passes through
    no SeaBiscuit code: anything of ours in them, and they stay (and fail the test)."""
    kept, lines, i = [], stderr.splitlines(), 0
    while i < len(lines):
        if HEARTBEAT_RACE not in lines[i]:
            kept.append(lines[i])
            i += 1
            continue
        j = i + 1           # NOTE: the record's traceback runs to the next log record
        while j < len(lines) and not re.match(r"\d{4}-\d\d-\d\d ", lines[j]):
            j += 1
        record = lines[i:j]
        if any("seabiscuit" in line.lower() for line in record[1:]) or "CommClosedError" not in record[-1]:
            kept += record
        i = j
    return "\n".join(kept)


def test_dasks_own_heartbeat_race_at_close_is_told_from_ours() -> None:
    race = (f"2026-12-02 17:00:48,046 - {HEARTBEAT_RACE}\nTraceback (most recent call last):\n"
            '  File "/x/distributed/worker.py", line 1165, in heartbeat\n'
            "distributed.comm.core.CommClosedError: in <TCP (closed) ConnectionPool.heartbeat_worker>")
    after = "2026-12-02 17:00:49,000 - distributed.scheduler - INFO - End scheduler"
    assert dask_own_close_races(f"{race}\n{after}") == after
    ours = race.replace("/x/distributed/worker.py", "/x/seabiscuit_dask/plugins/worker.py")
    assert "Traceback" in dask_own_close_races(f"{ours}\n{after}")
