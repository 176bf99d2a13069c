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


def test_local_cuda_cluster() -> None:
    dask_cuda = pytest.importorskip("dask_cuda")
    from distributed import Client

    model, x = M.gpt2(), M.ids()
    with dask_cuda.LocalCUDACluster(dashboard_address=None) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        with sb.distribute(model, client, (x,), budget="256KiB") as dm, torch.no_grad():
            assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4
