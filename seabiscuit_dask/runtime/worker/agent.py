"""The resource agent: what one worker has, measured on the worker itself, and its budget.

``static_report()`` is gathered once (CPU, memory, caches and NUMA nodes from
/sys, GPUs and the PCIe/NVLink links between them through pynvml, matmul FLOP/s
and memory bandwidth measured with torch at the worker's thread count);
``live_report()`` is cheap and runs on every heartbeat (utilisation, memory in
use, GPU memory, temperature). pynvml (``nvidia-ml-py``) is optional: without it,
or when an NVML call fails, the figure is simply unknown; the agent never raises.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from ... import config
from ...ir import fmt_bytes
from ...timing import median_s


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_caches() -> list[dict[str, Any]]:
    """Cache levels of CPU 0 from /sys: level, type and size in bytes."""
    out = []
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        size, level, kind = _read(d / "size"), _read(d / "level"), _read(d / "type")
        if not size or not level:
            continue
        mult = {"K": 1024, "M": 2**20, "G": 2**30}.get(size[-1], 1)
        digits = size[:-1] if size[-1] in "KMG" else size
        if digits.isdigit():
            out.append({"level": int(level), "type": kind or "", "size_bytes": int(digits) * mult})
    return out


def numa_nodes() -> list[dict[str, Any]]:
    """NUMA nodes from /sys with their CPU lists (one node on most laptops)."""
    out = []
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        out.append({"node": int(d.name[4:]), "cpus": _read(d / "cpulist") or ""})
    return out


# --- GPUs through NVML -----------------------------------------------------------------------
# Nominal link rates, bytes/s per direction: data-sheet figures, not measurements (a GPU-to-GPU
# copy reaches less). NVLink is quoted per link; the key is NVML's nvmlNvlinkVersion_t.
#
#   NVLink version (NVML enum)        per link  GPUs
#   1.0 (1)                           20 GB/s   P100
#   2.0, 2.2 (2, 3)                   25 GB/s   V100
#   3.0, 3.1 (4, 5)                   25 GB/s   A100 (12 links: 300 GB/s)
#   4.0 (6)                           25 GB/s   H100 (18 links: 450 GB/s)
#   5.0 (7)                           50 GB/s   B200 (18 links: 900 GB/s)
#
# PCIe is quoted per lane after line coding (gen 1-2: 8b/10b, gen 3-5: 128b/130b, gen 6: FLIT),
# times the link width; a pair gets the slower of its two GPUs' links.
#
#   PCIe gen    1      2      3       4       5       6
#   per lane    0.25   0.5    0.985   1.969   3.938   7.563 GB/s
#
# Where the two GPUs' PCIe paths meet sets how much of that a copy between them gets (nominal
# rules of thumb): under one or more PCIe switches, peer-to-peer runs at the link rate; through a
# CPU's host bridge ("pcie-host", NVML HOSTBRIDGE or NODE) 0.8 of it; across CPU sockets ("system",
# NVML SYSTEM: the SMP interconnect, usually staged through host memory) 0.5 of it.
NVLINK_BYTES_PER_S = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 25e9, 6: 25e9, 7: 50e9}
NVLINK_DEFAULT_BYTES_PER_S = 25e9        # NOTE: a version NVML does not tell (or a newer one)
PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
PCIE_PATH_SHARE = {"pcie-switch": 1.0, "pcie-host": 0.8, "system": 0.5}
# nvmlGpuTopologyLevel_t: INTERNAL 0 (one board), SINGLE 10, MULTIPLE 20 (PCIe switches),
# HOSTBRIDGE 30, NODE 40 (a CPU's host bridges), SYSTEM 50 (across CPU sockets)
TOPOLOGY_KINDS = {0: "pcie-switch", 10: "pcie-switch", 20: "pcie-switch", 30: "pcie-host",
                  40: "pcie-host", 50: "system"}
NVLINK_SWITCH = 2                        # NOTE: NVML_NVLINK_DEVICE_TYPE_SWITCH (an NVSwitch)


def nvml() -> Any:
    """pynvml, initialised; None without the package, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: report none
        return None
    return pynvml


def ask(lib: Any, fn: str, *args: Any, default: Any = None) -> Any:
    """``lib.fn(*args)``, or ``default`` when the call fails (an NVMLError: not supported, GPU lost)
    or this pynvml or driver has no such function."""
    call = getattr(lib, fn, None)
    if call is None:
        return default
    try:
        return call(*args)
    except Exception:  # noqa: BLE001 - the agent never raises for what NVML cannot tell
        return default


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def bus_id(value: Any) -> str:
    """A PCI bus id as NVML prints it (``00000000:07:00.0``), from either of its forms."""
    text = _text(getattr(value, "busId", value)).strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):08x}:{parts[1]}:{parts[2]}"
        except ValueError:
            return text
    return text


def _pcie(lib: Any, h: Any) -> tuple[int | None, int | None]:
    """PCIe generation and width of a GPU's link: the most its slot allows (``Max``), since an idle
    GPU drops its current link to gen 1 to save power; the current figures when ``Max`` is missing."""
    gen = ask(lib, "nvmlDeviceGetMaxPcieLinkGeneration", h) \
        or ask(lib, "nvmlDeviceGetCurrPcieLinkGeneration", h)
    width = ask(lib, "nvmlDeviceGetMaxPcieLinkWidth", h) or ask(lib, "nvmlDeviceGetCurrPcieLinkWidth", h)
    return (int(gen) if gen else None), (int(width) if width else None)


def pcie_bytes_per_s(generation: int | None, width: int | None) -> float | None:
    """Nominal bytes/s per direction of a PCIe link (None when either figure is unknown)."""
    lane = PCIE_LANE_BYTES_PER_S.get(int(generation or 0))
    return lane * int(width) if lane and width else None


def _one_gpu(lib: Any, index: int, h: Any) -> dict[str, Any] | None:
    """One GPU's figures; None when its memory cannot be read (a GPU that stops answering)."""
    mem = ask(lib, "nvmlDeviceGetMemoryInfo", h)
    if mem is None:
        return None
    util = ask(lib, "nvmlDeviceGetUtilizationRates", h)
    temp = ask(lib, "nvmlDeviceGetTemperature", h, getattr(lib, "NVML_TEMPERATURE_GPU", 0))
    pci = ask(lib, "nvmlDeviceGetPciInfo", h)
    gen, width = _pcie(lib, h)
    uuid = ask(lib, "nvmlDeviceGetUUID", h)
    return {"index": index, "name": _text(ask(lib, "nvmlDeviceGetName", h, default="")),
            "uuid": _text(uuid) if uuid is not None else None,
            "pci_bus_id": bus_id(pci) if pci is not None else None,
            "memory_total_bytes": int(mem.total), "memory_used_bytes": int(mem.used),
            "utilization": float(util.gpu) / 100.0 if util is not None else None,
            "temperature_c": float(temp) if temp is not None else None,
            "pcie_generation": gen, "pcie_width": width}


def _handles(lib: Any) -> list[tuple[int, Any]]:
    n = ask(lib, "nvmlDeviceGetCount", default=0) or 0
    out = []
    for i in range(int(n)):
        h = ask(lib, "nvmlDeviceGetHandleByIndex", i)
        if h is not None:
            out.append((i, h))
    return out


def gpu_report(lib: Any = None) -> list[dict[str, Any]]:
    """Every GPU of the host as NVML sees it (all of them, whatever ``CUDA_VISIBLE_DEVICES`` says):
    NVML index, name, uuid, PCI bus id, memory, utilisation (0..1), temperature and PCIe link.

    Empty without pynvml or a GPU; a figure NVML cannot give is None, and a GPU whose
    memory cannot be read is left out. ``lib``: an initialised pynvml (default: imported here).
    """
    lib = lib if lib is not None else nvml()
    if lib is None:
        return []
    return [g for g in (_one_gpu(lib, i, h) for i, h in _handles(lib)) if g is not None]


def _nvlinks(lib: Any, h: Any, gpu_at: Mapping[str, int]) -> dict[Any, list[float]]:
    """A GPU's active NVLinks: per peer (an NVML index, or "switch" for an NVSwitch), the nominal
    bytes/s of each link to it."""
    out: dict[Any, list[float]] = {}
    enabled = getattr(lib, "NVML_FEATURE_ENABLED", 1)
    for link in range(int(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18))):
        if ask(lib, "nvmlDeviceGetNvLinkState", h, link) != enabled:
            continue
        remote = ask(lib, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
        peer: Any = gpu_at.get(bus_id(remote)) if remote is not None else None
        if peer is None:
            kind = ask(lib, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link, default=NVLINK_SWITCH)
            if remote is None or kind != NVLINK_SWITCH:
                continue        # NOTE: a link to a CPU (IBM NPU) or to nothing NVML can name
            peer = "switch"
        version = ask(lib, "nvmlDeviceGetNvLinkVersion", h, link)
        out.setdefault(peer, []).append(NVLINK_BYTES_PER_S.get(int(version or 0), NVLINK_DEFAULT_BYTES_PER_S))
    return out


def _pair(lib: Any, a: tuple[int, Any], b: tuple[int, Any], nv: Mapping[int, Mapping[Any, list[float]]],
          pcie: Mapping[int, float | None]) -> dict[str, Any]:
    links = list(nv[a[0]].get(b[0], ()))
    if not links and nv[a[0]].get("switch") and nv[b[0]].get("switch"):
        mine, theirs = nv[a[0]]["switch"], nv[b[0]]["switch"]      # NOTE: all-to-all through NVSwitches
        links = mine if sum(mine) <= sum(theirs) else theirs
    if links:
        return {"a": a[0], "b": b[0], "kind": "nvlink", "nvlinks": len(links),
                "bandwidth_bytes_per_s": float(sum(links))}
    level = ask(lib, "nvmlDeviceGetTopologyCommonAncestor", a[1], b[1])
    kind = TOPOLOGY_KINDS.get(int(level), "unknown") if level is not None else "unknown"
    rates = [pcie[a[0]], pcie[b[0]]]
    bw = None
    if kind in PCIE_PATH_SHARE and None not in rates:
        bw = PCIE_PATH_SHARE[kind] * min(float(r or 0.0) for r in rates)
    return {"a": a[0], "b": b[0], "kind": kind, "nvlinks": 0, "bandwidth_bytes_per_s": bw}


def gpu_links(lib: Any = None) -> list[dict[str, Any]]:
    """The link between every ordered pair of the host's GPUs (NVML indices ``a`` -> ``b``).

    ``kind`` is ``nvlink`` (``nvlinks`` active links, direct or through NVSwitches), else where
    their PCIe paths meet: ``pcie-switch``, ``pcie-host`` or ``system``; ``unknown`` when NVML
    cannot tell. ``bandwidth_bytes_per_s`` is the nominal figure of the tables above (None when
    unknown). Never raises: every NVML call that fails only makes its figure unknown.
    """
    lib = lib if lib is not None else nvml()
    if lib is None:
        return []
    handles = _handles(lib)
    gpu_at: dict[str, int] = {}
    pcie: dict[int, float | None] = {}
    for i, h in handles:
        pci = ask(lib, "nvmlDeviceGetPciInfo", h)
        if pci is not None:
            gpu_at[bus_id(pci)] = i
        pcie[i] = pcie_bytes_per_s(*_pcie(lib, h))
    nv = {i: _nvlinks(lib, h, gpu_at) for i, h in handles}
    return [_pair(lib, a, b, nv, pcie) for a in handles for b in handles if a[0] != b[0]]


def own_gpu(gpus: list[dict[str, Any]], uuid: str | None = None,
            visible: str | None = None) -> dict[str, Any] | None:
    """Which of the host's GPUs (``gpu_report``) a worker's CUDA device 0 is: ``{index, uuid,
    pci_bus_id}``, or None when that cannot be told.

    By ``uuid`` (torch's, of device 0) when one of them has it; else by the first entry of
    ``visible`` (``CUDA_VISIBLE_DEVICES``: an NVML index as dask-cuda sets it, or a ``GPU-`` uuid);
    else NVML's GPU 0. A MIG instance is not one of the GPUs NVML counts: None.
    """
    def pick(g: dict[str, Any]) -> dict[str, Any]:
        return {"index": g["index"], "uuid": g.get("uuid"), "pci_bus_id": g.get("pci_bus_id")}

    def plain(u: Any) -> str:
        return str(u or "").lower().removeprefix("gpu-")

    by_uuid = next((pick(g) for g in gpus if plain(g.get("uuid")) == plain(uuid)), None) if uuid else None
    if by_uuid is not None:
        return by_uuid
    first = (visible if visible is not None else os.environ.get("CUDA_VISIBLE_DEVICES", "0")).split(",")[0]
    first = first.strip()
    if first.lower().startswith("gpu-"):
        return next((pick(g) for g in gpus if plain(g.get("uuid")) == plain(first)), None)
    if first.isdigit():
        return next((pick(g) for g in gpus if g["index"] == int(first)), None)
    return None


def dispatch_s(device: str = "cpu", reps: int = 9) -> tuple[float, float]:
    """Seconds the block runtime spends on one tiny op and on one view, as a block runs them
    (``BlockProgram``: the op's kernel called on its operands from the block's environment): a
    chain of 65 ops less a chain of one, over 64."""
    import torch

    from ...ir import Op, TensorSpec
    from ...lower.blocks import BlockProgram, BlockSpec

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = {"x": torch.ones(8, device=dev)}

    def chain(n: int, target: str, kind: str, extra: tuple[Any, ...]) -> BlockProgram:
        ops, prev = [], "x"
        for i in range(n):
            ops.append(Op(f"op{i}", kind, target, (prev,), (f"t{i}",), attrs={"args": ({"t": prev}, *extra)}))
            prev = f"t{i}"
        spec = BlockSpec("probe", 0, 0, device, tuple(ops), {}, {"x": TensorSpec((8,), "float32")}, (prev,),
                         (-1,))
        return BlockProgram(spec, {}, dev)

    def per_op(target: str, kind: str, extra: tuple[Any, ...]) -> float:
        one, many = chain(1, target, kind, extra), chain(65, target, kind, extra)

        def run(p: BlockProgram) -> None:
            for _ in range(10):
                p.run(x)
            sync()

        run(one)
        run(many)
        return max((median_s(lambda: run(many), reps) - median_s(lambda: run(one), reps)) / 640, 0.0)

    return per_op("aten.add.Tensor", "elementwise", (1.0,)), per_op("aten.view.default", "view", ((8,),))


def measure_speed(device: str = "cpu", n: int = 384, reps: int = 5) -> dict[str, float]:
    """Matmul FLOP/s, elementwise FLOP/s, memory bandwidth, and what the block runtime spends on a
    tiny op and on a view (``dispatch_s``), measured."""
    import torch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    big = torch.empty(64 * 2**20 // 4, device=dev)     # 64 MiB: larger than most L3 caches
    def mm() -> None:
        torch.mm(a, b)
        sync()

    def copy() -> None:
        big.mul_(1.0)
        sync()

    for f in (mm, copy):
        f()
    mm_s, copy_s = median_s(mm, reps), median_s(copy, reps)
    op_s, view_s = dispatch_s(device)
    bytes_moved = 2 * big.numel() * 4
    return {"matmul_flops_per_s": 2 * n**3 / mm_s, "other_flops_per_s": big.numel() / copy_s,
            "mem_bytes_per_s": bytes_moved / copy_s, "op_overhead_s": op_s, "view_overhead_s": view_s}


def static_report(nthreads: int, memory_limit: int | None, device: str = "cpu",
                  gpu_uuid: str | None = None) -> dict[str, Any]:
    """What this worker has; measured once at setup.

    On a host with several GPUs it gives the links between them (``gpu_links``). On a CUDA
    worker it also names its own GPU (``gpu``: NVML index, uuid, PCI bus id; see ``own_gpu``)
    and measures its host side too (``as_cpu``: the speeds a model placed with ``device="cpu"``
    runs at here).
    """
    mem = psutil.virtual_memory()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    lib = nvml()
    gpus = gpu_report(lib)
    out = {"host": socket.gethostname(), "cpu_count": cpus, "nthreads": nthreads,
           "memory_total_bytes": int(mem.total), "memory_limit_bytes": int(memory_limit or 0),
           "caches": cpu_caches(), "numa_nodes": numa_nodes(), "gpus": gpus,
           "gpu_links": gpu_links(lib) if len(gpus) > 1 else [],
           "device": device, **measure_speed(device)}
    if device == "cuda":
        out["gpu"] = own_gpu(gpus, gpu_uuid)
        out["as_cpu"] = measure_speed("cpu")
    return out


def live_report(process: psutil.Process, own_gpu_index: int | None = None) -> dict[str, Any]:
    """Cheap figures for every heartbeat; ``own_gpu_index``: the NVML index of the worker's GPU,
    whose temperature is then ``gpu_temperature_c_own``."""
    gpus = gpu_report()
    out = {"cpu_percent": process.cpu_percent(), "rss_bytes": int(process.memory_info().rss),
           "memory_available_bytes": int(psutil.virtual_memory().available),
           "host_cpu_idle": max(0.0, 1.0 - psutil.cpu_percent() / 100.0),
           "gpu_memory_used_bytes": [g["memory_used_bytes"] for g in gpus],
           "gpu_utilization": [g["utilization"] for g in gpus],
           "gpu_temperature_c": [g["temperature_c"] for g in gpus]}
    own = next((g for g in gpus if g["index"] == own_gpu_index), None)
    if own is not None and own["temperature_c"] is not None:
        out["gpu_temperature_c_own"] = own["temperature_c"]
    return out


class AvailabilityForecast:
    """What a worker can count on next, from the history of its heartbeats.

    Free memory and idle CPU are smoothed exponentially (weight ``alpha`` for each
    new reading) with their spread; the forecast is the smoothed value less
    ``k`` spreads, so a host whose free memory swings is planned on its lows, not on
    whatever the last heartbeat happened to read.
    """

    def __init__(self, alpha: float = 0.2, k: float = 2.0) -> None:
        self.alpha, self.k = alpha, k
        self.stats: dict[str, tuple[float, float]] = {}     # name -> (mean, variance)
        self.readings = 0

    def update(self, **values: float) -> None:
        a = self.alpha
        for name, x in values.items():
            if name not in self.stats:
                self.stats[name] = (float(x), 0.0)
                continue
            mean, var = self.stats[name]
            d = float(x) - mean
            mean += a * d
            self.stats[name] = (mean, (1 - a) * (var + a * d * d))
        self.readings += 1

    def low(self, name: str) -> float | None:
        """The smoothed value less ``k`` spreads (never below 0), or None before any reading."""
        if name not in self.stats:
            return None
        mean, var = self.stats[name]
        return max(0.0, mean - self.k * var ** 0.5)

    def report(self) -> dict[str, float]:
        out: dict[str, float] = {"forecast_readings": float(self.readings)}
        for name in self.stats:
            out[f"forecast_{name}"] = float(self.low(name) or 0.0)
        return out


def worker_budget(resources: Mapping[str, float], memory_limit: int | None, gpu_bytes: int | None) -> int:
    """Bytes of shards and activations a worker may hold.

    The worker resource ``MEM`` (bytes), else config ``seabiscuit.worker.memory-budget``,
    else ``seabiscuit.worker.memory-fraction`` of the worker's memory limit (or of its
    GPU's memory).
    """
    if resources.get("MEM"):
        return int(resources["MEM"])
    configured = config.get("worker.memory-budget")
    if configured:
        return config.to_bytes(configured, "seabiscuit.worker.memory-budget")
    fraction = float(config.get("worker.memory-fraction"))
    base = gpu_bytes or memory_limit or psutil.virtual_memory().total
    return int(base * fraction)


def machine_bytes(report: Mapping[str, Any]) -> int:
    """The most memory a worker can have: its GPU's, else its memory limit, else the host's."""
    gpus = report.get("gpus") or []
    if report.get("device") == "cuda" and gpus:
        own = (report.get("gpu") or {}).get("index")
        return int(next((g for g in gpus if g.get("index") == own), gpus[0])["memory_total_bytes"])
    return int(report.get("memory_limit_bytes") or report.get("memory_total_bytes") or 0)


def pressure_reason(live: Mapping[str, Any], memory_limit: int) -> str | None:
    """Why a worker should shed its work (memory or GPU heat over its limit), or None."""
    reason = None
    frac = float(config.get("worker.memory-pressure"))
    if live.get("rss_bytes", 0) > frac * memory_limit:
        reason = (f"memory pressure: {fmt_bytes(live['rss_bytes'])} in use, over {frac:.0%} of "
                  f"{fmt_bytes(memory_limit)}")
    hot = float(config.get("worker.gpu-temperature-limit"))
    # NOTE: a GPU worker watches its own GPU; a worker that knows none, every GPU of its host
    if live.get("gpu_temperature_c_own") is not None:
        temps = [float(live["gpu_temperature_c_own"])]
    else:
        temps = [float(t) for t in live.get("gpu_temperature_c", ()) or () if t is not None]
    if "gpu_temperature_c_max" in live:
        temps.append(float(live["gpu_temperature_c_max"]))
    if temps and max(temps) > hot:
        reason = f"GPU at {max(temps):.0f} C, over the {hot:.0f} C limit"
    return reason


def tune_malloc() -> bool:
    """Let glibc reuse freed activation buffers instead of mapping fresh pages for each.

    Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_``, which also freezes glibc's mmap
    threshold at 128 KiB: every activation tensor is then a fresh ``mmap`` with page
    faults, about 20% slower per block here. Buffers up to
    ``seabiscuit.worker.malloc-mmap-threshold`` come from the heap again; memory above
    ``malloc-trim-threshold`` still goes back to the system.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or "musl" in name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mmap_max = config.to_bytes(config.get("worker.malloc-mmap-threshold"), "malloc-mmap-threshold")
        trim = config.to_bytes(config.get("worker.malloc-trim-threshold"), "malloc-trim-threshold")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, mmap_max)) and bool(libc.mallopt(m_trim_threshold, trim))
    except (OSError, AttributeError):
        return False
