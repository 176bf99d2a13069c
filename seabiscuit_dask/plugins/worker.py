"""``SeaBiscuitWorkerPlugin``: the resource agent on one worker, and the keeper of its blocks.

It measures the worker once at setup (``runtime.agent``), publishes its figures
through ``worker.metrics["seabiscuit"]`` on every heartbeat, asks the scheduler to
move work away under memory or heat pressure, and wraps the worker's
``ResidentBlocks`` (``runtime.resident``). Its RPCs: ``seabiscuit_sync`` (hold what
the scheduler says this worker owns of a model; any peer may ask, the answer comes
from the scheduler) and ``seabiscuit_report`` (the agent's figures now).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import psutil
from distributed import WorkerPlugin

from .. import config
from ..errors import AccessDenied
from ..runtime import access, agent
from ..runtime.resident import ResidentBlocks
from ..runtime.tasks import PLUGIN_NAME

logger = logging.getLogger(__name__)


class SeaBiscuitWorkerPlugin(WorkerPlugin):
    """Resource agent and resident-block keeper; installed by the scheduler plugin."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        import torch

        self.worker = worker
        agent.tune_malloc()
        torch.set_num_threads(max(1, int(worker.state.nthreads)))
        self.device = torch.device(self.choose_device(worker))
        props = torch.cuda.get_device_properties(0) if self.device.type == "cuda" else None
        self.memory_limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
        resources = dict(worker.state.total_resources)
        budget = agent.worker_budget(resources, self.memory_limit, props.total_memory if props else None)
        self.report = agent.static_report(int(worker.state.nthreads), self.memory_limit, self.device.type,
                                          str(getattr(props, "uuid", "") or "") or None)
        # NOTE: a GPU worker also runs models placed with device="cpu", in host memory
        host_budget = agent.worker_budget(resources, self.memory_limit, None) if props else None
        self.resident = ResidentBlocks(budget, self.device, worker.address, host_budget_bytes=host_budget)
        self.process = psutil.Process()
        self.process.cpu_percent()
        self.simulated: dict[str, float] = {}       # readings injected by tests and drills
        self.forecast = agent.AvailabilityForecast()
        self.pressure_sent: str | None = None
        self.secret = ""                             # what the scheduler plugin sent: shown in calls
        self.has_secret = threading.Event()
        worker.metrics[PLUGIN_NAME] = self.metrics
        worker.stream_handlers["seabiscuit_secret"] = self._set_secret
        worker.handlers["seabiscuit_sync"] = self.sync
        worker.handlers["seabiscuit_report"] = self.report_now
        worker.handlers["seabiscuit_drop_sessions"] = self.drop_sessions
        worker.loop.add_callback(self._hello)

    @staticmethod
    def choose_device(worker: Any = None) -> str:
        """The worker's own device: CUDA where it has it, unless config ``seabiscuit.device`` is
        ``cpu`` (an operator's ``DASK_SEABISCUIT__DEVICE=cpu``); ``cuda`` without CUDA warns."""
        import torch

        choice = config.device_choice()
        if choice == "cpu":
            return "cpu"
        if torch.cuda.is_available():
            return "cuda"
        if choice == "cuda":
            logger.warning("seabiscuit: worker %s is configured with device 'cuda' but has no CUDA "
                           "device: it runs models on its CPU", getattr(worker, "address", ""))
        return "cpu"

    async def _hello(self) -> None:
        """Tell the scheduler plugin this worker can be placed on (before any heartbeat carries it)."""
        w = self.worker
        try:
            await w.scheduler.seabiscuit_hello(address=w.address, report=self.metrics())
        except Exception as e:  # noqa: BLE001 - no SeaBiscuit scheduler plugin: the worker serves nothing
            logger.info("seabiscuit: scheduler of %s did not take the agent's report: %s", w.address, e)

    def teardown(self, worker: Any) -> None:
        worker.metrics.pop(PLUGIN_NAME, None)
        worker.handlers.pop("seabiscuit_sync", None)
        worker.handlers.pop("seabiscuit_report", None)
        worker.handlers.pop("seabiscuit_drop_sessions", None)
        worker.stream_handlers.pop("seabiscuit_secret", None)
        self.resident.clear()

    @property
    def budget_bytes(self) -> int:
        return self.resident.budget_bytes

    @property
    def resident_bytes(self) -> int:
        return self.resident.resident_bytes

    # --- reporting ------------------------------------------------------------------------
    def metrics(self, worker: Any = None) -> dict[str, Any]:
        live = {**agent.live_report(self.process, (self.report.get("gpu") or {}).get("index")),
                **self.simulated}
        self._check_pressure(live)
        r = self.resident
        self.forecast.update(memory_available_bytes=live["memory_available_bytes"],
                             host_cpu_idle=live["host_cpu_idle"])
        return {**self.report, **live, **self.forecast.report(),
                "budget_bytes": r.budget_bytes, "resident_bytes": r.resident_bytes,
                "weight_bytes": r.weight_bytes, "kv_cache_bytes": r.kv.nbytes, "kv_sessions": r.kv_sessions(),
                "blocks": len(r.programs), "models": dict(r.versions), **r.counters,
                **self._as_cpu()}

    def _as_cpu(self) -> dict[str, Any]:
        """What a model placed with device="cpu" gets on a GPU worker: host-side speeds and budget."""
        speeds = self.report.get("as_cpu")
        if not speeds:
            return {}
        return {"as_cpu": {**speeds, "budget_bytes": self.resident.host_budget_bytes}}

    def report_now(self, comm: Any = None) -> dict[str, Any]:
        return self.metrics()

    def _check_pressure(self, live: dict[str, Any]) -> None:
        """Ask the scheduler to move work away once memory or GPU heat crosses its limit."""
        reason = agent.pressure_reason(live, self.memory_limit or psutil.virtual_memory().total)
        if reason is None:
            self.pressure_sent = None
        elif self.pressure_sent is None and self.resident.versions:
            self.pressure_sent = reason
            w = self.worker
            w.loop.add_callback(w.scheduler.seabiscuit_pressure, address=w.address, reason=reason,
                                secret=self.secret)

    # --- RPC ------------------------------------------------------------------------------
    def _set_secret(self, secret: str = "", **kwargs: Any) -> None:
        """Stream handler: the scheduler plugin's secret for this worker (only it writes there)."""
        self.secret = str(secret)
        self.has_secret.set()

    def drop_sessions(self, comm: Any = None, model: str = "", sessions: list[int] | None = None,
                      secret: str = "") -> int:
        """Free the KV caches of ``sessions`` of ``model`` here; returns the bytes freed."""
        if not access.same_token(self.secret, secret):
            raise AccessDenied(f"dropping sessions of model {model!r} on {self.worker.address} needs the "
                               "scheduler plugin's secret: end sessions through the model's client")
        return self.resident.kv.drop(access.check_model_id(model), {int(s) for s in sessions or ()})

    async def sync(self, comm: Any = None, model: str = "") -> int:
        """Hold what the scheduler says this worker owns of ``model``; loads run off the event loop."""
        access.check_model_id(model)
        w = self.worker
        owned = await w.scheduler.seabiscuit_owned(model=model, address=w.address, secret=self.secret)
        return await asyncio.to_thread(self.resident.sync, owned, model)
