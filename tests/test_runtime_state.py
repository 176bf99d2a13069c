"""The scheduler's decisions (``PlacementState``), driven by events with no cluster."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import dask.config
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.errors import UnknownWorker
from seabiscuit_dask.lower.blocks import (
    BlockProgram,
    BlockSpec,
    _remakes,
    block_specs,
    parse_key,
    request_graph,
    task_name,
)
from seabiscuit_dask.placement import CapacityChanged, DeviceAdded, DeviceLost
from seabiscuit_dask.runtime.scheduler import fencing
from seabiscuit_dask.runtime.scheduler.claims import MAX_CLAIMS, Claims
from seabiscuit_dask.runtime.scheduler.events import (
    BlockObserved,
    BlockRan,
    DeviceDrained,
    DeviceRestored,
    ForModel,
    ModelDeployed,
    ModelReleased,
    Pin,
    PlanChanged,
    Stranded,
    TasksForgotten,
    TasksSubmitted,
    WorkerFenced,
)
from seabiscuit_dask.runtime.scheduler.settings import StateSettings
from seabiscuit_dask.runtime.scheduler.state import PlacementState
from seabiscuit_dask.weights import WeightStore

from . import models as M


@pytest.fixture(scope="module")
def gpt2():
    model, x = M.gpt2(), M.ids()
    return model, x, sb.decompose(sb.trace(model, x), "64KiB")


def cluster(n: int = 4, memory: str = "64MiB") -> sb.ClusterSpec:
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=n, cpu_memory=memory)
    return sb.ClusterSpec(tuple(replace(d, address=f"tcp://10.0.0.{i}:4000")
                                for i, d in enumerate(spec.devices)), spec.links)


def deployed(graph, spec=None) -> tuple[PlacementState, sb.Plan]:
    spec = spec or cluster()
    state = PlacementState()
    for d in spec.devices:
        state.handle(DeviceAdded(d))
    plan = sb.place(graph, spec)
    assert state.handle(ModelDeployed("m1", plan, "secret")) == [PlanChanged("m1", 0, "deployed")]
    return state, plan


def test_keys_are_parsed_only_when_they_are_ours() -> None:
    assert parse_key(("sb-m1", 0, 7, 3)) == ("m1", 0, 7, 3)
    assert parse_key(("sb-m1", 0, -1, 3)) == ("m1", 0, -1, 3)
    for other in ["sb-m1", ("x-m1", 0, 1, 2), ("sb-m1", "a", 1, 2), ("sb-m1", 0, 1), 42]:
        assert parse_key(other) is None


def test_tasks_are_pinned_to_their_blocks_workers(gpt2) -> None:
    _, _, graph = gpt2
    state, plan = deployed(graph)
    keys = (*(("sb-m1", 0, 5, b) for b in range(len(plan.blocks))), ("other", 1), ("sb-zz", 0, 0, 0))
    pins = state.handle(TasksSubmitted(keys))
    assert [p.key for p in pins] == list(keys[:-2])            # foreign and unknown models untouched
    for p, blk in zip(pins, plan.blocks):
        assert p.address == plan.spec.devices[plan.spec.index(blk.device)].address
        assert p.order[1:] == (5, int(p.key[3])) and p.order[0] in (0, 1)
    # the last block hands the outputs to the client; blocks nobody else reads are "urgent"
    assert pins[-1].order[0] == 0
    state.handle(TasksForgotten(keys))
    assert state.pinned == {}


def test_losing_a_worker_replans_and_repins_its_tasks(gpt2) -> None:
    _, _, graph = gpt2
    state, plan = deployed(graph)
    keys = tuple(("sb-m1", 0, 0, b) for b in range(len(plan.blocks)))
    pins = state.handle(TasksSubmitted(keys))
    victim = max({p.address for p in pins}, key=lambda a: sum(p.address == a for p in pins))
    out = state.handle(DeviceLost(victim))
    changed = [i for i in out if isinstance(i, PlanChanged)]
    assert len(changed) == 1 and changed[0].version == 1 and changed[0].moved_bytes > 0
    repins = [i for i in out if isinstance(i, Pin)]
    assert {p.key for p in repins} == {p.key for p in pins if p.address == victim}
    assert all(p.repin and p.address != victim for p in repins)
    dep = state.models["m1"]
    assert victim not in {d.address for d in dep.plan.spec.devices}
    # an in-flight task of version 0 goes where most of its ops now live
    old_block = next(int(p.key[3]) for p in repins)
    assert dep.home(0, old_block) in {d.address for d in dep.plan.spec.devices}
    # new requests use version 1; both versions' blocks can still be fetched
    new = state.handle(TasksSubmitted((("sb-m1", 1, 1, 0),)))
    assert new[0].address != victim
    assert BlockSpec.from_dict(state.block_spec("m1", 0, old_block)).version == 0
    assert BlockSpec.from_dict(state.block_spec("m1", 1, 0)).version == 1


def test_a_model_that_no_longer_fits_is_stranded(gpt2) -> None:
    _, _, graph = gpt2
    w = sum(p.nbytes for p in graph.params.values())
    spec = cluster(2, memory=str(int(w * 0.8)))
    state, _ = deployed(graph, spec)
    out = state.handle(DeviceLost(spec.devices[0].address))
    assert len(out) == 1 and isinstance(out[0], Stranded)
    assert "cannot hold model m1" in out[0].message and "1 worker(s)" in out[0].message


def test_a_joining_worker_takes_work_on_its_host(gpt2) -> None:
    _, _, graph = gpt2
    spec = sb.ClusterSpec(tuple(replace(d, host="h0", address=f"tcp://a:{i}")
                                for i, d in enumerate(cluster(2).devices)), cluster(2).links)
    state, _ = deployed(graph, spec)
    newcomer = replace(spec.devices[0], name="w9", address="tcp://a:9")
    out = state.handle(DeviceAdded(newcomer))
    assert [type(i) for i in out] == [PlanChanged]
    assert "tcp://a:9" in {d.address for d in state.models["m1"].plan.spec.devices}


def test_unknown_queries_say_what_is_there(gpt2) -> None:
    _, _, graph = gpt2
    state, _ = deployed(graph)
    with pytest.raises(sb.AccessDenied, match="not deployed"):
        state.block_spec("nope", 0, 0)
    with pytest.raises(sb.AccessDenied, match="no plan version 7"):
        state.block_spec("m1", 7, 0)
    with pytest.raises(sb.AccessDenied, match="not block 999"):
        state.block_spec("m1", 0, 999)
    with pytest.raises(UnknownWorker, match="no worker tcp://10.9.9.9:1 in the cluster"):
        state.handle(DeviceDrained("tcp://10.9.9.9:1"))
    state.handle(ModelReleased("m1"))
    assert state.handle(TasksSubmitted((("sb-m1", 0, 0, 0),))) == []
    with pytest.raises(UnknownWorker, match="whose workers are not in the cluster"):
        PlacementState().handle(ModelDeployed("m2", sb.place(graph, cluster())))
    with pytest.raises(sb.AccessDenied, match="already deployed"):
        state2, plan = deployed(graph)
        state2.handle(ModelDeployed("m1", plan))


def test_blocks_run_one_after_another_reproduce_the_model(gpt2) -> None:
    model, x, graph = gpt2
    plan = sb.place(graph, cluster())
    specs = [BlockSpec.from_dict(s.to_dict()) for s in block_specs(plan, "m1")]   # as sent to workers
    # NOTE: each op runs once, but a view a block makes again from its source (``_remakes``)
    runs = Counter(op.name for s in specs for op in s.ops)
    assert all(runs[op.name] == 1 for op in graph.ops if not _remakes(graph, op))
    store = WeightStore.from_weights(model)
    values: dict[str, torch.Tensor] = {graph.inputs[0]: x}
    for s in specs:
        assert all(d < s.index for d in s.deps)          # blocks are in dependency order
        prog = BlockProgram.load(s, store.load, torch.device("cpu"))
        values.update(prog.run({t: values[t] for t in s.imports}))
    with torch.no_grad():
        assert M.rel_err(values[graph.outputs[0]], model(x).logits) <= 1e-4
    dsk, keys = request_graph(specs, 3, {graph.inputs[0]: x}, fn=print)
    assert keys[0] == (task_name("m1"), 0, 3, 0) and len(dsk) == len(specs)
    for s, k in zip(specs, keys):
        assert dsk[k][6:] == tuple(keys[d] for d in s.deps)


def test_a_drain_moves_models_off_a_live_worker_and_restore_brings_it_back(gpt2) -> None:
    _, _, graph = gpt2
    spec = sb.ClusterSpec(tuple(replace(d, host="h0", address=f"tcp://a:{i}")
                                for i, d in enumerate(cluster(3).devices)), cluster(3).links)
    state, plan = deployed(graph, spec)
    victim = spec.devices[int(plan.block_device[0])].address
    keys = tuple(("sb-m1", 0, 0, b) for b in range(len(plan.blocks)))
    state.handle(TasksSubmitted(keys))
    on_victim = {k for k, a in state.pinned.items() if a == victim}
    assert on_victim
    out = state.handle(DeviceDrained(victim, "maintenance"))
    assert [type(i) for i in out] == [PlanChanged] and "maintenance" in out[0].reason
    assert out[0].replan_s < 0.025
    assert victim not in {d.address for d in state.models["m1"].plan.spec.devices}
    assert {k for k, a in state.pinned.items() if a == victim} == on_victim   # in flight: runs where it is
    assert victim in state.drained
    assert state.handle(DeviceAdded(replace(spec.devices[0], address=victim))) == []  # drained: takes nothing
    back = state.handle(DeviceRestored(replace(spec.devices[0], address=victim, name="back")))
    assert victim not in state.drained
    assert [type(i) for i in back] == [PlanChanged]
    assert victim in {d.address for d in state.models["m1"].plan.spec.devices}
    assert state.owned("m1", victim)["blocks"]                             # it owns blocks again


def test_a_drain_the_rest_cannot_absorb_is_refused_and_changes_nothing(gpt2) -> None:
    _, _, graph = gpt2
    w = sum(p.nbytes for p in graph.params.values())
    spec = cluster(2, memory=str(int(w * 0.8)))
    state, _ = deployed(graph, spec)
    with pytest.raises(sb.ClusterTooSmall, match="cannot hold model m1"):
        state.handle(DeviceDrained(spec.devices[0].address, "too hot"))
    assert state.drained == {} and state.models["m1"].version == 0


def test_a_lowered_budget_replans_what_no_longer_fits(gpt2) -> None:
    _, _, graph = gpt2
    state, plan = deployed(graph, cluster(4))
    d = int(plan.block_device[0])
    held = float(plan.weight_bytes[d])
    addr = plan.spec.devices[d].address
    out = state.handle(CapacityChanged(addr, memory_bytes=int(held * 0.5) + 64))
    assert [type(i) for i in out] == [PlanChanged] and out[0].moved_bytes > 0
    new = state.models["m1"].plan
    assert new.weight_bytes[new.spec.index(plan.spec.devices[d].name)] < held


def test_a_chain_spreads_onto_a_device_that_joins_its_host() -> None:
    """DeviceAdded on a pipeline: the newcomer takes the tail of its busiest peer."""
    from .dags import chain

    g = chain([1024] * 40)
    spec = sb.ClusterSpec(tuple(replace(d, host="h0") for d in cluster(2, memory="64MiB").devices),
                          cluster(2).links)
    plan = sb.place(g, spec)
    new = sb.replan(plan, sb.DeviceAdded(replace(spec.devices[0], name="w-new", address="tcp://n:1")))
    i = new.spec.index("w-new")
    assert (new.device_of == i).sum() > 0 and new.info["moved_ops"] > 0
    assert new.acyclic


def test_a_plan_whose_room_another_model_took_is_refused(gpt2) -> None:
    """Two clients measured the cluster, then placed and deployed at once: the second plan counts
    on room the first took, and is refused (``RoomTaken``), not overcommitted."""
    _, _, graph = gpt2
    weights = sum(p.nbytes for p in graph.params.values())
    state, plan = deployed(graph, cluster(2, f"{int(weights * 0.8)}B"))
    with pytest.raises(sb.RoomTaken, match=r"other models' plans take \d+ of its budget.*place again"):
        state.handle(ModelDeployed("m2", plan, "other"))
    assert list(state.models) == ["m1"]
    state.handle(ModelReleased("m1"))
    assert state.handle(ModelDeployed("m2", plan, "other")) == [PlanChanged("m2", 0, "deployed")]


def test_only_the_deploying_client_may_change_a_model(gpt2) -> None:
    _, _, graph = gpt2
    state, _ = deployed(graph)
    assert state.authorized("m1", "secret").model == "m1"
    for forged in ("", "guess", None, 42, "secreT"):
        with pytest.raises(sb.AccessDenied, match="token"):
            state.authorized("m1", forged)


def test_a_drain_for_one_model_leaves_the_others_where_they_are(gpt2) -> None:
    _, _, graph = gpt2
    spec = sb.ClusterSpec(tuple(replace(d, host="h0") for d in cluster(3).devices), cluster(3).links)
    state, plan = deployed(graph, spec)
    state.handle(ModelDeployed("m2", plan, "other"))
    victim = plan.spec.devices[int(plan.block_device[0])].address
    out = state.handle(ForModel("m1", DeviceDrained(victim, "mine")))
    assert [(type(i), i.model) for i in out] == [(PlanChanged, "m1")]
    assert victim not in state.models["m1"].addresses() and victim in state.models["m2"].addresses()
    assert state.drained == {}
    back = state.handle(ForModel("m1", DeviceRestored(state.devices[victim])))
    assert [i.model for i in back] == ["m1"] and not state.models["m1"].excluded


def test_a_stranded_model_serves_again_once_a_worker_returns(gpt2) -> None:
    _, _, graph = gpt2
    w = sum(p.nbytes for p in graph.params.values())
    spec = sb.ClusterSpec(tuple(replace(d, host="h0") for d in cluster(2, memory=str(int(w * 0.8))).devices),
                          cluster(2).links)
    state, _ = deployed(graph, spec)
    lost = spec.devices[0]
    assert isinstance(state.handle(DeviceLost(lost.address))[0], Stranded)
    assert state.models["m1"].stranded
    out = state.handle(DeviceAdded(replace(lost, name="w9", address="tcp://10.0.0.9:4000")))
    assert [type(i) for i in out] == [PlanChanged] and out[0].reason.startswith("recovered")
    dep = state.models["m1"]
    assert not dep.stranded and lost.address not in dep.addresses()
    assert "tcp://10.0.0.9:4000" in dep.addresses()
    assert dep.plan.feasible


@pytest.mark.parametrize("hosts", ["one", "two"])
def test_a_stranded_model_takes_its_fenced_worker_back_on_measured_links(gpt2, hosts: str) -> None:
    """Two workers with measured links: one is fenced (lost), the model is stranded, and the same
    worker answering again brings it back, whether the two share a host or not. The newcomer's
    links came out as a bandwidth of 0 when nothing measured was left to copy, the spec refused
    them and the model stayed stranded for good."""
    _, _, graph = gpt2
    w = sum(p.nbytes for p in graph.params.values())
    devices = cluster(2, memory=str(int(w * 0.8))).devices
    if hosts == "one":
        devices = tuple(replace(d, host="h0") for d in devices)
    spec = sb.ClusterSpec(devices, cluster(2).links).with_link(devices[0].name, devices[1].name,
                                                                 sb.LinkSpec(2e9, 1e-4))
    assert spec.matrix is not None
    state, _ = deployed(graph, spec)
    fenced = spec.devices[1]
    assert isinstance(state.handle(DeviceLost(fenced.address))[0], Stranded)
    out = state.handle(DeviceAdded(fenced))
    assert [type(i) for i in out] == [PlanChanged] and out[0].reason.startswith("recovered")
    dep = state.models["m1"]
    assert not dep.stranded and dep.addresses() == {d.address for d in devices} and dep.plan.feasible
    bw = dep.plan.spec.direct_bandwidth
    assert (bw[~torch.eye(2, dtype=torch.bool).numpy()] > 0).all()


def test_block_runs_observed_leave_the_state_no_bigger(gpt2) -> None:
    """A block run observed is learned from, not kept: 20,000 more leave the state's memory as it
    was (a log of every event filled 45 MiB of the scheduler in a few minutes of serving)."""
    import tracemalloc

    _, _, graph = gpt2
    state, plan = deployed(graph)
    blocks = len(plan.blocks)
    for i in range(12_000):          # NOTE: past the learner's window of errors (10,000), bounded
        state.handle(BlockObserved("m1", 0, i % blocks, 1e-3))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):      # NOTE: each made anew, as the scheduler decodes each report
            state.handle(BlockObserved("m1", 0, i % blocks, 1e-3 * (1 + i % 7)))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, grown


def test_old_plans_are_dropped_once_no_task_needs_them(gpt2) -> None:
    _, _, graph = gpt2
    spec = sb.ClusterSpec(tuple(replace(d, host="h0") for d in cluster(4).devices), cluster(4).links)
    state, _ = deployed(graph, spec)
    old = (("sb-m1", 0, 0, 0),)
    state.handle(TasksSubmitted(old))
    for d in spec.devices[:2]:
        state.handle(DeviceLost(d.address))
    dep = state.models["m1"]
    assert dep.version == 2 and set(dep.history) == {0, 1}     # v0 has a task, v1 is the newest old plan
    state.handle(TasksForgotten(old))
    assert set(dep.history) == {1}


def test_other_models_holdings_are_counted_per_worker(gpt2) -> None:
    _, _, graph = gpt2
    state, plan = deployed(graph)
    addr = plan.spec.devices[0].address
    assert state.held_bytes(addr) == int(plan.peak_bytes[0])
    state.handle(ModelReleased("m1"))
    assert state.held_bytes(addr) == 0
    assert state.owned("m1", addr) == {"released": True, "version": -1, "blocks": []}


def test_a_fenced_worker_is_replanned_around_and_what_it_missed_waits_for_its_return(gpt2,
                                                                                    monkeypatch) -> None:
    """A worker that stopped answering is fenced: every model moves off it as if it had left, and the
    session ends and releases it misses are kept for it, in order and bounded, until it answers
    (or leaves: then they go with it)."""
    _, _, graph = gpt2
    state, plan = deployed(graph)
    state.handle(ModelDeployed("m2", plan, "other"))
    victim = plan.spec.devices[int(plan.block_device[0])].address
    out = state.handle(WorkerFenced(victim, "no answer to a probe"))
    assert sorted(i.model for i in out if isinstance(i, PlanChanged)) == ["m1", "m2"]
    assert victim in state.fencing and state.fencing.fenced[victim] == "no answer to a probe"
    assert all(victim not in dep.addresses() for dep in state.models.values())
    monkeypatch.setattr(fencing, "MAX_MISSED_ENDS", 3)
    ends = [([1, 2], []), ([3], [[4, 5, 16]]), ([6], []), ([7], [])]
    for ids, moves in ends:
        state.fencing.sessions_ended("m1", ids, moves)
    state.fencing.sessions_ended("m2", [9], [])
    state.handle(ModelReleased("m2"))                   # its ends no longer matter; the release does
    assert state.fencing.lift(victim) == "no answer to a probe" and victim not in state.fencing
    state.fencing.sessions_ended("m1", [8], [])          # told at once now: not kept
    assert state.fencing.take_releases(victim) == {"m2"}
    assert state.fencing.take_ends(victim) == {"m1": ends[:3]}
    assert state.fencing.take_ends(victim) == {} and state.fencing.take_releases(victim) == set()
    other = next(a for a in state.models["m1"].addresses())
    state.handle(WorkerFenced(other, "hung"))
    state.fencing.sessions_ended("m1", [10], [])
    state.handle(ModelReleased("m1"))
    state.fencing.left(other)                            # gone: its caches went with it
    assert other not in state.fencing and not state.fencing.missed_ends and not state.fencing.missed_releases


def test_only_a_models_owner_may_run_or_read_its_tasks(gpt2) -> None:
    _, _, graph = gpt2
    state, plan = deployed(graph)
    state.handle(ModelDeployed("m2", plan, "token", owner="client-2"))
    key = ("sb-m2", 0, 1, 0)
    assert state.models["m2"].owner == "client-2" and state.owned_by("client-2") == ["m2"]
    assert state.may_touch("client-2", key) and not state.may_touch("client-1", key)
    for anyones in (("x", 1), "plain", ("sb-zz", 0, 0, 0)):     # not a deployed model's: anyone's
        assert state.may_touch("client-1", anyones)
    state.handle(ModelReleased("m2"))
    assert state.owned_by("client-2") == [] and state.may_touch("client-1", key)


def test_a_deploy_claim_names_its_client_once_and_expires() -> None:
    claims = Claims(ttl_s=10.0)
    nonce = "n" * 32
    assert claims.claim("c1", nonce, now=0.0)
    assert claims.take(nonce) == "c1" and claims.take(nonce) is None
    for bad in ("", "short", "x" * 129, 42, None):
        assert not claims.claim("c1", bad, 0.0)
    assert not claims.claim("", nonce, 0.0)               # no client named it
    assert claims.claim("c1", "a" * 16, 0.0) and claims.claim("c2", "b" * 16, 5.0)
    assert claims.claim("c2", "c" * 16, 10.5)              # the first is past its 10 s now
    assert claims.take("a" * 16) is None and claims.take("b" * 16) == "c2"
    many = [f"{i:016d}" for i in range(MAX_CLAIMS + 1)]
    assert [claims.claim("c3", n, 11.0) for n in many] == [True] * MAX_CLAIMS + [False]
    assert claims.claim("c4", "d" * 16, 11.0)              # another client still may
    claims.client_left("c3")
    assert all(claims.take(n) is None for n in many) and claims.take("d" * 16) == "c4"


def test_block_runs_are_counted_per_model_and_per_live_task(gpt2) -> None:
    _, _, graph = gpt2
    state, _ = deployed(graph)
    key = ("sb-m1", 0, 7, 0)
    state.handle(TasksSubmitted((key,)))
    state.handle(BlockRan("m1", 0, 7, 0))
    state.handle(BlockRan("m1", 0, 7, 0))                 # the same task computed again
    state.handle(BlockRan("m1", 0, 8, 0))                 # no task's (the data plane's): not per task
    state.handle(BlockRan("m1", computed=False))          # read back from a checkpoint
    state.handle(BlockRan("m9", 0, 0, 0))                 # no such model: nothing
    assert state.runs.of("m1") == {"computed": 3, "resumed": 1, "re_executed": 1}
    assert state.runs.per_task == {"m1": {key: 2}} and set(state.runs.totals) == {"m1"}
    state.handle(TasksForgotten((key,)))
    assert state.runs.per_task == {"m1": {}}
    state.handle(BlockRan("m1", 0, 5, 0, compute_s=1e-3))     # a block's first run warms it
    state.handle(BlockRan("m1", 0, -1, 0, compute_s=1e-3))    # a load task's: not learned from
    state.handle(BlockRan("m1", 0, 6, 0))                     # no time: not learned from
    assert not state.learner.errors
    state.handle(BlockRan("m1", 0, 7, 0, compute_s=1e-3))
    assert len(state.learner.errors) == 1
    state.handle(ModelReleased("m1"))
    assert state.runs.totals == {} and state.runs.per_task == {}


def test_settings_are_read_when_the_state_is_built(gpt2) -> None:
    """A worker that slowed down is repaired or not as the state was built (``learn.repair``), not as
    the configuration says when its runs come in."""
    _, _, graph = gpt2
    base = sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB")   # no one device holds it
    slow_cpu = dict(flops_per_s={"matmul": 2e8, "other": 2e8}, mem_bytes_per_s=2e9)
    spec = sb.ClusterSpec(tuple(replace(d, address=f"tcp://10.0.0.{i}:4000", **slow_cpu)
                                for i, d in enumerate(base.devices)), base.links)
    with dask.config.set({"seabiscuit.learn.repair": False, "seabiscuit.learn.patience": 2,
                          "seabiscuit.routing.repair": False}):
        state, _ = deployed(graph, spec)
        settings = StateSettings.from_config()
    assert state.settings == settings and not settings.learn_repair and settings.learn_patience == 2
    assert state.learner.patience == 2 and settings.reroute.min_gain == float("inf")
    modelled = state.models["m1"].modelled(0)
    victim = max(modelled, key=lambda am: am[1].get("matmul", 0.0))[0]
    out: list = []
    with dask.config.set({"seabiscuit.learn.repair": True}):
        for _ in range(10):
            for b, (address, m) in enumerate(modelled):
                slower = 4.0 if address == victim else 1.0
                out += state.handle(BlockObserved("m1", 0, b, slower * sum(m.values())))
    assert out == [] and state.models["m1"].version == 0
    assert state.learned("m1")["scales"][victim]["matmul"] > 2       # learned all the same
