"""Routing on a real cluster (three worker processes on loopback): the data plane's transfers reach
the scheduler as link samples, and a link the scheduler learns is slow is relayed through the third
worker while requests run, every answer still the model's. The slow link's samples are made here
(loopback has none: twenty times slower than it measured); ``test_routing_netns`` throttles a
real one."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.placement.links import sample_s

from .clusters import seabiscuit_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

LAYERS, WIDTH = 6, 256


@pytest.fixture(scope="module")
def client():
    # NOTE: each worker holds two of the six layers, no more: the model spans all three
    with seabiscuit_cluster(3, int(2.6 * WIDTH * WIDTH * 4)) as c:
        yield c


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).eval()


def links(client) -> dict[tuple[str, str], dict]:
    return {(x["src"], x["dst"]): x for x in client.sync(client.scheduler.seabiscuit_links)}


def cuts(dask_scheduler=None) -> list[tuple[str, str, float]]:
    """On the scheduler: (sender, receiver, bytes a request) of each cut of the model's current plan."""
    (dep,) = dask_scheduler.plugins["seabiscuit"].state.models.values()
    spec, bb = dep.plan.spec, dep.plan.bytes_between
    return [(spec.devices[a].address, spec.devices[b].address, float(bb[a, b]))
            for a in range(len(spec.devices)) for b in range(len(spec.devices)) if bb[a, b]]


def plan_version(dask_scheduler=None) -> int:
    (dep,) = dask_scheduler.plugins["seabiscuit"].state.models.values()
    return int(dep.version)


def slow_down(src: str, dst: str, nbytes: float, load_rate: float | None = None,
              dask_scheduler=None) -> list[str]:
    """On the scheduler: the data plane of ``src`` reports six transfers to ``dst`` of twice the
    cut's bytes (no smaller than its real messages, which carry a header too) that took twenty times
    what the link measured so far says, their bytes coming in at the link's new pace; again, up to
    four times, until the link is repaired: on a loaded machine real transfers may have put other
    figures on trial, which the first of these samples settle. Returns the instructions (a repair
    by its kind)."""
    from seabiscuit_dask.placement.cluster import LinkSpec
    from seabiscuit_dask.runtime.scheduler import LinksObserved

    plugin = dask_scheduler.plugins["seabiscuit"]
    if load_rate is not None:       # NOTE: the state reads its settings when built: set its own
        now = plugin.state.settings
        plugin.state.settings = replace(now, reroute=replace(now.reroute, load_bytes_per_s=load_rate))
    size, done = 2 * nbytes, []
    for _ in range(4):
        now = plugin.state.links.links[(src, dst)].applied
        slow = LinkSpec(size / (20 * sample_s(now, size)), now.latency_s)
        read_s = 0.9 * size / slow.bandwidth_bytes_per_s
        samples = tuple((dst, size, sample_s(slow, size), 0.0, read_s) for _ in range(6))
        ins = plugin.state.handle(LinksObserved(src, samples))
        plugin._apply(ins)
        done += [getattr(i, "kind", type(i).__name__) for i in ins]
        if {"relay", "recut", "PlanChanged"} & set(done):
            break
    return done


def test_links_are_measured_from_requests_and_a_slow_one_is_left_while_requests_run(client) -> None:
    model, x = mlp(), torch.randn(32, WIDTH)
    with torch.no_grad():
        want = model(x)
    dm = sb.distribute(model, client, x, budget="16MiB")
    try:
        assert len({d for d in dm.plan.device_of.tolist()}) == 3
        for _ in range(4):
            torch.testing.assert_close(dm(x), want)

        def measured() -> list:
            """The current plan's cuts, once each link has twelve samples, past its calibration (a
            request more meanwhile: the plan may change as the links are first measured, and its new
            cuts need theirs)."""
            torch.testing.assert_close(dm(x), want)
            dm._flush_runs()
            cut = client.run_on_scheduler(cuts)
            seen = links(client)
            return cut if all(seen.get((a, b), {}).get("transfers", 0) >= 12 for a, b, _ in cut) else []

        cut = wait_for(measured, "a sample of each cut's transfers")
        seen = links(client)
        for src, dst, nbytes in cut:            # NOTE: every cut's link measured by its own transfers
            assert seen[(src, dst)]["bytes"] >= 4 * nbytes
            assert seen[(src, dst)]["bandwidth_bytes_per_s"] > 0 and seen[(src, dst)]["history"]
        src, dst, nbytes = cut[0]

        # NOTE: requests keep running while the link slows and the repair lands
        stop, answers, errors = threading.Event(), [], []

        def caller() -> None:
            try:
                while not stop.is_set():
                    answers.append(dm(x))
            except BaseException as e:  # noqa: BLE001 - asserted on below
                errors.append(e)

        version = client.run_on_scheduler(plan_version)
        thread = threading.Thread(target=caller)
        thread.start()
        # NOTE: weights that load at a byte a second never pay back: the repair is a relay
        done = client.run_on_scheduler(slow_down, src, dst, nbytes, 1.0)
        assert "relay" in done and "PlanChanged" not in done, done
        relaying = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["seabiscuit"].state.routes)
        (via,) = [c for a, b, c in relaying if (a, b) == (src, dst)]
        assert via not in (src, dst)
        wait_for(lambda: client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"]._links.routes,
                                    workers=[src])[src] == {dst: via}, "the sender to take the route")
        after = len(answers)
        wait_for(lambda: len(answers) >= after + 5, "five requests after the repair")
        stop.set()
        thread.join(60)
        assert not errors and all(torch.equal(a, answers[0]) for a in answers)
        torch.testing.assert_close(answers[0], want)
        # NOTE: the messages went through the third worker, and the plan stayed as it was
        relayed = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].dataplane.counters[
            "relayed"], workers=[via])
        sent = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"]._links.relayed, workers=[src])
        assert relayed[via] >= 5 and sent[src] >= 5 and client.run_on_scheduler(plan_version) == version
        events = client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.plugins["seabiscuit"].events))
        assert any(e["action"].startswith("link-") and e["action"] != "link-keep" for e in events)
    finally:
        dm.close()
