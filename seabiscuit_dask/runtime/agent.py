"""The resource agent: what one worker has, measured on the worker itself, and its budget.

``static_report()`` is gathered once (CPU, memory, caches and NUMA nodes from
/sys, GPUs through pynvml, matmul FLOP/s and memory bandwidth measured with
torch at the worker's thread count); ``live_report()`` is cheap and runs on
every heartbeat (utilisation, memory in use, GPU memory, temperature).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from .. import config
from ..ir import fmt_bytes


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


def gpu_report() -> list[dict[str, Any]]:
    """Memory, utilisation and temperature of each visible GPU (empty without pynvml or a GPU)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: report none
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            out.append({"index": i, "name": str(pynvml.nvmlDeviceGetName(h)),
                        "memory_total_bytes": int(mem.total), "memory_used_bytes": int(mem.used),
                        "utilization": float(util.gpu) / 100.0,
                        "temperature_c": float(pynvml.nvmlDeviceGetTemperature(h, 0))})
    except Exception:  # noqa: BLE001 - a GPU that stops answering is reported as absent
        return out
    return out


def median_s(fn: Any, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_speed(device: str = "cpu", n: int = 384, reps: int = 5) -> dict[str, float]:
    """Matmul FLOP/s, elementwise FLOP/s, memory bandwidth and per-op overhead, measured."""
    import torch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    big = torch.empty(64 * 2**20 // 4, device=dev)     # 64 MiB: larger than most L3 caches
    small = torch.ones(8, device=dev)

    def mm() -> None:
        torch.mm(a, b)
        sync()

    def copy() -> None:
        big.mul_(1.0)
        sync()

    def tiny() -> None:
        for _ in range(50):
            small.add(1.0)
        sync()

    for f in (mm, copy, tiny):
        f()
    mm_s, copy_s, tiny_s = median_s(mm, reps), median_s(copy, reps), median_s(tiny, reps)
    bytes_moved = 2 * big.numel() * 4
    return {"matmul_flops_per_s": 2 * n**3 / mm_s, "other_flops_per_s": big.numel() / copy_s,
            "mem_bytes_per_s": bytes_moved / copy_s, "op_overhead_s": tiny_s / 50}


def static_report(nthreads: int, memory_limit: int | None, device: str = "cpu") -> dict[str, Any]:
    """What this worker has; measured once at setup."""
    mem = psutil.virtual_memory()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return {"host": socket.gethostname(), "cpu_count": cpus, "nthreads": nthreads,
            "memory_total_bytes": int(mem.total), "memory_limit_bytes": int(memory_limit or 0),
            "caches": cpu_caches(), "numa_nodes": numa_nodes(), "gpus": gpu_report(),
            "device": device, **measure_speed(device)}


def live_report(process: psutil.Process) -> dict[str, Any]:
    """Cheap figures for every heartbeat."""
    gpus = gpu_report()
    return {"cpu_percent": process.cpu_percent(), "rss_bytes": int(process.memory_info().rss),
            "memory_available_bytes": int(psutil.virtual_memory().available),
            "host_cpu_idle": max(0.0, 1.0 - psutil.cpu_percent() / 100.0),
            "gpu_memory_used_bytes": [g["memory_used_bytes"] for g in gpus],
            "gpu_utilization": [g["utilization"] for g in gpus],
            "gpu_temperature_c": [g["temperature_c"] for g in gpus]}


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
    fraction = float(config.get("worker.memory-fraction", 0.6))
    base = gpu_bytes or memory_limit or psutil.virtual_memory().total
    return int(base * fraction)


def machine_bytes(report: Mapping[str, Any]) -> int:
    """The most memory a worker can have: its GPU's, else its memory limit, else the host's."""
    gpus = report.get("gpus") or []
    if report.get("device") == "cuda" and gpus:
        return int(gpus[0]["memory_total_bytes"])
    return int(report.get("memory_limit_bytes") or report.get("memory_total_bytes") or 0)


def pressure_reason(live: Mapping[str, Any], memory_limit: int) -> str | None:
    """Why a worker should shed its work (memory or GPU heat over its limit), or None."""
    reason = None
    frac = float(config.get("worker.memory-pressure", 0.9))
    if live.get("rss_bytes", 0) > frac * memory_limit:
        reason = (f"memory pressure: {fmt_bytes(live['rss_bytes'])} in use, over {frac:.0%} of "
                  f"{fmt_bytes(memory_limit)}")
    hot = float(config.get("worker.gpu-temperature-limit", 85))
    temps = [float(t) for t in live.get("gpu_temperature_c", ()) or ()]
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
