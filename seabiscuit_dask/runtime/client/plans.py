"""The plan a deployed model holds, kept up with the scheduler's.

When a worker leaves, joins or is drained, the scheduler plugin repairs the model's plan and
says so on the ``seabiscuit`` event topic. ``PlanFollower`` takes each newer plan (``take``),
asks the scheduler where an event may be late or lost (``catch_up``, ``wait_version``), and
knows when the model is closed or stranded (the rest of the cluster cannot hold it).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import ModelClosed, RunFailed, StaleRun, WorkerLost
from ...lower.blocks import block_specs
from ...placement import Plan
from ..watch import seconds
from .programs import StepLayout, layout_of

logger = logging.getLogger(__name__)

EVENTS_KEPT = 1000    # NOTE: the latest scheduler events a model keeps (``dm.events``), as the scheduler does


class PlanFollower:
    """The current plan of one deployed model, its version and the blocks of its own graph under
    it (``layout``); ``on_plan(plan, version)`` is told of each plan taken, under the lock, so
    whatever else follows the plan never misses nor reorders one."""

    def __init__(self, client: Any, plan: Plan, model_id: str, token: str, version: int,
                 on_plan: Callable[[Plan, int], None], checkpoint_dir: str = "",
                 verify_every: int = 0) -> None:
        self.client = client
        self.graph = plan.graph
        self.model_id = model_id
        self._token = token
        self._on_plan = on_plan
        self.checkpoint_dir = checkpoint_dir
        self.verify_every = verify_every
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)     # NOTE: notified on a new plan or a stranding
        self.stranded: str | None = None
        self.closed = False
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)      # oldest first
        self.version = -1
        self.plan: Plan
        self.layout: StepLayout          # the blocks of the model's own graph under ``plan``
        self.take(plan, version)

    def take(self, plan: Plan, version: int) -> None:
        """Hold ``plan`` from now on, unless a newer one is held already."""
        specs = block_specs(plan, self.model_id, version, self.checkpoint_dir, self.verify_every)
        layout = layout_of(specs, self.graph, version)
        with self.lock:
            if version < self.version:
                return      # NOTE: the event and a catch-up may bring the same plan twice
            self.plan, self.version, self.layout = plan, version, layout
            self.stranded = None       # NOTE: a newer plan holds the model again
            self._on_plan(plan, version)
            self.changed.notify_all()

    def on_event(self, msg: Mapping[str, Any]) -> bool:
        """Take a message of the scheduler's about this model; True when it strands the model."""
        self.events.append({k: v for k, v in msg.items() if k != "plan"})
        if msg.get("action") == "stranded":
            with self.changed:
                self.stranded = str(msg.get("message"))
                self.changed.notify_all()
            return True
        if msg.get("action") == "plan" and int(msg["version"]) > self.version:
            self.take(Plan.from_json(msg["plan"], self.graph), int(msg["version"]))
        return False

    def strand(self, why: str) -> None:
        """Hold the model as stranded (the scheduler said so in a reply): ``why``."""
        with self.changed:
            self.stranded = why

    def close(self) -> None:
        """Hold the model as closed, and wake whoever waits for a plan."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def unavailable(self) -> str | None:
        """None while the model serves; else why it does not (see ``DistributedModel.unavailable``)."""
        if self.closed:
            return f"distributed model {self.model_id} is closed"
        if self.stranded:
            try:
                self.catch_up()      # NOTE: the plan that holds it again may be on its way
            except Exception as e:  # noqa: BLE001 - no answer: what it last heard stands
                logger.info("seabiscuit: model %s: the scheduler did not say whether it serves: %s",
                            self.model_id, e)
        return self.stranded or None

    def check_open(self) -> None:
        """Refuse a call to a closed model, or to a stranded one (``WorkerLost``, at once). A model
        seen stranded is asked about first: the plan that holds it again may be on its way."""
        if self.closed:
            raise ModelClosed(f"distributed model {self.model_id} is closed")
        if self.stranded:
            self.catch_up()
        if self.stranded:
            raise WorkerLost(self.stranded)

    def recover(self, error: BaseException) -> None:
        """After a worker loss: take the plan the scheduler holds now (see
        ``DistributedModel.recover``), unless the model is stranded."""
        self.check_open()
        self.catch_up()
        failed_at = getattr(error, "version", None)
        if isinstance(error, RunFailed) and not isinstance(error, StaleRun) \
                and failed_at is not None and self.version <= int(failed_at):
            with self.changed:
                self.changed.wait_for(lambda: self.version > int(failed_at) or self.closed
                                      or bool(self.stranded), timeout=seconds("runtime.sync-timeout"))
            self.catch_up()
        if self.stranded:
            raise WorkerLost(self.stranded) from error

    def catch_up(self, version: int | None = None) -> None:
        """Hold the scheduler's current plan of this model (or at least ``version``)."""
        if version is not None and self.version >= int(version):
            return
        reply = self.client.sync(self.client.scheduler.seabiscuit_plan, model=self.model_id,
                                 token=self._token)
        if reply.get("stranded"):
            self.strand(str(reply["stranded"]))
        elif int(reply["version"]) > self.version:
            self.take(Plan.from_json(reply["plan"], self.graph), int(reply["version"]))

    def wait_version(self, want: int) -> None:
        """Block until this object holds plan ``want`` (its event comes on the client's loop)."""
        if self.version >= want:
            return
        with self.changed:
            self.changed.wait_for(lambda: self.version >= want or self.closed or bool(self.stranded),
                                  timeout=seconds("runtime.sync-timeout"))
        self.catch_up(want)      # NOTE: the event was late or lost: ask

    def __repr__(self) -> str:
        return f"<PlanFollower of model {self.model_id}: plan v{self.version}>"
