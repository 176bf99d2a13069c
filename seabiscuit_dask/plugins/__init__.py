"""Dask adapters: the scheduler plugin that owns placement and the worker plugin (resource agent).

The decisions live in plain classes of ``runtime/`` (``PlacementState`` on the
scheduler, ``ResidentBlocks`` on each worker), tested without a cluster; the
plugins forward Dask's hooks and RPCs to them and carry out their instructions.
"""

from ..runtime.discover import PluginMissing
from .scheduler import SeaBiscuitSchedulerPlugin
from .worker import SeaBiscuitWorkerPlugin

__all__ = ["PluginMissing", "SeaBiscuitSchedulerPlugin", "SeaBiscuitWorkerPlugin"]
