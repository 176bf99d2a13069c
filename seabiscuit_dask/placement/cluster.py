"""Cluster descriptions: devices, their speeds and memory, and the links between them.

A ``ClusterSpec`` is frozen data. Links come from the topology tree (two devices
on one host talk over NVLink or PCIe, hosts in one rack over the rack switch,
racks over the network) or from a measured bandwidth/latency matrix.

YAML schema (``ClusterSpec.from_yaml``)::

    devices:
      - name: gpu0                       # unique; one Dask worker = one device
        profile: gpu16                   # optional: start from a built-in profile
        kind: gpu                        # cpu | gpu
        memory: 16GiB                    # budget for weights and activations
        address: tcp://10.0.0.5:40123    # optional: the Dask worker this device is
        flops_per_s: {matmul: 1.0e14, other: 1.5e13}
        mem_bytes_per_s: 9.0e11          # memory bandwidth
        op_overhead_s: 8.0e-6            # fixed cost per micro-op (kernel launch)
        view_overhead_s: 2.0e-6          # cost of a view or reshape (no kernel, still dispatched)
        host: server0
        rack: rack0
    links:                               # topology tree, bytes/s and seconds
      nvlink:  {bandwidth: 1.0e11, latency: 5.0e-6}   # GPU <-> GPU, same host
      pcie:    {bandwidth: 2.5e10, latency: 1.0e-5}   # CPU <-> GPU, same host
      rack:    {bandwidth: 1.25e10, latency: 1.5e-5}  # hosts in one rack
      network: {bandwidth: 5.0e9, latency: 3.0e-5}    # across racks
    matrix:                              # optional, measured: overrides links
      bandwidth: [[...], ...]            # bytes/s, device order as listed
      latency: [[...], ...]
    relays:                              # optional: transfers from -> to go through via
      - [gpu0, gpu2, cpu0]               # (from, to, via) device names; see runtime/routing
    dask:                                # optional: what Dask itself costs (DaskSpec)
      task: 2.0e-4                       # scheduler time per task, s (one scheduler, serial)
      hop: 1.0e-3                        # a task's end to its dependent's start, s
      submit: 1.0e-3                     # client: send one request's graph, s
      gather: 1.0e-3                     # client: receive its results, s
      client_bandwidth: 1.0e9            # bytes/s between the client and the workers

A relay makes the link between two devices the path through a third one: its bandwidth the
slower leg's (the relay forwards chunk by chunk), its latency both legs' and half a
data-plane hop (``dask.hop_s``). ``bandwidth`` and ``latency`` are the links transfers
take (relays included); ``direct_bandwidth`` and ``direct_latency`` the links themselves.

A device may carry ``scale: {matmul: 1.1, other: 0.9}``: measured over modelled time
per op class, learned from observed block runs (``placement.learn``).

``preset: "4x(3gpu+cpu)"`` in place of ``devices`` builds a synthetic cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..config import to_bytes
from ..errors import BadClusterSpec, BadConfig, ClusterTooSmall, UnknownWorker

OP_CLASSES = ("matmul", "other")
MATMUL_KINDS = frozenset({"linear", "matmul", "conv", "conv_transpose", "attention"})
TOPOLOGY_LEVELS = ("nvlink", "pcie", "rack", "network")


def op_class(kind: str) -> str:
    """The throughput class of an op kind: dense math or everything else."""
    return "matmul" if kind in MATMUL_KINDS else "other"


@dataclass(frozen=True)
class LinkSpec:
    """A link: bandwidth in bytes/s and latency in seconds."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth": self.bandwidth_bytes_per_s, "latency": self.latency_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str = "link") -> LinkSpec:
        try:
            bw, lat = float(d["bandwidth"]), float(d["latency"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadClusterSpec(f"{what} needs numeric 'bandwidth' (bytes/s) and 'latency' (s), "
                                 f"got {dict(d) if isinstance(d, Mapping) else d!r}") from e
        if not bw > 0 or not lat >= 0 or math.isinf(bw):
            raise BadClusterSpec(f"{what}: bandwidth must be > 0 and latency >= 0, "
                                 f"got bandwidth={bw}, latency={lat}")
        return cls(bw, lat)


DASK_FIELDS = {"task": "task_s", "hop": "hop_s", "submit": "submit_s", "gather": "gather_s",
               "client_bandwidth": "client_bytes_per_s"}


@dataclass(frozen=True)
class DaskSpec:
    """What Dask itself costs per request: the terms the simulator adds to compute and transfers.

    ``task_s`` is scheduler time per task, spent serially (one scheduler for the whole
    cluster); ``hop_s`` is the delay from a task's end to the start of a task that depends
    on it (the worker tells the scheduler, which sends the next task: a round trip),
    besides the scheduler's own time and any data transfer; ``submit_s`` and ``gather_s``
    are the client's fixed costs of sending one request and receiving its results,
    whose bytes travel at ``client_bytes_per_s``. Defaults are typical of a cluster on
    a data-centre network; ``measure_cluster`` measures them on the live cluster.
    """

    task_s: float = 2e-4
    hop_s: float = 1e-3
    submit_s: float = 1e-3
    gather_s: float = 1e-3
    client_bytes_per_s: float = 1e9

    def __post_init__(self) -> None:
        for k in ("task_s", "hop_s", "submit_s", "gather_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
                raise BadClusterSpec(f"dask.{k} must be a time in seconds >= 0, got {v!r}")
        if not self.client_bytes_per_s > 0:
            raise BadClusterSpec(f"dask.client_bandwidth must be > 0 bytes/s, got {self.client_bytes_per_s}")

    @property
    def cut_s(self) -> float:
        """What one more dependent task costs on a path: the hop and the scheduler's time."""
        return self.hop_s + self.task_s

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, a)) for k, a in DASK_FIELDS.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DaskSpec:
        if not isinstance(d, Mapping):
            raise BadClusterSpec(f"'dask' must map {sorted(DASK_FIELDS)} to numbers, got {d!r}")
        unknown = set(d) - set(DASK_FIELDS)
        if unknown:
            raise BadClusterSpec(f"dask: unknown fields {sorted(unknown)}; known: {sorted(DASK_FIELDS)}")
        try:
            return cls(**{DASK_FIELDS[k]: float(v) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise BadClusterSpec(f"dask: every field must be a number: {e}") from e


NO_DASK = DaskSpec(0.0, 0.0, 0.0, 0.0, math.inf)
"""No Dask costs at all: what an in-process run pays."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device (one Dask worker): memory budget, speed per op class, place in the topology."""

    name: str
    kind: str
    memory_bytes: int
    flops_per_s: Mapping[str, float]
    mem_bytes_per_s: float
    op_overhead_s: float = 0.0
    view_overhead_s: float = 0.0      # a view's dispatch: no kernel, but the runtime still calls it
    host: str = "host0"
    rack: str = "rack0"
    address: str = ""                 # the Dask worker's address, for a cluster seen from a Client
    scale: Mapping[str, float] = field(default_factory=dict)   # measured / modelled time per op class

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise BadClusterSpec(f"device name must be a non-empty string, got {self.name!r}")
        if self.kind not in ("cpu", "gpu"):
            raise BadClusterSpec(f"device {self.name!r}: kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise BadClusterSpec(f"device {self.name!r}: memory must be a positive byte count, "
                                 f"got {self.memory_bytes!r}")
        missing = [c for c in OP_CLASSES if c not in self.flops_per_s]
        if missing:
            raise BadClusterSpec(f"device {self.name!r}: flops_per_s lacks classes {missing} "
                                 f"(needs {list(OP_CLASSES)})")
        for c, v in self.flops_per_s.items():
            if not float(v) > 0:
                raise BadClusterSpec(f"device {self.name!r}: flops_per_s[{c!r}] must be > 0, got {v}")
        if not self.mem_bytes_per_s > 0:
            raise BadClusterSpec(f"device {self.name!r}: mem_bytes_per_s must be > 0, "
                                 f"got {self.mem_bytes_per_s}")
        for what in ("op_overhead_s", "view_overhead_s"):
            if not getattr(self, what) >= 0:
                raise BadClusterSpec(f"device {self.name!r}: {what} must be >= 0, got {getattr(self, what)}")
        object.__setattr__(self, "flops_per_s", {c: float(v) for c, v in self.flops_per_s.items()})
        bad = {c: v for c, v in dict(self.scale).items()
               if c not in OP_CLASSES or not 0 < float(v) < math.inf}
        if bad:
            raise BadClusterSpec(f"device {self.name!r}: scale must map op classes {list(OP_CLASSES)} to "
                                 f"positive factors, got {bad}")
        object.__setattr__(self, "scale", {c: float(v) for c, v in self.scale.items() if float(v) != 1.0})

    def time_scale(self, op_class: str) -> float:
        """Measured over modelled time for ``op_class`` (1.0 until runs are observed)."""
        return float(self.scale.get(op_class, 1.0))

    @property
    def where(self) -> tuple[str, str]:
        """(rack, host): host names need only be unique within a rack."""
        return (self.rack, self.host)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "memory": self.memory_bytes,
                "flops_per_s": dict(self.flops_per_s), "mem_bytes_per_s": self.mem_bytes_per_s,
                "op_overhead_s": self.op_overhead_s, "host": self.host, "rack": self.rack,
                **({"view_overhead_s": self.view_overhead_s} if self.view_overhead_s else {}),
                **({"address": self.address} if self.address else {}),
                **({"scale": dict(self.scale)} if self.scale else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        d = dict(d)
        profile = d.pop("profile", None)
        base: dict[str, Any] = {}
        if profile is not None:
            if profile not in PROFILES:
                raise BadClusterSpec(f"device {d.get('name')!r}: unknown profile {profile!r}; "
                                     f"known: {', '.join(PROFILES)}")
            base = PROFILES[profile].to_dict()
        base.update(d)
        unknown = set(base) - {"name", "kind", "memory", "flops_per_s", "mem_bytes_per_s",
                               "op_overhead_s", "view_overhead_s", "host", "rack", "address", "scale"}
        if unknown:
            raise BadClusterSpec(f"device {base.get('name')!r}: unknown fields {sorted(unknown)}")
        need = [k for k in ("name", "kind", "memory", "flops_per_s", "mem_bytes_per_s") if k not in base]
        if need:
            raise BadClusterSpec(f"device {base.get('name')!r}: missing fields {need} "
                                 f"(or give a profile: {', '.join(PROFILES)})")
        try:
            return cls(name=str(base["name"]), kind=str(base["kind"]),
                       memory_bytes=to_bytes(base["memory"], f"device {base['name']!r} memory"),
                       flops_per_s={k: float(v) for k, v in dict(base["flops_per_s"]).items()},
                       mem_bytes_per_s=float(base["mem_bytes_per_s"]),
                       op_overhead_s=float(base.get("op_overhead_s", 0.0)),
                       view_overhead_s=float(base.get("view_overhead_s", 0.0)),
                       host=str(base.get("host", "host0")), rack=str(base.get("rack", "rack0")),
                       address=str(base.get("address", "")),
                       scale={k: float(v) for k, v in dict(base.get("scale") or {}).items()})
        except (TypeError, ValueError) as e:
            raise BadClusterSpec(f"device {base.get('name')!r}: {e}") from e
        except BadConfig as e:      # NOTE: a memory that is no byte count is the description's fault
            raise BadClusterSpec(str(e)) from e


# Built-in device profiles: a 16 GB data-centre GPU (HBM2, tensor cores) and a
# server CPU socket with 64 GB of DDR4. Figures are sustained rates, not peaks.
PROFILES: dict[str, DeviceSpec] = {
    "gpu16": DeviceSpec("gpu16", "gpu", 16 * 2**30, {"matmul": 1.0e14, "other": 1.5e13}, 9.0e11, 8e-6),
    "cpu64": DeviceSpec("cpu64", "cpu", 64 * 2**30, {"matmul": 2.0e12, "other": 5.0e11}, 1.0e11, 2e-6),
}

# Realistic link speeds per level of the topology tree.
def _level(a: DeviceSpec, b: DeviceSpec) -> str:
    """Topology level of the link between devices ``a`` and ``b`` (a key of ``DEFAULT_LINKS``)."""
    if a.where == b.where:
        return "nvlink" if a.kind == b.kind == "gpu" else "pcie"
    return "rack" if a.rack == b.rack else "network"


DEFAULT_LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec(1.0e11, 5e-6),      # NVLink between GPUs of one server
    "pcie": LinkSpec(2.5e10, 1e-5),        # PCIe 4.0 x16, CPU <-> GPU (or GPU <-> GPU without NVLink)
    "rack": LinkSpec(1.25e10, 1.5e-5),     # 100 Gb/s Ethernet inside a rack
    "network": LinkSpec(5.0e9, 3e-5),      # 40 Gb/s between racks
}

PRESETS: dict[str, dict[str, Any]] = {
    "4x(3gpu+cpu)": {"hosts": 4, "gpus_per_host": 3, "cpus_per_host": 1, "hosts_per_rack": 2},
    "2x(1gpu+cpu)": {"hosts": 2, "gpus_per_host": 1, "cpus_per_host": 1, "hosts_per_rack": 2},
    "4xcpu": {"hosts": 4, "gpus_per_host": 0, "cpus_per_host": 1, "hosts_per_rack": 4},
}


Rows = tuple[tuple[float, ...], ...]
Matrix = tuple[Rows, Rows]         # (bandwidth, latency), a row and a column per device


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links of a cluster. Frozen; ``without``/``with_device`` return new specs."""

    devices: tuple[DeviceSpec, ...]
    links: Mapping[str, LinkSpec] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    matrix: Matrix | None = None
    dask: DaskSpec = field(default_factory=DaskSpec)
    relays: tuple[tuple[str, str, str], ...] = ()       # (from, to, via) device names

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "relays", tuple(tuple(str(x) for x in r) for r in self.relays))
        if not isinstance(self.dask, DaskSpec):
            raise BadClusterSpec(f"ClusterSpec.dask must be a DaskSpec, got {type(self.dask).__name__}")
        if not self.devices:
            raise BadClusterSpec("a cluster needs at least one device, got none")
        names = [d.name for d in self.devices]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise BadClusterSpec(f"device names must be unique; repeated: {dup}")
        missing = [lvl for lvl in TOPOLOGY_LEVELS if lvl not in self.links]
        if missing and self.matrix is None:
            raise BadClusterSpec(f"links lack topology levels {missing} (needs {list(TOPOLOGY_LEVELS)})")
        if self.matrix is not None:
            n = len(self.devices)
            for what, m in zip(("bandwidth", "latency"), self.matrix):
                if len(m) != n or any(len(r) != n for r in m):
                    raise BadClusterSpec(f"matrix.{what} must be {n}x{n} (one row and column per "
                                         f"device), got {len(m)} rows")
            bw, lat = np.array(self.matrix[0]), np.array(self.matrix[1])
            off = ~np.eye(n, dtype=bool)
            if not ((bw[off] > 0).all() and (lat[off] >= 0).all()):
                raise BadClusterSpec("matrix: every off-diagonal bandwidth must be > 0 and latency >= 0")
        self._check_relays()

    def _check_relays(self) -> None:
        names = {d.name for d in self.devices}
        pairs = [(a, b) for a, b, _ in self.relays]
        for r in self.relays:
            if len(r) != 3 or not set(r) <= names or len(set(r)) != 3:
                raise BadClusterSpec(f"relay {list(r)}: a relay is [from, to, via], three different devices "
                                     f"of the cluster (devices: {sorted(names)[:8]})")
            if (r[0], r[2]) in pairs or (r[2], r[1]) in pairs:
                raise BadClusterSpec(f"relay {list(r)}: a leg of it is relayed itself; a transfer takes "
                                     "one relay at most")
        if len(set(pairs)) != len(pairs):
            twice = next(p for p in pairs if pairs.count(p) > 1)
            raise BadClusterSpec(f"relays name the pair {twice} twice; a pair has one route")

    # --- construction ---------------------------------------------------------------
    @classmethod
    def synthetic(cls, preset: str | None = "4x(3gpu+cpu)", *, hosts: int | None = None,
                  gpus_per_host: int | None = None, cpus_per_host: int | None = None,
                  hosts_per_rack: int | None = None, gpu_memory: int | str | None = None,
                  cpu_memory: int | str | None = None, nvlink: bool = True) -> ClusterSpec:
        """A cluster of identical servers with built-in device profiles and link speeds.

        >>> spec = ClusterSpec.synthetic("4x(3gpu+cpu)")   # 4 servers x (3 GPUs 16 GiB + 1 CPU 64 GiB)
        >>> len(spec.devices), spec.devices[0].name
        (16, 'h0-gpu0')
        """
        base = dict(PRESETS.get(preset, {})) if preset else {}
        if preset and preset not in PRESETS:
            raise BadClusterSpec(f"unknown cluster preset {preset!r}; known: {', '.join(PRESETS)}")
        for k, v in {"hosts": hosts, "gpus_per_host": gpus_per_host, "cpus_per_host": cpus_per_host,
                     "hosts_per_rack": hosts_per_rack}.items():
            if v is not None:
                base[k] = v
        try:
            n_hosts = int(base.get("hosts", 1))
            n_gpu, n_cpu = int(base.get("gpus_per_host", 0)), int(base.get("cpus_per_host", 1))
            per_rack = int(base.get("hosts_per_rack", n_hosts))
        except (TypeError, ValueError) as e:
            raise BadClusterSpec(f"synthetic cluster counts must be integers: {e}") from e
        if per_rack < 1:
            raise BadClusterSpec(f"hosts_per_rack must be >= 1, got {per_rack}")
        if n_hosts < 1 or n_gpu < 0 or n_cpu < 0 or n_gpu + n_cpu < 1:
            raise BadClusterSpec(f"synthetic cluster needs >= 1 host with >= 1 device, got hosts={n_hosts}, "
                                 f"gpus_per_host={n_gpu}, cpus_per_host={n_cpu}")
        gpu_mem = to_bytes(gpu_memory, "gpu_memory") if gpu_memory is not None else None
        cpu_mem = to_bytes(cpu_memory, "cpu_memory") if cpu_memory is not None else None
        devices = []
        for h in range(n_hosts):
            host, rack = f"host{h}", f"rack{h // per_rack}"
            for i in range(n_gpu):
                p = PROFILES["gpu16"]
                mem = gpu_mem or p.memory_bytes
                devices.append(replace(p, name=f"h{h}-gpu{i}", memory_bytes=mem,
                                       host=host, rack=rack))
            for i in range(n_cpu):
                p = PROFILES["cpu64"]
                mem = cpu_mem or p.memory_bytes
                devices.append(replace(p, name=f"h{h}-cpu{i}", memory_bytes=mem,
                                       host=host, rack=rack))
        links = dict(DEFAULT_LINKS)
        if not nvlink:
            links["nvlink"] = links["pcie"]
        return cls(tuple(devices), links)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        if not isinstance(d, Mapping):
            raise BadClusterSpec(f"a cluster description must be a mapping, got {type(d).__name__}")
        dask = DaskSpec.from_dict(d["dask"]) if d.get("dask") is not None else DaskSpec()
        if "preset" in d:
            return replace(cls.synthetic(str(d["preset"])), dask=dask)
        devs = d.get("devices")
        if not isinstance(devs, Sequence) or isinstance(devs, str) or not all(
                isinstance(x, Mapping) for x in devs):
            raise BadClusterSpec("a cluster description needs a 'devices' list of mappings "
                                 f"(or a 'preset'), got {devs!r}")
        if not isinstance(d.get("links") or {}, Mapping):
            raise BadClusterSpec(f"'links' must map topology levels to links, got {d['links']!r}")
        devices = tuple(DeviceSpec.from_dict(x) for x in d["devices"])
        links = dict(DEFAULT_LINKS)
        for lvl, ld in dict(d.get("links") or {}).items():
            if lvl not in TOPOLOGY_LEVELS:
                raise BadClusterSpec(f"unknown link level {lvl!r}; known: {list(TOPOLOGY_LEVELS)}")
            links[lvl] = LinkSpec.from_dict(ld, f"link {lvl!r}")
        matrix = None
        if d.get("matrix") is not None:
            m = d["matrix"]
            try:
                matrix = tuple(tuple(tuple(float(x) for x in row) for row in m[k])
                               for k in ("bandwidth", "latency"))
            except (KeyError, TypeError, ValueError) as e:
                raise BadClusterSpec(f"matrix needs numeric 'bandwidth' and 'latency' lists: {e}") from e
        relays = d.get("relays") or ()
        if not isinstance(relays, Sequence) or not all(isinstance(r, Sequence) and not isinstance(r, str)
                                                       for r in relays):
            raise BadClusterSpec(f"'relays' must be a list of [from, to, via] device names, got {relays!r}")
        return cls(devices, links, matrix, dask, tuple(tuple(r) for r in relays))  # type: ignore[arg-type]

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        """Read a cluster description (schema in this module's docstring)."""
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as e:
            raise BadClusterSpec(f"cannot read cluster file {str(p)!r}: {e}") from e
        except yaml.YAMLError as e:
            raise BadClusterSpec(f"cluster file {str(p)!r} is not valid YAML: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"devices": [d.to_dict() for d in self.devices],
                               "links": {k: v.to_dict() for k, v in self.links.items()},
                               "dask": self.dask.to_dict()}
        if self.matrix is not None:
            out["matrix"] = {"bandwidth": [list(r) for r in self.matrix[0]],
                             "latency": [list(r) for r in self.matrix[1]]}
        if self.relays:
            out["relays"] = [list(r) for r in self.relays]
        return out

    # --- edits (each returns a new spec) ---------------------------------------------
    def index(self, name: str) -> int:
        """Position of the device called ``name``, or whose worker address is ``name``."""
        try:
            return self.names.index(name)
        except ValueError:
            pass
        for i, d in enumerate(self.devices):
            if d.address and d.address == name:
                return i
        raise UnknownWorker(f"no device {name!r} in the cluster; devices: {list(self.names)}")

    def without(self, name: str) -> ClusterSpec:
        i = self.index(name)
        if len(self.devices) == 1:
            raise ClusterTooSmall(f"cannot remove {name!r}: it is the cluster's last device")
        matrix = None
        if self.matrix is not None:
            matrix = tuple(tuple(r[:i] + r[i + 1:] for j, r in enumerate(m) if j != i) for m in self.matrix)
        gone = self.devices[i].name
        return replace(self, devices=self.devices[:i] + self.devices[i + 1:], matrix=matrix,  # type: ignore[arg-type]
                       relays=tuple(r for r in self.relays if gone not in r))

    def with_device(self, device: DeviceSpec) -> ClusterSpec:
        """A new spec with ``device`` added. With a measured matrix, the newcomer's links are
        those of a device on its host (the median of the measured ones elsewhere) until measured;
        where nothing measured tells (the newcomer would be the second device), the topology's
        figure for the level of each link (``links``)."""
        return replace(self, devices=(*self.devices, device),
                       matrix=None if self.matrix is None else self._matrix_with(device))

    def _matrix_with(self, device: DeviceSpec) -> Matrix:
        n = len(self.devices)
        peer = next((i for i, d in enumerate(self.devices) if d.where == device.where), -1)
        mates = [j for j, d in enumerate(self.devices) if d.where == device.where and j != peer]
        out = []
        for which, (m, diag) in enumerate(zip(self.matrix or (), (math.inf, 0.0))):
            a = np.array(m, dtype=float)
            measured = a[~np.eye(n, dtype=bool)]
            typical = float(np.median(measured)) if measured.size else None
            by_level = [self.links[_level(device, d)].to_dict()["latency" if which else "bandwidth"]
                        for d in self.devices]
            if peer >= 0:
                row, col = a[peer].copy(), a[:, peer].copy()
                # NOTE: to and from the peer itself: as between the peer and another device of its host
                inner = float(np.median(a[peer, mates])) if mates else typical
                row[peer] = col[peer] = by_level[peer] if inner is None else inner
            else:
                row = np.array(by_level if typical is None else [typical] * n, dtype=float)
                col = row.copy()
            grown = np.zeros((n + 1, n + 1))
            grown[:n, :n], grown[n, :n], grown[:n, n] = a, row, col
            grown[n, n] = diag if not math.isinf(diag) else 0.0
            out.append(tuple(tuple(float(x) for x in r) for r in grown))
        return out[0], out[1]

    def with_changes(self, name: str, **changes: Any) -> ClusterSpec:
        i = self.index(name)
        dev = replace(self.devices[i], **changes)
        return replace(self, devices=(*self.devices[:i], dev, *self.devices[i + 1:]))

    def with_dask(self, dask: DaskSpec) -> ClusterSpec:
        return replace(self, dask=dask)

    def with_link(self, a: str, b: str, link: LinkSpec) -> ClusterSpec:
        """A new spec whose link from device ``a`` to ``b`` (names or addresses) is ``link``, as
        measured; the other links stay as they are (a measured matrix is made if there is none)."""
        i, j = self.index(a), self.index(b)
        if i == j:
            raise BadClusterSpec(f"a link joins two devices; {a!r} and {b!r} are one")
        bw, lat = self.direct_bandwidth.copy(), self.direct_latency.copy()
        np.fill_diagonal(bw, 0.0)
        bw[i, j], lat[i, j] = link.bandwidth_bytes_per_s, link.latency_s
        matrix = tuple(tuple(tuple(float(x) for x in r) for r in m) for m in (bw, lat))
        return replace(self, matrix=matrix)  # type: ignore[arg-type]

    def with_relay(self, a: str, b: str, via: str | None) -> ClusterSpec:
        """A new spec whose transfers from ``a`` to ``b`` go through ``via`` (None: directly)."""
        names = [self.names[self.index(x)] for x in (a, b)]
        kept = tuple(r for r in self.relays if list(r[:2]) != names)
        if via is None:
            return replace(self, relays=kept)
        return replace(self, relays=(*kept, (names[0], names[1], self.names[self.index(via)])))

    def relay(self, a: int, b: int) -> int:
        """The device transfers from device ``a`` to ``b`` go through, or -1 (directly)."""
        return self._relay_index.get((a, b), -1)

    @cached_property
    def _relay_index(self) -> dict[tuple[int, int], int]:
        pos = {n: i for i, n in enumerate(self.names)}
        return {(pos[a], pos[b]): pos[c] for a, b, c in self.relays}

    # --- derived views ----------------------------------------------------------------
    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def memory_bytes(self) -> int:
        return sum(d.memory_bytes for d in self.devices)

    def level(self, a: int, b: int) -> str:
        """Topology level of the link between devices ``a`` and ``b``."""
        return _level(self.devices[a], self.devices[b])

    def _link_matrix(self, which: int, diagonal: float) -> np.ndarray:
        """``[a, b]`` figure of the link a -> b: 0 = bandwidth, 1 = latency (measured or by level)."""
        if self.matrix is not None:
            out = np.array(self.matrix[which], dtype=float)
        else:
            n = len(self.devices)
            key = "latency" if which else "bandwidth"
            out = np.array([[self.links[self.level(a, b)].to_dict()[key] for b in range(n)]
                            for a in range(n)], dtype=float)
        np.fill_diagonal(out, diagonal)
        return out

    @cached_property
    def direct_bandwidth(self) -> np.ndarray:
        """``[a, b]`` -> bytes/s of the link from device a to device b itself (inf on the diagonal)."""
        return self._link_matrix(0, np.inf)

    @cached_property
    def direct_latency(self) -> np.ndarray:
        """``[a, b]`` -> seconds of the link from device a to device b itself (0 on the diagonal)."""
        return self._link_matrix(1, 0.0)

    @cached_property
    def bandwidth(self) -> np.ndarray:
        """``[a, b]`` -> bytes/s from device a to device b, through its relay if it has one."""
        bw = self.direct_bandwidth
        if not self.relays:
            return bw
        out = bw.copy()
        for (a, b), c in self._relay_index.items():
            out[a, b] = min(bw[a, c], bw[c, b])
        return out

    @cached_property
    def latency(self) -> np.ndarray:
        """``[a, b]`` -> seconds from device a to device b, through its relay if it has one."""
        lat = self.direct_latency
        if not self.relays:
            return lat
        out = lat.copy()
        for (a, b), c in self._relay_index.items():
            out[a, b] = lat[a, c] + lat[c, b] + self.dask.hop_s / 2
        return out

    @cached_property
    def cut_latency(self) -> np.ndarray:
        """``[a, b]`` -> what a cut from a to b costs before its bytes: the link's latency plus a
        Dask hop and the scheduler's time for the task on the far side (0 on the diagonal).
        The partitioners weigh cuts with it; ``simulate`` models the terms one by one."""
        out = self.latency + self.dask.cut_s
        np.fill_diagonal(out, 0.0)
        return out

    def transfer_s(self, a: int, b: int, nbytes: float) -> float:
        if a == b:
            return 0.0
        return float(self.latency[a, b] + nbytes / self.bandwidth[a, b])

    @cached_property
    def routes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """``[a][b]`` -> ids of the shared resources a transfer a->b occupies.

        Inside a host each ordered device pair has its own channel; between hosts a
        transfer holds the sender host's NIC (egress) and the receiver's (ingress), so
        transfers leaving one host contend. With a measured matrix, pairs are independent.
        A relayed transfer holds the resources of both its legs.
        """
        n = len(self.devices)
        hid = {h: i for i, h in enumerate(sorted({d.where for d in self.devices}))}
        out = []
        for a in range(n):
            row: list[tuple[int, ...]] = []
            for b in range(n):
                c = self.relay(a, b)
                if a == b:
                    row.append(())
                elif c >= 0:        # NOTE: a relayed transfer holds both legs
                    row.append(self._route(a, c, hid, n) + self._route(c, b, hid, n))
                else:
                    row.append(self._route(a, b, hid, n))
            out.append(tuple(row))
        return tuple(out)

    def _route(self, a: int, b: int, hid: dict[tuple[str, str], int], n: int) -> tuple[int, ...]:
        ha, hb = hid[self.devices[a].where], hid[self.devices[b].where]
        if self.matrix is not None or ha == hb:
            return (2 * len(hid) + a * n + b,)
        return (2 * ha, 2 * hb + 1)

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Device indices grouped by host, hosts ordered by rack then name."""
        by_host: dict[tuple[str, str], list[int]] = {}
        for i, d in enumerate(self.devices):
            by_host.setdefault((d.rack, d.host), []).append(i)
        return tuple(tuple(v) for _, v in sorted(by_host.items()))

    def __repr__(self) -> str:
        kinds = {k: sum(d.kind == k for d in self.devices) for k in ("gpu", "cpu")}
        return (f"<ClusterSpec {len(self.devices)} devices ({kinds['gpu']} gpu, {kinds['cpu']} cpu) on "
                f"{len(self.groups)} hosts, {self.memory_bytes / 2**30:.0f} GiB>")

    def table(self) -> str:
        lines = [f"{'device':<14} {'kind':<4} {'memory':>10} {'matmul TF/s':>11} {'mem GB/s':>9} "
                 f"{'host':<8} {'rack':<6}"]
        for d in self.devices:
            lines.append(f"{d.name:<14} {d.kind:<4} {d.memory_bytes / 2**30:>6.1f} GiB "
                         f"{d.flops_per_s['matmul'] / 1e12:>11.1f} {d.mem_bytes_per_s / 1e9:>9.0f} "
                         f"{d.host:<8} {d.rack:<6}")
        return "\n".join(lines)
