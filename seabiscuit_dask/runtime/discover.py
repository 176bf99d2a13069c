"""A ``ClusterSpec`` of a live cluster (``measure_cluster``), from the agents' reports and short probes.

One worker is one device. Its memory budget comes from the agent (worker resource
``MEM``, config ``seabiscuit.worker.memory-budget``, or a fraction of its memory
limit); its speeds were measured on the worker. Workers are grouped into hosts by
address. Everything else is measured through Dask itself, with tasks that do nothing:

- ``measure_dask``: the scheduler's time per task (a wide graph), the hop from a
  task's end to its dependent's start (a chain on one worker), the client's submit
  and gather (one task's round trip) and the client's bandwidth (a large result);
- ``probe_links``: for each pair of hosts and inside each host, the latency and
  bandwidth of moving a small and a large result from one worker to a task on
  another, less the same hop without the move. The result is a measured matrix, so
  a slow link between two hosts is seen as slow. On the data plane (``runtime.data-plane:
  p2p``) activations never go through a task: the hop is a worker-to-worker message
  (``measure_data_plane``) and the links are timed with echoes between the workers'
  comms (``probe_link_p2p``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .. import config
from ..errors import ClusterTooSmall, DeviceUnavailable, SeaBiscuitError
from ..placement.cluster import DEFAULT_LINKS, ClusterSpec, DaskSpec, DeviceSpec, LinkSpec, Matrix
from ..timing import median_s

PROBE_BYTES = 8 * 2**20
FLOOR_S = 1e-5          # NOTE: a measured time below this is noise, not a cost


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
                      view_overhead_s=float(r.get("view_overhead_s", 0.0)),
                      host=str(info["host"]), rack="rack0", address=str(info["address"]))


def for_device(info: dict[str, Any], device: str) -> dict[str, Any] | None:
    """``info`` as a model placed with ``device`` sees the worker, or None when it may not use it.

    ``cuda``: GPU workers only. ``cpu``: every worker, a GPU worker as the CPU device it also
    is (its agent's ``as_cpu`` figures: host-memory budget, speeds measured on its CPU).
    ``auto``: every worker as it is.
    """
    r = info["report"]
    on_gpu = r.get("device") == "cuda"
    if device == "cuda":
        return info if on_gpu else None
    if device == "cpu" and on_gpu:
        host = r.get("as_cpu")
        return {**info, "report": {**r, **host, "device": "cpu"}} if host else None
    return info


def no_device_error(infos: list[dict[str, Any]], device: str, where: str) -> DeviceUnavailable:
    """What ``measure_cluster(device=...)`` raises when no worker can run the model there."""
    seen = ", ".join(f"{i['address']} ({i['report'].get('device', 'cpu')})" for i in infos[:8])
    more = f" and {len(infos) - 8} more" if len(infos) > 8 else ""
    if device == "cuda":
        return DeviceUnavailable(
            f"device='cuda' needs GPU workers, but none of the {len(infos)} worker(s) of the cluster at "
            f"{where} has one: {seen}{more}. Start GPU workers (dask-cuda's LocalCUDACluster or "
            "`dask cuda worker`), or use device='auto' (GPUs where there are any) or device='cpu'")
    return DeviceUnavailable(
        f"device={device!r}: none of the {len(infos)} worker(s) of the cluster at {where} reports what "
        f"it can offer there: {seen}{more}; use device='auto'")


def nvml_link(a: dict[str, Any], b: dict[str, Any]) -> LinkSpec | None:
    """The nominal link between two GPU workers of one host from NVML's topology (their agents'
    ``gpu``, ``gpus`` and ``gpu_links``), or None when that is not known."""
    ra, rb = a["report"], b["report"]
    if a["host"] != b["host"] or ra.get("device") != "cuda" or rb.get("device") != "cuda":
        return None
    mine, theirs = ra.get("gpu") or {}, rb.get("gpu") or {}
    index = {g.get("pci_bus_id"): g.get("index") for g in ra.get("gpus") or ()}
    j = index.get(theirs.get("pci_bus_id")) if theirs.get("pci_bus_id") else None
    if mine.get("index") is None or j is None or j == mine["index"]:
        return None
    for link in ra.get("gpu_links") or ():
        if link.get("a") == mine["index"] and link.get("b") == j and link.get("bandwidth_bytes_per_s"):
            level = "nvlink" if link.get("kind") == "nvlink" else "pcie"
            return LinkSpec(float(link["bandwidth_bytes_per_s"]), DEFAULT_LINKS[level].latency_s)
    return None


def topology_matrix(spec: ClusterSpec, infos: list[dict[str, Any]]) -> Matrix | None:
    """The link matrix of ``spec`` (its devices in the order of ``infos``) by topology level, with
    NVML's figure for each pair of GPU workers on one host where the agents know it; None when
    NVML knows no pair (the levels say it all)."""
    known = {(a, b): link for a, ia in enumerate(infos) for b, ib in enumerate(infos)
             if a != b and (link := nvml_link(ia, ib)) is not None}
    if not known:
        return None
    n = len(infos)
    links = [[known.get((a, b)) or spec.links[spec.level(a, b)] for b in range(n)] for a in range(n)]
    bw, lat = (tuple(tuple(0.0 if a == b else getattr(links[a][b], f) for b in range(n)) for a in range(n))
               for f in ("bandwidth_bytes_per_s", "latency_s"))
    return bw, lat


def _payload(nbytes: int) -> bytes:
    return bytes(nbytes)


def _size(x: bytes) -> int:
    return len(x)


PROBE_TOPIC = "seabiscuit-probe"


def _noop(*deps: Any) -> dict[str, Any]:
    """A task that computes nothing but pays what a block task pays around its compute: it
    finds its worker, reports to the scheduler, and returns a dict holding a tensor."""
    import torch
    from distributed import get_worker

    get_worker().log_event(PROBE_TOPIC, {"deps": len(deps)})
    return {"t": torch.zeros(1)}


def _hop_s(client: Any, a: str, b: str, nbytes: int, reps: int = 3) -> float:
    """Median time to read on ``b``, from the client, a result of ``nbytes`` already on ``a``."""
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
    """Latency and bandwidth of moving a task's result from worker ``a`` to a task on ``b``.

    The same hop without the move (``b`` = ``a``) is taken off: the task and its
    dispatch are Dask's own costs (``measure_dask``), not the link's.
    """
    stay = _hop_s(client, a, a, 1)
    small = _hop_s(client, a, b, 1)
    large = _hop_s(client, a, b, PROBE_BYTES)
    return LinkSpec(PROBE_BYTES / max(large - small, 1e-6), max(small - stay, FLOOR_S))


def probe_link_p2p(client: Any, a: str, b: str, reps: int = 5) -> LinkSpec:
    """Latency and bandwidth of the link from worker ``a`` to ``b`` as the data plane uses it:
    messages between the two workers' comms, with no scheduler and no task. An echo of one byte
    and of ``PROBE_BYTES`` (random, so no compression flatters it) timed from ``a``; the same
    echo to ``a`` itself is taken off the latency (that much is the data plane's own hop,
    ``measure_data_plane``), and the payload crosses twice."""
    def trips(to: str, nbytes: int) -> float:
        return float(client.run(_rpc_trip_s, to, reps, nbytes=nbytes, workers=[a])[a])

    stay, small, large = trips(a, 1), trips(b, 1), trips(b, PROBE_BYTES)
    return LinkSpec(2 * PROBE_BYTES / max(large - small, 2 * PROBE_BYTES / 1e11),   # NOTE: at most 100 GB/s
                    max((small - stay) / 2, FLOOR_S))


def measure_dask(client: Any, worker: str, *, chain: int = 12, wide: int = 48, reps: int = 5) -> DaskSpec:
    """What Dask costs on this cluster, measured with tasks that do nothing (see the module doc).

    A round trip of one task is the client's submit and gather, one task of the
    scheduler's and one hop; a chain of ``chain`` tasks on ``worker`` adds a hop and a
    task per link; ``wide`` independent tasks add the scheduler's time per task.
    """
    import torch

    token = torch.zeros(16)      # NOTE: requests carry their inputs inside the graph

    def graph(n: int, dependent: bool, first: Any) -> tuple[dict[str, Any], list[str]]:
        tag = uuid.uuid4().hex[:12]
        keys = [f"seabiscuit-probe-{tag}-{i}" for i in range(n)]
        dsk = {k: (_noop, keys[i - 1]) if dependent and i else first for i, k in enumerate(keys)}
        return dsk, keys[-1:] if dependent else keys

    def run(n: int, dependent: bool, first: Any = (_noop, token)) -> None:
        # NOTE: the way a request goes: one graph, futures gathered, then released
        dsk, want = graph(n, dependent, first)
        futures = client.get(dsk, want, sync=False, workers=[worker] if dependent else None,
                             allow_other_workers=not dependent)
        client.gather(futures)
        for f in futures:
            f.release()

    run(2, True)                                           # NOTE: warm the path once
    trip = median_s(lambda: run(1, True), reps * 2)
    per_link = (median_s(lambda: run(chain, True), reps) - trip) / (chain - 1)
    task = max((median_s(lambda: run(wide, False), reps) - trip) / (wide - 1), FLOOR_S)
    hop = max(per_link - task, FLOOR_S)
    ends = max(trip - task - hop, 2 * FLOOR_S)
    small = median_s(lambda: run(1, True, (_payload, 1)), reps)
    big = median_s(lambda: run(1, True, (_payload, PROBE_BYTES)), reps)
    bandwidth = PROBE_BYTES / max(big - small, PROBE_BYTES / 1e11)     # NOTE: at most 100 GB/s
    return DaskSpec(task_s=task, hop_s=hop, submit_s=ends / 2, gather_s=ends / 2,
                    client_bytes_per_s=bandwidth)


def probe_links(client: Any, infos: list[dict[str, Any]],
                probe: Callable[[Any, str, str], LinkSpec] = probe_link
                ) -> tuple[Matrix, dict[tuple[str, str], LinkSpec]]:
    """The measured link matrix between the workers of ``infos`` (bandwidth, latency), and the
    link measured for each host pair (``(h, h)``: inside host h). One pair of workers stands
    for each pair of hosts; workers alone on their host have no inner link to measure.
    ``probe(client, a, b)`` measures one link (``probe_link``: through Dask's transfers;
    ``probe_link_p2p``: as the data plane moves activations)."""
    by_host: dict[str, list[str]] = {}
    for i in infos:
        by_host.setdefault(str(i["host"]), []).append(str(i["address"]))
    measured: dict[tuple[str, str], LinkSpec] = {}
    for h, addrs in by_host.items():
        if len(addrs) > 1:
            measured[(h, h)] = probe(client, addrs[0], addrs[1])
    for h1, h2 in itertools.combinations(sorted(by_host), 2):
        measured[(h1, h2)] = measured[(h2, h1)] = probe(client, by_host[h1][0], by_host[h2][0])
    inner = [v for (a, b), v in measured.items() if a == b]
    fallback = inner[0] if inner else DEFAULT_LINKS["pcie"]
    hosts = [str(i["host"]) for i in infos]
    bw = tuple(tuple(0.0 if a == b else measured.get((ha, hb), fallback).bandwidth_bytes_per_s
                     for b, hb in enumerate(hosts)) for a, ha in enumerate(hosts))
    lat = tuple(tuple(0.0 if a == b else measured.get((ha, hb), fallback).latency_s
                      for b, hb in enumerate(hosts)) for a, ha in enumerate(hosts))
    return (bw, lat), measured


def cluster_workers(client: Any) -> dict[str, dict[str, Any]]:
    """Every worker of the cluster, by address, as the scheduler itself lists them now (not
    ``client.scheduler_info()``: the client's shared copy, which its periodic update may have just
    replaced with one that lists no workers)."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


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


def forecast_budget(info: dict[str, Any], infos: list[dict[str, Any]]) -> int:
    """A worker's free budget for a new model: its budget less what deployed models hold there
    (their plans' peaks, or what the worker reports it holds, weights and KV caches, where that
    is more: a generation deployment's caches grow past its plan), and no more than its share
    of the memory its host is forecast to have free (the agent's smoothed low of free memory,
    split among the host's workers)."""
    r = info["report"]
    free = int(r["budget_bytes"]) - max(int(info["held_bytes"]), int(r.get("resident_bytes") or 0))
    low = r.get("forecast_memory_available_bytes")
    if low is None:
        return free
    peers = sum(1 for i in infos if i["host"] == info["host"])
    return min(free, int(float(low) / max(peers, 1)))


SPEED_KEYS = ("matmul_flops_per_s", "other_flops_per_s", "mem_bytes_per_s", "op_overhead_s",
              "view_overhead_s")


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
        med = {k: statistics.median(float(p["report"].get(k, 0.0)) for p in peers) for k in SPEED_KEYS}
        out.append({**i, "report": {**i["report"], **med}})
    return out


def measure_data_plane(client: Any, workers: list[str], dask: DaskSpec, reps: int = 15) -> DaskSpec:
    """``dask`` (the client's bandwidth) with what a request costs on SeaBiscuit's data plane: no
    scheduler time per block; a hop is a message from one worker to another (the round trip of
    an RPC between two workers: the send, the handler, the reply, each side's event loop) and
    the hand-off of a block to the worker's compute thread and back; the caller's submit and
    gather are one RPC to a worker (half its round trip each) as a caller makes it: from its own
    thread, through the client's event loop and back (``p2p.start``)."""
    first, other = workers[0], workers[-1]
    hop = client.run(_rpc_trip_s, other, reps, workers=[first])[first]
    hop += client.run(_handoff_s, reps, workers=[first])[first]
    trip = _caller_trip_s(client, first, reps)
    return replace(dask, task_s=FLOOR_S, hop_s=max(float(hop), FLOOR_S), submit_s=max(trip / 2, FLOOR_S),
                   gather_s=max(trip / 2, FLOOR_S))


def _caller_trip_s(client: Any, address: str, reps: int) -> float:
    """Median seconds of an RPC to ``address`` from this thread, the way a request's caller waits
    for its outputs: the call handed to the client's event loop, tensors sent as a request's
    inputs go (``wire.Tensors``) and echoed back as its outputs come, the reply handed back."""
    import asyncio

    import torch
    from distributed.protocol import to_serialize

    from .dataplane.wire import Tensors

    call, loop = client.rpc(address), client.loop.asyncio_loop
    tensors = Tensors({"x": torch.zeros(16)})

    def trip() -> None:
        asyncio.run_coroutine_threadsafe(call.seabiscuit_dp_echo(data=to_serialize(tensors)), loop).result()

    trip()                                      # NOTE: the connection is made once, then pooled
    return median_s(trip, reps)


async def _handoff_s(reps: int, dask_worker: Any = None) -> float:
    """Median seconds to run nothing on the worker's data-plane threads and come back."""
    import asyncio

    pool = getattr(dask_worker.plugins.get("seabiscuit"), "_pool", None)
    loop = asyncio.get_running_loop()
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        await loop.run_in_executor(pool, time.perf_counter)
        times.append(time.perf_counter() - t)
    return float(statistics.median(times[1:]))


async def _rpc_trip_s(address: str, reps: int, dask_worker: Any = None, nbytes: int = 0) -> float:
    """Median seconds of an RPC to ``address`` from this worker: an ``identity``, or with ``nbytes``
    an ``echo`` of that many random bytes (no compression flatters them)."""
    call = dask_worker.rpc(address)
    data = os.urandom(nbytes) if nbytes else None

    async def trip() -> None:
        await (call.echo(data=data) if data is not None else call.identity())

    await trip()                               # NOTE: the connection is made once, then pooled
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        await trip()
        times.append(time.perf_counter() - t)
    return float(statistics.median(times))


# NOTE: releases of models their callers dropped unclosed (``client.model._release_dropped``), still on
# their way: a measurement waits for them, so what they held counts as free
_releasing: set[concurrent.futures.Future[Any]] = set()
_releasing_lock = threading.Lock()
RELEASE_WAIT_S = 30.0


def releasing(release: concurrent.futures.Future[Any], on_error: Callable[[BaseException], None]) -> None:
    """Count ``release`` as on its way until it is done; ``on_error(exception)`` if it fails."""
    def done(f: concurrent.futures.Future[Any]) -> None:
        with _releasing_lock:
            _releasing.discard(f)
        if not f.cancelled() and (error := f.exception()) is not None:
            on_error(error)

    with _releasing_lock:
        _releasing.add(release)
    release.add_done_callback(done)


def await_releases(timeout_s: float = RELEASE_WAIT_S) -> None:
    """Wait for the releases of models dropped unclosed, so what they held is free to plan with."""
    with _releasing_lock:
        pending = list(_releasing)
    if pending:
        concurrent.futures.wait(pending, timeout_s)


def measure_cluster(client: Any, *, probe: bool = True, device: str | None = None) -> ClusterSpec:
    """The live cluster behind a ``distributed.Client``: one device per worker.

    Built from the reports of SeaBiscuit's worker agents (free memory budget,
    measured speeds, host) and, with ``probe``, what Dask itself costs (``measure_dask``)
    and the links between every pair of hosts and inside each host, measured through
    Dask (``probe_links``). Needs ``SeaBiscuitSchedulerPlugin``.
    A worker whose budget other models already fill is left out.

    ``device`` (default: config ``seabiscuit.device``): ``"auto"`` takes every worker as
    it is; ``"cuda"`` only GPU workers (``DeviceUnavailable`` without any); ``"cpu"``
    every worker as a CPU device, a GPU worker with its host-memory budget and CPU speeds,
    so a plan placed on the spec runs on CPUs only (``BlockSpec.kind``).

    Without ``probe`` the links are those of the topology levels, except between GPU
    workers of one host whose agents read the link from NVML (NVLink or the PCIe path,
    ``agent.gpu_links``). Measured links are always used as measured: activations move
    between workers through host memory and Dask's comms, never over NVLink, so a
    nominal NVLink figure would only overstate them.

    >>> spec = sb.measure_cluster(client)      # doctest: +SKIP
    >>> print(spec.table())                     # doctest: +SKIP
    """
    choice = config.device_choice(device)
    await_releases()
    every = sorted(workers_info(client), key=lambda i: (i["host"], i["address"]))
    if not every:
        raise ClusterTooSmall(f"the cluster at {client.scheduler.address} has no workers")
    infos = [j for j in (for_device(i, choice) for i in every) if j is not None]
    if not infos:
        raise no_device_error(every, choice, client.scheduler.address)
    for i in infos:
        i["report"] = {**i["report"], "budget_bytes": forecast_budget(i, every)}
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
    if not probe:
        spec = ClusterSpec(tuple(devices), links)
        return ClusterSpec(spec.devices, links, topology_matrix(spec, infos))
    dask = measure_dask(client, str(infos[0]["address"]))
    if config.data_plane() == "p2p":
        dask = measure_data_plane(client, [str(i["address"]) for i in infos], dask)
    if len(infos) == 1:
        return ClusterSpec(tuple(devices), links, None, dask)
    probe_one = probe_link_p2p if config.data_plane() == "p2p" else probe_link
    matrix, measured = probe_links(client, infos, probe_one)
    # NOTE: the levels stay as the measured links too, for a device that joins a new host
    same = [v for (a, b), v in measured.items() if a == b]
    across = [v for (a, b), v in measured.items() if a != b]
    if same:
        links["pcie"] = links["nvlink"] = same[0]
    if across:
        links["rack"] = links["network"] = min(across, key=lambda v: v.bandwidth_bytes_per_s)
    return ClusterSpec(tuple(devices), links, matrix, dask)
