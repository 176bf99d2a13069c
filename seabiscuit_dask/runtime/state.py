"""The scheduler's state under the names the package has imported it by.

The code lives on the scheduler's side, ``runtime/scheduler/``: ``state``
(``PlacementState``), ``events`` (what it takes and returns), ``deployment``,
``fencing``, ``claims``, ``runs`` and ``settings``. This module defines nothing.
"""

from __future__ import annotations

from ..lower.blocks import parse_key
from ..placement import CapacityChanged, DeviceAdded, DeviceLost
from .scheduler.deployment import Deployment, admits, modelled_block_times
from .scheduler.events import (
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
from .scheduler.state import PlacementState

__all__ = ["BlockObserved", "BlockRan", "CapacityChanged", "Deployment", "DeviceAdded", "DeviceDrained",
           "DeviceEvent", "DeviceLost", "DeviceRestored", "Event", "ForModel", "Instruction", "LinksObserved",
           "ModelDeployed", "ModelReleased", "Pin", "PlacementState", "PlanChanged", "ProgramAdded",
           "Rerouted", "RoutesChanged", "Stranded", "TasksForgotten", "TasksSubmitted", "WorkerFenced",
           "admits", "modelled_block_times", "parse_key"]
