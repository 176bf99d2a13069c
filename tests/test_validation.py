"""Every document is validated before it touches shared state: graph and plan documents,
byte counts and counts from users are refused with typed errors that name the numbers."""

from __future__ import annotations

import dataclasses
import json
import math

import dask.config
import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask import config
from seabiscuit_dask.errors import BadConfig
from seabiscuit_dask.ir import MAX_ELEMENTS, OpGraph, verify
from seabiscuit_dask.placement import ClusterSpec, Plan, place
from seabiscuit_dask.placement.plan import check_spec


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return sb.trace(torch.nn.Linear(8, 4), (torch.randn(2, 8),))


@pytest.fixture(scope="module")
def plan(graph: OpGraph) -> Plan:
    return place(graph, ClusterSpec.synthetic("2x(1gpu+cpu)"))


def edited(graph: OpGraph, section: str, name: str, **fields) -> str:
    d = graph.to_dict()
    d[section][name].update(fields)
    return json.dumps(d)


# --- graphs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("section", "name", "shape"), [
    ("params", "weight", [-4, 8]),           # the -512 GB worker of the review
    ("tensors", "input", [2, -8]),
    ("tensors", "input", [True, 8]),
    ("tensors", "input", [2.5, 8]),
    ("tensors", "input", [2.0, 8]),
    ("tensors", "input", "28"),
    ("params", "bias", [[4]]),
])
def test_a_shape_that_is_not_ints_ge_0_is_refused(graph, section, name, shape) -> None:
    with pytest.raises(sb.InvalidGraph, match=rf"{section[:-1]} '{name}' has shape .*ints >= 0"):
        OpGraph.from_json(edited(graph, section, name, shape=shape))


@pytest.mark.parametrize("shape", [[10**12, 10**12], [2**48 + 1], [0, 2**60], [2**25, 2**24]])
def test_a_shape_beyond_2_48_elements_is_refused_with_the_limit(graph, shape) -> None:
    limit = rf"tensor 'linear' has shape .*at most 2\*\*48 = {MAX_ELEMENTS}"
    with pytest.raises(sb.InvalidGraph, match=limit):
        OpGraph.from_json(edited(graph, "tensors", "linear", shape=shape))


def test_shapes_up_to_the_limit_still_load(graph) -> None:
    g = OpGraph.from_json(edited(graph, "tensors", "linear", shape=[2**24, 2**24]))
    assert g.tensors["linear"].numel == MAX_ELEMENTS
    assert OpGraph.from_json(edited(graph, "tensors", "linear", shape=[0, 4])).tensors["linear"].nbytes == 0


def test_an_unknown_dtype_is_refused(graph) -> None:
    with pytest.raises(sb.InvalidGraph, match="param 'bias' has dtype 'float128'.*known: float64"):
        OpGraph.from_json(edited(graph, "params", "bias", dtype="float128"))


def test_param_sources_out_of_range_are_refused(graph) -> None:
    source = {**graph.params["weight"].source.to_dict(), "slices": [[-4, 0], [0, 8]]}
    with pytest.raises(sb.InvalidGraph, match=r"param 'weight' reads slices \[\[-4, 0\], \[0, 8\]\]"):
        OpGraph.from_json(edited(graph, "params", "weight", source=source))


@pytest.mark.parametrize("flops", [-1, 2**63, 1.5, True])
def test_op_flops_out_of_range_are_refused(graph, flops) -> None:
    d = graph.to_dict()
    d["ops"][0]["flops"] = flops
    with pytest.raises(sb.InvalidGraph, match=rf"op 'linear' claims {flops!r} flops"):
        OpGraph.from_dict(d)


def test_a_malformed_graph_document_is_a_typed_error(graph) -> None:
    d = graph.to_dict()
    del d["tensors"]["input"]["shape"]
    with pytest.raises(sb.InvalidGraph, match="OpGraph document is malformed: KeyError"):
        OpGraph.from_dict(d)


def test_verify_refuses_a_graph_built_with_bad_specs(graph) -> None:
    assert verify(graph) is graph
    w = graph.params["weight"]
    negative = dataclasses.replace(graph, params={**graph.params,
                                                  "weight": dataclasses.replace(w, shape=(-4, 8))})
    assert negative.param_bytes < 0          # what placement would have counted
    with pytest.raises(sb.InvalidGraph, match=r"param 'weight' has shape \[-4, 8\]"):
        verify(negative)
    x = graph.tensors["input"]
    huge = dataclasses.replace(graph, tensors={**graph.tensors,
                                               "input": dataclasses.replace(x, shape=(10**12, 10**12))})
    with pytest.raises(sb.InvalidGraph, match=r"tensor 'input' has shape .*1e\+24 elements.*2\*\*48"):
        verify(huge)


# --- plans -------------------------------------------------------------------------------------
def plan_doc(plan: Plan) -> dict:
    return json.loads(plan.to_json())


def test_a_plan_round_trips_and_stays_valid(plan, graph) -> None:
    back = Plan.from_json(plan.to_json(stats=False), graph)
    assert back.assignment == plan.assignment and check_spec(back.spec) == plan.spec


@pytest.mark.parametrize("memory", [10**15, "1PB", "1PiB", 2**48 + 1])
def test_a_plan_claiming_a_petabyte_per_device_is_refused(plan, graph, memory) -> None:
    d = plan_doc(plan)
    for dev in d["cluster"]["devices"]:
        dev["memory"] = memory
    with pytest.raises(sb.SeaBiscuitError, match=r"device 'h0-gpu0' memory .*at most 256 TiB"):
        Plan.from_dict(d, graph)


def test_a_spec_built_with_a_petabyte_is_refused(plan) -> None:
    big = plan.spec.with_changes("h0-cpu0", memory_bytes=10**15)
    with pytest.raises(sb.SeaBiscuitError, match=r"device 'h0-cpu0' claims 909.5 TiB \(10{15} bytes\)"
                                                 r".*at most 256 TiB"):
        check_spec(big)


@pytest.mark.parametrize(("where", "value", "message"), [
    (("devices", 0, "flops_per_s", "matmul"), math.inf, r"device 'h0-gpu0': flops_per_s\['matmul'\] = inf"),
    (("devices", 1, "mem_bytes_per_s"), math.inf, "device 'h0-cpu0': mem_bytes_per_s = inf"),
    (("devices", 0, "flops_per_s", "other"), math.nan, r"flops_per_s\['other'\] must be > 0, got nan"),
    (("links", "network", "latency"), math.inf, "link 'network': latency = inf"),
])
def test_non_finite_figures_in_a_plan_are_refused(plan, graph, where, value, message) -> None:
    d = plan_doc(plan)
    node = d["cluster"]
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    with pytest.raises(sb.SeaBiscuitError, match=message):
        Plan.from_json(json.dumps(d), graph)


def test_a_nan_in_a_measured_matrix_is_refused(plan, graph) -> None:
    d = plan_doc(plan)
    n = len(d["cluster"]["devices"])
    bw = [[0.0 if a == b else 1e9 for b in range(n)] for a in range(n)]
    d["cluster"]["matrix"] = {"bandwidth": bw, "latency": [[1e-5] * n for _ in range(n)]}
    assert Plan.from_dict(d, graph).spec.matrix is not None
    bw[2][2] = math.nan
    with pytest.raises(sb.SeaBiscuitError, match=r"matrix: bandwidth\[2\]\[2\] = nan"):
        Plan.from_dict(d, graph)


def test_a_nan_planning_time_is_refused(plan, graph) -> None:
    d = plan_doc(plan)
    d["stats"]["planning_s"] = math.nan
    with pytest.raises(sb.SeaBiscuitError, match="planning_s is nan"):
        Plan.from_json(json.dumps(d), graph)


@pytest.mark.parametrize("phase", [10**30, -1, 2.5, True])
def test_block_phases_out_of_range_are_refused(plan, graph, phase) -> None:
    d = plan_doc(plan)
    d["blocks"][0]["phase"] = phase
    with pytest.raises(sb.SeaBiscuitError, match=rf"plan block 'b0' has phase {phase!r}: .* 1 ops"):
        Plan.from_dict(d, graph)


def test_device_indices_out_of_range_or_not_ints_are_refused(plan, graph) -> None:
    with pytest.raises(sb.SeaBiscuitError, match=r"op 'linear' \(#0\) on device 4, .*devices 0\.\.3"):
        Plan(graph, plan.spec, np.array([4]))
    with pytest.raises(sb.SeaBiscuitError, match=r"op 'linear' \(#0\) on device -1"):
        Plan(graph, plan.spec, np.array([-1]))
    with pytest.raises(sb.SeaBiscuitError, match="ints; got float64 values such as 0.5"):
        Plan(graph, plan.spec, np.array([0.5]))
    with pytest.raises(sb.SeaBiscuitError, match="one device per op: 1 ops, 2 devices given"):
        Plan(graph, plan.spec, np.array([0, 1]))


def test_a_plan_assigning_ops_the_graph_lacks_is_refused(plan, graph) -> None:
    d = plan_doc(plan)
    d["assignment"]["ghost"] = plan.spec.names[0]
    with pytest.raises(sb.SeaBiscuitError, match="1 op\\(s\\) the graph does not have, e.g. 'ghost'"):
        Plan.from_dict(d, graph)


# --- byte counts -------------------------------------------------------------------------------
BAD_BUDGETS = [1e30, math.inf, -math.inf, math.nan, "1e40B", "1e400", 10**40, 2**48 + 1, 2.5, True, "abc",
               None, [16]]


@pytest.mark.parametrize("budget", BAD_BUDGETS)
def test_to_bytes_refuses_what_is_no_byte_count(budget) -> None:
    with pytest.raises(sb.SeaBiscuitError, match=r"budget must be a byte count like '16MiB'") as e:
        config.to_bytes(budget)
    assert not isinstance(e.value, sb.BudgetTooSmall)


@pytest.mark.parametrize("budget", [1e30, math.inf, "1e40B"])
def test_decompose_refuses_an_absurd_budget_as_a_typed_error(graph, budget) -> None:
    with pytest.raises(sb.SeaBiscuitError, match=r"budget must be a byte count like '16MiB'") as e:
        sb.decompose(graph, budget=budget)
    assert not isinstance(e.value, sb.BudgetTooSmall)


@pytest.mark.parametrize(("budget", "nbytes"), [(2.0**20, 2**20), ("16MiB", 2**24), (np.int64(4096), 4096),
                                                ("64TiB", 2**46), (2**48, 2**48), ("1.5KiB", 1536)])
def test_to_bytes_still_reads_byte_counts(budget, nbytes) -> None:
    assert config.to_bytes(budget) == nbytes


def test_to_bytes_still_refuses_zero_and_negative() -> None:
    for budget in (0, -5, "-1MiB"):
        with pytest.raises(sb.SeaBiscuitError, match="budget must be positive"):
            config.to_bytes(budget)


def test_a_bad_setting_is_bad_config() -> None:
    with dask.config.set({"seabiscuit.runtime.data-plane": "pigeon"}), \
            pytest.raises(BadConfig, match="'pigeon': it must be p2p or tasks"):
        config.data_plane()
    with pytest.raises(BadConfig, match="device must be one of"):
        config.device_choice("tpu")
    with pytest.raises(BadConfig, match="budget must be a byte count"):
        config.to_bytes("lots")


# --- counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "n"), [(8, 8), ("8", 8), (" 8 ", 8), (np.int32(3), 3), (0, 0)])
def test_to_count_reads_ints_and_digits(value, n) -> None:
    got = config.to_count(value, "sessions")
    assert got == n and type(got) is int


@pytest.mark.parametrize(("value", "kw", "bounds"), [
    ("abc", {}, ">= 0"), (2.5, {}, ">= 0"), (8.0, {}, ">= 0"), (True, {}, ">= 0"), (None, {}, ">= 0"),
    ("1e3", {}, ">= 0"), (-1, {}, ">= 0"), (0, {"minimum": 1}, ">= 1"),
    (65, {"minimum": 1, "maximum": 64}, "from 1 to 64"), ("9" * 5000, {}, ">= 0"),
])
def test_to_count_refuses_everything_else_as_bad_input(value, kw, bounds) -> None:
    with pytest.raises(sb.BadInput, match=rf"sessions must be a whole number {bounds} .*got "):
        config.to_count(value, "sessions", **kw)
