"""replan: pure unit tests of each event, no cluster."""

from __future__ import annotations

import numpy as np
import pytest

import seabiscuit_dask as sb
from seabiscuit_dask.placement import CapacityChanged, DeviceAdded, DeviceLost, DeviceSpec, place, replan
from seabiscuit_dask.placement.cluster import NO_DASK
from tests.dags import random_dag
from tests.test_placement import block_graph_acyclic, small_spec


@pytest.fixture(scope="module")
def plan():
    # NOTE: without Dask's costs the plan spreads over every device: each repair has work to move.
    g = random_dag(400, seed=11, window=20, out_kib=(16, 128))
    return place(g, small_spec(hosts=2, gpus=3, gpu_mem="64MiB", cpu_mem="64MiB", dask=NO_DASK))


@pytest.mark.parametrize("lost", ["h0-gpu1", "h1-gpu0", "h0-cpu0"])
def test_device_lost_moves_only_its_ops_to_the_same_host(plan, lost):
    new = replan(plan, DeviceLost(lost))
    assert lost not in new.spec.names and len(new.spec.devices) == len(plan.spec.devices) - 1
    before, after = plan.assignment, new.assignment
    moved = [op for op in before if before[op] != after[op]]
    assert set(moved) == set(plan.ops_on(lost))
    w = plan.workload
    lost_bytes = plan.weight_bytes[plan.spec.index(lost)]
    assert new.info["moved_bytes"] == pytest.approx(lost_bytes)
    assert new.info["moved_ops"] == len(moved)
    host = plan.spec.devices[plan.spec.index(lost)].host
    assert all(new.spec.devices[new.spec.index(after[op])].host == host for op in moved)
    assert new.feasible and block_graph_acyclic(new)
    assert w is new.workload


def test_replan_is_deterministic(plan):
    a = replan(plan, DeviceLost("h1-gpu2"))
    b = replan(plan, DeviceLost("h1-gpu2"))
    assert np.array_equal(a.device_of, b.device_of) and a.assignment == b.assignment


def test_losing_devices_until_the_model_no_longer_fits(plan):
    p = plan
    with pytest.raises(sb.ClusterTooSmall, match=r"short by .* \(\d+ bytes\)"):
        for name in ["h0-cpu0", "h1-cpu0", "h0-gpu0", "h0-gpu1", "h0-gpu2", "h1-gpu0", "h1-gpu1"]:
            p = replan(p, DeviceLost(name))
            assert p.feasible


def test_unknown_device_and_unknown_event(plan):
    with pytest.raises(sb.SeaBiscuitError, match="no device 'h9-gpu9'"):
        replan(plan, DeviceLost("h9-gpu9"))
    with pytest.raises(sb.SeaBiscuitError, match="does not know the event"):
        replan(plan, "lost h0-gpu0")  # type: ignore[arg-type]


def test_device_added_to_a_host_takes_a_fair_share(plan):
    gpu = plan.spec.devices[0]
    extra = DeviceSpec("h0-gpu9", "gpu", gpu.memory_bytes, gpu.flops_per_s, gpu.mem_bytes_per_s,
                       gpu.op_overhead_s, host="host0", rack=gpu.rack)
    new = replan(plan, DeviceAdded(extra))
    assert new.spec.names[-1] == "h0-gpu9"
    mine = new.ops_on("h0-gpu9")
    assert mine, "the new device took no work"
    # Only ops of its host moved, and only onto it.
    changed = [op for op in plan.assignment if plan.assignment[op] != new.assignment[op]]
    assert set(changed) == set(mine)
    host0 = {d.name for d in plan.spec.devices if d.host == "host0"}
    assert {plan.assignment[op] for op in mine} <= host0
    host_bytes = plan.weight_bytes[[plan.spec.index(n) for n in host0]].sum()
    assert new.info["moved_bytes"] <= host_bytes / 3      # at most its share of 3 equal GPUs + a CPU
    assert new.makespan_s <= plan.makespan_s * 1.05
    assert new.feasible and block_graph_acyclic(new)


def test_device_added_on_a_new_host_moves_nothing(plan):
    cpu = DeviceSpec("far", "cpu", 2**30, {"matmul": 1e11, "other": 1e10}, 1e10, host="elsewhere")
    new = replan(plan, DeviceAdded(cpu))
    assert new.info["moved_bytes"] == 0 and new.assignment == plan.assignment
    with pytest.raises(sb.SeaBiscuitError, match="repeated"):
        replan(plan, DeviceAdded(DeviceSpec("h0-gpu0", "cpu", 2**30, {"matmul": 1.0, "other": 1.0}, 1.0)))


def test_capacity_shrink_moves_just_enough(plan):
    name = "h1-gpu1"
    i = plan.spec.index(name)
    held = plan.weight_bytes[i]
    new_mem = int(held * 0.6)                         # less the 1/8 reserve: room for about half
    new = replan(plan, CapacityChanged(name, memory_bytes=new_mem))
    assert new.spec.devices[i].memory_bytes == new_mem
    assert new.weight_bytes[i] <= new_mem and new.feasible
    assert 0 < new.info["moved_bytes"] <= held
    changed = [op for op in plan.assignment if plan.assignment[op] != new.assignment[op]]
    assert all(plan.assignment[op] == name for op in changed)


def test_capacity_growth_moves_nothing_and_a_slowdown_sheds_work(plan):
    name = "h0-gpu2"
    grown = replan(plan, CapacityChanged(name, memory_bytes=2**34))
    assert grown.info["moved_bytes"] == 0 and grown.assignment == plan.assignment
    faster = replan(plan, CapacityChanged(name, scale={"matmul": 0.5, "other": 0.5}))
    assert faster.info["moved_ops"] == 0
    slow = {"matmul": 4.0, "other": 4.0}
    slower = replan(plan, CapacityChanged(name, scale=slow))
    assert slower.spec.devices[plan.spec.index(name)].scale == slow
    changed = [op for op in plan.assignment if plan.assignment[op] != slower.assignment[op]]
    assert changed and all(plan.assignment[op] == name for op in changed)
    assert len(changed) < len(plan.ops_on(name))          # it keeps part of its work
    stay = sb.Plan(plan.graph, slower.spec, plan.device_of)
    assert slower.makespan_s < stay.makespan_s and slower.feasible and block_graph_acyclic(slower)


def three_devices(mib: int = 100, hosts: tuple[str, str, str] = ("s0", "s0", "s1")) -> sb.ClusterSpec:
    d = dict(flops_per_s={"matmul": 1e12, "other": 1e11}, mem_bytes_per_s=1e11)
    return sb.ClusterSpec(tuple(DeviceSpec(n, "gpu", mib * 2**20, host=h, **d)
                                for n, h in zip("ABC", hosts)))


def test_capacity_shrink_of_the_last_device():
    from tests.dags import chain

    spec = three_devices()
    p = sb.Plan(chain([10 * 1024] * 6), spec, np.array([0, 0, 2, 2, 2, 2]))
    new = replan(p, CapacityChanged("C", memory_bytes=40 * 2**20))
    assert new.weight_bytes[2] <= 35 * 2**20 and new.feasible
    assert set(new.ops_on("C")) <= set(p.ops_on("C"))


def test_lost_ops_go_farther_out_when_no_neighbour_fits_them():
    from tests.dags import chain

    spec = three_devices(mib=100, hosts=("s0", "s0", "s1"))
    # The 60 MiB op on A cannot go to its host peer B (already holding 60 MiB): it goes to C.
    p = sb.Plan(chain([60 * 1024, 60 * 1024]), spec, np.array([0, 1]))
    new = replan(p, DeviceLost("A"))
    assert new.assignment["op0"] == "C" and new.feasible


def test_weights_that_fit_in_total_but_not_in_pieces():
    from tests.dags import chain

    spec = three_devices(mib=80)
    with pytest.raises(sb.ClusterTooSmall, match="not in pieces|memory is"):
        place(chain([40 * 1024] * 5), spec)


def test_a_repaired_plan_cuts_the_same_blocks_at_both_ends_of_the_wire(plan):
    for name in plan.spec.names[:4]:
        new = replan(plan, DeviceLost(name))
        assert block_graph_acyclic(new)
        back = sb.Plan.from_json(new.to_json(stats=False), new.graph)
        assert np.array_equal(back.block_of, new.block_of)
        assert np.array_equal(back.phases, new.phases)


def test_blocks_out_of_phase_order_are_refused(plan):
    doc = plan.to_dict(stats=False)
    first = max(doc["blocks"], key=lambda b: b["phase"])
    for b in doc["blocks"]:
        b["phase"] = first["phase"] - b["phase"]       # reversed: every dependency goes backwards
    with pytest.raises(sb.SeaBiscuitError, match="phase order"):
        sb.Plan.from_dict(doc, plan.graph)
