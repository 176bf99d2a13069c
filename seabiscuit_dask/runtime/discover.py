"""A ``ClusterSpec`` of a live cluster (``measure_cluster``), from the agents' reports and a short link probe.

One worker is one device. Its memory budget comes from the agent (worker resource
``MEM``, config ``seabiscuit.worker.memory-budget``, or a fraction of its memory
limit); its speeds were measured on the worker. Workers are grouped into hosts by
address. Links are measured through Dask itself: the time to move a small and a
large payload between two workers of one host, and of two hosts, gives each
level's latency (a whole Dask hop, task dispatch included: the real cost of a
cut) and bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..errors import ClusterTooSmall, SeaBiscuitError
from ..placement.cluster import DEFAULT_LINKS, ClusterSpec, DeviceSpec, LinkSpec

PROBE_BYTES = 8 * 2**20


class PluginMissing(SeaBiscuitError):
    """The cluster runs without SeaBiscuit's scheduler plugin."""


HOW_TO_INSTALL = ("install SeaBiscuit's scheduler plugin first: "
                  "`client.register_plugin(seabiscuit_dask.SeaBiscuitSchedulerPlugin())`, or start the "
                  "scheduler with `dask scheduler --preload seabiscuit_dask.plugins.preload`")


def device_name(info: dict[str, Any], taken: set[str]) -> str:
    name = str(info["name"])
    name = f"w{name}" if name.isdigit() else name
    return info["address"] if name in taken or not name else name


def device_from_report(info: dict[str, Any], name: str | None = None) -> DeviceSpec:
    """One worker's ``DeviceSpec`` from ``{address, name, host, report}``."""
    r = info["report"]
    kind = "gpu" if r.get("device") == "cuda" else "cpu"
    return DeviceSpec(name or device_name(info, set()), kind, int(r["budget_bytes"]),
                      {"matmul": float(r["matmul_flops_per_s"]), "other": float(r["other_flops_per_s"])},
                      float(r["mem_bytes_per_s"]), float(r["op_overhead_s"]),
                      host=str(info["host"]), rack="rack0", address=str(info["address"]))


def _payload(nbytes: int) -> bytes:
    return bytes(nbytes)


def _size(x: bytes) -> int:
    return len(x)


def _hop_s(client: Any, a: str, b: str, nbytes: int, reps: int = 3) -> float:
    """Median time to make ``nbytes`` on ``a`` and read it on ``b``, less the time with no hop."""
    times = []
    for _ in range(reps):
        src = client.submit(_payload, nbytes, workers=[a], allow_other_workers=False, pure=False)
        src.result()
        t0 = time.perf_counter()
        client.submit(_size, src, workers=[b], allow_other_workers=False, pure=False).result()
        times.append(time.perf_counter() - t0)
        src.release()
    return statistics.median(times)


def probe_link(client: Any, a: str, b: str) -> LinkSpec:
    """Latency and bandwidth of the Dask path from worker ``a`` to worker ``b``."""
    small = _hop_s(client, a, b, 1)
    large = _hop_s(client, a, b, PROBE_BYTES)
    # NOTE: the latency is the whole hop, task dispatch included: every cut between
    # workers costs a Dask task on the far side, which is what placement must weigh.
    latency = max(small, 1e-5)
    bandwidth = PROBE_BYTES / max(large - small, 1e-6)
    return LinkSpec(bandwidth, latency)


def workers_info(client: Any, everyone: bool = False) -> list[dict[str, Any]]:
    """The scheduler plugin's view of every worker, with fresh agent reports.

    Drained workers are left out unless ``everyone``. Each report's ``budget_bytes``
    is what the worker has free: its budget less what other models' plans take there.
    """
    try:
        infos = client.sync(client.scheduler.seabiscuit_workers, everyone=everyone)
    except Exception as e:
        if "seabiscuit_workers" not in str(e) and "Unknown operation" not in str(e):
            raise
        infos = None
    if not isinstance(infos, (list, tuple)):   # NOTE: an unknown operation is answered with None
        raise PluginMissing(f"the cluster at {client.scheduler.address} has no SeaBiscuit plugin: "
                            + HOW_TO_INSTALL)
    infos = [dict(i) for i in infos]
    absent = [i["address"] for i in infos if i["report"] is None]
    if absent:
        raise PluginMissing(f"workers {absent} have no SeaBiscuit agent: " + HOW_TO_INSTALL)
    return infos


SPEED_KEYS = ("matmul_flops_per_s", "other_flops_per_s", "mem_bytes_per_s", "op_overhead_s")


def same_speed(infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Workers of one host with the same device kind and thread count get the median speeds.

    They measured at the same moment on shared cores, so their figures differ by
    noise only; a placement should not favour one of them for it.
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for i in infos:
        groups.setdefault((i["host"], i["report"].get("device"), i["nthreads"]), []).append(i)
    out = []
    for i in infos:
        peers = groups[(i["host"], i["report"].get("device"), i["nthreads"])]
        med = {k: statistics.median(float(p["report"][k]) for p in peers) for k in SPEED_KEYS}
        out.append({**i, "report": {**i["report"], **med}})
    return out


def measure_cluster(client: Any, *, probe: bool = True) -> ClusterSpec:
    """The live cluster behind a ``distributed.Client``: one device per worker.

    Built from the reports of SeaBiscuit's worker agents (free memory budget,
    measured speeds, host) and, with ``probe``, links measured through Dask between
    two workers of one host and of two hosts. Needs ``SeaBiscuitSchedulerPlugin``.
    A worker whose budget other models already fill is left out.

    >>> spec = sb.measure_cluster(client)      # doctest: +SKIP
    >>> print(spec.table())                     # doctest: +SKIP
    """
    infos = sorted(workers_info(client), key=lambda i: (i["host"], i["address"]))
    for i in infos:
        i["report"] = {**i["report"], "budget_bytes": int(i["report"]["budget_bytes"]) - int(i["held_bytes"])}
    if not infos:
        raise ClusterTooSmall(f"the cluster at {client.scheduler.address} has no workers")
    full = [i for i in infos if int(i["report"]["budget_bytes"]) <= 0]
    infos = [i for i in infos if i not in full]
    if not infos:
        raise ClusterTooSmall(f"every worker's budget is taken by the models already deployed "
                              f"({len(full)} workers): close one of them or add workers")
    taken: set[str] = set()
    devices = []
    for info in same_speed(infos):
        name = device_name(info, taken)
        taken.add(name)
        devices.append(device_from_report(info, name))
    links = dict(DEFAULT_LINKS)
    if probe and len(infos) > 1:
        by_host: dict[str, list[str]] = {}
        for i in infos:
            by_host.setdefault(i["host"], []).append(i["address"])
        same = next((v for v in by_host.values() if len(v) > 1), None)
        if same:
            links["pcie"] = links["nvlink"] = probe_link(client, same[0], same[1])
        hosts = list(by_host.values())
        if len(hosts) > 1:
            links["rack"] = links["network"] = probe_link(client, hosts[0][0], hosts[1][0])
    return ClusterSpec(tuple(devices), links)
