"""Cluster specs, cost per (op, device), place, plans, the simulator and the baselines."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import yaml

import seabiscuit_dask as sb
from seabiscuit_dask.errors import BadClusterSpec, BadPlan
from seabiscuit_dask.placement import (
    BASELINES,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    Plan,
    place,
    simulate,
)
from seabiscuit_dask.placement.cluster import NO_DASK, DaskSpec
from seabiscuit_dask.placement.workload import workload
from tests.dags import chain, random_dag
from tests.models import gpt2, ids


def small_spec(hosts: int = 2, gpus: int = 2, gpu_mem: str = "64MiB", cpu_mem: str = "256MiB",
               dask: DaskSpec | None = None) -> ClusterSpec:
    spec = ClusterSpec.synthetic(None, hosts=hosts, gpus_per_host=gpus, cpus_per_host=1, hosts_per_rack=1,
                                 gpu_memory=gpu_mem, cpu_memory=cpu_mem)
    return spec if dask is None else spec.with_dask(dask)


def block_graph_acyclic(plan: Plan) -> bool:
    w = plan.workload
    t_idx, c_op = w.pairs
    a, b = plan.block_of[w.t_src[t_idx]], plan.block_of[c_op]
    edges = {(int(x), int(y)) for x, y in zip(a, b) if x != y}
    n = len(plan.block_device)
    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for x, y in edges:
        succ[x].append(y)
        indeg[y] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while ready:
        x = ready.pop()
        seen += 1
        for y in succ[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    return seen == n


# --- ClusterSpec -----------------------------------------------------------------------------
def test_synthetic_preset_is_four_servers_of_three_gpus_and_a_cpu():
    spec = ClusterSpec.synthetic("4x(3gpu+cpu)")
    assert len(spec.devices) == 16
    assert sum(d.kind == "gpu" for d in spec.devices) == 12
    assert {d.memory_bytes for d in spec.devices if d.kind == "gpu"} == {16 * 2**30}
    assert {d.memory_bytes for d in spec.devices if d.kind == "cpu"} == {64 * 2**30}
    assert len(spec.groups) == 4 and all(len(g) == 4 for g in spec.groups)
    i = spec.index
    assert spec.level(i("h0-gpu0"), i("h0-gpu1")) == "nvlink"
    assert spec.level(i("h0-gpu0"), i("h0-cpu0")) == "pcie"
    assert spec.level(i("h0-gpu0"), i("h1-gpu0")) == "rack"
    assert spec.level(i("h0-gpu0"), i("h2-gpu0")) == "network"
    # Faster inside a host than across racks, and a transfer costs latency + bytes / bandwidth.
    assert spec.bandwidth[0, 1] > spec.bandwidth[0, 4] > spec.bandwidth[0, 8]
    link = spec.links["rack"]
    assert spec.transfer_s(0, 4, 1e6) == pytest.approx(link.latency_s + 1e6 / link.bandwidth_bytes_per_s)
    assert spec.transfer_s(3, 3, 1e9) == 0.0
    assert "16 devices" in repr(spec) and "h3-cpu0" in spec.table()


def test_cluster_yaml_round_trip_with_profiles_and_matrix(tmp_path):
    spec = ClusterSpec.synthetic("2x(1gpu+cpu)")
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump(spec.to_dict()))
    assert ClusterSpec.from_yaml(f) == spec
    f.write_text(yaml.safe_dump({
        "devices": [{"name": "a", "profile": "gpu16", "memory": "8GiB", "host": "s0"},
                    {"name": "b", "profile": "cpu64", "host": "s1"}],
        "matrix": {"bandwidth": [[0, 1e9], [2e9, 0]], "latency": [[0, 1e-5], [1e-5, 0]]}}))
    m = ClusterSpec.from_yaml(f)
    assert m.devices[0].memory_bytes == 8 * 2**30 and m.devices[0].kind == "gpu"
    assert m.bandwidth[0, 1] == 1e9 and m.bandwidth[1, 0] == 2e9
    assert m.routes[0][1] != m.routes[1][0]
    f.write_text("preset: 4x(3gpu+cpu)\n")
    assert len(ClusterSpec.from_yaml(f).devices) == 16


@pytest.mark.parametrize("doc, match", [
    ({"devices": []}, "at least one device"),
    ({"devices": [{"name": "a", "profile": "gpu16"}, {"name": "a", "profile": "gpu16"}]}, "repeated"),
    ({"devices": [{"name": "a", "profile": "gpu16", "memory": -5}]}, "positive"),
    ({"devices": [{"name": "a", "profile": "tpu"}]}, "unknown profile"),
    ({"devices": [{"name": "a", "kind": "gpu", "memory": "1GiB"}]}, "missing fields"),
    ({"devices": [{"name": "a", "profile": "gpu16", "speed": 3}]}, "unknown fields"),
    ({"devices": [{"name": "a", "profile": "gpu16", "kind": "fpga"}]}, "kind must be"),
    ({"devices": [{"name": "a", "profile": "gpu16"}], "links": {"rack": {"bandwidth": 0, "latency": 0}}},
     "bandwidth must be > 0"),
    ({"devices": [{"name": "a", "profile": "gpu16"}], "matrix": {"bandwidth": [[0, 1]], "latency": [[0]]}},
     "1x1"),
    ({"preset": "moon"}, "unknown cluster preset"),
])
def test_bad_cluster_descriptions_are_named(doc, match):
    with pytest.raises(sb.SeaBiscuitError, match=match):
        ClusterSpec.from_dict(doc)


def test_a_bad_cluster_file_is_a_bad_cluster_spec(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump({"devices": [{"name": "a", "profile": "gpu16", "memory": -5}]}))
    with pytest.raises(BadClusterSpec, match="device 'a' memory must be positive"):
        ClusterSpec.from_yaml(f)
    f.write_text("devices: [{name: a, profile: gpu16}]\nrelays: [[a, a, a]]\n")
    with pytest.raises(BadClusterSpec, match="a relay is"):
        ClusterSpec.from_yaml(f)


def test_bad_cluster_files(tmp_path):
    with pytest.raises(sb.SeaBiscuitError, match="cannot read"):
        ClusterSpec.from_yaml(tmp_path / "missing.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("devices: [unclosed")
    with pytest.raises(sb.SeaBiscuitError, match="not valid YAML"):
        ClusterSpec.from_yaml(f)


# --- cost per (op, device) -------------------------------------------------------------------
def test_roofline_time_per_op_and_device():
    g = chain([1024, 0], out_kib=4, flops=10**9)
    spec = ClusterSpec((DeviceSpec("fast", "gpu", 2**30, {"matmul": 1e12, "other": 1e11}, 1e9, 1e-5),
                        DeviceSpec("slow", "cpu", 2**30, {"matmul": 1e10, "other": 1e9}, 1e8, 0.0)))
    t = workload(g).times(spec)
    moved = (1024 + 4 + 4) * 1024       # weights + input + output of op0
    assert t[0, 0] == pytest.approx(max(1e9 / 1e12, moved / 1e9) + 1e-5)   # memory-bound
    assert t[0, 1] == pytest.approx(max(1e9 / 1e10, moved / 1e8))           # compute-bound
    assert t[1, 0] == pytest.approx(max(1e9 / 1e12, 8 * 1024 / 1e9) + 1e-5)


def test_a_view_costs_its_dispatch_not_a_kernel():
    """A view launches no kernel, but the block runtime still calls it: each costs the device's
    ``view_overhead_s`` (measured by its agent), not its roofline and not nothing; the figure
    survives the spec's dict round trip and a negative one is refused."""
    import torch

    g = sb.trace(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Flatten(0)), (torch.randn(4, 16),))
    w = workload(g)
    views = [i for i, op in enumerate(g.ops) if op.kind == "view"]
    assert views and not w.is_view.all()
    dev = DeviceSpec("cpu", "cpu", 2**30, {"matmul": 1e11, "other": 1e10}, 1e10, 4e-6, view_overhead_s=2e-6)
    t = w.device_times(dev)
    assert (t[views] == 2e-6).all()
    assert (t[~w.is_view] >= 4e-6).all()
    free = w.device_times(DeviceSpec("cpu", "cpu", 2**30, {"matmul": 1e11, "other": 1e10}, 1e10, 4e-6))
    assert (free[views] == 0).all() and (free[~w.is_view] == t[~w.is_view]).all()
    assert DeviceSpec.from_dict(dev.to_dict()) == dev
    # NOTE: a learned scale of "other" scales views too: the learner fits blocks whose views it modelled so
    scaled = w.device_times(dataclasses.replace(dev, scale={"other": 2.0}))
    assert (scaled[views] == 4e-6).all()
    with pytest.raises(BadClusterSpec, match="view_overhead_s must be >= 0"):
        DeviceSpec("cpu", "cpu", 2**30, {"matmul": 1e11, "other": 1e10}, 1e10, view_overhead_s=-1.0)


def test_a_lookup_streams_the_rows_it_gathers_not_its_table():
    """An embedding of a 32 MiB table read for 4 tokens moves kilobytes: its time is no
    more than a small op's, so a stage holding it is not judged busy by its table."""
    import torch

    from seabiscuit_dask.cost import op_time_s

    model = torch.nn.Sequential(torch.nn.Embedding(32768, 256), torch.nn.Linear(256, 256))
    g = sb.trace(model, (torch.zeros(1, 4, dtype=torch.long),))
    w = workload(g)
    (emb,) = [i for i, op in enumerate(g.ops) if op.kind == "embedding"]
    row_bytes = 4 * 256 * 4
    assert w.weight_bytes[emb] == 32768 * 256 * 4                  # it holds the whole table ...
    assert w.moved_bytes[emb] <= 2 * row_bytes + 4 * 8               # ... and streams its rows only
    dev = DeviceSpec("cpu", "cpu", 2**30, {"matmul": 1e11, "other": 1e10}, 1e10, 0.0)
    assert op_time_s(g, g.ops[emb], 1e10, 1e10) == pytest.approx(w.device_times(dev)[emb])


def test_a_table_read_by_index_select_streams_its_rows_as_an_embedding_does():
    """A position table read by ``index_select`` gathers rows as a lookup does (the op table's
    ``GATHERS``): the cost model counts the rows it reads, not the whole table."""
    import torch

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(32768, 256))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return torch.index_select(self.table, 0, idx.reshape(-1))

    g = sb.trace(Positions(), (torch.zeros(1, 4, dtype=torch.long),))
    w = workload(g)
    (sel,) = [i for i, op in enumerate(g.ops) if op.target == "aten.index_select.default"]
    row_bytes = 4 * 256 * 4
    assert w.weight_bytes[sel] == 32768 * 256 * 4
    assert w.moved_bytes[sel] <= 2 * row_bytes + 4 * 8


def test_stages_cut_at_the_cheapest_boundary_nearest_their_share():
    """Where every boundary costs the same bytes (a stack of equal layers), each stage boundary
    sits at the one nearest the load share, not at the first of the window."""
    from seabiscuit_dask.placement.partition import contiguous_split

    n = 100
    src, last = np.arange(n - 1), np.arange(1, n)         # op i's output is read by op i + 1 only
    stage = contiguous_split(np.ones(n), src, last, np.full(n - 1, 64.0), np.array([0.5, 0.5]),
                             np.array([1e9, 1e9]), window=0.2)
    assert int((stage == 0).sum()) == 50
    stage = contiguous_split(np.ones(n), src, last, np.full(n - 1, 64.0), np.array([0.3, 0.7]),
                             np.array([1e9, 1e9]), window=0.2, load=np.r_[np.full(50, 2.0), np.ones(50)])
    assert int((stage == 0).sum()) == 23      # 30% of a load of 150 is 45: 22.5 ops of weight 2


# --- place -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_graph():
    return sb.decompose(sb.trace(gpt2(), (ids(),)), "1MiB")


def test_place_real_model_feasible_acyclic_and_round_trips(gpt2_graph, tmp_path):
    spec = small_spec()
    plan = place(gpt2_graph, spec)
    assert set(plan.assignment) == {op.name for op in gpt2_graph.ops}
    assert plan.feasible and block_graph_acyclic(plan)
    assert plan.makespan_s > 0 and plan.cut_bytes >= 0
    assert sum(len(b.ops) for b in plan.blocks) == len(gpt2_graph.ops)
    text = plan.to_json()
    doc = json.loads(text)
    assert doc["schema"] == 1 and set(doc["stats"]["devices"]) == set(spec.names)
    back = Plan.from_json(text, gpt2_graph)
    assert back.assignment == plan.assignment and back.spec == plan.spec
    table = plan.table()
    assert "h1-gpu1" in table and "makespan" in table
    assert "blocks" in repr(plan)
    other = sb.decompose(sb.trace(gpt2(), (ids(),)), "2MiB")
    with pytest.raises(sb.SeaBiscuitError, match="plan was made for graph"):
        Plan.from_json(text, other)
    with pytest.raises(sb.SeaBiscuitError, match="not valid JSON"):
        Plan.from_json("{", gpt2_graph)


def test_place_beats_every_baseline_on_a_real_model(gpt2_graph):
    spec = small_spec()
    ours = place(gpt2_graph, spec).makespan_s
    for name, fn in BASELINES.items():
        if name == "metis":
            pytest.importorskip("pymetis")
        base = fn(gpt2_graph, spec)
        assert base.feasible and block_graph_acyclic(base), name
        assert ours <= base.makespan_s * 1.001, name


def test_place_spreads_a_layer_over_one_host_first():
    # Wide, parallel work with big tensors: the fast links inside a host carry it.
    g = random_dag(300, seed=3, window=30, out_kib=(64, 256))
    spec = small_spec(hosts=2, gpus=3, gpu_mem="1GiB", dask=NO_DASK)
    plan = place(g, spec)
    bb = plan.bytes_between
    same_host = np.array([[a.host == b.host for b in spec.devices] for a in spec.devices])
    assert bb[same_host].sum() > bb[~same_host].sum()


class MLPs(torch.nn.Module):
    """Residual MLP layers, the shape of a transformer's feed-forward half."""

    def __init__(self, layers: int = 4, d: int = 128, h: int = 512) -> None:
        super().__init__()
        nn = torch.nn
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(approximate="tanh"),
                                                  nn.Linear(h, d)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.layers:
            x = x + mlp(x)
        return x


def one_host_of_two(memory: int, hop_s: float) -> ClusterSpec:
    d = dict(flops_per_s={"matmul": 1e9, "other": 1e9}, mem_bytes_per_s=1e10, op_overhead_s=1e-5)
    devices = (DeviceSpec("a", "cpu", memory, host="h0", **d), DeviceSpec("b", "cpu", memory, host="h0", **d))
    return ClusterSpec(devices, {lvl: LinkSpec(2e9, 1e-5) for lvl in ("nvlink", "pcie", "rack", "network")},
                       dask=DaskSpec(task_s=1e-5, hop_s=hop_s, submit_s=1e-4, gather_s=1e-4))


def mlp_graph() -> tuple[sb.OpGraph, int]:
    torch.manual_seed(0)
    model = MLPs().eval()
    g = sb.decompose(sb.trace(model, (torch.randn(1, 64, 128),)), "320KiB")   # 256 KiB weights: 2 tiles
    return g, sum(p.numel() * p.element_size() for p in model.parameters())


def halves(g: sb.OpGraph, plan: Plan, layer: int, linear: int, tag: str) -> list[int]:
    """The devices of the two tiles of a layer's first (0) or second (2) linear."""
    found = [int(plan.device_of[i]) for i, op in enumerate(g.ops) for k in (0, 1)
             if op.name.startswith(f"layers.{layer}.{linear}.") and op.name.endswith(f".{tag}{k}")]
    assert len(found) == 2, (layer, linear)
    return found


def test_place_runs_the_halves_of_each_mlp_at_once_on_two_devices_of_a_host():
    g, weights = mlp_graph()
    plan = place(g, one_host_of_two(int(weights * 0.8), hop_s=1e-4))      # neither holds them all
    assert "spread" in plan.info["tier"], plan.info["candidates"]
    for layer in range(4):
        first, second = halves(g, plan, layer, 0, "c"), halves(g, plan, layer, 2, "r")
        assert len(set(second)) == 2 and len(set(first)) == 2, layer    # the two halves at once
    stages = min(v for k, v in plan.info["candidates"].items() if "spread" not in k)
    assert plan.makespan_s < 0.8 * stages
    assert plan.feasible and block_graph_acyclic(plan)


def test_halves_that_compute_for_less_than_a_hop_stay_on_one_device():
    g, weights = mlp_graph()
    plan = place(g, one_host_of_two(int(weights * 0.8), hop_s=0.05))
    assert "spread" not in plan.info["tier"], plan.info["candidates"]
    assert all(len(set(halves(g, plan, layer, 2, "r"))) == 1 for layer in range(4))


class HeadOfMLPs(torch.nn.Module):
    """Residual MLPs under a wide output head, whose output is larger than the budget: it is
    delivered as column tiles that no op joins (a language model's logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLPs(layers=2)
        self.head = torch.nn.Linear(128, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_place_spreads_the_tiles_of_an_output_over_two_devices_of_a_host():
    torch.manual_seed(0)
    model = HeadOfMLPs().eval()
    g = sb.decompose(sb.trace(model, (torch.randn(1, 64, 128),)), "320KiB")
    assert g.tilings, "the head's output should be delivered as tiles"
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = place(g, one_host_of_two(int(weights * 0.8), hop_s=1e-4))
    head = [int(plan.device_of[i]) for i, op in enumerate(g.ops) if op.name.startswith("head.")]
    assert len(head) >= 4 and abs(head.count(0) - head.count(1)) <= 1, head      # half the tiles each
    assert "spread" in plan.info["tier"], plan.info["candidates"]
    others = min(v for k, v in plan.info["candidates"].items() if "spread" not in k)
    assert plan.makespan_s < 0.95 * others, plan.info["candidates"]
    assert plan.feasible and block_graph_acyclic(plan)


def test_cluster_too_small_names_shortfall_and_op():
    g = chain([4096, 4096, 4096])                   # 12 MiB of weights
    spec = small_spec(hosts=1, gpus=1, gpu_mem="4MiB", cpu_mem="4MiB")
    with pytest.raises(sb.ClusterTooSmall, match=r"short by .* \(\d+ bytes\)"):
        place(g, spec)
    big = chain([64 * 1024, 16])                     # one 64 MiB op
    with pytest.raises(sb.ClusterTooSmall, match="op 'op0' needs 64.0 MiB"):
        place(big, small_spec(hosts=4, gpus=2, gpu_mem="40MiB", cpu_mem="40MiB"))


# --- simulator -------------------------------------------------------------------------------
def two_devices(bw: float = 1e9, lat: float = 1e-4, same_host: bool = False) -> ClusterSpec:
    d = dict(flops_per_s={"matmul": 1e9, "other": 1e9}, mem_bytes_per_s=1e12, op_overhead_s=0.0)
    return ClusterSpec((DeviceSpec("a", "gpu", 2**30, host="h0", **d),
                        DeviceSpec("b", "gpu", 2**30, host="h0" if same_host else "h1", **d)),
                       {lvl: LinkSpec(bw, lat) for lvl in ("nvlink", "pcie", "rack", "network")})


def test_simulator_chain_across_two_devices_is_exact():
    g = chain([0, 0, 0], out_kib=1000, flops=10**6)   # each op 1 ms at 1 GFLOP/s
    spec = two_devices()
    plan = Plan(g, spec, np.array([0, 1, 1]))
    s = simulate(plan, dask=NO_DASK)
    transfer = 1e-4 + 1000 * 1024 / 1e9
    assert s.makespan_s == pytest.approx(3e-3 + transfer)
    assert s.op_start[1] == pytest.approx(1e-3 + transfer)
    assert len(s.transfers) == 1 and len(plan.block_device) == 2


def test_simulator_link_contention_serialises_transfers_leaving_a_host():
    # op0 on a feeds two ops on b's host: one tensor each way, both leave host h0 by its NIC.
    from seabiscuit_dask.ir import Op, OpGraph, TensorSpec

    t = {n: TensorSpec((256 * 1000,), "float32") for n in ("x", "y0", "y1", "z0", "z1")}
    ops = (Op("p0", "linear", "t", ("x",), ("y0",), flops=10**6),
           Op("p1", "linear", "t", ("x",), ("y1",), flops=10**6),
           Op("c0", "linear", "t", ("y0",), ("z0",), flops=10**6),
           Op("c1", "linear", "t", ("y1",), ("z1",), flops=10**6))
    g = OpGraph(ops, t, {}, ("x",), ("z0", "z1"))
    spec = ClusterSpec.synthetic(None, hosts=2, gpus_per_host=2, cpus_per_host=0, hosts_per_rack=1)
    # p0, p1 on host0's two GPUs; c0, c1 on host1's two GPUs: both transfers share h0's egress.
    plan = Plan(g, spec, np.array([0, 1, 2, 3]))
    s = simulate(plan, dask=NO_DASK)
    (_, _, _, s0, _), (_, _, _, s1, _) = sorted(s.transfers, key=lambda x: x[3])
    busy = 1000 * 1024 / spec.bandwidth[0, 2]
    assert s1 == pytest.approx(s0 + busy)             # the second waits for the NIC
    # Inside a host each pair has its own channel: no waiting.
    spec1 = ClusterSpec.synthetic(None, hosts=1, gpus_per_host=4, cpus_per_host=0)
    s = simulate(Plan(g, spec1, np.array([0, 1, 2, 3])), dask=NO_DASK)
    starts = sorted(x[3] for x in s.transfers)
    assert starts[0] == pytest.approx(starts[1])


def test_blocks_cut_after_sends_and_stay_acyclic():
    g = random_dag(120, seed=5)
    spec = small_spec(hosts=2, gpus=2, gpu_mem="1GiB")
    rnd = np.random.default_rng(0)
    plan = Plan(g, spec, rnd.integers(0, len(spec.devices), len(g.ops)))
    assert block_graph_acyclic(plan)
    w = plan.workload
    # Whatever another device reads is the last op of its block.
    t_idx, c_op = w.pairs
    src = w.t_src[t_idx]
    senders = set(src[plan.device_of[src] != plan.device_of[c_op]].tolist())
    for b in plan.blocks:
        idx = [w.index[o] for o in b.ops]
        assert all(v not in senders for v in idx[:-1])


def test_host_names_are_unique_per_rack_only():
    d = dict(flops_per_s={"matmul": 1e12, "other": 1e11}, mem_bytes_per_s=1e11)
    spec = ClusterSpec((DeviceSpec("a", "gpu", 2**30, host="s0", rack="r0", **d),
                        DeviceSpec("b", "gpu", 2**30, host="s0", rack="r1", **d)))
    assert spec.level(0, 1) == "network" and len(spec.groups) == 2


@pytest.mark.parametrize("doc", ["[]", '{"schema": 1, "graph": null}', '{"schema": 1}',
                                 '{"schema": 1, "graph": {"ops": 0}, "cluster": {"devices": "x"}}'])
def test_malformed_plan_documents_are_named(doc):
    g = chain([4])
    with pytest.raises(sb.SeaBiscuitError):
        Plan.from_json(doc, g)


def test_a_plan_document_for_another_graph_is_a_bad_plan():
    doc = place(chain([4, 4]), small_spec()).to_json()
    with pytest.raises(BadPlan, match="plan was made for graph"):
        Plan.from_json(doc, chain([4]))
    with pytest.raises(BadPlan, match="plan schema"):
        Plan.from_dict({**json.loads(doc), "schema": 0}, chain([4, 4]))


def test_tight_memory_gives_a_feasible_plan_or_cluster_too_small():
    for seed in range(12):
        g = random_dag(60, seed=seed, param_kib=(256, 4096))
        weights = sum(p.nbytes for p in g.params.values())
        spec = small_spec(hosts=2, gpus=1, gpu_mem=int(weights * 0.4), cpu_mem=int(weights * 0.3))
        try:
            plan = place(g, spec)
        except sb.ClusterTooSmall:
            continue
        assert plan.feasible
