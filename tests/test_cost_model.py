"""The cost model's Dask terms and the fusion decisions they drive: pure, no cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest

import seabiscuit_dask as sb
from seabiscuit_dask.ir import Op, OpGraph, TensorSpec
from seabiscuit_dask.placement import NO_DASK, ClusterSpec, DaskSpec, DeviceSpec, Plan, place, simulate
from tests.dags import chain
from tests.test_placement import two_devices

DASK = DaskSpec(task_s=3e-4, hop_s=2e-3, submit_s=1.5e-3, gather_s=1e-3, client_bytes_per_s=1e8)


def test_a_chain_across_two_devices_pays_every_dask_term_once():
    g = chain([0, 0, 0], out_kib=1000, flops=10**6)          # each op 1 ms at 1 GFLOP/s
    spec = two_devices().with_dask(DASK)
    plan = Plan(g, spec, np.array([0, 1, 1]))
    s = simulate(plan)
    nbytes = 1000 * 1024
    submit = DASK.submit_s + nbytes / DASK.client_bytes_per_s            # the input goes with the graph
    first = submit + DASK.task_s + DASK.hop_s / 2                        # scheduler, then to the worker
    assert s.block_start[0] == pytest.approx(first)
    transfer = 1e-4 + nbytes / 1e9
    second = first + 1e-3 + DASK.hop_s / 2 + DASK.task_s + DASK.hop_s / 2 + transfer
    assert s.block_start[1] == pytest.approx(second)
    gather = DASK.gather_s + nbytes / DASK.client_bytes_per_s
    assert s.makespan_s == pytest.approx(second + 2e-3 + DASK.hop_s / 2 + gather)
    assert s.tasks == 2 and s.scheduler_s == pytest.approx(2 * DASK.task_s)
    # Without Dask, only compute and the link remain.
    assert simulate(plan, dask=NO_DASK).makespan_s == pytest.approx(3e-3 + transfer)


def test_the_scheduler_is_one_serial_resource():
    # Eight independent ops on eight devices: the scheduler hands out their tasks one by one.
    n = 8
    t = {"x": TensorSpec((4,), "float32"), **{f"y{i}": TensorSpec((4,), "float32") for i in range(n)}}
    ops = tuple(Op(f"op{i}", "linear", "t", ("x",), (f"y{i}",), flops=10**6) for i in range(n))
    g = OpGraph(ops, t, {}, ("x",), tuple(f"y{i}" for i in range(n)))
    d = dict(flops_per_s={"matmul": 1e9, "other": 1e9}, mem_bytes_per_s=1e12)
    spec = ClusterSpec(tuple(DeviceSpec(f"d{i}", "cpu", 2**30, host="h", **d) for i in range(n)), dask=DASK)
    s = simulate(Plan(g, spec, np.arange(n)))
    starts = np.sort(s.block_start)
    assert np.diff(starts) == pytest.approx([DASK.task_s] * (n - 1))
    assert s.makespan_s == pytest.approx(starts[-1] + 1e-3 + DASK.hop_s / 2 + DASK.gather_s
                                         + 16 * n / DASK.client_bytes_per_s)


def test_a_dependent_task_on_the_same_device_costs_a_hop():
    # A device's ops cut where another device reads its output: one task more than fused.
    t = {n: TensorSpec((4,), "float32") for n in ("x", "a", "b", "c")}
    ops = (Op("p", "linear", "t", ("x",), ("a",), flops=10**6),
           Op("q", "linear", "t", ("a",), ("b",), flops=10**6),
           Op("r", "linear", "t", ("a",), ("c",), flops=10**6))
    g = OpGraph(ops, t, {}, ("x",), ("b", "c"))
    spec = two_devices().with_dask(DASK)
    cut = Plan(g, spec, np.array([0, 0, 1]))
    fused = Plan(g, spec, np.array([0, 0, 1]), info={"fused": True})
    assert len(cut.block_device) == 3 and len(fused.block_device) == 2
    # Cut: q waits a hop and the scheduler after p; fused: q runs right after p.
    q_cut = cut.schedule.block_start[cut.block_of[1]] - cut.schedule.block_finish[cut.block_of[0]]
    assert q_cut == pytest.approx(DASK.hop_s + DASK.task_s)
    assert fused.schedule.op_start[1] == pytest.approx(fused.schedule.op_finish[0])
    # The fused flag travels with the plan's document.
    again = Plan.from_json(fused.to_json(), g)
    assert again.fused and again.blocks == fused.blocks


def test_a_model_that_fits_one_device_is_one_block():
    from tests.models import gpt2, ids

    g = sb.decompose(sb.trace(gpt2(), ids()), "64KiB")
    spec = ClusterSpec.synthetic(None, hosts=2, gpus_per_host=2, cpus_per_host=1)   # 16 GiB GPUs
    plan = place(g, spec)
    assert len(plan.block_device) == 1 and len(set(plan.device_of.tolist())) == 1
    assert plan.info["tier"] == "stages1"
    # Spread over every device as list scheduling would, it pays hops for nothing.
    assert plan.makespan_s < sb.placement.heft(g, spec).makespan_s


def wide(branches: int, flops: int) -> OpGraph:
    """``branches`` independent heavy ops between a fork and a join."""
    t = {"x": TensorSpec((256,), "float32"), "z": TensorSpec((256,), "float32"),
         **{f"y{i}": TensorSpec((256,), "float32") for i in range(branches)}}
    ops = tuple(Op(f"layers.0.b{i}", "linear", "t", ("x",), (f"y{i}",), flops=flops)
                for i in range(branches))
    ops += (Op("layers.0.join", "concat", "t", tuple(f"y{i}" for i in range(branches)), ("z",)),)
    return OpGraph(ops, t, {}, ("x",), ("z",))


@pytest.mark.parametrize("hop_s, spread", [(1e-4, True), (5e-2, True), (0.1, False)])
def test_parallel_work_spreads_only_where_the_hop_is_cheaper(hop_s, spread):
    # 4 x 20 ms on one device, or 20 ms on four and one hop more to join: 60 ms saved.
    g = wide(4, 10**8)
    d = dict(flops_per_s={"matmul": 5e9, "other": 5e9}, mem_bytes_per_s=1e11)
    spec = ClusterSpec(tuple(DeviceSpec(f"d{i}", "cpu", 2**30, host="h", **d) for i in range(4)),
                       dask=DaskSpec(task_s=1e-4, hop_s=hop_s))
    plan = place(g, spec)
    used = len(set(plan.device_of.tolist()))
    assert (used > 1) == spread, plan.table()
    alone = Plan(g, spec, np.zeros(len(g.ops), dtype=np.int64), info={"fused": True})
    assert plan.makespan_s <= alone.makespan_s * 1.001


def test_dask_costs_round_trip_and_are_checked():
    spec = ClusterSpec.synthetic("2x(1gpu+cpu)").with_dask(DASK)
    doc = json.loads(json.dumps(spec.to_dict()))
    assert ClusterSpec.from_dict(doc).dask == DASK
    assert ClusterSpec.from_dict({"preset": "4xcpu", "dask": {"hop": 0.5}}).dask.hop_s == 0.5
    with pytest.raises(sb.SeaBiscuitError, match="unknown fields"):
        ClusterSpec.from_dict({"preset": "4xcpu", "dask": {"latency": 1}})
    with pytest.raises(sb.SeaBiscuitError, match=r"dask.hop_s must be a time"):
        DaskSpec(hop_s=-1.0)
    with pytest.raises(sb.SeaBiscuitError, match="client_bandwidth"):
        DaskSpec(client_bytes_per_s=0.0)


def test_cut_latency_adds_the_hop_and_the_scheduler():
    spec = two_devices(lat=1e-4).with_dask(DASK)
    assert spec.cut_latency[0, 1] == pytest.approx(1e-4 + DASK.hop_s + DASK.task_s)
    assert spec.cut_latency[0, 0] == 0.0


def test_a_device_joining_a_measured_matrix_takes_its_host_peers_links():
    d = dict(flops_per_s={"matmul": 1e9, "other": 1e9}, mem_bytes_per_s=1e12)
    devs = (DeviceSpec("a", "cpu", 2**30, host="h0", **d), DeviceSpec("b", "cpu", 2**30, host="h0", **d),
            DeviceSpec("c", "cpu", 2**30, host="h1", **d))
    bw = ((0.0, 5e9, 1e7), (5e9, 0.0, 1e7), (1e7, 1e7, 0.0))
    lat = ((0.0, 1e-4, 1e-3), (1e-4, 0.0, 1e-3), (1e-3, 1e-3, 0.0))
    spec = ClusterSpec(devs, matrix=(bw, lat))
    grown = spec.with_device(DeviceSpec("n", "cpu", 2**30, host="h0", **d))
    assert grown.bandwidth[3, 2] == 1e7 and grown.bandwidth[3, 0] == 5e9 and grown.bandwidth[0, 3] == 5e9
    assert grown.latency[3, 1] == 1e-4 and grown.latency[2, 3] == 1e-3
    assert grown.bandwidth[3, 3] == np.inf
