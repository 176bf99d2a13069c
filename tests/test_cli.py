from __future__ import annotations

import json

from seabiscuit_dask import cli


def test_plan_prints_the_decomposition_summary(capsys, tmp_path) -> None:
    out = tmp_path / "g.json"
    assert cli.main(["plan", "--model", "gpt2-tiny", "--budget", "64KiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "micro-ops:" in text and "over budget (64.0 KiB): 0" in text
    assert json.loads(out.read_text())["schema"] == 1


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


def test_demo_serves_a_model_bigger_than_each_worker(capsys) -> None:
    assert cli.main(["demo", "--model", "gpt2-tiny", "--workers", "2", "--requests", "2",
                     "--concurrency", "2"]) == 0
    text = capsys.readouterr().out
    assert "starting a LocalCluster: 2 worker processes" in text
    assert "loading weights on the workers" in text and "(100%)" in text
    assert "device" in text and "makespan" in text               # the plan table
    assert "smaller than the model" in text and "(OK)" in text
    assert "latency      median" in text and "requests/s" in text and "dashboard    http" in text


def test_demo_rejects_an_unknown_model(capsys) -> None:
    assert cli.main(["demo", "--model", "llama-20b"]) == 2
    assert "choose one of gpt2-medium, gpt2-tiny, minilm" in capsys.readouterr().err
