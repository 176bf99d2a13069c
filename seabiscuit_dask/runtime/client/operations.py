"""What a deployed model's owner asks the cluster about it, besides running it.

Moving it off a worker, back on, or within another memory budget (each answered with the
plan that carries it out), and reading what its runs did: block counts, the scales the
scheduler learned, the latency the plan predicts, and each worker's counters.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace
from typing import Any

from ... import config
from ...errors import UnknownWorker
from ...placement import Plan
from ..discover import cluster_workers, device_name, workers_info
from .plans import PlanFollower
from .requests import RequestSender


class ModelOperations:
    """The operations of ``DistributedModel`` on one model (``drain``, ``restore``, ``set_budget``,
    ``run_counts``, ``learned``, ``predicted_s``, ``stats``), under the plan ``plans`` holds."""

    def __init__(self, client: Any, plans: PlanFollower, sender: RequestSender, model_id: str,
                 token: str) -> None:
        self.client = client
        self.plans = plans
        self.sender = sender
        self.model_id = model_id
        self._token = token

    # --- moving the model ---------------------------------------------------------------------
    def address(self, worker: str) -> str:
        """The address of ``worker``: a device of the plan, or a worker of the cluster, named by
        address, name or alias (``"w0"``)."""
        for d in self.plans.plan.spec.devices:
            if worker in (d.name, d.address):
                return d.address
        info = cluster_workers(self.client)
        for addr, w in info.items():
            alias = device_name({"name": w.get("name"), "address": addr}, set())   # "w0" for worker 0
            if worker in (addr, str(w.get("name")), alias):
                return str(addr)
        raise UnknownWorker(f"model {self.model_id}: no worker {worker!r} in the cluster; name one of "
                            f"its workers (by address, name or alias such as 'w0'): {sorted(info)}")

    def ask(self, op: str, **kwargs: Any) -> dict[str, Any]:
        """Call the scheduler plugin's ``seabiscuit_<op>`` for this model and wait for the new plan."""
        reply = dict(self.client.sync(getattr(self.client.scheduler, f"seabiscuit_{op}"),
                                      model=self.model_id, token=self._token, **kwargs))
        want = reply.get("versions", {}).get(self.model_id)
        if want is not None:
            self.plans.wait_version(int(want))
        return reply

    def drain(self, worker: str, reason: str) -> dict[str, Any]:
        return self.ask("drain", address=self.address(worker), reason=reason)

    def restore(self, worker: str) -> dict[str, Any]:
        return self.ask("restore", address=self.address(worker))

    def set_budget(self, worker: str, memory: int | str) -> dict[str, Any]:
        nbytes = config.to_bytes(memory, "memory budget")
        return self.ask("budget", address=self.address(worker), memory_bytes=nbytes)

    # --- what its runs did --------------------------------------------------------------------
    def run_counts(self) -> dict[str, int]:
        self.flush_runs()
        return dict(self.client.sync(self.client.scheduler.seabiscuit_runs, model=self.model_id,
                                     token=self._token))

    def learned(self, last: int) -> dict[str, Any]:
        self.flush_runs()
        return dict(self.client.sync(self.client.scheduler.seabiscuit_learned, model=self.model_id,
                                     token=self._token, last=last))

    def flush_runs(self) -> None:
        """Have the plan's workers report their data plane's block runs to the scheduler now."""
        if not self.sender.p2p:
            return

        async def flush() -> None:
            async def one(addr: str) -> None:
                try:
                    await self.client.rpc(addr).seabiscuit_dp_flush()
                except Exception:  # noqa: BLE001 - a worker gone has nothing to report
                    pass
            await asyncio.gather(*(one(d.address) for d in self.plans.plan.spec.devices))

        self.client.sync(flush)

    def predicted_s(self, learned: bool) -> float:
        """See ``DistributedModel.predicted_s``."""
        plan = self.plans.plan
        if learned:
            scales = self.learned(100)["scales"]
            spec = plan.spec
            for d in spec.devices:
                if d.address in scales:
                    spec = spec.with_changes(d.name, scale=dict(scales[d.address]))
            client_s = self.sender.client_s
            if client_s:
                submit = statistics.median(s for s, _ in client_s)
                after = statistics.median(a for _, a in client_s)
                # NOTE: on the data plane the caller's submit returns before the send (what it
                # measured is its own work before it); as tasks it waited for the graph to go
                sent = spec.dask.submit_s + submit if self.sender.p2p else max(spec.dask.submit_s, submit)
                spec = spec.with_dask(replace(spec.dask, submit_s=sent,
                                              gather_s=spec.dask.gather_s + after))
            plan = Plan(plan.graph, spec, plan.device_of, plan.method, plan.planning_s, dict(plan.info))
        return plan.makespan_s

    def stats(self) -> dict[str, dict[str, Any]]:
        keys = ("block_runs", "resumed_from_checkpoint", "checkpoints_written", "checkpoint_write_failures",
                "checkpoints_skipped", "corrupt_tiles", "corrupt_checkpoints", "prefetched_blocks",
                "resident_bytes", "budget_bytes")
        return {i["address"]: {k: i["report"].get(k, 0) for k in keys}
                for i in workers_info(self.client, everyone=True)}
