"""A real topology: two hosts as network namespaces, 100 Mbit/s between them, unlimited inside.

``measure_cluster`` must recover it (workers grouped by host, the link between hosts
measured slow), and ``place`` must cut on the fast links: fewer bytes cross the slow
link than in a topology-blind plan of the same model on the same workers.
"""

from __future__ import annotations

import numpy as np
import pytest

import seabiscuit_dask as sb

from . import models as M
from . import netns

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

RATE_BYTES_PER_S = 100e6 / 8
blind, cross_host_bytes = netns.blind, netns.cross_host_bytes


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    why = netns.unavailable()
    if why:
        pytest.skip(f"no namespace hosts: {why}")
    from distributed import Client

    model, x = M.llama(), M.ids(seq=16)       # NOTE: untied: a pipeline need not come back
    weights = sum(p.numel() * 4 for p in model.parameters())
    with netns.namespace_hosts(2, rate="100mbit") as hosts, \
            netns.dask_on_hosts(hosts, 2, int(weights * 0.45), tmp_path_factory.mktemp("topo")) as sched, \
            Client(scheduler_file=sched, timeout="60s") as client:
        client.wait_for_workers(4, timeout=120)
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        yield client, hosts, model, x


def test_measure_cluster_recovers_the_hosts_and_the_slow_link(topology):
    client, hosts, _, _ = topology
    spec = sb.measure_cluster(client)
    assert sorted({d.host for d in spec.devices}) == sorted(hosts.addresses)
    assert [len(g) for g in spec.groups] == [2, 2]
    same = np.array([[a.host == b.host for b in spec.devices] for a in spec.devices])
    off = ~np.eye(len(spec.devices), dtype=bool)
    across, inside = spec.bandwidth[~same], spec.bandwidth[same & off]
    # The token bucket caps the link between hosts near 12.5 MB/s; inside a host it is loopback.
    assert across.max() < 2 * RATE_BYTES_PER_S
    assert inside.min() > 5 * across.max()


def test_place_cuts_on_the_fast_links_and_serves_across_hosts(topology):
    client, _, model, x = topology
    spec = sb.measure_cluster(client)
    g = sb.decompose(sb.trace(model, x), "64KiB")
    host_of = {d.address: d.host for d in spec.devices}
    aware = sb.place(g, spec)
    unaware = sb.place(g, blind(spec))
    assert len(set(aware.device_of.tolist())) >= 3          # no host holds the model alone
    assert cross_host_bytes(aware, host_of) < cross_host_bytes(unaware, host_of)
    with sb.deploy(aware, client, weights=model) as dm:
        assert M.rel_err(dm(x).logits, model(x).logits) <= 1e-4
