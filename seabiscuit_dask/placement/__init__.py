"""Placement: which device runs each micro-op, and the repair when the cluster changes.

Pure Python and numpy, no cluster: the Dask scheduler plugin calls it in its
event loop. ``place`` partitions, ``replan`` repairs, ``simulate`` predicts the
time of one request, and ``baselines`` holds the methods ``place`` is measured
against.
"""

from .baselines import BASELINES, heft, metis, pipeline, round_robin
from .cluster import (
    NO_DASK,
    PRESETS,
    PROFILES,
    ClusterSpec,
    DaskSpec,
    DeviceSpec,
    LinkSpec,
)
from .partition import place
from .plan import Block, Plan
from .replan import CapacityChanged, DeviceAdded, DeviceLost, replan
from .report import PlanReport
from .reroute import LinkChanged, reroute
from .simulate import Schedule, lower_bound_s, simulate

__all__ = [
    "BASELINES", "NO_DASK", "PRESETS", "PROFILES", "Block", "CapacityChanged", "ClusterSpec", "DaskSpec",
    "DeviceAdded", "DeviceLost", "DeviceSpec", "LinkChanged", "LinkSpec", "Plan", "PlanReport", "Schedule",
    "heft",
    "lower_bound_s", "metis", "pipeline", "place", "replan", "reroute", "round_robin", "simulate",
]
