"""A worker leaves a live cluster: the plan is repaired and requests, in flight or new, still answer."""

from __future__ import annotations

import threading

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.runtime.dataplane.runs import Run

from . import models as M
from .clusters import running_on, seabiscuit_cluster, serve_until, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]


def test_requests_survive_a_worker_leaving() -> None:
    model, x = M.llama(), M.ids()
    with torch.no_grad():
        expected = model(x).logits
    with seabiscuit_cluster(4, 1_600_000) as client:
        with sb.distribute(model, client, (x,), budget="256KiB") as dm:
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            counts = {}
            for b in dm.plan.blocks:
                counts[b.device] = counts.get(b.device, 0) + len(b.ops)
            busiest = max(counts, key=counts.get)
            victim = dm.plan.spec.devices[dm.plan.spec.index(busiest)].address
            stop = threading.Event()
            results, errors, threads = serve_until(dm, x, stop)
            try:
                wait_for(lambda: running_on(client, dm, victim), "a block running on the leaving worker")
                client.retire_workers([victim], close_workers=True)
            finally:
                stop.set()
            for t in threads:
                t.join(timeout=120)
            assert not errors, errors
            assert len(results) >= 6 and all(M.rel_err(r, expected) <= 1e-4 for r in results)
            wait_for(lambda: dm.version >= 1, "the plan repaired after the worker left")
            assert victim not in {d.address for d in dm.plan.spec.devices}
            assert any(e["action"] == "plan" and "left" in e["reason"] for e in dm.events)
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            held = client.run(lambda dask_worker: (dask_worker.plugins["seabiscuit"].resident_bytes,
                                                   dask_worker.plugins["seabiscuit"].budget_bytes))
            assert all(h <= b for h, b in held.values())


def test_a_request_whose_run_was_lost_is_sent_again_not_waited_on_forever(caplog) -> None:
    """A message lost on the data plane leaves nothing running anywhere: past its bound the
    caller finds that no worker holds any of the run that moves, and sends it again."""
    import dask.config

    model, x = M.llama(), M.ids()
    with torch.no_grad():
        expected = model(x).logits
    with dask.config.set({"seabiscuit.runtime.hang-floor": "0.3s", "seabiscuit.runtime.probe-timeout": "0.3s",
                          "seabiscuit.learn.repair": False, "seabiscuit.routing.repair": False}), \
            seabiscuit_cluster(2, 4_000_000, processes=False) as client:
        with sb.distribute(model, client, (x,), budget="256KiB") as dm:
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            (collector,) = {s.address for s in dm.specs if s.outputs}
            plane = next(w for w in client.cluster.workers.values()
                         if w.address == collector).plugins["seabiscuit"].dataplane
            dropped: list[int] = []
            deliver = Run.deliver

            def lose_the_first(run, block, tensors, ticket):      # NOTE: its inputs never land
                if run.keeper is plane and (not dropped or dropped[0] == run.request):
                    dropped.append(run.request)
                    return True
                return deliver(run, block, tensors, ticket)

            Run.deliver = lose_the_first
            got: list[torch.Tensor] = []
            caller = threading.Thread(target=lambda: got.append(dm(x).logits))
            try:
                caller.start()
                caller.join(timeout=120)
                assert not caller.is_alive(), "the request hung"
            finally:
                Run.deliver = deliver
            assert M.rel_err(got[0], expected) <= 1e-4
            assert len(set(dropped)) == 1 and dropped[0] >> 32 > 0     # one request lost, then sent anew
            assert dm.version == 0                                     # no plan change was needed
            assert any("it was lost, and runs again" in r.getMessage() for r in caplog.records)
