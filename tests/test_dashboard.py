"""The /seabiscuit dashboard page and its JSON routes, fetched over HTTP from a live cluster,
and rendered in headless Chromium (skipped where none is installed)."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import dask
import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.dashboard import record_serving
from seabiscuit_dask.dashboard.data import Activity
from seabiscuit_dask.dashboard.page import PANES, TITLES

from . import models as M
from .browser import BOKEH_PLOTS_JS, chromium_page, find_chromium, write_png
from .clusters import wait_for

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]

WORKER_BUDGET = 2_000_000
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))     # NOTE: loopback, never a proxy
REQUESTS = 3


def get(url: str) -> bytes:
    with OPENER.open(url, timeout=30) as r:
        return r.read()


def api(base: str, view: str) -> object:
    return json.loads(get(f"{base}/seabiscuit/api/{view}"))


@pytest.fixture(scope="module")
def served():
    """A 3-worker cluster in this process with its dashboard, serving toy GPT-2 after 3 requests."""
    from distributed import Client, LocalCluster

    model, x = M.gpt2(), M.ids()
    # NOTE: no learned repair moves the plan while the routes are compared with it (runs are
    # reported in batches, so the learner may act after the requests)
    with dask.config.set({"seabiscuit.learn.repair": False, "seabiscuit.routing.repair": False}), \
            LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
                         resources={"MEM": WORKER_BUDGET}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        with sb.distribute(model, client, (x,), budget="256KiB") as dm, torch.no_grad():
            for _ in range(REQUESTS):
                assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4
            yield base, client, dm


def test_the_page_is_in_the_dashboard_menu(served) -> None:
    base, _, _ = served
    page = get(f"{base}/seabiscuit").decode()
    assert "static/js/bokeh.min.js" in page and "bokeh-tables" in page     # a Bokeh document with tables
    assert 'href="seabiscuit"' in get(f"{base}/status").decode()      # the menu of every page lists it


def test_workers_route_shows_budgets_and_resident_weights(served) -> None:
    base, _, dm = served
    plan = dm.plan
    expected = {d.address: int(plan.weight_bytes[i]) for i, d in enumerate(plan.spec.devices)}

    def settled():       # NOTE: the figures come with the workers' heartbeats
        ws = api(base, "workers")
        return ws if all(w["weight_bytes"] == expected.get(w["address"], 0) for w in ws) else None

    workers = wait_for(settled, "heartbeats carrying the resident weight bytes")
    assert len(workers) == 3
    for w in workers:
        assert w["agent"] and w["budget_bytes"] == WORKER_BUDGET and w["device"] == "cpu"
        used = w["weight_bytes"] + w["kv_cache_bytes"] + w["activation_bytes"]
        assert w["free_bytes"] == WORKER_BUDGET - used
        assert w["name"] in plan.spec.names and w["gpus"] == []


def test_plans_route_matches_the_plan(served) -> None:
    base, _, dm = served

    def measured():
        plans = api(base, "plans")
        # NOTE: the first request is left out (it loads the blocks)
        return plans if plans and plans[0]["programs"][0]["requests"] >= REQUESTS - 1 else None

    (p,) = wait_for(measured, "the latencies of the requests")
    plan = dm.plan
    assert p["model"] == dm.model_id and p["version"] == dm.version == 0
    assert [d["name"] for d in p["devices"]] == list(plan.spec.names)
    assert sum(d["blocks"] for d in p["devices"]) == len(plan.blocks)
    assert [d["weight_bytes"] for d in p["devices"]] == [int(b) for b in plan.weight_bytes]
    np.testing.assert_allclose(np.array(p["bytes_between"]), plan.bytes_between)
    forward = p["programs"][0]
    assert forward["label"] == "forward" and forward["blocks"] == len(plan.blocks)
    assert forward["predicted_s"] > 0 and all(s > 0 for s in forward["measured_s"])
    assert min(forward["measured_s"]) <= forward["measured_median_s"] <= max(forward["measured_s"])


def test_timeline_route_has_every_block_of_every_request(served) -> None:
    base, _, dm = served
    n = len(dm.plan.blocks)
    runs = wait_for(lambda: (r := api(base, "timeline")) and len(r) >= REQUESTS * n and r, "block runs")
    mine = [r for r in runs if r["model"] == dm.model_id and r["program"] == 0]
    # NOTE: a request number is its place in order, then 32 random bits
    seen = {(r["request"] >> 32, r["block"]) for r in mine}
    assert seen >= {(q, b) for q in range(REQUESTS) for b in range(n)}
    spec = dm.plan.spec
    assert {r["worker"] for r in mine} == {spec.devices[spec.names.index(b.device)].address
                                           for b in dm.plan.blocks}
    assert all(r["duration_s"] > 0 and r["how"] == "computed" for r in mine)
    assert any(r["layers"] for r in mine)                # blocks name the layers they hold
    last = max(r["start"] for r in runs)
    assert json.loads(get(f"{base}/seabiscuit/api/timeline?since={last}")) == []
    with pytest.raises(urllib.error.HTTPError) as e:
        get(f"{base}/seabiscuit/api/timeline?since=yesterday")
    assert e.value.code == 400


def test_data_plane_runs_are_on_dasks_own_task_stream(served) -> None:
    """Dask's status page draws the block runs of the data plane (no Dask task runs them) in its task
    stream, each on the worker that ran it, named by its program, beside Dask's own tasks."""
    from dask.utils import key_split
    from distributed.diagnostics.task_stream import rectangles

    base, client, dm = served
    assert 'href="seabiscuit"' in get(f"{base}/status").decode()    # NOTE: the page starts Dask's task stream

    def ours(dask_scheduler) -> list[dict]:
        stream = dask_scheduler.plugins["task-stream"].buffer
        return [r for r in stream if str(r["key"]).startswith("seabiscuit-")]

    x = M.ids()
    with torch.no_grad():
        for _ in range(2):
            dm(x)
    spec = dm.plan.spec
    workers = {spec.devices[spec.names.index(b.device)].address for b in dm.plan.blocks}

    def every_worker() -> list[dict] | None:
        runs = client.run_on_scheduler(ours)
        return runs if {r["worker"] for r in runs} == workers else None

    runs = wait_for(every_worker, "every worker's runs on the task stream")
    assert {key_split(r["key"]) for r in runs} == {"seabiscuit-forward"}
    drawn = rectangles(runs)        # NOTE: what the status page's task stream figure draws of them
    assert len(drawn["start"]) == len(runs) and all(d > 0 for d in drawn["duration"])
    assert set(drawn["name"]) == {"seabiscuit-forward"}


def test_runs_that_follow_each_other_are_one_span_of_the_task_stream() -> None:
    """A worker's batch of runs becomes task-stream records in order of start: runs of one kind and
    model within 2 ms of each other are one span (a decode loop's back-to-back blocks), a gap or
    another kind starts the next; runs of models not deployed, or with broken figures, are left out."""
    from seabiscuit_dask.lower.blocks import program_block
    from seabiscuit_dask.plugins.scheduler import task_stream_records

    step = program_block(1, 0)
    runs = [{"model": "ab12cd34", "block": step, "start": 10.0105, "compute_s": 0.004},   # NOTE: not in order
            {"model": "ab12cd34", "block": step, "start": 10.0, "compute_s": 0.01},
            {"model": "ab12cd34", "block": 0, "start": 10.015, "compute_s": 0.001},
            {"model": "ab12cd34", "block": step, "start": 10.05, "compute_s": 0.01},
            {"model": "gone", "block": step, "start": 10.06, "compute_s": 0.01},
            {"model": "ab12cd34", "block": step, "start": float("nan"), "compute_s": 0.01},
            {"model": "ab12cd34", "block": "x"}]
    got = task_stream_records("tcp://w:1", runs, {"ab12cd34"})
    spans = [(r["key"].split("-")[1], r["startstops"][0]["start"], r["startstops"][0]["stop"]) for r in got]
    assert spans == [("step", 10.0, 10.0145), ("forward", 10.015, 10.016), ("step", 10.05, 10.06)]
    assert all(r["worker"] == "tcp://w:1" and r["status"] == "OK" for r in got)
    assert len({r["key"] for r in got}) == 3


def test_events_route_shows_a_drain_with_its_cost(served) -> None:
    base, _, dm = served
    events = api(base, "events")
    assert any(e["action"] == "plan" and e["model"] == dm.model_id and e["reason"] == "deployed"
               for e in events)
    worker = dm.plan.blocks[0].device
    worker = dm.plan.spec.devices[dm.plan.spec.names.index(worker)].address
    dm.drain(worker)
    try:
        drained = [e for e in api(base, "events") if e["action"] == "plan" and e["version"] == dm.version]
        assert len(drained) == 1, drained
        assert worker in drained[0]["reason"] and "drained" in drained[0]["reason"]
        assert drained[0]["moved_bytes"] > 0 and drained[0]["replan_s"] > 0
        everything = api(base, "")                       # /seabiscuit/api: all views at once
        assert set(everything) >= {"workers", "plans", "timeline", "events"}
        assert everything["plans"][0]["excluded"] == {worker: "drained"}
    finally:
        dm.restore(worker)


def test_activity_latency_runs_from_submission_to_the_last_block() -> None:
    a = Activity(runs=10, requests=2)
    a.submitted([("m", 0, 6, 0)], now=90.0)                # a program's first request is left out
    a.ran({"model": "m", "version": 0, "request": 6, "block": 0, "start": 90.0, "compute_s": 5.0})
    a.measured({"model": "m", "program": 3, "latency_s": 9.0})
    assert a.latencies == {}
    a.submitted([("m", 0, 7, 0), ("m", 0, 7, 1)], now=100.0)
    a.ran({"model": "m", "version": 0, "request": 7, "block": 0, "start": 100.5, "compute_s": 0.25})
    assert a.latencies == {}                               # one block of two: not finished
    a.ran({"model": "m", "version": 0, "request": 7, "block": 1, "start": 100.75, "compute_s": 0.5})
    assert list(a.latencies[("m", 0)]) == [1.25]
    for q in range(8, 12):                                  # only the newest `requests` latencies stay
        a.submitted([("m", 0, q, 0)], now=200.0 + q)
        a.ran({"model": "m", "version": 0, "request": q, "block": 0, "start": 200.0 + q, "compute_s": 0.5})
    assert list(a.latencies[("m", 0)]) == [0.5, 0.5]
    a.ran({"model": "m", "block": "x"})                   # malformed reports are ignored
    assert len(a.runs) == 7
    a.measured({"model": "m", "program": 3, "latency_s": 0.5})
    assert list(a.latencies[("m", 3)]) == [0.5]
    a.forget("m")
    assert a.latencies == {}
    a.measured({"model": "m", "program": 3, "latency_s": 9.0})     # deployed again: a first request again
    assert a.latencies == {}


def test_preload_puts_the_page_on_the_dashboard() -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
                      scheduler_kwargs={"preload": ["seabiscuit_dask.plugins.preload"]}) as cluster, \
            Client(cluster):
        base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        assert b"static/js/bokeh.min.js" in get(f"{base}/seabiscuit")
        assert b'href="seabiscuit"' in get(f"{base}/status")
        workers = wait_for(lambda: (w := api(base, "workers")) and w[0]["agent"] and w, "the worker's agent")
        assert workers[0]["budget_bytes"] > 0
        panes = json.loads(get(f"{base}/individual-plots.json"))      # what dask-labextension lists
        assert {f"/individual-seabiscuit-{p}" for p in PANES} <= set(panes.values())
        assert b"static/js/bokeh.min.js" in get(f"{base}/individual-seabiscuit-timeline")


@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_page_draws_in_chromium(served, tmp_path: Path) -> None:
    base, client, dm = served
    gpu = {"index": 0, "name": "Fake H100", "memory_total_bytes": 80 << 30, "memory_used_bytes": 20 << 30,
           "utilization": 0.5, "temperature_c": 61.0}

    def fake_gpu(dask_worker) -> None:     # NOTE: what an NVML agent reports, on one worker
        p = dask_worker.plugins["seabiscuit"]
        p.report["gpus"] = [gpu]
        p.simulated.update(gpu_memory_used_bytes=[20 << 30], gpu_temperature_c=[61.0], gpu_utilization=[0.5])

    client.run(fake_gpu, workers=[dm.plan.spec.devices[0].address])
    wait_for(lambda: any(w["gpus"] for w in api(base, "workers")), "the fake GPU in a heartbeat")
    # what a serving process reports every 2 s (``Server.report``): two samples draw each line
    for i, t in enumerate((time.time() - 2, time.time())):
        assert client.run_on_scheduler(record_serving, {
            "time": t, "name": "smol", "model": dm.model_id, "running": 1 + i, "waiting": i,
            "tokens_per_s": 20.0 + i, "requests_per_s": 0.5, "ttft_ms": 300.0, "itl_ms": 60.0 + i,
            "errors": {"429": i}})
    assert api(base, "serving")[0]["name"] == "smol"
    with chromium_page() as page:
        page.navigate(f"{base}/seabiscuit")
        plots = wait_for(lambda: (p := page.evaluate(BOKEH_PLOTS_JS)) and len(p) == len(TITLES)
                         and all(x["glyph_pixels"] > 0 for x in p) and p, "every figure to draw its data")
        shot = write_png(page.screenshot(), tmp_path / "seabiscuit-dashboard.png")
    if os.environ.get("SEABISCUIT_SCREENSHOTS"):          # NOTE: a look at every figure drawn
        shutil.copy(shot, Path(os.environ["SEABISCUIT_SCREENSHOTS"]) / "dashboard-test.png")
    assert [p["title"] for p in plots] == list(TITLES.values())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
