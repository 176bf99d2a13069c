"""Network-aware routing without a cluster: links learned from transfers (``placement.links``),
the repair a changed link gets (``placement.reroute``), relays in ``ClusterSpec``, flow control
of one stream (``runtime.dataplane.flow``, and ``streams`` over a real TCP connection), and a
relay on the data plane."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import dask.config
import numpy as np
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.errors import SeaBiscuitError
from seabiscuit_dask.placement import DeviceAdded
from seabiscuit_dask.placement.cluster import ClusterSpec, DaskSpec, DeviceSpec, LinkSpec
from seabiscuit_dask.placement.links import LinkEstimator, LinkLearner, sample_s
from seabiscuit_dask.placement.reroute import LinkChanged, RepairPolicy, best_routes, reroute
from seabiscuit_dask.runtime.dataplane.flow import URGENT, FlowState
from seabiscuit_dask.runtime.dataplane.streams import ACK, FlowSettings, Links, Receiving, serve
from seabiscuit_dask.runtime.dataplane.wire import Tensors, pack_message, unpack_message
from seabiscuit_dask.runtime.scheduler import (
    LinksObserved,
    ModelDeployed,
    PlacementState,
    PlanChanged,
    Rerouted,
    RoutesChanged,
)

GBIT, SLOW = LinkSpec(1.25e8, 1.5e-4), LinkSpec(2.5e6, 1.5e-4)      # 1 Gbit/s, and 20 Mbit/s
SIZES = (200, 4096, 65536, 1 << 18, 1 << 20)


def trace(est: LinkEstimator, link: LinkSpec, n: int, rng: np.random.Generator, outliers: float = 0.0,
          sizes: tuple[int, ...] = SIZES) -> list[LinkSpec]:
    """``n`` transfers of random sizes on ``link`` (15% noise, ``outliers`` of them 10x slow): the
    changes ``est`` raised."""
    out = []
    for _ in range(n):
        nbytes = float(rng.choice(sizes))
        seconds = sample_s(link, nbytes) * float(rng.lognormal(0.0, 0.15))
        if rng.random() < outliers:
            seconds *= 10
        changed = est.observe(nbytes, seconds)
        if changed is not None:
            out.append(changed)
    return out


# --- the estimator -------------------------------------------------------------------------------
def test_the_estimate_converges_on_a_noisy_trace_and_ignores_outliers() -> None:
    rng = np.random.default_rng(1)
    est = LinkEstimator(LinkSpec(2.5e8, 1e-4))       # NOTE: the probe's figures, 2x off
    changes = trace(est, GBIT, 200, rng, outliers=0.05)
    got = est.estimate()
    assert got.bandwidth_bytes_per_s == pytest.approx(GBIT.bandwidth_bytes_per_s, rel=0.2)
    assert got.latency_s == pytest.approx(GBIT.latency_s, rel=0.35)
    assert len(changes) <= 1          # at most the prior's own error, never one per outlier
    assert est.count == 200 and len(est.history) >= 1


def test_a_throttled_link_is_seen_within_a_few_transfers() -> None:
    """1 Gbit/s to 20 Mbit/s: the activations of a pipeline (one size, again and again) show it on
    the third transfer and confirm it on the sixth, and the new figures are the link's."""
    rng = np.random.default_rng(2)
    est = LinkEstimator(GBIT)
    assert trace(est, GBIT, 40, rng, sizes=(1 << 17,)) == []
    seen = [est.observe(1 << 17, sample_s(SLOW, 1 << 17) * float(rng.lognormal(0, 0.15))) for _ in range(6)]
    assert seen[:5] == [None] * 5 and seen[5] is not None
    assert est.applied.bandwidth_bytes_per_s < GBIT.bandwidth_bytes_per_s / 10    # on trial from the third
    assert seen[5].bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.3)
    assert est.applied == seen[5] and est.changes == 1


def test_activations_a_header_apart_make_one_row() -> None:
    """A pipeline's activations differ by a header's bytes now and then (256 KiB and 256 bytes more):
    the smaller ones count in the row of slow transfers, and the throttle is still on trial from the
    third and confirmed on the sixth (it waited for more same-sized ones on a namespace link)."""
    est = LinkEstimator(GBIT)
    for k in range(20):
        assert est.observe(262161 + 256 * (k % 2), sample_s(GBIT, 262161)) is None
    sizes = (262417, 262417, 262161, 262161, 262417, 262161)
    seen = [est.observe(n, sample_s(SLOW, n), read_s=0.95 * n / SLOW.bandwidth_bytes_per_s) for n in sizes]
    assert est.changes == 1 and seen[:5] == [None] * 5 and seen[5] is not None
    assert seen[5].bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.3)


def test_a_stray_small_message_off_does_not_hold_back_a_throttle() -> None:
    """A request sends one large message and one small one. A small one delayed by its event loops
    just before the throttle joins the row of slow large ones: it neither spoils their fit nor
    delays the change past the third slow large transfer and its three confirming ones."""
    est = LinkEstimator(GBIT)
    for _ in range(12):
        assert est.observe(1 << 18, sample_s(GBIT, 1 << 18)) is None
        assert est.observe(273, sample_s(GBIT, 273)) is None
    assert est.observe(273, 10 * sample_s(GBIT, 273)) is None          # NOTE: a stall, 3 ms
    seen = []
    for _ in range(6):
        seen.append(est.observe(1 << 18, sample_s(SLOW, 1 << 18)))
        seen.append(est.observe(273, sample_s(GBIT, 273)))
    assert seen[-2] is not None and seen[:-2].count(None) == len(seen) - 2
    assert seen[-2].bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.3)


def test_small_messages_faster_than_the_fitted_latency_do_not_hold_back_a_throttle() -> None:
    """The fit took a latency of 0.45 ms from the noise of its first small messages; under the
    throttle the small ones of each request come in at 0.3 ms, faster by more than the band. They
    are no news against the slow large ones: the change still shows on the third slow large
    transfer and is confirmed on the sixth (seen on a namespace link: it took eight)."""
    est = LinkEstimator(LinkSpec(GBIT.bandwidth_bytes_per_s, 4.5e-4))
    for _ in range(12):
        assert est.observe(1 << 18, sample_s(est.applied, 1 << 18)) is None
        assert est.observe(273, sample_s(est.applied, 273)) is None
    seen = []
    for _ in range(6):
        seen.append(est.observe(1 << 18, sample_s(SLOW, 1 << 18)))
        seen.append(est.observe(273, 3e-4 if len(seen) % 4 == 1 else 6e-4))
    assert seen[-2] is not None and seen[:-2].count(None) == len(seen) - 2
    assert seen[-2].bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.3)


def test_a_stall_of_a_few_messages_is_no_change() -> None:
    """A receiver busy for 75 ms delays the messages that come meanwhile: three in a row look like a
    longer link, the next ones do not, and the link keeps its figures."""
    rng = np.random.default_rng(4)
    est = LinkEstimator(GBIT)
    assert trace(est, GBIT, 40, rng, sizes=(1 << 17,)) == []
    before = est.applied
    stalled = [est.observe(1 << 17, sample_s(GBIT, 1 << 17) + d) for d in (0.075, 0.07, 0.066)]
    assert stalled == [None] * 3 and est.trial is not None and est.applied != before     # on trial
    assert trace(est, GBIT, 20, rng, sizes=(1 << 17,)) == []
    assert est.applied == before and est.changes == 0


def test_the_first_gap_to_the_probes_figures_is_calibration_not_a_change() -> None:
    """Probes said 1 Gbit/s and 0.15 ms; the data plane sees 5 ms of latency from its first transfers
    (event loops, acknowledgements): taken as the link's figures without a repair. A change after
    that is news."""
    rng = np.random.default_rng(5)
    est = LinkEstimator(GBIT)
    busy = LinkSpec(GBIT.bandwidth_bytes_per_s, 5e-3)
    assert trace(est, busy, 30, rng) == []
    assert est.applied.latency_s == pytest.approx(5e-3, rel=0.3) and est.calibrated and est.changes == 0
    changes = trace(est, LinkSpec(2.5e6, 5e-3), 12, rng)
    assert len(changes) == 1 and changes[0].bandwidth_bytes_per_s == pytest.approx(2.5e6, rel=0.3)


def test_a_token_bucket_is_seen_though_small_messages_pass_at_full_speed() -> None:
    """Small messages within the bucket's burst keep their speed; they do not hide the large ones'."""
    est = LinkEstimator(GBIT)
    assert trace(est, GBIT, 20, np.random.default_rng(6)) == []
    changed = None
    for _ in range(6):
        for small in (200, 6000):       # NOTE: a failure; a large message's last unit, within the burst
            assert est.observe(small, sample_s(GBIT, small)) is None
        changed = est.observe(1 << 20, sample_s(SLOW, 1 << 20))
    assert changed is not None
    assert changed.bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.2)


@pytest.mark.parametrize("receiver_says", [False, True])
def test_the_receivers_read_time_tells_a_slower_link_from_a_longer_one(receiver_says: bool) -> None:
    """Messages of one size fit both a slower link and a longer one: the least change wins, unless
    the receiver saw the bytes trickle in (the link is no faster than that)."""
    first = LinkSpec(1.25e8, 3e-3)           # NOTE: a latency measured high at the start
    est = LinkEstimator(first)
    n = float(1 << 18)
    for _ in range(10):
        assert est.observe(n, sample_s(first, n)) is None
    read_s = 0.9 * n / SLOW.bandwidth_bytes_per_s if receiver_says else 0.0
    for _ in range(6):
        changed = est.observe(n, sample_s(SLOW, n), read_s=read_s)
    assert changed is not None
    if receiver_says:
        assert changed.bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.2)
    else:               # NOTE: a longer link, as fast as before: wrong, and what the figures alone allow
        assert changed.bandwidth_bytes_per_s > 10 * SLOW.bandwidth_bytes_per_s
        assert changed.latency_s > 10 * 3e-3


def test_mixed_sizes_on_a_changed_link_give_both_figures() -> None:
    rng = np.random.default_rng(3)
    est = LinkEstimator(GBIT)
    assert trace(est, GBIT, 20, rng) == []
    changes = trace(est, LinkSpec(5e6, 2e-3), 12, rng)
    assert changes
    got = est.estimate()
    assert got.bandwidth_bytes_per_s == pytest.approx(5e6, rel=0.3)
    assert got.latency_s == pytest.approx(2e-3, rel=0.5)


LOOPBACK = LinkSpec(2.75e8, 6e-5)       # NOTE: loopback as probes measured it: 2.2 Gbit/s, 0.06 ms
ACTIVATION = 131345.0                   # NOTE: a 128 KiB activation and its header


def loaded(rng: np.random.Generator, n: int,
           throttle: LinkSpec | None = None) -> list[tuple[float, float, float]]:
    """``n`` transfers ``(bytes, seconds, read seconds)`` of 128 KiB activations (now and then two or
    three in one busy period) between workers computing on two busy cores, modelled on those a
    LocalCluster of three worker processes running six Linear(512) layers beside a busy loop made on
    loopback (as its scheduler got them): each took the link's time plus a stall of an end (its event
    loop busy with a block's compute, or its process waiting for a core) of 4 ms at the median, 19 ms
    at the 90th percentile and 65 ms at the 99th, in spells (each stall 0.8 correlated with the one
    before, in log); the bytes came in at 3.2 GB/s once read, and one read in a hundred was itself
    stalled, up to 12 ms. Under a ``throttle`` the bytes come in at its pace."""
    out, spell = [], 0.0
    for _ in range(n):
        nbytes = ACTIVATION * float(rng.choice([1, 2, 3], p=[0.9, 0.08, 0.02]))
        spell = 0.8 * spell + 0.6 * float(rng.normal())
        stall_s = 4e-3 * math.exp(1.2 * spell)
        read_s = nbytes / 3.2e9 * float(rng.lognormal(0.0, 0.3))
        if throttle is not None:
            read_s = 0.95 * nbytes / throttle.bandwidth_bytes_per_s
        paused_s = float(rng.uniform(2e-4, 1.2e-2)) if rng.random() < 0.01 else 0.0
        seconds = sample_s(throttle or LOOPBACK, nbytes) + stall_s + paused_s
        out.append((nbytes, seconds, read_s + paused_s))
    return out


def test_a_loaded_loopback_is_no_slower_link_and_a_throttle_under_load_is_still_seen() -> None:
    """Transfers whose time went on stalls of their ends (their bytes came in at the link's pace once
    read) are no change of the link: 3,000 of them, and none is confirmed, none even put on trial,
    and the fit keeps the link's figures. A throttle on the same loaded link shows in its read times:
    on trial from the third slow transfer, confirmed on the sixth."""
    rng = np.random.default_rng(7)
    est = LinkEstimator(LOOPBACK)
    trials = 0
    for nbytes, seconds, read_s in loaded(rng, 3000):
        assert est.observe(nbytes, seconds, read_s=read_s) is None
        trials += est.trial is not None
    assert trials == 0 and est.changes == 0 and est.applied == LOOPBACK
    assert est.stalls > 2500 and est.count == 3000
    got = est.estimate()
    assert 0.5 < got.bandwidth_bytes_per_s / LOOPBACK.bandwidth_bytes_per_s < 2
    assert max(bw for _, bw, _ in est.history) < 2 * LOOPBACK.bandwidth_bytes_per_s
    seen = [est.observe(n, s, read_s=r) for n, s, r in loaded(rng, 6, throttle=SLOW)]
    assert seen[:5] == [None] * 5 and seen[5] is not None
    assert seen[5].bandwidth_bytes_per_s == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.3)


def test_the_learner_keeps_a_link_per_direction_and_forgets_a_worker() -> None:
    learner = LinkLearner(patience=2)
    learner.observe("a", "b", 1e6, sample_s(GBIT, 1e6), GBIT)
    learner.observe("b", "a", 1e6, sample_s(SLOW, 1e6), SLOW)
    ab, ba = learner.estimate("a", "b"), learner.estimate("b", "a")
    assert ab is not None and ba is not None and ab.bandwidth_bytes_per_s > 10 * ba.bandwidth_bytes_per_s
    assert learner.estimate("a", "c") is None
    learner.forget_device("b")
    assert learner.links == {}


# --- relays in the cluster spec -----------------------------------------------------------------
def three_hosts(memory: int = 3 * 2**20 + 2**18, link: LinkSpec = GBIT) -> ClusterSpec:
    devices = tuple(DeviceSpec(f"w{i}", "cpu", memory, {"matmul": 2e10, "other": 5e9}, 1e10, 1e-5,
                               host=f"h{i}", address=f"tcp://10.0.0.{i}:1") for i in range(3))
    bw = tuple(tuple(0.0 if a == b else link.bandwidth_bytes_per_s for b in range(3)) for a in range(3))
    lat = tuple(tuple(0.0 if a == b else link.latency_s for b in range(3)) for a in range(3))
    return ClusterSpec(devices, matrix=(bw, lat), dask=DaskSpec(1e-5, 3e-4, 3e-4, 3e-4, 1e9))


def test_a_relayed_link_is_as_fast_as_its_slower_leg_and_round_trips() -> None:
    spec = three_hosts().with_link("w0", "w1", SLOW).with_relay("w0", "w1", "w2")
    assert spec.direct_bandwidth[0, 1] == SLOW.bandwidth_bytes_per_s
    assert spec.bandwidth[0, 1] == GBIT.bandwidth_bytes_per_s
    assert spec.latency[0, 1] == pytest.approx(2 * GBIT.latency_s + spec.dask.hop_s / 2)
    assert set(spec.routes[0][1]) == set(spec.routes[0][2]) | set(spec.routes[2][1])
    again = ClusterSpec.from_dict(spec.to_dict())
    assert again.relays == (("w0", "w1", "w2"),) and np.array_equal(again.bandwidth, spec.bandwidth)
    assert spec.without("w2").relays == () and spec.with_relay("w0", "w1", None).relays == ()


@pytest.mark.parametrize("relays", [[["w0", "w1", "w0"]], [["w0", "w1", "nope"]],
                                    [["w0", "w1", "w2"], ["w0", "w2", "w1"]]])
def test_a_relay_that_is_not_one_hop_between_three_devices_is_refused(relays) -> None:
    with pytest.raises(SeaBiscuitError, match="relay"):
        ClusterSpec.from_dict({**three_hosts().to_dict(), "relays": relays})


# --- the repair decision -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline() -> sb.Plan:
    """Six 512x512 layers on three hosts, two a host (each holds no more): two cuts of 128 KiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).eval()
    g = sb.decompose(sb.trace(model, (torch.randn(64, 512),)), "16MiB")
    plan = sb.place(g, three_hosts())
    assert sorted(plan.bytes_between[np.nonzero(plan.bytes_between)].tolist()) == [131072.0, 131072.0]
    return plan


def cut_of(plan: sb.Plan) -> tuple[str, str]:
    a, b = (int(x[0]) for x in np.nonzero(plan.bytes_between))
    return plan.spec.names[a], plan.spec.names[b]


def direct_bytes(plan: sb.Plan, a: str, b: str) -> float:
    """Bytes a request sends over the link a -> b itself (none when it is relayed)."""
    i, j = plan.spec.index(a), plan.spec.index(b)
    return 0.0 if plan.spec.relay(i, j) >= 0 else float(plan.bytes_between[i, j])


def test_a_slow_link_on_the_cut_is_left_when_that_pays(pipeline) -> None:
    a, b = cut_of(pipeline)
    r = reroute(pipeline, LinkChanged(a, b, SLOW))
    assert r.kind in ("relay", "recut") and r.request_s < 0.5 * r.keep_s
    assert r.keep_s > pipeline.makespan_s and r.request_s == pytest.approx(r.plan.makespan_s)
    assert direct_bytes(r.plan, a, b) == 0.0
    spec = r.plan.spec
    assert spec.direct_bandwidth[spec.index(a), spec.index(b)] == SLOW.bandwidth_bytes_per_s
    assert sb.replan(pipeline, LinkChanged(a, b, SLOW)).device_of.tolist() == r.plan.device_of.tolist()


def test_a_relay_wins_where_moving_weights_would_not_pay_back(pipeline) -> None:
    a, b = cut_of(pipeline)
    r = reroute(pipeline, LinkChanged(a, b, SLOW),
                RepairPolicy(0.1, payback_requests=1, load_bytes_per_s=1e8))
    assert r.kind == "relay" and r.moved_bytes == 0.0
    assert r.plan.device_of.tolist() == pipeline.device_of.tolist()
    (relay,) = r.plan.spec.relays
    assert relay[:2] == (a, b) and relay[2] not in (a, b)


def test_no_repair_is_made_when_none_pays(pipeline) -> None:
    a, b = cut_of(pipeline)
    # NOTE: 20% slower: the transfer is a millisecond of a request's 14
    r = reroute(pipeline, LinkChanged(a, b, LinkSpec(1.0e8, 1.5e-4)))
    assert r.kind == "keep" and r.request_s == r.keep_s and "no repair pays" in r.reason
    assert r.plan.device_of.tolist() == pipeline.device_of.tolist() and r.plan.spec.relays == ()
    # NOTE: a slow link that carries nothing of the plan
    idle = next((x, y) for x in pipeline.spec.names for y in pipeline.spec.names
                if x != y and not pipeline.bytes_between[pipeline.spec.index(x), pipeline.spec.index(y)])
    assert reroute(pipeline, LinkChanged(*idle, SLOW)).kind == "keep"


def test_a_relay_that_no_longer_pays_goes_direct_again(pipeline) -> None:
    a, b = cut_of(pipeline)
    relayed = reroute(pipeline, LinkChanged(a, b, SLOW), RepairPolicy(0.1, 1, 1e8)).plan
    c = relayed.spec.relays[0][2]
    # NOTE: the relay's own leg is slow now, the direct link back to speed
    slowed = sb.Plan(relayed.graph, relayed.spec.with_link(a, c, SLOW), relayed.device_of, relayed.method)
    back = reroute(slowed, LinkChanged(a, b, GBIT), RepairPolicy(0.1, 1, 1e8))
    assert back.kind == "relay" and back.plan.spec.relays == ()
    assert best_routes(back.plan) is back.plan.spec


def test_routes_made_over_an_older_plans_relays_are_one_hop(pipeline) -> None:
    """A repair moved ops back and forth (a budget change), so w0 sends to w1 and to w2, and w1 back
    to w0; the relays are an older plan's, w0 -> w2 through w1 (from when w0 -> w2 was slow). Now
    w0 -> w1 is slow and w0 -> w2 fast again: w0 -> w1 is best through w2, whose leg w0 -> w2 was
    still relayed while the table was made pair by pair, and every reroute raised 'a leg of it is
    relayed itself' (logged at each change after). The table is made whole: one hop, the pair that
    gains most relayed."""
    from dataclasses import replace

    spec = replace(three_hosts(), relays=(("w0", "w2", "w1"),)).with_link("w0", "w1", SLOW)
    bouncing = sb.Plan(pipeline.graph, spec, np.array([0, 0, 0, 1, 0, 2]), pipeline.method)
    assert {(spec.names[a], spec.names[b]) for a, b in zip(*np.nonzero(bouncing.bytes_between))} == \
        {("w0", "w1"), ("w1", "w0"), ("w0", "w2")}
    assert best_routes(bouncing).relays == (("w0", "w1", "w2"),)
    r = reroute(bouncing, LinkChanged("w0", "w1", SLOW), RepairPolicy(0.1, 1, 1e8))
    assert r.kind == "relay" and r.plan.spec.relays == (("w0", "w1", "w2"),)
    assert direct_bytes(r.plan, "w0", "w1") == 0.0 and direct_bytes(r.plan, "w0", "w2") > 0
    assert best_routes(r.plan) is r.plan.spec


# --- the scheduler's state ----------------------------------------------------------------------
def deployed(plan: sb.Plan) -> PlacementState:
    state = PlacementState()
    for d in plan.spec.devices:
        state.handle(DeviceAdded(d))
    assert state.handle(ModelDeployed("m1", plan, "secret")) == [PlanChanged("m1", 0, "deployed")]
    return state


def transfers(a: str, b: str, link: LinkSpec, n: int) -> LinksObserved:
    return LinksObserved(a, tuple((b, 131072.0, sample_s(link, 131072.0), 1e9 + k, 0.0) for k in range(n)))


def measured(state: PlacementState, plan: sb.Plan) -> None:
    """Every link ``plan`` sends over has ten transfers at 1 Gbit/s behind it."""
    for i, j in zip(*np.nonzero(plan.bytes_between)):
        a, b = plan.spec.devices[int(i)].address, plan.spec.devices[int(j)].address
        assert state.handle(transfers(a, b, GBIT, 10)) == []


def test_the_state_learns_a_link_and_relays_it_without_a_new_plan(pipeline) -> None:
    a, b = (pipeline.spec.devices[pipeline.spec.index(x)].address for x in cut_of(pipeline))
    with dask.config.set({"seabiscuit.routing.payback-requests": 1, "seabiscuit.routing.load-rate": "100MB"}):
        state = deployed(pipeline)
        measured(state, pipeline)
        out = state.handle(transfers(a, b, SLOW, 6))
    (rerouted,) = [i for i in out if isinstance(i, Rerouted)]
    (routes,) = [i for i in out if isinstance(i, RoutesChanged)]
    assert rerouted.kind == "relay" and not any(isinstance(i, PlanChanged) for i in out)
    assert [r[:2] for r in routes.routes] == [(a, b)] and state.routes == routes.routes
    assert routes.watch == ((a, b),)        # NOTE: no plan sends over the link itself: its sender probes it
    dep = state.models["m1"]
    assert dep.version == 0 and dep.plan.spec.relays
    (link,) = [x for x in state.links_data() if (x["src"], x["dst"]) == (a, b)]
    assert link["via"] == routes.routes[0][2] and link["changes"] == 1 and link["transfers"] == 16
    assert link["applied_bandwidth_bytes_per_s"] == pytest.approx(SLOW.bandwidth_bytes_per_s, rel=0.1)


def test_a_change_waits_until_every_link_of_the_plan_is_measured(pipeline) -> None:
    """Weighing a measured link against links only probed would compare two instruments."""
    a, b = (pipeline.spec.devices[pipeline.spec.index(x)].address for x in cut_of(pipeline))
    state = deployed(pipeline)
    assert state.handle(transfers(a, b, GBIT, 10)) == []
    assert state.handle(transfers(a, b, SLOW, 6)) == [] and state.pending == {(a, b)}
    out = []
    for i, j in zip(*np.nonzero(pipeline.bytes_between)):
        x, y = pipeline.spec.devices[int(i)].address, pipeline.spec.devices[int(j)].address
        if (x, y) != (a, b):
            out += state.handle(transfers(x, y, GBIT, 3))
    assert [i.kind for i in out if isinstance(i, Rerouted)] in (["relay"], ["recut"]) and not state.pending


def test_the_state_moves_the_cut_when_that_pays_best_and_reports_only_when_repair_is_off(pipeline) -> None:
    a, b = (pipeline.spec.devices[pipeline.spec.index(x)].address for x in cut_of(pipeline))
    state = deployed(pipeline)
    measured(state, pipeline)
    out = state.handle(transfers(a, b, SLOW, 6))
    kinds = [i.kind for i in out if isinstance(i, Rerouted)]
    assert kinds and kinds[0] in ("relay", "recut")
    assert any(isinstance(i, (PlanChanged, RoutesChanged)) for i in out)
    with dask.config.set({"seabiscuit.routing.repair": False}):
        quiet = deployed(pipeline)
        measured(quiet, pipeline)
        out = quiet.handle(transfers(a, b, SLOW, 6))
    assert [i.kind for i in out if isinstance(i, Rerouted)] == ["keep"]
    assert not any(isinstance(i, (PlanChanged, RoutesChanged)) for i in out)
    assert quiet.models["m1"].plan.spec.direct_bandwidth.min() < GBIT.bandwidth_bytes_per_s   # learned, kept


def test_the_state_repairs_nothing_on_a_loaded_loopback(pipeline) -> None:
    """Both cuts' links report 1,500 transfers each as a loaded loopback times them (``loaded``), in
    batches as the workers send them: no change is confirmed, so no repair is weighed (no
    ``link-keep`` event), no route and no plan changes."""
    plan = sb.Plan(pipeline.graph, three_hosts(link=LOOPBACK), pipeline.device_of, pipeline.method)
    state = deployed(plan)
    cuts = [(plan.spec.devices[int(i)].address, plan.spec.devices[int(j)].address)
            for i, j in zip(*np.nonzero(plan.bytes_between))]
    rng = np.random.default_rng(11)
    out = []
    for k in range(75):
        for a, b in cuts:
            batch = tuple((b, n, s, 1e9 + k, r) for n, s, r in loaded(rng, 20))
            out += state.handle(LinksObserved(a, batch))
    assert out == [] and not state.pending and state.models["m1"].version == 0
    seen = {(x["src"], x["dst"]): x for x in state.links_data()}
    assert all(seen[c]["transfers"] == 1500 and seen[c]["changes"] == 0 for c in cuts)


# --- flow control --------------------------------------------------------------------------------
def flow(**kw) -> FlowState:
    return FlowState(**{"chunk_bytes": 1000, "window_bytes": 10_000, "priority_bytes": 100,
                        "pipe_delay_s": 1e-9, **kw})      # NOTE: a pipe of one chunk


def drain(f: FlowState, rounds: int = 10_000) -> list:
    """Take and acknowledge units until none is left: the units in the order they went out."""
    out = []
    for k in range(rounds):
        units = f.take(now=float(k))
        if not units:
            break
        out += units
        for u in units:
            f.acked(u.item.msg_id, u.length, 0.0, now=k + 0.5)
    return out


def test_two_streams_share_a_link_chunk_by_chunk() -> None:
    f = flow(window_bytes=100_000)
    f.add("first", 20_000, stream=("m", 1))          # NOTE: queued first, twice as large
    f.add("second", 10_000, stream=("m", 2))
    order = [u.item.token for u in drain(f)]
    assert order == ["first", "second"] * 10 + ["first"] * 10
    sent = {"first": 0, "second": 0}
    for token in order[:20]:
        sent[token] += 1000
        assert abs(sent["first"] - sent["second"]) <= 1000        # never a chunk apart while both send


def test_a_small_message_goes_before_the_rest_of_a_large_one() -> None:
    f = flow()
    f.add("prefill", 50_000, stream=("m", 1))
    first = f.take(now=0.0)
    assert [u.item.token for u in first] == ["prefill"]          # NOTE: one chunk fills the pipe
    f.add("decode", 80, stream=("m", 2))
    nxt = f.take(now=1.0)
    assert nxt[0].item.token == "decode" and nxt[0].item.lane == URGENT and nxt[0].length == 80
    assert f.counters["urgent"] == 1


def test_the_pipe_holds_one_chunk_on_a_slow_link_and_an_urgent_message_passes_it() -> None:
    f = flow(pipe_delay_s=1e-3)
    assert f.take(now=0.0) == []
    for k, n in enumerate((250, 1000, 500, 1000)):     # NOTE: acknowledged at 2 kB/s
        f.add(k, n, stream=("m", k))
        (unit,) = f.take(now=10.0 * k)
        f.acked(unit.item.msg_id, unit.length, 0.0, now=10.0 * k + (n + 17) / 2000)
    assert f.bandwidth_bytes_per_s == pytest.approx(2000, rel=0.2) and len(f.samples) == 4
    f.add("big", 10_000, stream=("m", 99))
    assert len(f.take(now=100.0)) == 1 and f.take(now=100.0) == []      # one chunk on the wire
    f.add("small", 50, stream=("m", 100))
    assert [u.item.token for u in f.take(now=100.0)] == ["small"]


def test_one_stalled_transfer_leaves_the_pipe_and_a_second_slow_one_shrinks_it() -> None:
    """A receiver that computes on a shared core acknowledges a message late now and then: that one
    sample must not shrink the pipe below the messages it passed whole (each would then go in pieces,
    every piece waiting for an acknowledgement: seen between two workers of a 2-core machine, a
    stall took a 512 KiB activation's pipe to 493 KiB). A link that did slow down is seen on its
    second sample."""
    f = flow(pipe_delay_s=1e-2)          # NOTE: chunks of 1000 bytes; the pipe 10 ms of the link

    def through(n: int, seconds: float, now: float) -> int:
        """Send a message of ``n`` bytes, acknowledged ``seconds`` later: the units it went out in."""
        f.add(now, n, stream=("m", now))
        units = f.take(now=now, max_bytes=math.inf)
        for u in units:
            f.acked(u.item.msg_id, u.length, 0.0, now=now + seconds)
        return len(units)

    for k in range(6):                   # NOTE: 5000 bytes in 5 ms: 1 MB/s, a pipe of 10 kB
        through(5000, 5e-3, float(k))
    assert f.bandwidth_bytes_per_s == pytest.approx(1e6, rel=0.05)
    assert through(5000, 0.1, 10.0) == 1                  # NOTE: stalled: 20x late
    assert f.bandwidth_bytes_per_s == pytest.approx(1e6, rel=0.05)
    assert through(5000, 5e-3, 11.0) == 1                 # NOTE: still whole
    through(5000, 0.1, 12.0)
    through(5000, 0.1, 13.0)                              # NOTE: slow twice in a row: 50 kB/s now
    assert f.bandwidth_bytes_per_s == pytest.approx(5e4, rel=0.05)
    assert through(5000, 0.1, 14.0) == 1 and f.by_id      # NOTE: one chunk on the wire, the rest waits


def test_stalls_in_a_row_whose_bytes_came_in_at_the_links_pace_leave_the_pipe() -> None:
    """On a loaded host stalls come in spells: two acknowledgements in a row 20x late, whose bytes the
    receiver read in at the link's pace once it ran, are no slower link and leave the pipe (it shrank
    to a twentieth before). Two whose bytes came in slowly shrink it."""
    f = flow(pipe_delay_s=1e-2)          # NOTE: chunks of 1000 bytes; the pipe 10 ms of the link

    def through(n: int, seconds: float, read_s: float, now: float) -> None:
        """A message of ``n`` bytes, acknowledged ``seconds`` later, its bytes read in ``read_s``."""
        f.add(now, n, stream=("m", now))
        units = f.take(now=now, max_bytes=math.inf)
        for u in units:
            f.acked(u.item.msg_id, u.length, 0.0, now=now + seconds, read_s=read_s / len(units))

    for k in range(6):                   # NOTE: 5000 bytes in 5 ms: 1 MB/s, a pipe of 10 kB
        through(5000, 5e-3, 4.5e-3, float(k))
    assert f.bandwidth_bytes_per_s == pytest.approx(1e6, rel=0.05)
    through(5000, 0.1, 4.5e-3, 10.0)
    through(5000, 0.1, 4.5e-3, 11.0)     # NOTE: stalled twice in a row
    assert f.bandwidth_bytes_per_s == pytest.approx(1e6, rel=0.05) and len(f.samples) == 8
    through(5000, 0.1, 0.095, 12.0)
    through(5000, 0.1, 0.095, 13.0)      # NOTE: throttled: the bytes came in at 50 kB/s
    assert f.bandwidth_bytes_per_s == pytest.approx(5e4, rel=0.05)


def test_the_window_bounds_what_the_peer_holds() -> None:
    f = flow(window_bytes=3000, pipe_delay_s=1.0)         # NOTE: a pipe as wide as any message
    for k in range(8):
        f.add(k, 2000, stream=("m", k))
    units = f.take(now=0.0, max_bytes=1e9)
    assert {u.item.token for u in units} == {0} and f.open_bytes[1] == 2000    # NOTE: 2 x 2000 > 3000
    for u in units:
        f.acked(u.item.msg_id, u.length, 0.0, now=0.5)
    assert f.open_bytes[1] == 0         # NOTE: the peer took it all: the credit is back
    f.add("jumbo", 50_000, stream=("m", 50))
    peak = 0
    delivered = []
    for k in range(1000):
        units = f.take(now=float(k))
        if not units:
            break
        peak = max(peak, f.open_bytes[1])
        delivered += [u.item.token for u in units if u.last]
        for u in units:
            f.acked(u.item.msg_id, u.length, 0.0, now=k + 0.5)
    assert delivered == [*range(1, 8), "jumbo"]
    assert peak == 50_000         # NOTE: a message past the window goes alone, none beside it


def test_acknowledgements_go_in_batches_and_still_time_the_link() -> None:
    """Small messages' acknowledgements wait for a prompt one (a large message's last unit) and go
    with it in one write, each counting its wait as held; the sender's samples are then exact."""
    from types import SimpleNamespace

    from seabiscuit_dask.runtime.dataplane.streams import ACK, Acks

    written: list[bytes] = []
    comm = SimpleNamespace(stream=SimpleNamespace(write=written.append))

    async def run() -> None:
        acks = Acks(comm, raw=True, small_bytes=100)
        acks.add(1, 50, 1e-4, 1e-5, 50)          # NOTE: small: put off
        acks.add(2, 60, 0.0, 1e-5, 60)           # NOTE: small: put off
        assert written == [] and len(acks.pending) == 2
        acks.add(3, 500, 2e-4, 1e-3, 5000)       # NOTE: a unit of a large message: prompt
        await asyncio.sleep(0)                   # NOTE: the flush is the loop's next callback
    asyncio.run(run())
    (batch,) = written
    got = [ACK.unpack(batch[k:k + ACK.size]) for k in range(0, len(batch), ACK.size)]
    assert [(i, n) for _, i, n, _, _ in got] == [(1, 50), (2, 60), (3, 500)]
    assert got[0][3] >= 1e-4 and got[1][3] > 0.0 and got[2][3] == 2e-4     # held: with the wait; its own

    f = flow()
    for k in (1, 2):
        f.add(k, 50, stream=("m", k))
    units = f.take(now=0.0)
    f.acked(units[0].item.msg_id, 50, 1e-4, now=1e-3)
    f.acked(units[1].item.msg_id, 50, 9e-3, now=1e-2)       # NOTE: put off 9 ms at the receiver
    assert [x[1] for x in f.samples] == pytest.approx([1e-3 - 1e-4, 1e-2 - 9e-3])
    assert f.urgent_bytes == 0 and f.open_bytes == [0, 0]


def test_a_small_messages_acknowledgement_that_falls_due_goes_after_the_work_already_queued() -> None:
    """A block that ran on the event loop past the acknowledgements' delay queues its sends as it
    ends; the acknowledgement that fell due meanwhile is written after them, not before."""
    from types import SimpleNamespace

    from seabiscuit_dask.runtime.dataplane.streams import ACK, Acks

    order: list[Any] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        written = loop.create_future()

        def write(b: bytes) -> None:
            order.append(("ack", len(b) // ACK.size))
            if not written.done():
                written.set_result(None)

        acks = Acks(SimpleNamespace(stream=SimpleNamespace(write=write)), raw=True, small_bytes=100)
        acks.add(1, 50, 0.0, 1e-5, 50)                    # NOTE: small: put off
        assert acks._later is not None
        loop.call_soon(order.append, "send")              # NOTE: queued by the block as it ended
        acks._later._run()                                # NOTE: the timer falls due, behind it
        await asyncio.wait_for(written, 30)
        acks.add(2, 50, 0.0, 1e-5, 50)                    # NOTE: put off again, as before
        assert acks._later is not None and len(acks.pending) == 1
        acks.flush()
    asyncio.run(run())
    assert order == ["send", ("ack", 1), ("ack", 1)]


def test_a_broken_stream_fails_what_it_held() -> None:
    f = flow()
    f.add("a", 5000, stream=1)
    f.take(now=0.0)
    f.add("b", 10, stream=2)
    assert {i.token for i in f.failed()} == {"a", "b"}
    assert f.queued == 0 and f.pipe_bytes == 0


def test_watched_links_are_probed_once_idle_and_a_probe_is_dropped_by_its_receiver() -> None:
    links = Links(lambda address: None, FlowSettings(1 << 16, 1 << 20, 1 << 10, 5e-3))   # type: ignore[arg-type]
    links.watch = {"tcp://b:1", "tcp://c:1"}
    links._sent_at["tcp://b:1"] = 100.0
    assert links.idle(101.0, 2.0) == ["tcp://c:1"]            # NOTE: b carried a message a second ago
    assert links.idle(102.5, 2.0) == ["tcp://b:1", "tcp://c:1"]

    from seabiscuit_dask.runtime.dataplane import DataPlane

    from .planes import FunctionHost

    async def nothing(*args, **kwargs):
        raise AssertionError("a probe reaches no run")

    plane = DataPlane(FunctionHost("tcp://b:1", None, nothing, nothing, nothing, nothing, spec_of=nothing,
                                   version_of=nothing))
    asyncio.run(plane.receive({"op": "probe", "sender": "tcp://a:1", "tensors": Tensors(x=torch.zeros(8))}))
    assert plane.counters["probes"] == 1 and plane.counters["messages"] == 0 and not plane.runs


def test_a_relay_forwards_only_what_the_scheduler_routes_through_it() -> None:
    from seabiscuit_dask.errors import AccessDenied
    from seabiscuit_dask.runtime.dataplane import DataPlane

    from .planes import FunctionHost

    forwarded, told, broken = [], [], []

    async def forward(address, msg):
        if broken:
            raise OSError("no route")
        forwarded.append((address, msg))

    async def send(address, op, **msg):
        told.append((address, op, msg))

    async def check(model, ticket):
        if ticket != "t":
            raise AccessDenied("wrong ticket")
        return "t"

    plane = DataPlane(FunctionHost("tcp://c:1", None, None, send, check, None, forward=forward))
    plane.relaying = {("tcp://a:1", "tcp://b:1")}
    push = {"op": "push", "sender": "tcp://a:1", "to": "tcp://b:1", "model": "m", "ticket": "t", "version": 0,
            "request": 5, "block": 3, "tensors": Tensors(x=torch.ones(2))}

    async def run() -> None:
        await plane.receive(dict(push))
        await plane.receive({**push, "to": "tcp://d:1"})          # NOTE: no route through here
        await plane.receive({**push, "ticket": "forged"})
        broken.append(True)
        await plane.receive(dict(push))
        await asyncio.gather(*plane._telling)        # NOTE: the fail goes out as a task of its own
    asyncio.run(run())
    ((to, msg),) = forwarded
    assert to == "tcp://b:1" and "to" not in msg and msg["sender"] == "tcp://a:1" and msg["block"] == 3
    assert plane.counters["relayed"] == 1 and plane.counters["relays_refused"] == 2 and not plane.runs
    ((addr, op, why),) = told
    assert (addr, op, why["request"]) == ("tcp://a:1", "seabiscuit_dp_fail", 5)
    assert "could not relay" in why["reason"]


# --- streams over TCP ----------------------------------------------------------------------------
async def tcp_link(receive, settings: FlowSettings):
    """A ``Links`` whose one peer is a listener here that serves the stream with ``receive``."""
    from distributed.comm import connect, listen

    held = Receiving()
    served = []     # NOTE: as a worker's server does, so no comm is collected while it is read

    async def handler(comm) -> None:
        served.append(comm)
        hello = await comm.read()
        await serve(comm, bool(hello["raw"]), receive, held, settings.priority_bytes)

    listener = listen("tcp://127.0.0.1:0", handler)
    await listener.start()

    async def open_stream(address: str):
        comm = await connect(address)
        raw = getattr(comm, "stream", None) is not None
        await comm.write({"op": "seabiscuit_dp_stream", "reply": False, "raw": raw})
        return comm, raw

    return Links(open_stream, settings), listener.contact_address, held, listener


def test_a_decode_message_is_not_held_behind_a_prefill_over_tcp() -> None:
    """The receiver is stalled on a first message; a prefill gets one chunk onto the wire, the
    decode message passes the full pipe, and arrives before the rest of the prefill."""
    settings = FlowSettings(chunk_bytes=1 << 16, window_bytes=64 << 20, priority_bytes=1 << 12,
                            pipe_delay_s=1e-9)

    async def run():
        got, gate = [], asyncio.Event()

        async def receive(msg):
            got.append((msg["op"], {k: v.clone() for k, v in msg.get("tensors", {}).items()}))
            if msg["op"] == "gate":
                await gate.wait()

        links, addr, held, listener = await tcp_link(receive, settings)
        await links.send(addr, {"op": "gate", "model": "m", "request": 0})
        prefill = torch.randn(1 << 20)
        big = asyncio.ensure_future(links.send(addr, {"op": "push", "model": "m", "request": 1,
                                                      "tensors": Tensors(x=prefill)}))
        await links.send(addr, {"op": "push", "model": "m", "request": 2,
                                "tensors": Tensors(t=torch.arange(4))})
        assert not big.done()
        gate.set()
        await asyncio.wait_for(big, 30)
        while len(got) < 3:
            await asyncio.sleep(0)
        counters = links.counters()[addr]
        links.close()
        listener.stop()
        return got, prefill, counters, held

    got, prefill, counters, held = asyncio.run(run())
    assert [op for op, _ in got] == ["gate", "push", "push"]
    assert torch.equal(got[1][1]["t"], torch.arange(4)) and torch.equal(got[2][1]["x"], prefill)
    assert counters["urgent"] == 2 and counters["units"] > 64 and held.held_bytes == 0


def test_many_requests_over_tcp_arrive_whole_within_the_window() -> None:
    settings = FlowSettings(chunk_bytes=1 << 15, window_bytes=1 << 20, priority_bytes=1 << 10,
                            pipe_delay_s=5e-3)

    async def run():
        got = {}

        async def receive(msg):
            got[msg["request"]] = msg["tensors"]["x"]

        links, addr, held, listener = await tcp_link(receive, settings)
        xs = {r: torch.randn(1 << 17) for r in range(12)}         # NOTE: 512 KiB each, 6 MiB in all
        await asyncio.gather(*(links.send(addr, {"op": "push", "model": "m", "request": r,
                                                  "tensors": Tensors(x=x)}) for r, x in xs.items()))
        link = links._links[addr]
        while len(got) < len(xs) or link.flow.pipe_bytes:      # NOTE: every unit acknowledged
            await asyncio.sleep(0)
        samples = links.take_samples()
        links.close()
        listener.stop()
        return xs, got, held, samples

    xs, got, held, samples = asyncio.run(run())
    assert all(torch.equal(got[r], x) for r, x in xs.items())
    assert held.peak_bytes <= (1 << 20) + (1 << 19) + 4096        # the window, and one message past it
    assert held.held_bytes == 0 and held.messages == 12
    (peer,) = samples
    assert sum(n for n, _, _, _ in samples[peer]) >= 6 * 2**20
    assert all(s > 0 and r >= 0 for _, s, _, r in samples[peer]) and any(r > 0 for *_, r in samples[peer])


class Arrivals:
    """What a test's receiver got, and a wait for the n-th arrival (the event itself, not a poll)."""

    def __init__(self) -> None:
        self.got: list = []
        self.changed = asyncio.Condition()

    async def add(self, item) -> None:
        async with self.changed:
            self.got.append(item)
            self.changed.notify_all()

    async def reach(self, n: int) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.got) >= n), 30)


def test_small_messages_go_straight_to_the_socket_and_a_large_one_the_socket_cannot_take_keeps_its_place(
        monkeypatch) -> None:
    """A message down an idle stream goes in one ``sendmsg``, not through tornado's write buffer; one
    the socket takes only part of (32 MiB as one unit) leaves the rest to the stream, and the
    messages after it queue behind that rest: every byte arrives, in order. Small messages read
    together are cut into units from one read."""
    from tornado.iostream import BaseIOStream

    writes, reads = [], []
    write, read_bytes = BaseIOStream.write, BaseIOStream.read_bytes
    monkeypatch.setattr(BaseIOStream, "write",
                        lambda self, data: writes.append(len(data)) or write(self, data))
    monkeypatch.setattr(BaseIOStream, "read_bytes",
                        lambda self, n, partial=False: reads.append(n) or read_bytes(self, n, partial))
    settings = FlowSettings(chunk_bytes=64 << 20, window_bytes=256 << 20, priority_bytes=1 << 12,
                            pipe_delay_s=1.0)

    async def run():
        arrived = Arrivals()
        got = arrived.got

        async def receive(msg):
            await arrived.add((msg["request"], {k: v.clone() for k, v in msg["tensors"].items()}))

        links, addr, held, listener = await tcp_link(receive, settings)
        await links.send(addr, {"op": "hello", "model": "m", "request": -1, "tensors": Tensors()})
        await arrived.reach(1)
        opened = len(writes)            # NOTE: the comm's handshakes and the stream's hello
        await links.send(addr, {"op": "push", "model": "m", "request": 0,
                                "tensors": Tensors(t=torch.arange(4))})
        await arrived.reach(2)
        direct = len(writes) - opened
        del reads[:]
        big = torch.randn(8 << 20)
        sends = [links.send(addr, {"op": "push", "model": "m", "request": 1, "tensors": Tensors(x=big)})]
        sends += [links.send(addr, {"op": "push", "model": "m", "request": r,
                                    "tensors": Tensors(t=torch.full((3,), r))}) for r in range(2, 40)]
        await asyncio.gather(*sends)
        await arrived.reach(41)
        links.close()
        listener.stop()
        return got[1:], big, direct, held

    got, big, direct, held = asyncio.run(run())
    assert direct == 0
    assert len(writes) >= 1             # NOTE: the rest of the 32 MiB message, and what queued behind it
    assert [r for r, _ in got] == list(range(40))
    assert torch.equal(got[1][1]["x"], big)
    assert all(torch.equal(ts["t"], torch.full((3,), r)) for r, ts in got[2:])
    assert held.held_bytes == 0 and held.messages == 41
    assert len([n for n in reads if n != ACK.size]) < 39     # NOTE: fewer reads than messages


def test_a_message_of_more_pieces_than_one_sendmsg_takes_arrives_whole() -> None:
    """700 tensors are about 1,400 pieces (each frame and its padding): past the 1,024 one
    ``sendmsg`` takes, the rest goes through the stream (the link broke on EMSGSIZE)."""
    settings = FlowSettings(chunk_bytes=1 << 16, window_bytes=1 << 30, priority_bytes=1 << 20,
                            pipe_delay_s=1.0)

    async def run():
        arrived = Arrivals()
        got = arrived.got

        async def receive(msg):
            await arrived.add({k: v.clone() for k, v in msg["tensors"].items()})

        links, addr, _, listener = await tcp_link(receive, settings)
        ts = Tensors({f"t{i}": torch.full((3,), i) for i in range(700)})
        await links.send(addr, {"op": "push", "model": "m", "request": 1, "tensors": ts})
        await arrived.reach(1)
        links.close()
        listener.stop()
        return got[0]

    got = asyncio.run(run())
    assert len(got) == 700 and all(torch.equal(got[f"t{i}"], torch.full((3,), i)) for i in range(700))


def test_a_packed_message_keeps_its_tensors_aligned() -> None:
    msg = {"op": "push", "tensors": Tensors(a=torch.arange(3, dtype=torch.int8), b=torch.randn(5, 3))}
    pieces, total = pack_message([msg])
    buf = bytearray(b"".join(bytes(memoryview(p)) for p in pieces))
    assert len(buf) == total
    (back,) = unpack_message(buf)
    assert torch.equal(back["tensors"]["b"], msg["tensors"]["b"])
    base = memoryview(buf)
    assert (back["tensors"]["b"].data_ptr() - np.frombuffer(base, np.uint8).ctypes.data) % 64 == 0
    with pytest.raises(SeaBiscuitError, match="frames take"):
        unpack_message(buf + bytearray(3))


def test_the_dashboard_shows_the_measured_links_and_their_history(pipeline) -> None:
    from types import SimpleNamespace

    from seabiscuit_dask.dashboard import Activity
    from seabiscuit_dask.dashboard.data import links_data
    from seabiscuit_dask.dashboard.page import SeaBiscuitPage, link_level

    a, b = (pipeline.spec.devices[pipeline.spec.index(x)].address for x in cut_of(pipeline))
    state = deployed(pipeline)
    state.handle(transfers(a, b, GBIT, 5))
    slow = tuple((b, 131072.0, sample_s(SLOW, 131072.0), 2e9 + k, 0.0) for k in range(3))
    state.handle(LinksObserved(a, slow))
    (link,) = links_data(state)
    assert (link["src_name"], link["dst_name"]) == cut_of(pipeline) and len(link["history"]) == 8
    assert link["history"][4][1] > 10 * link["history"][-1][1]          # the bandwidth before and after
    page = SeaBiscuitPage(SimpleNamespace(scheduler=SimpleNamespace(workers={}), state=state,
                                          activity=Activity(), events=[]))
    shown = page.links_source.data
    assert (shown["src"], shown["dst"]) == ([link["src_name"]], [link["dst_name"]])
    assert shown["level"] == [link_level(link["bandwidth_bytes_per_s"])] and "Mbit/s" in shown["text"][0]
    assert page.history_source.data["ys"][0][0] == pytest.approx(link["history"][0][1] * 8 / 1e6)
    assert link_level(2.5e6) == pytest.approx(math.log10(20)) and link_level(1.0) == 0.0
