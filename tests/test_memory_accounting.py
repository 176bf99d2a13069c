"""Resident shards are visible to Dask's memory manager: a worker's reported memory rises by them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seabiscuit_dask as sb

from .clusters import seabiscuit_cluster, wait_for

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]

WIDTH = 4096           # two 4096 x 4096 float32 layers: 64 MiB of weights each, well above the
                       # memory a worker takes for other things (imports, buffers) as it runs a request
WORKER_BUDGET = 96 << 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))


def test_reported_process_memory_rises_by_the_resident_shards() -> None:
    model, x = mlp(), torch.randn(4, WIDTH)
    with seabiscuit_cluster(2, WORKER_BUDGET) as client:
        scheduler = client.cluster.scheduler

        def reported() -> dict[str, int]:    # what the memory manager works from, as the scheduler sees it
            return {a: int(ws.memory.process) for a, ws in scheduler.workers.items()}

        def resident() -> dict[str, int]:
            return {a: int((ws.metrics.get("seabiscuit") or {}).get("resident_bytes", 0))
                    for a, ws in scheduler.workers.items()}

        before = reported()
        with sb.distribute(model, client, (x,), budget="16MiB") as dm, torch.no_grad():
            torch.testing.assert_close(dm(x), model(x), rtol=1e-4, atol=1e-5)
            planned = {d.address: int(dm.plan.weight_bytes[i]) for i, d in enumerate(dm.plan.spec.devices)}
            held = wait_for(lambda: (r := resident()) == planned and r, "heartbeats carrying resident bytes")
            assert sum(held.values()) >= 2 * WIDTH * WIDTH * 4      # both weight matrices, nothing dropped

            def risen() -> dict[str, int] | None:
                now = reported()
                rise = {a: now[a] - before[a] for a in held}
                return rise if all(rise[a] >= 0.9 * held[a] for a in held) else None

            rise = wait_for(risen, "the workers' process memory to include their shards")
            for a, nbytes in held.items():
                ws = scheduler.workers[a]
                # NOTE: Dask's pause and spill thresholds compare this process memory with the limit
                assert ws.memory.process >= nbytes and rise[a] >= 0.9 * nbytes
