"""GPU workers: blocks run on CUDA and shards are accounted in GPU memory (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import seabiscuit_dask as sb

from . import models as M
from .clusters import seabiscuit_cluster

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.filterwarnings("ignore::ResourceWarning")]


def test_gpu_worker_runs_blocks_on_cuda_and_accounts_gpu_memory() -> None:
    model, x = M.llama(), M.ids()
    with seabiscuit_cluster(2, 2_000_000) as client:
        spec = sb.measure_cluster(client)
        assert {d.kind for d in spec.devices} == {"gpu"}
        with sb.distribute(model, client, (x,), budget="256KiB") as dm:
            with torch.no_grad():
                assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4

            def on_gpu(dask_worker) -> tuple[str, int, int]:
                p = dask_worker.plugins["seabiscuit"]
                tiles = [t for tiles in p.resident.tiles.values() for t in tiles.values()]
                return p.device.type, p.resident_bytes, sum(t.is_cuda for t in tiles)

            for dev, held, cuda_tiles in client.run(on_gpu).values():
                assert dev == "cuda" and held > 0 and cuda_tiles > 0


def tiles_on(client) -> dict[str, tuple[str, set[str]]]:
    """Per worker: its own device and the devices its resident tiles are on."""
    def where(dask_worker) -> tuple[str, set[str]]:
        p = dask_worker.plugins["seabiscuit"]
        return p.device.type, {t.device.type for ts in p.resident.tiles.values() for t in ts.values()}

    return client.run(where)


def test_device_cuda_runs_on_the_gpus_and_cpu_in_host_memory() -> None:
    model, x = M.llama(), M.ids()
    with torch.no_grad():
        expected = model(x).logits
    with seabiscuit_cluster(2, 2_000_000) as client:
        with sb.distribute(model, client, (x,), budget="256KiB", device="cuda") as dm:
            assert {d.kind for d in dm.plan.spec.devices} == {"gpu"}
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            assert all(tiles <= {"cuda"} for _, tiles in tiles_on(client).values())
        with sb.distribute(model, client, (x,), budget="256KiB", device="cpu") as dm:
            # NOTE: the same GPU workers, as CPU devices with their host-memory budgets
            assert {d.kind for d in dm.plan.spec.devices} == {"cpu"}
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            where = tiles_on(client).values()
            assert {dev for dev, _ in where} == {"cuda"} and set().union(*(t for _, t in where)) == {"cpu"}
        reports = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].metrics())
        for r in reports.values():        # NVML through pynvml, where it is installed
            assert r["device"] == "cuda" and r["as_cpu"]["budget_bytes"] > 0
            if r["gpus"]:
                assert r["gpu"] is not None and r["gpu"]["pci_bus_id"] in {g["pci_bus_id"] for g in r["gpus"]}


def test_local_cuda_cluster() -> None:
    dask_cuda = pytest.importorskip("dask_cuda")
    from distributed import Client

    model, x = M.gpt2(), M.ids()
    with dask_cuda.LocalCUDACluster(dashboard_address=None) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        with sb.distribute(model, client, (x,), budget="256KiB") as dm, torch.no_grad():
            assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4
        with sb.distribute(model, client, (x,), budget="256KiB", device="cuda") as dm, torch.no_grad():
            assert {d.kind for d in dm.plan.spec.devices} == {"gpu"}
            assert len(dm.plan.spec.devices) == len(cluster.workers)
            assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4
            assert all(dev == "cuda" and tiles <= {"cuda"} for dev, tiles in tiles_on(client).values())
        # NOTE: dask-cuda gives each worker its own GPU: the agents name different physical GPUs
        reports = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].metrics())
        named = [r["gpu"]["uuid"] for r in reports.values() if r.get("gpu")]
        assert len(set(named)) == len(named)


def test_linear_tiles_run_as_one_kernel_on_the_gpu() -> None:
    model, x = M.llama(), M.ids()
    with torch.no_grad():
        expected = model(x).logits
    with seabiscuit_cluster(2, 2_000_000) as client:
        with sb.distribute(model, client, (x,), budget="64KiB", device="cuda") as dm:
            assert M.rel_err(dm(x).logits, expected) <= 1e-4

            def fused(dask_worker) -> int:
                programs = dask_worker.plugins["seabiscuit"].resident.programs.values()
                return sum(p.fused_groups for p in programs)

            assert sum(client.run(fused).values()) > 0      # seabiscuit.lower.fuse-tiles: auto, on GPUs
