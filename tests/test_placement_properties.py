"""Property tests on random DAGs and clusters: what every plan must satisfy."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seabiscuit_dask.placement import BASELINES, ClusterSpec, DeviceLost, Plan, place, replan
from tests.dags import random_dag
from tests.test_placement import block_graph_acyclic

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    n_ops = draw(st.integers(1, 120))
    seed = draw(st.integers(0, 10**6))
    g = random_dag(n_ops, seed=seed, max_fanin=draw(st.integers(1, 4)), window=draw(st.integers(1, 12)))
    hosts = draw(st.integers(1, 3))
    gpus = draw(st.integers(0, 3))
    cpus = draw(st.integers(0 if gpus else 1, 2))
    n_dev = hosts * (gpus + cpus)
    weights = sum(p.nbytes for p in g.params.values())
    # Memory per device between "just enough in total" and plenty.
    slack = draw(st.floats(1.3, 4.0))
    per_dev = max(int(weights * slack / n_dev), 4 * 2**20) + 8 * 2**20
    spec = ClusterSpec.synthetic(None, hosts=hosts, gpus_per_host=gpus, cpus_per_host=cpus,
                                 hosts_per_rack=draw(st.integers(1, 2)), gpu_memory=per_dev,
                                 cpu_memory=per_dev)
    return g, spec


def check_plan(plan: Plan) -> None:
    g, spec = plan.graph, plan.spec
    # Every op placed exactly once, on a device of the cluster.
    assert plan.device_of.shape == (len(g.ops),)
    assert set(plan.assignment) == {op.name for op in g.ops}
    blocks = [o for b in plan.blocks for o in b.ops]
    assert sorted(blocks) == sorted(op.name for op in g.ops)
    # Memory respected: weights plus the largest block's activations.
    mem = np.array([d.memory_bytes for d in spec.devices])
    assert (plan.peak_bytes <= mem).all()
    assert block_graph_acyclic(plan)
    check_schedule(plan)


def check_schedule(plan: Plan) -> None:
    """The simulated schedule respects every dependency and every transfer's duration."""
    s = plan.schedule
    w, spec = plan.workload, plan.spec
    eps = 1e-12
    for t, (u, dsts) in enumerate(zip(w.t_src.tolist(), w.t_dst)):
        du = int(plan.device_of[u])
        for v in dsts:
            dv = int(plan.device_of[v])
            if du == dv:
                assert s.op_start[v] >= s.op_finish[u] - eps
            else:
                arrive = s.arrivals[(t, dv)]
                assert arrive >= s.op_finish[u] + spec.transfer_s(du, dv, w.t_bytes[t]) - eps
                assert s.op_start[v] >= arrive - eps
    # One block at a time per device.
    for d in range(len(spec.devices)):
        idx = np.flatnonzero(plan.block_device == d)
        spans = sorted(zip(s.block_start[idx], s.block_finish[idx]))
        for (_, f0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= f0 - eps
    assert s.makespan_s >= s.op_finish.max() - eps


@SETTINGS
@given(problems())
def test_place_plans_are_complete_feasible_acyclic_and_schedulable(problem):
    g, spec = problem
    check_plan(place(g, spec))


@SETTINGS
@given(problems(), st.sampled_from(sorted(BASELINES)))
def test_baseline_plans_obey_the_same_rules(problem, method):
    if method == "metis":
        import pytest

        pytest.importorskip("pymetis")
    g, spec = problem
    check_plan(BASELINES[method](g, spec))


@SETTINGS
@given(problems(), st.data())
def test_replan_after_a_loss_keeps_every_rule(problem, data):
    g, spec = problem
    if len(spec.devices) < 2:
        return
    plan = place(g, spec)
    lost = data.draw(st.sampled_from(spec.names))
    try:
        new = replan(plan, DeviceLost(lost))
    except Exception as e:  # noqa: BLE001 - only "the rest cannot hold it" is allowed
        from seabiscuit_dask import ClusterTooSmall

        assert isinstance(e, ClusterTooSmall), e
        return
    check_plan(new)
    moved = new.info["moved_bytes"]
    assert moved == plan.weight_bytes[spec.index(lost)]
