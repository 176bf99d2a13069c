"""Plan.report: the dry-run figures (headroom, KV cache, bottlenecks, throughput, losses)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

import seabiscuit_dask as sb
from seabiscuit_dask import cli
from seabiscuit_dask.placement import ClusterSpec, DeviceLost, place, replan
from seabiscuit_dask.placement.report import kv_bytes_per_token
from tests import models as M

CONTEXT = 64


def expected_kv_per_token(model) -> int:
    """2 (keys and values) x layers x KV heads x head dim x 4 bytes (float32), from the config."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4


@pytest.fixture(scope="module")
def llama():
    return M.llama()


@pytest.fixture(scope="module")
def graph(llama):
    return sb.decompose(sb.trace(llama, (M.ids(seq=16),)), "16KiB")


@pytest.fixture(scope="module")
def plan(graph):
    # NOTE: 2 MiB devices: no one holds the 3.6 MiB model, two together cannot either
    return place(graph, ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB"))


@pytest.fixture(scope="module")
def roomy(graph):
    return place(graph, ClusterSpec.synthetic("4xcpu", hosts=4, cpu_memory="2MiB"))


def test_headroom_is_budget_less_peak_on_every_device(plan):
    r = plan.report(context=CONTEXT)
    assert [d.name for d in r.devices] == list(plan.spec.names)
    used = 0
    for i, d in enumerate(r.devices):
        assert d.memory_bytes == plan.spec.devices[i].memory_bytes == 2 * 2**20
        assert d.peak_bytes == plan.peak_bytes[i] and d.weight_bytes == plan.weight_bytes[i]
        assert d.headroom_bytes == d.memory_bytes - d.peak_bytes
        assert d.busy_s == pytest.approx(plan.schedule.busy_s[i])
        used += d.weight_bytes > 0
    assert used >= 2                                     # the plan really spreads


def test_kv_bytes_per_token_come_from_the_graph(llama, graph):
    per_layer = kv_bytes_per_token(graph)
    # NOTE: 4 query heads share 2 KV heads; the cache holds each KV head once
    assert sorted(per_layer) == [0, 1]
    assert sum(per_layer.values()) == expected_kv_per_token(llama) == 1024
    from seabiscuit_dask.trace.decoder import trace_step

    step = sb.decompose(trace_step(llama, 1, 1), "16KiB")     # the decode step lists its cache layers
    assert kv_bytes_per_token(step) == per_layer


def test_sessions_and_tokens_fit_the_headroom_of_the_cache_devices(llama, plan):
    r = plan.report(context=CONTEXT)
    per_layer = expected_kv_per_token(llama) // 2
    assert r.kv_bytes_per_token == 2 * per_layer and r.context_tokens == CONTEXT
    # each layer's cache lives where most of its attention ops run
    names = plan.spec.names
    for layer in (0, 1):
        ops = [op for op in plan.graph.ops if op.kind == "attention" and f".layers.{layer}." in op.name]
        home = Counter(plan.assignment[op.name] for op in ops).most_common(1)[0][0]
        assert layer in next(d.kv_layers for d in r.devices if d.name == home)
    holders = [d for d in r.devices if d.kv_layers]
    assert sorted(x for d in holders for x in d.kv_layers) == [0, 1]
    for d in r.devices:
        if not d.kv_layers:
            assert d.kv_tokens is None and d.sessions is None and d.kv_bytes_per_token == 0
            continue
        kv = per_layer * len(d.kv_layers)
        assert d.kv_bytes_per_token == kv
        assert d.kv_tokens * kv <= d.headroom_bytes < (d.kv_tokens + 1) * kv
        assert d.sessions * CONTEXT * kv <= d.headroom_bytes < (d.sessions + 1) * CONTEXT * kv
    # the cluster holds what its tightest cache device holds: one more session fails there
    assert r.sessions == min(d.sessions for d in holders) > 0
    low = next(d for d in holders if d.name == r.kv_limited_by)
    assert all(r.sessions * CONTEXT * d.kv_bytes_per_token <= d.headroom_bytes for d in holders)
    assert (r.sessions + 1) * CONTEXT * low.kv_bytes_per_token > low.headroom_bytes
    assert r.kv_tokens == low.kv_tokens == min(d.kv_tokens for d in holders)
    assert names.index(r.kv_limited_by) >= 0
    assert plan.report(context=4 * CONTEXT).sessions == r.kv_tokens // (4 * CONTEXT)


def test_a_graph_without_attention_has_no_kv_cache():
    g = sb.decompose(sb.trace(M.convnet(), (M.image(),)), "64KiB")
    r = place(g, ClusterSpec.synthetic("2x(1gpu+cpu)")).report()
    assert r.kv_bytes_per_token == 0 and r.sessions is None and r.kv_limited_by is None
    assert all(d.kv_tokens is None and not d.kv_layers for d in r.devices)
    assert "no KV cache" in str(r)


def test_bottlenecks_latency_and_throughput(plan):
    r = plan.report()
    busy = plan.schedule.busy_s
    assert r.bottleneck_device == plan.spec.names[int(np.argmax(busy))]
    assert r.bottleneck_busy_s == pytest.approx(busy.max()) and busy.max() > 0
    bw, lat, sent = plan.spec.bandwidth, plan.spec.latency, plan.bytes_between
    times = {(a, b): sent[a, b] / bw[a, b] + lat[a, b] for a in range(len(busy)) for b in range(len(busy))
             if sent[a, b] > 0}
    (a, b), worst = max(times.items(), key=lambda kv: kv[1])
    link = r.bottleneck_link
    assert (link.src, link.dst) == (plan.spec.names[a], plan.spec.names[b])
    assert link.sent_bytes == sent[a, b] > 0 and link.transfer_s == pytest.approx(worst)
    assert r.makespan_s == plan.makespan_s > 0
    assert r.serial_requests_per_s == pytest.approx(1 / plan.makespan_s)
    assert r.scheduler_s == pytest.approx(len(plan.blocks) * plan.spec.dask.task_s)
    assert r.pipelined_requests_per_s == pytest.approx(1 / max(busy.max(), r.scheduler_s))
    assert r.pipelined_requests_per_s > r.serial_requests_per_s


def test_one_device_has_no_bottleneck_link(graph):
    plan = place(graph, ClusterSpec.synthetic("2x(1gpu+cpu)"))        # 16 GiB GPUs: one holds it
    r = plan.report()
    assert r.bottleneck_link is None and "bottleneck link: none" in str(r)
    assert r.pipelined_requests_per_s == pytest.approx(1 / max(plan.schedule.busy_s.max(), r.scheduler_s))


def test_losing_a_device_that_holds_weights_replans(roomy):
    busy = roomy.schedule.busy_s
    victim = roomy.spec.names[int(np.argmax(roomy.weight_bytes))]
    r = roomy.report(context=CONTEXT, lose=[victim])
    (x,) = r.losses
    want = replan(roomy, DeviceLost(victim))
    moved = roomy.workload.weight_bytes[roomy.device_of == roomy.spec.index(victim)].sum()
    assert x.lost == (victim,) and x.fits and x.reason == ""
    assert x.moved_bytes == want.info["moved_bytes"] == moved > 0
    assert x.moved_ops == int((roomy.device_of == roomy.spec.index(victim)).sum())
    before = dict(zip(roomy.spec.names, roomy.weight_bytes))
    grown = sum(max(0, w - before[n]) for n, w in zip(want.spec.names, want.weight_bytes))
    assert x.loaded_bytes == round(grown) > 0
    assert x.makespan_s == pytest.approx(want.makespan_s)
    assert x.bottleneck_device == want.spec.names[int(np.argmax(want.schedule.busy_s))] != victim
    assert x.bottleneck_busy_s == pytest.approx(want.schedule.busy_s.max())
    assert x.memory_bytes == 3 * 2 * 2**20 and busy.max() > 0
    assert f"lose {victim}: latency" in str(r)


def test_losing_any_device_of_a_tight_cluster_does_not_fit(plan):
    r = plan.report(lose="all")
    assert [x.lost for x in r.losses] == [(n,) for n in plan.spec.names]
    model = int(plan.workload.weight_bytes.sum())
    for x in r.losses:
        assert not x.fits and x.makespan_s is None and x.bottleneck_device is None
        assert x.weight_bytes == model and x.memory_bytes == 2 * 2 * 2**20
        assert "short by" in x.reason
        assert f"lose {x.lost[0]}: does not fit" in str(r)
    together = plan.report(lose=[plan.spec.names[:2]]).losses[0]
    assert together.lost == plan.spec.names[:2] and not together.fits and together.memory_bytes == 2**21


def test_report_input_errors_and_json(plan):
    with pytest.raises(sb.SeaBiscuitError, match="no device 'nope'"):
        plan.report(lose=["nope"])
    with pytest.raises(sb.BadInput, match="context must be at least 1"):
        plan.report(context=0)
    r = plan.report(context=CONTEXT, lose=[plan.spec.names[0]])
    doc = json.loads(json.dumps(r.to_dict()))
    assert doc == r.to_dict()
    assert doc["sessions"] == r.sessions and doc["bottleneck_device"] == r.bottleneck_device
    assert [d["headroom_bytes"] for d in doc["devices"]] == [d.headroom_bytes for d in r.devices]
    assert doc["losses"][0]["lost"] == [plan.spec.names[0]] and doc["losses"][0]["fits"] is False
    assert math.isclose(doc["makespan_s"], plan.makespan_s)


def test_cli_plan_prints_the_report(capsys):
    args = ["plan", "--model", "gpt2-tiny", "--budget", "64KiB", "--cluster", "2x(1gpu+cpu)"]
    assert cli.main([*args, "--context", "256", "--lose", "all", "--lose", "h0-gpu0,h1-gpu0"]) == 0
    text = capsys.readouterr().out
    # the same plan built here prints the same report
    from seabiscuit_dask.models import demo_model

    model, x = demo_model("gpt2-tiny", materialize=False)
    plan = place(sb.decompose(sb.trace(model, x), "64KiB"), ClusterSpec.synthetic("2x(1gpu+cpu)"))
    names = plan.spec.names
    r = plan.report(context=256, lose=[*([n] for n in names), ["h0-gpu0", "h1-gpu0"]])
    assert str(r) in text
    # gpt2-tiny: 2 layers x 4 heads x (32 + 32) x 4 bytes per token
    assert r.kv_bytes_per_token == 2 * 4 * 64 * 4 and "2.0 KiB per token over 2 layers" in text
    assert f"= {r.sessions} sessions of 256 tokens" in text and r.sessions > 0
    assert len(r.losses) == len(names) + 1 and r.losses[-1].lost == ("h0-gpu0", "h1-gpu0")
    assert cli.main([*args, "--lose", "h9-gpu9"]) == 2
    assert "no device 'h9-gpu9'" in capsys.readouterr().err
