"""Dask adapters: the scheduler plugin that owns placement and the worker plugin (resource agent).

The decisions live in ``state.PlacementState`` (plain Python, tested without a
cluster); the plugins forward Dask's hooks to it and carry out its instructions.
"""

from .discover import PluginMissing
from .scheduler import SeaBiscuitSchedulerPlugin
from .state import PlacementState
from .worker import SeaBiscuitWorkerPlugin

__all__ = ["PlacementState", "PluginMissing", "SeaBiscuitSchedulerPlugin", "SeaBiscuitWorkerPlugin"]
