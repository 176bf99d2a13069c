"""``SeaBiscuitWorkerPlugin``: the resource agent and keeper of resident blocks on one worker.

It measures the worker once at setup (``agent.static_report``), publishes its
figures through ``worker.metrics["seabiscuit"]`` on every heartbeat, and keeps
the compiled blocks of deployed models with their weight shards, counting their
bytes against the worker's budget: a load that would exceed it is refused with
``ClusterTooSmall``. The budget is the worker resource ``MEM`` (bytes), else the
config key ``seabiscuit.worker.memory-budget``, else
``seabiscuit.worker.memory-fraction`` of the worker's memory limit (or of its
GPU's memory).

The module-level functions are what Dask tasks run: ``load_block`` (put a
block's weights in place) and ``run_block_task`` (one block of one request).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

import psutil
from distributed import WorkerPlugin, get_worker
from distributed.utils import sync

from .. import config
from ..errors import ClusterTooSmall, SeaBiscuitError
from ..ir import fmt_bytes
from ..lower.blocks import BlockProgram, BlockSpec, run_block
from . import agent

logger = logging.getLogger(__name__)

PLUGIN_NAME = "seabiscuit"


def worker_budget(resources: Mapping[str, float], memory_limit: int | None, gpu_bytes: int | None) -> int:
    """Bytes of shards and activations this worker may hold (see the module docstring)."""
    if resources.get("MEM"):
        return int(resources["MEM"])
    configured = config.get("worker.memory-budget")
    if configured:
        return config.to_bytes(configured, "seabiscuit.worker.memory-budget")
    fraction = float(config.get("worker.memory-fraction", 0.6))
    base = gpu_bytes or memory_limit or psutil.virtual_memory().total
    return int(base * fraction)


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


class SeaBiscuitWorkerPlugin(WorkerPlugin):
    """Resource agent and resident-block keeper; installed by the scheduler plugin."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        import torch

        self.worker = worker
        tune_malloc()
        torch.set_num_threads(max(1, int(worker.state.nthreads)))
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        gpu_bytes = (torch.cuda.get_device_properties(0).total_memory
                     if self.device.type == "cuda" else None)
        limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
        self.budget_bytes = worker_budget(dict(worker.state.total_resources), limit, gpu_bytes)
        self.report = agent.static_report(int(worker.state.nthreads), limit, self.device.type)
        self.report["budget_bytes"] = self.budget_bytes
        self.process = psutil.Process()
        self.process.cpu_percent()
        self.programs: dict[tuple[str, int], BlockProgram] = {}
        self.versions: dict[str, int] = {}
        self.lock = threading.RLock()
        self.stores: dict[str, Any] = {}
        self.tiles: dict[str, dict[tuple[Any, ...], Any]] = {}
        worker.metrics[PLUGIN_NAME] = self.metrics

    def teardown(self, worker: Any) -> None:
        worker.metrics.pop(PLUGIN_NAME, None)
        with self.lock:
            self.programs.clear()

    # --- reporting ------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """Bytes of weight tiles held for resident blocks, each tile once."""
        return sum(t.numel() * t.element_size() for tiles in list(self.tiles.values())
                   for t in list(tiles.values()))

    def metrics(self, worker: Any) -> dict[str, Any]:
        return {**self.report, **agent.live_report(self.process), "resident_bytes": self.resident_bytes,
                "blocks": len(self.programs), "models": dict(self.versions)}

    # --- resident blocks ------------------------------------------------------------------
    def _store(self, model: str) -> Any:
        from ..weights import WeightStore

        if model not in self.stores:
            self.stores[model] = WeightStore(device=self.device)
        return self.stores[model]

    def load(self, spec: BlockSpec, keep: bool = True) -> BlockProgram:
        """Compile ``spec`` and load its shards; resident (counted) when ``keep``.

        A tile read by several blocks of this worker (a tied embedding) is loaded
        and counted once.
        """
        with self.lock:
            self._retire(spec.model, spec.version)
            have = self.programs.get((spec.model, spec.index))
            if have is not None and have.spec.version == spec.version:
                return have
            keep = keep and spec.version == self.versions.get(spec.model)
            tiles = self.tiles.setdefault(spec.model, {}) if keep else {}
            need = sum(p.nbytes for p in {_tile_key(p): p for p in spec.params.values()}.values()
                       if _tile_key(p) not in tiles)
            held = self.resident_bytes
            if keep and held + need > self.budget_bytes:
                raise ClusterTooSmall(
                    f"worker {self.worker.address} cannot hold block b{spec.index} of model "
                    f"{spec.model}: it holds {fmt_bytes(held)} of shards, the block needs "
                    f"{fmt_bytes(need)} more, and its budget is {fmt_bytes(self.budget_bytes)} "
                    f"({held} + {need} > {self.budget_bytes} bytes)")
            store = self._store(spec.model)

            def tile(p: Any) -> Any:
                k = _tile_key(p)
                if k not in tiles:
                    tiles[k] = store.load(p)
                return tiles[k]

            program = BlockProgram.load(spec, tile, self.device)
            if keep:
                self.programs[(spec.model, spec.index)] = program
            return program

    def _retire(self, model: str, version: int) -> None:
        """Note ``version`` as seen; a newer version drops the older blocks."""
        current = self.versions.get(model, -1)
        if version > current:
            self.versions[model] = version
            for k in [k for k in self.programs if k[0] == model]:
                del self.programs[k]
            self.tiles.pop(model, None)

    def program(self, model: str, version: int, block: int) -> BlockProgram:
        """The block to run: resident, or loaded now from a spec the scheduler keeps.

        A block of the current plan that this worker owns becomes resident; any
        other (a request in flight when the plan changed, re-pinned here) is loaded
        for this run only and not counted against the budget.
        """
        have = self.programs.get((model, block))
        if have is not None and have.spec.version == version:
            return have
        spec = BlockSpec.from_dict(self._fetch_spec(model, version, block))
        owner = spec.address in ("", self.worker.address)
        return self.load(spec, keep=owner and version >= self.versions.get(model, -1))

    def _fetch_spec(self, model: str, version: int, block: int) -> dict[str, Any]:
        w = self.worker
        try:
            return sync(w.loop, w.scheduler.seabiscuit_block, model=model, version=version, block=block)
        except Exception as e:
            raise SeaBiscuitError(f"worker {w.address} could not get block b{block} of model {model} "
                                  f"plan {version} from the scheduler: {e}") from e

    def release(self, model: str) -> int:
        """Drop every block of ``model``; returns the bytes freed."""
        with self.lock:
            freed = sum(t.numel() * t.element_size() for t in self.tiles.pop(model, {}).values())
            for k in [k for k in self.programs if k[0] == model]:
                del self.programs[k]
            self.versions.pop(model, None)
            self.stores.pop(model, None)
        return freed


def _tile_key(p: Any) -> tuple[Any, ...]:
    return (p.source.key, p.source.slices, p.source.file, p.dtype)


def _plugin() -> SeaBiscuitWorkerPlugin:
    w = get_worker()
    p = w.plugins.get(PLUGIN_NAME)
    if not isinstance(p, SeaBiscuitWorkerPlugin):
        raise SeaBiscuitError(f"worker {w.address} has no SeaBiscuit plugin: install it on the scheduler "
                              "(client.register_plugin(SeaBiscuitSchedulerPlugin()) or "
                              "`dask scheduler --preload seabiscuit_dask.plugins.preload`)")
    return p


def load_block(spec: dict[str, Any]) -> int:
    """Task: make a block resident on this worker; returns its shard bytes."""
    return _plugin().load(BlockSpec.from_dict(spec)).nbytes


def load_block_json(spec: str) -> int:
    """Task: ``load_block`` with the spec as JSON text (cheap for Dask to carry)."""
    return load_block(json.loads(spec))


def run_block_task(model: str, version: int, block: int, inputs: Mapping[str, Any], *deps: Any) -> Any:
    """Task: run one block of one request."""
    return run_block(_plugin().program(model, version, block), inputs, deps)


def release_model(model: str, dask_worker: Any = None) -> int:
    """``client.run`` target: free a model's blocks on this worker."""
    p = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    return p.release(model) if isinstance(p, SeaBiscuitWorkerPlugin) else 0


def worker_report(dask_worker: Any = None) -> dict[str, Any] | None:
    """``client.run`` target: the agent's full report, or None without the plugin."""
    p = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    return p.metrics(p.worker) if isinstance(p, SeaBiscuitWorkerPlugin) else None
