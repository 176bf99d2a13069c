"""SeaBiscuit: run models too big for one device across the machines you have.

The pipeline, one stage a module: ``trace`` -> ``decompose`` -> cost ->
``place`` -> lower -> runtime.

>>> import seabiscuit_dask as sb                               # doctest: +SKIP
>>> g = sb.decompose(sb.trace(model, x), budget="16MiB")       # doctest: +SKIP
>>> y = sb.run_local(g, x, weights=model)                       # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import config
from .decompose import decompose
from .errors import (
    BadCheckpoint,
    BadInput,
    BudgetTooSmall,
    ClusterTooSmall,
    InvalidGraph,
    SeaBiscuitError,
    UnsupportedModel,
    WorkerLost,
)
from .ir import Op, OpCost, OpGraph, ParamSource, ParamSpec, TensorSpec, verify
from .placement import (
    CapacityChanged,
    ClusterSpec,
    DeviceAdded,
    DeviceLost,
    DeviceSpec,
    LinkSpec,
    Plan,
    place,
    replan,
    simulate,
)
from .runtime import run_local
from .trace import bind_checkpoint, build_empty, empty_weights, trace

__all__ = [
    "BadCheckpoint", "BadInput", "BudgetTooSmall", "CapacityChanged", "ClusterSpec", "ClusterTooSmall",
    "DeviceAdded", "DeviceLost", "DeviceSpec", "DistributedModel", "InvalidGraph", "LinkSpec", "Op",
    "OpCost", "OpGraph", "ParamSource", "ParamSpec", "PlacementState", "Plan", "SeaBiscuitError",
    "SeaBiscuitSchedulerPlugin", "SeaBiscuitWorkerPlugin", "TensorSpec", "UnsupportedModel",
    "WorkerLost", "bind_checkpoint", "build_empty", "config", "decompose", "distribute",
    "empty_weights", "place", "replan", "run_local", "simulate", "trace", "verify",
]


def __getattr__(name: str):
    # NOTE: the Dask runtime loads lazily, so planning alone never imports distributed.
    if name in ("distribute", "DistributedModel"):
        from . import deploy as _d

        return getattr(_d, name)
    if name in ("SeaBiscuitSchedulerPlugin", "SeaBiscuitWorkerPlugin", "PlacementState"):
        from . import plugins

        return getattr(plugins, name)
    raise AttributeError(f"module 'seabiscuit_dask' has no attribute {name!r}")
