"""Costs learned from observed runs, and the speed-change repair they trigger: no cluster."""

from __future__ import annotations

from dataclasses import replace

import dask.config
import numpy as np
import pytest

import seabiscuit_dask as sb
from seabiscuit_dask import config
from seabiscuit_dask.placement import DeviceAdded
from seabiscuit_dask.placement.learn import CostLearner
from seabiscuit_dask.runtime.scheduler import BlockObserved, ModelDeployed, PlacementState, PlanChanged

from . import models as M

TRUE = {"matmul": 1.8, "other": 0.6}


def trace(rng: np.random.Generator, n: int, true: dict[str, float] = TRUE, noise: float = 0.03):
    """Blocks with random mixes of op classes and their observed times under ``true`` scales."""
    for _ in range(n):
        modelled = {"matmul": float(rng.uniform(1e-3, 1e-2)), "other": float(rng.uniform(1e-4, 5e-3))}
        observed = sum(true[c] * modelled[c] for c in modelled) * float(rng.normal(1.0, noise))
        yield modelled, observed


def test_corrections_converge_and_the_error_falls():
    errors = []
    for seed in range(20):
        learner = CostLearner()
        for modelled, observed in trace(np.random.default_rng(seed), 40):
            learner.observe("w0", modelled, observed)
        errors.append(list(learner.errors))
        s = learner.scale("w0")
        assert s["matmul"] == pytest.approx(TRUE["matmul"], rel=0.1)
        assert s["other"] == pytest.approx(TRUE["other"], rel=0.25)
    e = np.mean(errors, axis=0)
    assert e[0] > e[4] > e[19]                         # after 1, 5 and 20 observations
    assert e[19] < 0.1
    # A device never seen keeps the model's own figures.
    assert learner.scale("w9") == {"matmul": 1.0, "other": 1.0}


def test_a_device_that_slows_down_is_detected_within_a_few_runs():
    rng = np.random.default_rng(1)
    learner = CostLearner()
    for modelled, observed in trace(rng, 30):
        assert learner.observe("w0", modelled, observed) in (None, pytest.approx(learner.scale("w0")))
    learner.applied("w0", learner.scale("w0"))         # the plan now runs with what was learned
    before = learner.scale("w0")
    slower = {c: 3 * v for c, v in TRUE.items()}
    runs, changed = 0, None
    for modelled, observed in trace(rng, 10, slower):
        runs += 1
        changed = learner.observe("w0", modelled, observed)
        if changed is not None:
            break
    assert changed is not None and runs <= 5, "not detected within five runs"
    assert changed["matmul"] > 1.5 * before["matmul"]
    # Steady runs after that raise nothing.
    learner.applied("w0", learner.scale("w0"))
    assert all(learner.observe("w0", m, o) is None for m, o in trace(rng, 5, slower))


def test_the_learner_reads_its_thresholds_from_the_configuration():
    """Speed change, patience and cool-down default to ``seabiscuit.learn.*``, as the scheduler's do."""
    learner = CostLearner()
    assert (learner.change, learner.patience, learner.cooldown) == \
        (config.get("learn.speed-change"), config.get("learn.patience"), config.get("learn.cooldown"))
    with dask.config.set({"seabiscuit.learn.patience": 2, "seabiscuit.learn.cooldown": 7}):
        assert (CostLearner().patience, CostLearner().cooldown) == (2, 7)
    assert CostLearner(patience=9).patience == 9


def test_bad_observations_are_ignored():
    learner = CostLearner()
    assert learner.observe("w0", {"matmul": 0.0, "other": 0.0}, 1.0) is None
    assert learner.observe("w0", {"matmul": 1e-3}, float("nan")) is None
    assert not learner.errors


def slow_cluster_state(g) -> tuple[PlacementState, sb.Plan]:
    base = sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB")   # no one device holds it
    slow_cpu = dict(flops_per_s={"matmul": 2e8, "other": 2e8}, mem_bytes_per_s=2e9)
    spec = sb.ClusterSpec(tuple(replace(d, address=f"tcp://10.0.0.{i}:4000", **slow_cpu)
                                for i, d in enumerate(base.devices)), base.links)
    state = PlacementState()
    for d in spec.devices:
        state.handle(DeviceAdded(d))
    plan = sb.place(g, spec)
    state.handle(ModelDeployed("m1", plan, "secret"))
    return state, plan


@pytest.fixture(scope="module")
def graph():
    return sb.decompose(sb.trace(M.gpt2(), M.ids()), "64KiB")


def test_a_machine_busy_everywhere_changes_no_plan(graph):
    state, plan = slow_cluster_state(graph)
    assert len(set(plan.device_of.tolist())) > 1
    out = []
    for _ in range(8):
        for b, (_, m) in enumerate(state.models["m1"].modelled(0)):
            out += state.handle(BlockObserved("m1", 0, b, 3.0 * sum(m.values())))
    assert out == [] and state.models["m1"].version == 0


def test_the_scheduler_repairs_the_plan_of_a_slowed_worker(graph):
    g = graph
    state, plan = slow_cluster_state(g)
    modelled = state.models["m1"].modelled(0)
    victim = max(modelled, key=lambda am: am[1].get("matmul", 0.0))[0]   # NOTE: a worker running matmuls
    out: list = []
    requests = 0
    while not out and requests < 10:
        requests += 1
        for b, (address, m) in enumerate(modelled):
            factor = 4.0 if address == victim else 1.0
            out += state.handle(BlockObserved("m1", 0, b, factor * sum(m.values())))
    changed = [i for i in out if isinstance(i, PlanChanged)]
    patience = state.learner.patience + 1      # NOTE: a block's first run is not learned from
    assert changed and requests <= patience, f"the slowdown was not acted on within {patience} requests"
    assert "runs at" in changed[0].reason and victim in changed[0].reason
    new = state.models["m1"].plan
    i = new.spec.index(victim)
    assert new.spec.devices[i].scale["matmul"] > 2
    # Work left the slowed worker, and the repaired plan beats keeping the old one there.
    assert (new.device_of == i).sum() < (plan.device_of == plan.spec.index(victim)).sum()
    assert new.makespan_s < sb.Plan(g, new.spec, plan.device_of, info=dict(plan.info)).makespan_s
    assert state.learned("m1")["scales"][victim]["matmul"] > 2


def test_availability_forecast_plans_on_the_lows():
    from seabiscuit_dask.runtime.worker.agent import AvailabilityForecast

    steady, swinging = AvailabilityForecast(), AvailabilityForecast()
    for i in range(40):
        steady.update(memory_available_bytes=6e9)
        swinging.update(memory_available_bytes=9e9 if i % 2 else 3e9)    # the same 6 GB on average
    assert steady.low("memory_available_bytes") == pytest.approx(6e9)
    assert swinging.low("memory_available_bytes") < 3.5e9
    assert swinging.report()["forecast_readings"] == 40
    assert AvailabilityForecast().low("memory_available_bytes") is None


def test_placement_budgets_follow_the_forecast():
    from seabiscuit_dask.runtime.discover import forecast_budget

    def info(host: str, forecast: float | None) -> dict:
        report = {"budget_bytes": 10e9, **({"forecast_memory_available_bytes": forecast} if forecast else {})}
        return {"host": host, "held_bytes": 1e9, "report": report}

    two = [info("a", 8e9), info("a", 8e9), info("b", None)]
    assert forecast_budget(two[0], two) == 4e9          # half of its host's forecast free memory
    assert forecast_budget(two[2], two) == 9e9          # no forecast yet: its budget less what is held
    plenty = [info("a", 64e9)]
    assert forecast_budget(plenty[0], plenty) == 9e9
    # A worker that holds more than its plans say (a generation deployment's KV caches) is
    # planned with what it holds: a new model placed on the plans' figure would not load.
    grown = {**plenty[0], "report": {**plenty[0]["report"], "resident_bytes": 3e9}}
    assert forecast_budget(grown, [grown]) == 7e9


def test_the_fit_solves_its_normal_equations_as_numpy_does():
    from seabiscuit_dask.placement.learn import _solve

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 5):
        for _ in range(20):
            m = rng.normal(size=(n, n))
            a = m @ m.T + 0.05 * np.eye(n)                 # NOTE: as the fit's: prior on the diagonal
            b = rng.normal(size=n)
            assert _solve(a.tolist(), b.tolist()) == pytest.approx(np.linalg.solve(a, b).tolist(),
                                                                    rel=1e-7, abs=1e-9)
