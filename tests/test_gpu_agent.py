"""The worker agent's GPU side, against a fake NVML: four GPUs, 0-1 and 2-3 NVLink pairs.

The fake is a module object with pynvml's function names (``sys.modules["pynvml"]``),
so the agent runs exactly as it would on a GPU host: no GPU and no pynvml needed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import dask.config
import psutil
import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.placement.cluster import DEFAULT_LINKS
from seabiscuit_dask.plugins.worker import SeaBiscuitWorkerPlugin
from seabiscuit_dask.runtime import discover
from seabiscuit_dask.runtime.worker import agent

GiB = 2**30
PCIE4_X16 = 16 * 1.969e9                      # the agent's nominal PCIe 4.0 x16, per direction
NVLINK3 = 4                                   # NVML's nvmlNvlinkVersion_t for NVLink 3.0 (A100)


class FakeNVMLError(Exception):
    """pynvml raises NVMLError subclasses; the agent must treat every one as 'unknown'."""


def fake_nvml(temps: tuple[float, ...] = (41.0, 46.0, 51.0, 56.0)) -> types.SimpleNamespace:
    """Four A100s: GPU i uses i GiB of 40, is 10*i % busy, at ``temps[i]``; 4 NVLinks join 0-1 and
    2-3; 0-1 and 2-3 share a PCIe switch, the other pairs meet at the CPU's host bridge."""
    bus = [f"00000000:{0x07 + i:02x}:00.0" for i in range(4)]
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    links_per_pair = 4
    level = {frozenset(p): 10 for p in ((0, 1), (2, 3))}            # NVML_TOPOLOGY_SINGLE

    def bad_link(link: int) -> None:
        if link >= links_per_pair + 2:                               # NOTE: links the GPU lacks
            raise FakeNVMLError("Not Supported")

    def state(h: int, link: int) -> int:
        bad_link(link)
        return 1 if link < links_per_pair else 0

    def remote(h: int, link: int) -> Any:
        bad_link(link)
        # NOTE: the legacy 4-digit domain form, as NVLink remote info gives it on some drivers
        return types.SimpleNamespace(busId=f"0000:{0x07 + peer[h]:02x}:00.0".encode())

    def handle(i: int) -> int:
        if not 0 <= i < 4:
            raise FakeNVMLError("Invalid Argument")
        return i

    return types.SimpleNamespace(
        NVMLError=FakeNVMLError, NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=12, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: b"NVIDIA A100-SXM4-40GB",
        nvmlDeviceGetUUID=lambda h: f"GPU-5a0c7e1d-0000-0000-0000-00000000000{h}",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=bus[h].encode()),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=40 * GiB, used=h * GiB,
                                                                free=(40 - h) * GiB),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=10 * h, memory=5 * h),
        nvmlDeviceGetTemperature=lambda h, sensor: temps[h],
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4,
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1,         # NOTE: idle GPUs drop to gen 1
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: level.get(frozenset((a, b)), 30),  # HOSTBRIDGE
        nvmlDeviceGetNvLinkState=state,
        nvmlDeviceGetNvLinkRemotePciInfo=remote,
        nvmlDeviceGetNvLinkRemoteDeviceType=lambda h, link: 0,   # NVML_NVLINK_DEVICE_TYPE_GPU
        nvmlDeviceGetNvLinkVersion=lambda h, link: NVLINK3,
    )


def raising(*args: Any) -> Any:
    raise FakeNVMLError("Not Supported")


@pytest.fixture
def nvml(monkeypatch):
    fake = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def by_pair(links: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(x["a"], x["b"]): x for x in links}


# --- gpu_report --------------------------------------------------------------------------------
def test_gpu_report_reads_memory_utilisation_temperature_and_identity(nvml) -> None:
    gpus = agent.gpu_report()
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    g3 = gpus[3]
    assert g3["name"] == "NVIDIA A100-SXM4-40GB"                      # bytes from NVML, decoded
    assert g3["uuid"] == "GPU-5a0c7e1d-0000-0000-0000-000000000003"
    assert g3["pci_bus_id"] == "00000000:0a:00.0"
    assert g3["memory_total_bytes"] == 40 * GiB and g3["memory_used_bytes"] == 3 * GiB
    assert g3["utilization"] == pytest.approx(0.30)
    assert g3["temperature_c"] == 56.0
    # NOTE: the link the slot allows (gen 4), not the idle GPU's current gen 1
    assert (g3["pcie_generation"], g3["pcie_width"]) == (4, 16)


def test_without_pynvml_or_a_driver_there_are_no_gpus(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)            # NOTE: `import pynvml` raises ImportError
    assert agent.gpu_report() == [] and agent.gpu_links() == []
    fake = fake_nvml()
    fake.nvmlInit = raising                                      # a host without the NVIDIA driver
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert agent.gpu_report() == [] and agent.gpu_links() == []


def test_a_figure_nvml_cannot_give_is_unknown_and_a_mute_gpu_is_left_out(nvml) -> None:
    nvml.nvmlDeviceGetTemperature = raising
    del nvml.nvmlDeviceGetUtilizationRates                       # an old pynvml without it
    memory = nvml.nvmlDeviceGetMemoryInfo
    nvml.nvmlDeviceGetMemoryInfo = lambda h: raising() if h == 2 else memory(h)   # GPU 2 stopped answering
    gpus = agent.gpu_report()
    assert [g["index"] for g in gpus] == [0, 1, 3]
    assert all(g["temperature_c"] is None and g["utilization"] is None for g in gpus)
    assert gpus[2]["memory_used_bytes"] == 3 * GiB
    live = agent.live_report(psutil.Process(), own_gpu_index=1)
    assert live["gpu_temperature_c"] == [None, None, None] and "gpu_temperature_c_own" not in live
    assert agent.pressure_reason(live, 2**60) is None           # unknown heat drains nothing


# --- gpu_links ------------------------------------------------------------------------------------
def test_links_between_gpus_nvlink_pairs_and_the_host_bridge(nvml) -> None:
    links = by_pair(agent.gpu_links())
    assert len(links) == 12                                      # every ordered pair of 4 GPUs
    for a, b in ((0, 1), (1, 0), (2, 3), (3, 2)):
        assert links[(a, b)]["kind"] == "nvlink" and links[(a, b)]["nvlinks"] == 4
        assert links[(a, b)]["bandwidth_bytes_per_s"] == pytest.approx(4 * 25e9)
    for a, b in ((0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (3, 1)):
        assert links[(a, b)]["kind"] == "pcie-host" and links[(a, b)]["nvlinks"] == 0
        assert links[(a, b)]["bandwidth_bytes_per_s"] == pytest.approx(0.8 * PCIE4_X16)
    assert links[(0, 1)]["bandwidth_bytes_per_s"] > 3 * links[(0, 2)]["bandwidth_bytes_per_s"]


@pytest.mark.parametrize("level, kind", [(0, "pcie-switch"), (10, "pcie-switch"), (20, "pcie-switch"),
                                         (30, "pcie-host"), (40, "pcie-host"), (50, "system"),
                                         (99, "unknown")])
def test_where_pcie_paths_meet_names_the_link(nvml, level: int, kind: str) -> None:
    nvml.nvmlDeviceGetNvLinkState = lambda h, link: 0            # no NVLink at all
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: level
    link = by_pair(agent.gpu_links())[(0, 1)]
    share = {"pcie-switch": 1.0, "pcie-host": 0.8, "system": 0.5}.get(kind)
    assert link["kind"] == kind and link["nvlinks"] == 0
    if share is None:
        assert link["bandwidth_bytes_per_s"] is None
    else:
        assert link["bandwidth_bytes_per_s"] == pytest.approx(share * PCIE4_X16)


def test_nvswitch_links_join_every_gpu(nvml) -> None:
    """On an NVSwitch board (DGX) every NVLink ends at a switch, not at a GPU."""
    nvml.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(busId=b"00000000:c0:00.0")
    nvml.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: 2   # NVML_NVLINK_DEVICE_TYPE_SWITCH
    links = agent.gpu_links()
    assert {x["kind"] for x in links} == {"nvlink"}
    assert all(x["nvlinks"] == 4 and x["bandwidth_bytes_per_s"] == pytest.approx(1e11) for x in links)


def test_failing_nvml_calls_degrade_to_unknown_and_never_raise(nvml) -> None:
    nvml.nvmlDeviceGetTopologyCommonAncestor = raising
    links = by_pair(agent.gpu_links())
    assert links[(0, 1)]["kind"] == "nvlink"                     # NVLink still known
    assert links[(0, 2)] == {"a": 0, "b": 2, "kind": "unknown", "nvlinks": 0, "bandwidth_bytes_per_s": None}

    # an old driver: no NVLink functions, no Max PCIe figures (the current, idle gen 1 is used)
    for name in ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemotePciInfo",
                 "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"):
        delattr(nvml, name)
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 10
    links = by_pair(agent.gpu_links())
    assert links[(0, 1)]["kind"] == "pcie-switch"
    assert links[(0, 1)]["bandwidth_bytes_per_s"] == pytest.approx(16 * 0.25e9)

    # every call fails: nothing to report, nothing raised
    for name in [n for n in vars(nvml) if n.startswith("nvml")]:
        setattr(nvml, name, raising)
    assert agent.gpu_links() == [] and agent.gpu_report() == []
    report = agent.static_report(1, None, "cpu")
    assert report["gpus"] == [] and report["gpu_links"] == []


def test_static_report_carries_the_gpus_and_their_links(nvml) -> None:
    report = agent.static_report(1, None, "cpu")
    assert [g["uuid"][-1] for g in report["gpus"]] == ["0", "1", "2", "3"]
    assert by_pair(report["gpu_links"])[(2, 3)]["kind"] == "nvlink"
    assert "gpu" not in report and "as_cpu" not in report      # a CPU worker names no GPU of its own


# --- which GPU a worker is ---------------------------------------------------------------------------
def test_a_worker_names_its_physical_gpu(nvml) -> None:
    gpus = agent.gpu_report()
    # dask-cuda gives worker 2 CUDA_VISIBLE_DEVICES=2,3,0,1: its CUDA device 0 is NVML's GPU 2
    assert agent.own_gpu(gpus, visible="2,3,0,1") == {
        "index": 2, "uuid": "GPU-5a0c7e1d-0000-0000-0000-000000000002", "pci_bus_id": "00000000:09:00.0"}
    assert agent.own_gpu(gpus, visible="GPU-5a0c7e1d-0000-0000-0000-000000000003,0")["index"] == 3
    # torch's uuid of device 0 (printed without the GPU- prefix) wins over the environment
    assert agent.own_gpu(gpus, uuid="5a0c7e1d-0000-0000-0000-000000000001", visible="3")["index"] == 1
    assert agent.own_gpu(gpus, visible="MIG-7f3e0000-0000-0000-0000-000000000000") is None
    assert agent.own_gpu(gpus, visible="0")["index"] == 0
    assert agent.own_gpu(gpus, visible="") is None               # CUDA_VISIBLE_DEVICES="": no GPU at all
    assert agent.own_gpu(gpus, visible="7") is None              # not a GPU of this host


def test_a_gpu_workers_memory_is_its_own_gpus() -> None:
    gpus = [{"index": 0, "memory_total_bytes": 40 * GiB}, {"index": 1, "memory_total_bytes": 80 * GiB}]
    report = {"device": "cuda", "gpus": gpus, "gpu": {"index": 1}, "memory_limit_bytes": 8 * GiB}
    assert agent.machine_bytes(report) == 80 * GiB
    assert agent.machine_bytes({**report, "device": "cpu"}) == 8 * GiB


# --- the link matrix between GPU workers --------------------------------------------------------------
def gpu_worker_infos(nvml: Any, visible: list[str]) -> list[dict[str, Any]]:
    """Workers of one host as the scheduler plugin reports them, each on the GPU ``visible`` names."""
    gpus, links = agent.gpu_report(nvml), agent.gpu_links(nvml)
    speeds = {"matmul_flops_per_s": 1e13, "other_flops_per_s": 1e12, "mem_bytes_per_s": 1e12,
              "op_overhead_s": 1e-5}
    out = []
    for i, v in enumerate(visible):
        report = {"device": "cuda" if v else "cpu", "budget_bytes": GiB, **speeds, "gpus": gpus,
                  "gpu_links": links, **({"gpu": agent.own_gpu(gpus, visible=v)} if v else {})}
        out.append({"address": f"tcp://10.0.0.1:{4000 + i}", "name": f"w{i}", "host": "10.0.0.1",
                    "report": report})
    return out


def test_gpu_workers_links_come_from_nvml_where_nothing_was_measured(nvml) -> None:
    infos = gpu_worker_infos(nvml, ["1", "0", "2", "3", ""])     # w4 is a CPU worker of the host
    spec = sb.ClusterSpec(tuple(discover.device_from_report(i) for i in infos))
    matrix = discover.topology_matrix(spec, infos)
    assert matrix is not None
    spec = sb.ClusterSpec(spec.devices, spec.links, matrix)
    bw = spec.bandwidth
    assert bw[0, 1] == bw[1, 0] == pytest.approx(4 * 25e9)      # GPUs 1 and 0: NVLink
    assert bw[2, 3] == pytest.approx(4 * 25e9)
    assert bw[0, 2] == bw[1, 3] == pytest.approx(0.8 * PCIE4_X16)   # across the host bridge
    assert bw[0, 4] == bw[4, 2] == DEFAULT_LINKS["pcie"].bandwidth_bytes_per_s   # a CPU worker: its level
    assert spec.latency[0, 1] == DEFAULT_LINKS["nvlink"].latency_s
    assert spec.latency[0, 2] == DEFAULT_LINKS["pcie"].latency_s
    # without what NVML says, the topology levels stand (no matrix)
    for i in infos:
        i["report"].pop("gpu_links")
    assert discover.topology_matrix(spec, infos) is None


# --- heartbeats: the worker plugin on a fake GPU host -----------------------------------------------------
def fake_worker(recorded: list[Any]) -> types.SimpleNamespace:
    """Just what ``SeaBiscuitWorkerPlugin.setup`` and its heartbeat touch of a Dask worker."""
    return types.SimpleNamespace(
        address="tcp://10.0.0.1:4001", metrics={}, handlers={}, stream_handlers={},
        state=types.SimpleNamespace(nthreads=torch.get_num_threads(), total_resources={"MEM": 64 * 2**20}),
        memory_manager=types.SimpleNamespace(memory_limit=8 * GiB),
        loop=types.SimpleNamespace(add_callback=lambda fn, *a, **kw: recorded.append((fn, a, kw))),
        scheduler=types.SimpleNamespace(seabiscuit_pressure="pressure-rpc", seabiscuit_hello="hello-rpc"))


def test_heartbeats_carry_gpu_memory_and_temperature_and_a_hot_gpu_drains(monkeypatch) -> None:
    temps = [41.0, 46.0, 51.0, 56.0]
    fake = fake_nvml()
    fake.nvmlDeviceGetTemperature = lambda h, sensor: temps[h]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sent: list[Any] = []
    plugin = SeaBiscuitWorkerPlugin()
    with dask.config.set({"seabiscuit.device": "cpu"}):
        plugin.setup(fake_worker(sent))
    beat = plugin.metrics()                                     # what every heartbeat publishes
    assert beat["gpu_memory_used_bytes"] == [0, GiB, 2 * GiB, 3 * GiB]
    assert beat["gpu_utilization"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert beat["gpu_temperature_c"] == temps
    assert [g["memory_total_bytes"] for g in beat["gpus"]] == [40 * GiB] * 4
    assert len(beat["gpu_links"]) == 12
    assert not [s for s in sent if s[0] == "pressure-rpc"]

    plugin.resident.versions["0123456789abcdef"] = 0            # NOTE: a worker holding nothing sheds nothing
    temps[2] = 97.0
    beat = plugin.metrics()
    assert beat["gpu_temperature_c"][2] == 97.0
    asked = [s for s in sent if s[0] == "pressure-rpc"]
    assert len(asked) == 1
    assert asked[0][2] == {"address": "tcp://10.0.0.1:4001", "reason": "GPU at 97 C, over the 85 C limit",
                           "secret": plugin.secret}          # NOTE: the worker's own, from its stream
    plugin.metrics()
    assert len([s for s in sent if s[0] == "pressure-rpc"]) == 1     # asked once while it stays hot
    plugin.teardown(plugin.worker)


def test_a_gpu_worker_watches_its_own_gpu(nvml) -> None:
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 97.0 if h == 3 else 50.0
    mine = agent.live_report(psutil.Process(), own_gpu_index=0)
    assert mine["gpu_temperature_c_own"] == 50.0
    assert agent.pressure_reason(mine, 2**60) is None            # GPU 3 is another worker's
    hot = agent.live_report(psutil.Process(), own_gpu_index=3)
    assert agent.pressure_reason(hot, 2**60) == "GPU at 97 C, over the 85 C limit"
    anyone = agent.live_report(psutil.Process())                # a worker with no GPU of its own
    assert agent.pressure_reason(anyone, 2**60) == "GPU at 97 C, over the 85 C limit"
    with dask.config.set({"seabiscuit.worker.gpu-temperature-limit": 99}):
        assert agent.pressure_reason(hot, 2**60) is None
