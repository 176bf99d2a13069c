"""``sb.distribute(..., device="auto"|"cuda"|"cpu")`` and config ``seabiscuit.device``, on CPUs.

One in-process cluster of two workers; a GPU worker is played by a worker whose agent
report says ``device: cuda`` (with the host-side ``as_cpu`` figures a real GPU worker
publishes), so the choice of workers and device kinds is exercised without a GPU. Its
blocks still run on its CPU: ``ResidentBlocks`` only uses CUDA where the worker has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import dask.config
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask import cli, config
from seabiscuit_dask.lower.blocks import block_specs
from seabiscuit_dask.plugins.worker import SeaBiscuitWorkerPlugin
from seabiscuit_dask.runtime.scheduler import admits
from seabiscuit_dask.runtime.worker.resident import ResidentBlocks
from seabiscuit_dask.runtime.worker.store import stored

from . import models as M
from .clusters import seabiscuit_cluster

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

BUDGET = 8_000_000            # NOTE: one worker holds the 3.7 MB toy GPT-2
HOST_BUDGET = 7_000_000       # what the pretend GPU worker offers as a CPU device
OP_BUDGET = "256KiB"


@pytest.fixture(scope="module")
def client():
    with seabiscuit_cluster(2, BUDGET, processes=False) as c:
        yield c


def plugins(client) -> dict[str, Any]:
    return {w.address: w.plugins["seabiscuit"] for w in client.cluster.workers.values()}


def scheduler_plugin(client) -> Any:
    return client.cluster.scheduler.plugins["seabiscuit"]


@contextlib.contextmanager
def one_gpu_worker(client) -> Iterator[str]:
    """The first worker reports itself as a GPU worker for the duration; yields its address."""
    address, p = sorted(plugins(client).items())[0]
    report, host = p.report, p.resident.host_budget_bytes
    speeds = {k: report[k] for k in ("matmul_flops_per_s", "other_flops_per_s", "mem_bytes_per_s",
                                     "op_overhead_s", "view_overhead_s")}
    p.report = {**report, "device": "cuda", "as_cpu": speeds}
    p.resident.host_budget_bytes = HOST_BUDGET
    try:
        yield address
    finally:
        p.report, p.resident.host_budget_bytes = report, host


def resident(client) -> dict[str, int]:
    return {a: p.resident_bytes for a, p in plugins(client).items()}


# --- the choice itself ------------------------------------------------------------------------
def test_the_choice_defaults_to_auto_and_a_bad_value_lists_the_choices(client) -> None:
    assert config.get("device") == "auto" and config.device_choice() == "auto"
    assert config.device_choice("CPU") == "cpu"
    with dask.config.set({"seabiscuit.device": "cuda"}):
        assert config.device_choice() == "cuda"
    with pytest.raises(sb.SeaBiscuitError, match=r"device must be one of 'auto', 'cuda', 'cpu', got 'tpu'"):
        sb.distribute(M.gpt2(), client, (M.ids(),), budget=OP_BUDGET, device="tpu")
    with dask.config.set({"seabiscuit.device": "gpu"}), \
            pytest.raises(sb.SeaBiscuitError, match="got 'gpu'"):
        sb.measure_cluster(client, probe=False)
    assert set(resident(client).values()) == {0}


def test_cuda_without_a_gpu_worker_fails_at_once_naming_the_workers(client) -> None:
    workers = sorted(plugins(client))
    with pytest.raises(sb.DeviceUnavailable) as e:
        # NOTE: not even a model: the cluster is checked before anything is traced or moved
        sb.distribute(object(), client, (M.ids(),), budget=OP_BUDGET, device="cuda")
    msg = str(e.value)
    assert isinstance(e.value, sb.ClusterTooSmall)
    assert "none of the 2 worker(s)" in msg and all(f"{w} (cpu)" in msg for w in workers)
    assert "LocalCUDACluster" in msg and "device='auto'" in msg and "device='cpu'" in msg
    assert scheduler_plugin(client).state.models == {} and set(resident(client).values()) == {0}


def test_cpu_gives_the_models_output_on_cpu_devices(client) -> None:
    model, x = M.gpt2(), M.ids()
    with torch.no_grad():
        expected = model(x).logits
    with sb.distribute(model, client, (x,), budget=OP_BUDGET, device="cpu") as dm:
        assert {d.kind for d in dm.plan.spec.devices} == {"cpu"}
        assert {s.kind for s in dm.specs} == {"cpu"}
        assert dm.graph.meta["device"] == "cpu"
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        tiles = [t for p in plugins(client).values() for ts in p.resident.tiles.values() for t in ts.values()]
        assert tiles and all(t.device.type == "cpu" for t in tiles)
        # NOTE: the scheduler got the choice with the graph: its repairs keep to CPU workers
        assert scheduler_plugin(client).state.models[dm.model_id].plan.graph.meta["device"] == "cpu"
    with one_gpu_worker(client) as gpu, \
            sb.distribute(model, client, (x,), budget=OP_BUDGET, device="cpu") as dm:
        as_cpu = {d.address: (d.kind, d.memory_bytes) for d in dm.plan.spec.devices}[gpu]
        assert as_cpu == ("cpu", HOST_BUDGET)
        assert M.rel_err(dm(x).logits, expected) <= 1e-4


# --- a cluster with a GPU worker ------------------------------------------------------------------
def test_the_choice_picks_and_rekinds_the_workers(client) -> None:
    with one_gpu_worker(client) as gpu:
        auto = sb.measure_cluster(client, probe=False)
        assert {d.address: d.kind for d in auto.devices}[gpu] == "gpu"
        assert {d.kind for d in auto.devices} == {"gpu", "cpu"}
        only = sb.measure_cluster(client, probe=False, device="cuda")
        assert [(d.address, d.kind) for d in only.devices] == [(gpu, "gpu")]
        cpu = sb.measure_cluster(client, probe=False, device="cpu")
        assert {d.kind for d in cpu.devices} == {"cpu"} and len(cpu.devices) == 2
        # NOTE: the GPU worker as a CPU device: its host-memory budget, not its GPU's
        assert {d.address: d.memory_bytes for d in cpu.devices}[gpu] == HOST_BUDGET
        with dask.config.set({"seabiscuit.device": "cuda"}):     # the config's default
            assert len(sb.measure_cluster(client, probe=False).devices) == 1


def test_cuda_places_only_on_the_gpu_worker(client) -> None:
    model, x = M.gpt2(), M.ids()
    with torch.no_grad():
        expected = model(x).logits
    with one_gpu_worker(client) as gpu, \
            sb.distribute(model, client, (x,), budget=OP_BUDGET, device="cuda") as dm:
        assert [d.address for d in dm.plan.spec.devices] == [gpu]
        assert {s.kind for s in dm.specs} == {"gpu"}
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        held = resident(client)
        assert held[gpu] > 0 and sum(held.values()) == held[gpu]


class Owner:
    """Keeps the test's weight store alive."""


def test_cpu_on_a_gpu_worker_runs_in_host_memory_within_its_host_budget() -> None:
    """A GPU worker's ``ResidentBlocks`` (driven without a GPU): a block placed on a CPU device
    loads to host memory against the host budget; one placed on a GPU counts against the GPU's."""
    model, x, owner = M.gpt2(), M.ids(), Owner()
    graph, _ = stored(sb.decompose(sb.trace(model, (x,)), OP_BUDGET), model, owner)
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=1)
    spec = sb.ClusterSpec(tuple(replace(d, address="tcp://h:0") for d in spec.devices), spec.links)
    specs = block_specs(sb.place(graph, spec), "0123456789abcdef")
    weights = sum(s.weight_bytes for s in specs)
    big = max(specs, key=lambda s: s.weight_bytes)
    r = ResidentBlocks(big.weight_bytes - 1, "cuda", "tcp://h:0", host_budget_bytes=2 * weights)
    assert {s.kind for s in specs} == {"cpu"} and {r.device_for(s).type for s in specs} == {"cpu"}
    # NOTE: refused before any tile is read, so no CUDA is needed to see it
    with pytest.raises(sb.ClusterTooSmall, match=rf"0 \+ {big.weight_bytes} > {big.weight_bytes - 1} bytes"):
        r.load(replace(big, kind="gpu"))
    for s in specs:
        r.load(s)
    tiles = [t for ts in r.tiles.values() for t in ts.values()]
    assert tiles and all(t.device.type == "cpu" for t in tiles)
    assert r.bytes_on(torch.device("cpu"))[0] == r.resident_bytes > r.budget_bytes     # past the GPU budget
    assert r.bytes_on(torch.device("cuda")) == (0, 0)
    out = {}
    for s in specs:
        out[s.index], _ = r.run("0123456789abcdef", 0, 0, s.index, {graph.inputs[0]: x},
                                [out[d] for d in s.deps], lambda m, v, b: specs[b].to_dict())
    with torch.no_grad():
        expected = model(x).logits
    got = next(o[graph.outputs[0]] for o in out.values() if graph.outputs[0] in o)
    assert M.rel_err(got, expected) <= 1e-4


def test_a_model_keeps_its_kind_of_worker_when_workers_join() -> None:
    gpu = sb.ClusterSpec.synthetic("2x(1gpu+cpu)").devices[0]
    cpu = sb.ClusterSpec.synthetic("2x(1gpu+cpu)").devices[1]

    def dep(choice: str | None) -> Any:
        meta = {"device": choice} if choice else {}
        return types.SimpleNamespace(plan=types.SimpleNamespace(graph=types.SimpleNamespace(meta=meta)))

    assert admits(dep(None), gpu) and admits(dep(None), cpu)
    assert admits(dep("cuda"), gpu) and not admits(dep("cuda"), cpu)
    assert admits(dep("cpu"), cpu) and not admits(dep("cpu"), gpu)


# --- the worker's own choice (config) ---------------------------------------------------------------
def fake_worker() -> types.SimpleNamespace:
    """Just what ``SeaBiscuitWorkerPlugin.setup`` touches of a Dask worker."""
    return types.SimpleNamespace(
        address="tcp://10.0.0.1:4001", metrics={}, handlers={}, stream_handlers={},
        state=types.SimpleNamespace(nthreads=torch.get_num_threads(), total_resources={"MEM": BUDGET}),
        memory_manager=types.SimpleNamespace(memory_limit=2**30),
        loop=types.SimpleNamespace(add_callback=lambda *a, **kw: None), scheduler=None)


def test_a_worker_configured_for_cpu_leaves_its_gpu_alone(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_cuda(*args: Any) -> Any:
        raise AssertionError("a worker configured for the CPU touched CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    plugin = SeaBiscuitWorkerPlugin()
    with dask.config.set({"seabiscuit.device": "cpu"}):
        plugin.setup(fake_worker())
    assert plugin.device == torch.device("cpu") and plugin.resident.device == torch.device("cpu")
    assert plugin.report["device"] == "cpu" and "as_cpu" not in plugin.metrics()
    assert plugin.budget_bytes == BUDGET
    plugin.teardown(plugin.worker)
    assert SeaBiscuitWorkerPlugin.choose_device() == "cuda"        # auto: the GPU it (says it) has
    # NOTE: a closing worker sent routes after its plugin stopped refuses them in a line, no traceback
    reply = asyncio.run(plugin.worker.handlers["seabiscuit_routes"](routes=[], watch=[], secret="s"))
    assert reply["status"] == "uncaught-error" and "has stopped" in str(reply["exception"])
    assert plugin.worker.stream_handlers["seabiscuit_secret"](secret="s") is None


def test_a_worker_configured_for_cuda_without_one_says_so_and_uses_its_cpu(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with dask.config.set({"seabiscuit.device": "cuda"}), caplog.at_level(logging.WARNING):
        assert SeaBiscuitWorkerPlugin.choose_device(fake_worker()) == "cpu"
    assert "tcp://10.0.0.1:4001 is configured with device 'cuda' but has no CUDA device" in caplog.text


# --- the command line ---------------------------------------------------------------------------------
def test_demo_and_generate_pass_device_through(monkeypatch, capsys) -> None:
    from seabiscuit_dask import demo

    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr(demo, "run", lambda *a, **kw: seen.append(("run", kw["device"])) or 0)
    monkeypatch.setattr(demo, "run_generate", lambda *a, **kw: seen.append(("generate", kw["device"])) or 0)
    assert cli.main(["demo", "--model", "gpt2-tiny", "--device", "cpu"]) == 0
    assert cli.main(["demo", "--device", "cuda"]) == 0
    assert cli.main(["generate", "--device", "cpu"]) == 0
    assert cli.main(["generate"]) == 0
    assert seen == [("run", "cpu"), ("generate", "cuda"), ("generate", "cpu"), ("generate", None)]
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "tpu"])
    err = capsys.readouterr().err
    assert "argument --device: invalid choice: 'tpu'" in err and all(c in err for c in config.DEVICES)
