"""SeaBiscuit: run models too big for one device across the machines you have.

The pipeline, one stage a package: ``trace`` -> ``decompose`` -> ``placement``
(``place``) -> ``lower`` -> ``runtime`` (``run_local``, ``deploy``); ``plugins``
are the Dask adapters.

>>> import seabiscuit_dask as sb                               # doctest: +SKIP
>>> g = sb.decompose(sb.trace(model, x), budget="16MiB")       # doctest: +SKIP
>>> y = sb.run_local(g, x, weights=model)                       # doctest: +SKIP
"""

from __future__ import annotations

from . import config
from .decompose import decompose
from .errors import (
    AccessDenied,
    BadCheckpoint,
    BadClusterSpec,
    BadConfig,
    BadInput,
    BadMessage,
    BadPlan,
    BlockFailed,
    BudgetTooSmall,
    Busy,
    ClusterTooSmall,
    DeviceUnavailable,
    InvalidGraph,
    MissingPackage,
    ModelClosed,
    RoomTaken,
    RunFailed,
    SeaBiscuitError,
    SessionClosed,
    SpecUnavailable,
    StaleRun,
    UnsupportedModel,
    UnsupportedOp,
    WorkerLost,
)
from .ir import Op, OpCost, OpGraph, ParamSource, ParamSpec, TensorSpec, verify
from .placement import (
    CapacityChanged,
    ClusterSpec,
    DaskSpec,
    DeviceAdded,
    DeviceLost,
    DeviceSpec,
    LinkChanged,
    LinkSpec,
    Plan,
    place,
    replan,
    simulate,
)
from .runtime import run_local
from .trace import bind_checkpoint, build_empty, empty_weights, trace
from .version import __version__ as __version__

__all__ = [
    "AccessDenied", "BadCheckpoint", "BadClusterSpec", "BadConfig", "BadInput", "BadMessage", "BadPlan",
    "BlockFailed", "BudgetTooSmall", "Busy", "CapacityChanged", "ClusterSpec", "ClusterTooSmall",
    "DaskSpec", "DeviceAdded", "DeviceLost", "DeviceSpec", "DeviceUnavailable", "DistributedModel",
    "InvalidGraph", "LinkChanged", "LinkSpec", "MissingPackage", "ModelClosed", "Op", "OpCost", "OpGraph",
    "ParamSource", "ParamSpec", "PlacementState", "Plan", "RoomTaken", "RunFailed", "SeaBiscuitError",
    "SeaBiscuitSchedulerPlugin", "SeaBiscuitWorkerPlugin", "SessionClosed", "SpecUnavailable", "StaleRun",
    "TensorSpec", "UnsupportedModel", "UnsupportedOp", "WorkerLost", "bind_checkpoint", "build_empty",
    "config", "decompose", "deploy", "distribute", "empty_weights", "measure_cluster", "place", "replan",
    "run_local", "simulate", "trace", "verify",
]


def __getattr__(name: str):
    # NOTE: the Dask runtime loads lazily, so planning alone never imports distributed.
    if name in ("deploy", "distribute", "DistributedModel"):
        from .runtime import client

        return getattr(client, name)
    if name == "measure_cluster":
        from .runtime.discover import measure_cluster

        return measure_cluster
    if name == "PlacementState":
        from .runtime.scheduler import PlacementState

        return PlacementState
    if name in ("SeaBiscuitSchedulerPlugin", "SeaBiscuitWorkerPlugin"):
        from . import plugins

        return getattr(plugins, name)
    raise AttributeError(f"module 'seabiscuit_dask' has no attribute {name!r}")
