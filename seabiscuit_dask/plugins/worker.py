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


class SeaBiscuitWorkerPlugin(WorkerPlugin):
    """Resource agent and resident-block keeper; installed by the scheduler plugin."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        import torch

        self.worker = worker
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
        worker.metrics[PLUGIN_NAME] = self.metrics

    def teardown(self, worker: Any) -> None:
        worker.metrics.pop(PLUGIN_NAME, None)
        with self.lock:
            self.programs.clear()

    # --- reporting ------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        return sum(p.nbytes for p in list(self.programs.values()))

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
        """Compile ``spec`` and load its shards; resident (counted) when ``keep``."""
        with self.lock:
            self._retire(spec.model, spec.version)
            have = self.programs.get((spec.model, spec.index))
            current = self.versions.get(spec.model)
            if have is not None and have.spec.version == spec.version:
                return have
            need = spec.weight_bytes
            if keep and spec.version == current:
                held = self.resident_bytes
                if held + need > self.budget_bytes:
                    raise ClusterTooSmall(
                        f"worker {self.worker.address} cannot hold block b{spec.index} of model "
                        f"{spec.model}: it holds {fmt_bytes(held)} of shards, the block needs "
                        f"{fmt_bytes(need)} more, and its budget is {fmt_bytes(self.budget_bytes)} "
                        f"({held} + {need} > {self.budget_bytes} bytes)")
            program = BlockProgram.load(spec, self._store(spec.model), self.device)
            if keep and spec.version == current:
                self.programs[(spec.model, spec.index)] = program
            return program

    def _retire(self, model: str, version: int) -> None:
        """Note ``version`` as seen; a newer version drops the older blocks."""
        current = self.versions.get(model, -1)
        if version > current:
            self.versions[model] = version
            for k in [k for k in self.programs if k[0] == model]:
                del self.programs[k]

    def program(self, model: str, version: int, block: int) -> BlockProgram:
        """The block to run: resident, or loaded now from a spec the scheduler keeps."""
        have = self.programs.get((model, block))
        if have is not None and have.spec.version == version:
            return have
        spec = BlockSpec.from_dict(self._fetch_spec(model, version, block))
        return self.load(spec, keep=version >= self.versions.get(model, -1))

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
            keys = [k for k in self.programs if k[0] == model]
            freed = sum(self.programs[k].nbytes for k in keys)
            for k in keys:
                del self.programs[k]
            self.versions.pop(model, None)
            self.stores.pop(model, None)
        return freed


def _plugin() -> SeaBiscuitWorkerPlugin:
    w = get_worker()
    p = w.plugins.get(PLUGIN_NAME)
    if p is None:
        raise SeaBiscuitError(f"worker {w.address} has no SeaBiscuit plugin: install it on the scheduler "
                              "(client.register_plugin(SeaBiscuitSchedulerPlugin()) or "
                              "`dask scheduler --preload seabiscuit_dask.plugins.preload`)")
    return p  # type: ignore[no-any-return]


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
    return p.release(model) if p is not None else 0


def worker_report(dask_worker: Any = None) -> dict[str, Any] | None:
    """``client.run`` target: the agent's full report, or None without the plugin."""
    p = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    return p.metrics(p.worker) if p is not None else None
