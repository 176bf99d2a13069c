"""The scheduler's side of the runtime, as plain Python that tests drive with no cluster.

``state.PlacementState`` turns events into instructions (``events``) and holds what the
scheduler knows: each model's ``deployment.Deployment``, the workers ``fencing.Fencing``
keeps out, the deploy claims of ``claims.Claims`` and the block runs ``runs.RunCounts``
counts, under the ``settings.StateSettings`` read when it is built. The scheduler plugin
(``plugins/scheduler.py``) forwards Dask's hooks and RPCs to it and carries the
instructions out.
"""

from __future__ import annotations

from .deployment import Deployment, admits, modelled_block_times
from .events import (
    BlockObserved,
    BlockRan,
    DeviceDrained,
    DeviceEvent,
    DeviceRestored,
    Event,
    ForModel,
    Instruction,
    LinksObserved,
    ModelDeployed,
    ModelReleased,
    Pin,
    PlanChanged,
    ProgramAdded,
    Rerouted,
    RoutesChanged,
    Stranded,
    TasksForgotten,
    TasksSubmitted,
    WorkerFenced,
)
from .state import PlacementState

__all__ = ["BlockObserved", "BlockRan", "Deployment", "DeviceDrained",
           "DeviceEvent", "DeviceRestored", "Event", "ForModel", "Instruction", "LinksObserved",
           "ModelDeployed", "ModelReleased", "Pin", "PlacementState", "PlanChanged", "ProgramAdded",
           "Rerouted", "RoutesChanged", "Stranded", "TasksForgotten", "TasksSubmitted", "WorkerFenced",
           "admits", "modelled_block_times"]
