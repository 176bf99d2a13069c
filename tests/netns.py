"""Real hosts on one machine: network namespaces joined by a bridge through rate-limited links.

Each host is a namespace with one veth link to a bridge in the root namespace;
``tc`` with a token bucket (``tbf``) caps what leaves each host, so traffic between
hosts is slow in bandwidth while traffic inside a host (loopback, or its own
address) is not. Processes run in a host with ``NamespaceHosts.popen``. Needs root
and iproute2; ``unavailable()`` says why not where they are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import seabiscuit_dask as sb
from tests.clusters import stop, wait_for

SUBNET_PREFIX = "10.213"


def _free_subnet() -> str:
    """A /24 under ``SUBNET_PREFIX`` that no interface here uses: a run killed before its cleanup
    leaves its bridge and address behind, and a second bridge on the same subnet would take half
    the routes (workers in the new namespaces then never reach the scheduler)."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                          timeout=30).stdout
    taken = {int(m) for m in re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", used)}
    for k in range(256):
        if k not in taken:
            return f"{SUBNET_PREFIX}.{k}"
    raise RuntimeError(f"every {SUBNET_PREFIX}.x.0/24 subnet is in use here; delete stale sb*br bridges")


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"sbprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` is not permitted here: {getattr(e, 'stderr', b'') or e}"
    _ip("netns", "del", name)
    return None


@dataclass(frozen=True)
class NamespaceHosts:
    """Hosts made by ``namespace_hosts``: their namespaces and addresses, and the bridge's."""

    names: tuple[str, ...]
    addresses: tuple[str, ...]
    bridge_address: str
    rate: str

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], **kwargs)


@contextmanager
def namespace_hosts(n: int, rate: str = "100mbit") -> Iterator[NamespaceHosts]:
    """``n`` hosts whose links to each other (and to the root namespace) carry at most ``rate``."""
    tag = f"sb{os.getpid() % 10000}"
    bridge = f"{tag}br"
    names = tuple(f"{tag}h{i}" for i in range(n))
    subnet = _free_subnet()
    addrs = tuple(f"{subnet}.{10 + i}" for i in range(n))
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (ns, addr) in enumerate(zip(names, addrs)):
            _ip("netns", "add", ns)
            made.append(ns)
            outer, inner = f"{tag}v{i}r", f"{tag}v{i}e"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("addr", "add", f"{addr}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", "tbf",
                            "rate", rate, "burst", "64kb", "latency", "100ms"],
                           check=True, capture_output=True, timeout=30)
        yield NamespaceHosts(names, addrs, f"{subnet}.1", rate)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def namespace_mesh(n: int, rate: str = "1gbit") -> Iterator[NamespaceHosts]:
    """``n`` hosts as ``namespace_hosts`` makes them, but with a link of its own from each host to
    each other one: an ``htb`` class per destination on the host's veth (traffic to the root
    namespace is not limited), so one link can be throttled alone (``throttle``)."""
    with namespace_hosts(n, rate) as hosts:
        tag = f"sb{os.getpid() % 10000}"
        for i, ns in enumerate(hosts.names):
            dev = f"{tag}v{i}e"
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "99")
            _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:99", "htb", "rate", "10gbit")
            for j, addr in enumerate(hosts.addresses):
                if j != i:
                    _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{10 + j}", "htb",
                        "rate", rate, "ceil", rate, "burst", "128k", "cburst", "128k")
                    _tc(ns, "filter", "add", "dev", dev, "protocol", "ip", "parent", "1:", "prio", "1", "u32",
                        "match", "ip", "dst", f"{addr}/32", "flowid", f"1:{10 + j}")
        yield hosts


def throttle(hosts: NamespaceHosts, src: int, dst: int, rate: str, burst: str = "16k") -> None:
    """``tc class change``: the link from host ``src`` to host ``dst`` now carries at most ``rate``."""
    dev = f"sb{os.getpid() % 10000}v{src}e"
    _tc(hosts.names[src], "class", "change", "dev", dev, "parent", "1:", "classid", f"1:{10 + dst}", "htb",
        "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)


PRELOAD = "seabiscuit_dask.plugins.preload"


def _dask_cli(*args: str) -> list[str]:
    # NOTE: `dask` is the CLI an operator types; run through this interpreter to find it.
    import sys

    return [sys.executable, "-c", "from dask.cli import run_cli; run_cli()", *args]


@contextmanager
def dask_on_hosts(hosts: NamespaceHosts, per_host: int, mem_bytes: int, folder: Any) -> Iterator[str]:
    """A scheduler in the root namespace and ``per_host`` workers (1 thread each) in every host,
    all with SeaBiscuit's preload; yields the scheduler file's path."""
    from pathlib import Path

    folder = Path(folder)
    sched_file = folder / "scheduler.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(_dask_cli("scheduler", "--host", hosts.bridge_address, "--port", "0",
                                        "--scheduler-file", str(sched_file), "--no-dashboard",
                                        "--preload", PRELOAD),
                              stdout=(folder / "scheduler.log").open("w"), stderr=subprocess.STDOUT, env=env)]
    try:
        wait_for(sched_file.exists, "the scheduler to write its file", 60)
        for h, addr in enumerate(hosts.addresses):
            for k in range(per_host):
                argv = _dask_cli("worker", "--scheduler-file", str(sched_file), "--host", addr,
                                 "--nthreads", "1", "--nworkers", "1", "--name", f"h{h}w{k}",
                                 "--no-dashboard", "--no-nanny", "--resources", f"MEM={mem_bytes}",
                                 "--preload", PRELOAD)
                procs.append(hosts.popen(h, argv, stdout=(folder / f"worker-{h}-{k}.log").open("w"),
                                         stderr=subprocess.STDOUT, env=env))
        yield str(sched_file)
    finally:
        stop(procs)


def blind(spec: sb.ClusterSpec) -> sb.ClusterSpec:
    """The same workers as a placement that knows nothing of hosts sees them: each its own host,
    one uniform link (the median measured), one speed (the first worker's: speeds measured on
    shared cores differ by noise), listed as the hosts take turns."""
    off = ~np.eye(len(spec.devices), dtype=bool)
    bw, lat = float(np.median(spec.bandwidth[off])), float(np.median(spec.latency[off]))
    by_host: dict[str, list[sb.DeviceSpec]] = {}
    for d in spec.devices:
        by_host.setdefault(d.host, []).append(d)
    turns = [d for group in zip(*by_host.values()) for d in group]
    first = spec.devices[0]
    devices = tuple(replace(d, host=f"solo{i}", flops_per_s=dict(first.flops_per_s),
                            mem_bytes_per_s=first.mem_bytes_per_s, op_overhead_s=first.op_overhead_s,
                            view_overhead_s=first.view_overhead_s)
                    for i, d in enumerate(turns))
    link = sb.LinkSpec(bw, lat)
    return sb.ClusterSpec(devices, dict.fromkeys(("nvlink", "pcie", "rack", "network"), link), dask=spec.dask)


def cross_host_bytes(plan: sb.Plan, hosts: dict[str, str]) -> float:
    """Bytes per request between devices of different real hosts (``hosts``: address -> host)."""
    where = [hosts[d.address] for d in plan.spec.devices]
    bb = plan.bytes_between
    return float(sum(bb[a, b] for a in range(len(where)) for b in range(len(where)) if where[a] != where[b]))
