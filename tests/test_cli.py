from __future__ import annotations

import json
import re
import urllib.request

from seabiscuit_dask import cli


def test_plan_prints_the_decomposition_summary(capsys, tmp_path) -> None:
    out = tmp_path / "g.json"
    assert cli.main(["plan", "--model", "gpt2-tiny", "--budget", "64KiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "micro-ops:" in text and "over budget (64.0 KiB): 0" in text
    assert json.loads(out.read_text())["schema"] == 2


def test_plan_reports_bad_input_without_a_traceback(capsys) -> None:
    assert cli.main(["plan", "--model", "nope"]) == 2
    assert "neither a model folder nor one of" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "gpt2-tiny", "--budget", "lots"]) == 2
    assert "budget must be a byte count" in capsys.readouterr().err


def test_plan_places_on_a_cluster_and_writes_the_plan(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "gpt2-tiny", "--budget", "64KiB", "--cluster", "2x(1gpu+cpu)",
                     "--plan-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "h1-gpu0" in text and "makespan" in text and "lower bound" in text
    doc = json.loads(out.read_text())
    assert doc["method"] == "multilevel" and len(doc["cluster"]["devices"]) == 4
    assert cli.main(["plan", "--model", "gpt2-tiny", "--cluster", "moon"]) == 2
    assert "unknown cluster preset" in capsys.readouterr().err


def test_plan_dry_runs_on_a_live_cluster_without_deploying(capsys) -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None,
                      resources={"MEM": 3_000_000}) as cluster, Client(cluster) as client:
        assert cli.main(["plan", "--model", "gpt2-tiny", "--budget", "64KiB", "--cluster",
                         cluster.scheduler_address, "--lose", "all"]) == 0
        text = capsys.readouterr().out
        assert f"measuring the cluster at {cluster.scheduler_address}" in text
        assert "w0" in text and "w1" in text and "headroom" in text and "lose w0" in text
        plugin = cluster.scheduler.plugins["seabiscuit"]
        assert plugin.state.models == {}                     # a dry run: nothing was deployed
        held = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident_bytes)
        assert set(held.values()) == {0}


def test_demo_serves_a_model_bigger_than_each_worker(capsys) -> None:
    assert cli.main(["demo", "--model", "gpt2-tiny", "--workers", "2", "--requests", "2",
                     "--concurrency", "2"]) == 0
    text = capsys.readouterr().out
    assert "starting a LocalCluster: 2 worker processes" in text
    assert "loading weights on the workers" in text and "(100%)" in text
    assert "device" in text and "makespan" in text               # the plan table
    assert "smaller than the model" in text and "(OK)" in text
    assert "latency      median" in text and "requests/s" in text and "dashboard    http" in text
    assert "closes when the demo ends" in text and "serving until Ctrl-C" not in text


def test_demo_rejects_an_unknown_model(capsys) -> None:
    assert cli.main(["demo", "--model", "llama-20b"]) == 2
    assert "choose one of smollm2, gpt2-medium, gpt2-tiny, minilm" in capsys.readouterr().err


def test_demo_serve_keeps_the_dashboard_up_until_ctrl_c(capsys, monkeypatch) -> None:
    from seabiscuit_dask import demo

    seen = []

    def ctrl_c() -> None:                 # the dashboard answers while serving; then a simulated Ctrl-C
        text = capsys.readouterr().out
        seen.append(text)
        link = re.search(r"dashboard at (\S+); serving until Ctrl-C", text).group(1)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        assert link.endswith("/seabiscuit")
        with opener.open(link, timeout=30) as r:
            assert r.status == 200 and b"bokeh.min.js" in r.read()
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "wait_for_interrupt", ctrl_c)
    assert cli.main(["demo", "--model", "gpt2-tiny", "--workers", "2", "--requests", "1",
                     "--concurrency", "1", "--serve"]) == 0
    assert len(seen) == 1 and "(OK)" in seen[0] and "closes when the demo ends" not in seen[0]
    assert "stopping" in capsys.readouterr().out


def test_demo_reports_an_unreachable_scheduler_in_one_line(capsys) -> None:
    address = "tcp://127.0.0.1:1"                  # NOTE: port 1 (tcpmux) has no listener here
    assert cli.main(["demo", "--scheduler", address]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("seabiscuit: error: ") and address in err
    assert "dask scheduler --preload seabiscuit_dask.plugins.preload" in err
