"""``replan``: repair a plan when the cluster changes, moving as few weights as possible.

Events are frozen descriptions; ``replan(plan, event)`` returns a new ``Plan`` on
the new cluster and records what moved in ``plan.info`` (``moved_bytes``,
``moved_ops``). The repair is local and deterministic:

- ``DeviceLost(name)``: only the lost device's ops move. Each goes, in
  topological order, to the device of the same host (then the same rack, then
  anywhere) with room that finishes it soonest by a cheap estimate: that
  device's work in the op's depth level, the op's time there, and the time to
  bring its inputs. Devices more than ``QUICK`` times slower for that work than
  the quickest anywhere are a last resort: a farther ring's quick devices with
  room come before a near CPU. Then the lost ops all on one device with room
  (the nearest and quickest ``WHOLE_TRIES``) are simulated too, and the
  fastest of these repairs is kept: a stage handed over whole keeps one cut on
  each side. The kept repair is the one simulating them all would keep, with
  fewer simulations: devices alike and idle are tried once (they simulate
  alike), a repair whose bound (its longest chain of blocks, each a Dask hop
  and the scheduler's time after the one before) passes the fastest one found
  is not simulated, and the op-by-op repair stops as soon as a chain of its
  ops crosses devices so often that its hops alone would.
- ``DeviceAdded(device)``: a device joining a host takes over part of its peers'
  ops (up to its share of the host's speed) where that evens out a depth level.
  A device on a new host is spare capacity until the next ``place``.
- ``CapacityChanged(name, ...)``: new memory or speed figures (or learned time
  ``scale`` s). If the device no longer holds its weights, its ops leave (most bytes
  per second of work first) as on a loss until they fit. If it became slower by a
  factor f, the last (1 - 1/f) of its work in topological order moves whole to the
  nearest, fastest device with room (less of it where it does not fit), so it is back
  to its old time; kept only if the simulator finds the repair faster.

A *pipeline* (a plan placed as contiguous stages of the topological order: method
``"follow-decode"``, a generation deployment, or ``"stages"``) is repaired so that it
stays one: a decode step that follows it (``follow``) runs a task per stage, and the
rules above would scatter its ops into many. It is told by its method, which travels
with the plan in its JSON (both ends of the wire take the same branch); its structure
is not guessed, and the rules below only move stage boundaries or hand a stage over
whole, so they stay sound on a pipeline that an earlier fallback scattered. A *run*
of a device is a maximal stretch of its ops in op order, passing over other devices'
ops that read no weights (a mask, a view that follows its input): a decode step's
tasks follow the weights.

- ``DeviceLost``: each run of the lost device goes to the devices of the runs around
  it, a prefix to the one before and the rest to the one after, split where the two
  finish soonest (their modelled time) within their weight room. The runs no split
  fits go whole to one device with room (not far slower than the quickest, idle
  first: it takes the stage over, then nearest, then fastest). Failing both, the
  rule above.
- ``DeviceAdded``: the newcomer takes one of the busiest device's runs whole (a device
  that took a lost stage over hands it back) or the back of one, split where the two
  finish soonest, within its room: one stage more at most. Of the takes that make that
  device finish sooner by more than a new cut costs per step (``ClusterSpec.cut_latency``:
  the link and a Dask hop), the one that adds the fewest tasks, then gains the most: a
  decode step is latency-bound. Where none gains that much, the newcomer stays spare
  (the rule above would scatter the pipeline).
- ``CapacityChanged``, memory: the fewest ops at one end of one of the device's runs
  move to the device of the run beside that end (the tail to the next stage, the head
  to the previous), the receiver that finishes soonest; speed: the last (1 - 1/f) of
  the device's time, from its busiest run, as that run's tail to the next stage, else
  its head to the previous one, kept as above. Where no end fits, the rules above.

A repair keeps every device's weights within its memory less the activation
reserve, or raises ``ClusterTooSmall`` naming the device; ``plan.check()`` adds
the activations of the largest block (as ``place`` does) when there is time.
A cluster described by a measured matrix cannot take ``DeviceAdded`` (the new
device's links are unknown): measure again.

This module takes the event and keeps the books; the rules live beside it: ``rehome`` (op by
op), ``handover`` (a lost device's ops whole), ``pipelines`` (stage boundaries), ``rebalance``
(joins and capacity changes), and ``repair`` holds what they share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BadInput, ClusterTooSmall
from ..ir import fmt_bytes
from ..pauses import no_gc
from .capacity import weight_capacity
from .cluster import ClusterSpec, DeviceSpec
from .handover import BOUND_SLACK, fastest, rather, wholes
from .pipelines import is_pipeline, merge_lost, take_stage
from .plan import Plan
from .rebalance import adopt, shrink
from .rehome import rehome, rehome_within
from .repair import repaired
from .reroute import LinkChanged, reroute
from .workload import Workload


@dataclass(frozen=True)
class DeviceLost:
    """A device (worker) left the cluster."""

    name: str


@dataclass(frozen=True)
class DeviceAdded:
    """A device joined the cluster."""

    device: DeviceSpec


@dataclass(frozen=True)
class CapacityChanged:
    """A device's memory budget or speed changed (``None``: unchanged)."""

    name: str
    memory_bytes: int | None = None
    flops_per_s: dict[str, float] | None = None
    mem_bytes_per_s: float | None = None
    scale: dict[str, float] | None = None       # measured / modelled time per op class (learned)


Event = DeviceLost | DeviceAdded | CapacityChanged


def replan(plan: Plan, event: Event | LinkChanged) -> Plan:
    """Repair ``plan`` after ``event``; see the module docstring (``LinkChanged``: ``reroute``).

    >>> plan2 = sb.replan(plan, sb.DeviceLost("h0-gpu1"))      # doctest: +SKIP
    >>> plan2.info["moved_bytes"]                               # doctest: +SKIP
    """
    if isinstance(event, LinkChanged):
        return reroute(plan, event).plan
    with no_gc():
        return _replan(plan, event, time.perf_counter())


def _replan(plan: Plan, event: Event, t0: float) -> Plan:
    if isinstance(event, DeviceLost):
        spec = plan.spec.without(event.name)
        lost = plan.spec.index(event.name)
        moving = np.flatnonzero(plan.device_of == lost)
        new = _lose(plan, spec, lost, moving, _info(plan, event, moving))
    else:
        spec, dev, moving = _moves(plan, event)
        new = repaired(plan, spec, dev, _info(plan, event, moving))
    _ = new.block_of  # NOTE: blocks are part of the repair: the runtime needs them at once.
    _check_room(plan, new, event)
    object.__setattr__(new, "planning_s", time.perf_counter() - t0)
    return new


def _moves(plan: Plan, event: Event) -> tuple[ClusterSpec, np.ndarray, np.ndarray]:
    """After a join or a capacity change: the new cluster, every op's device and the ops moved."""
    if isinstance(event, DeviceAdded):
        spec = plan.spec.with_device(event.device)
        join = take_stage if is_pipeline(plan) else adopt
        dev = join(plan, spec, plan.device_of.copy(), len(spec.devices) - 1)
        return spec, dev, np.flatnonzero(dev != plan.device_of)
    if isinstance(event, CapacityChanged):
        changes: dict[str, Any] = {k: v for k, v in (("memory_bytes", event.memory_bytes),
                                                       ("flops_per_s", event.flops_per_s),
                                                       ("mem_bytes_per_s", event.mem_bytes_per_s),
                                                       ("scale", event.scale))
                                   if v is not None}
        spec = plan.spec.with_changes(event.name, **changes)
        dev, moving = shrink(plan, spec, plan.spec.index(event.name))
        return spec, dev, moving
    raise BadInput(f"replan does not know the event {event!r}; expected DeviceLost, "
                   "DeviceAdded or CapacityChanged")


def _info(plan: Plan, event: Event, moving: np.ndarray) -> dict[str, Any]:
    """The repaired plan's info: the old plan's, the event, what moved, and where phases change."""
    w = plan.workload
    info = {k: v for k, v in plan.info.items() if k != "phases_from"}
    info.update(event=repr(event), moved_bytes=float(w.weight_bytes[moving].sum()) if len(moving) else 0.0,
                moved_ops=len(moving), phases_from=(plan.phases, *_window(w, moving)))
    return info


def _check_room(plan: Plan, new: Plan, event: Event) -> None:
    """Raise ``ClusterTooSmall`` if the repair gave a device more weights than it has room for."""
    d = _overfilled(plan, new)
    if d is not None:
        raise ClusterTooSmall(f"after {event!r}, {new.spec.names[d]!r} would hold "
                              f"{fmt_bytes(new.weight_bytes[d])} of weights; it has room for "
                              f"{fmt_bytes(weight_capacity(new.spec)[d])}")


def _overfilled(plan: Plan, new: Plan) -> int | None:
    """The first device ``new`` gives more weights than it has room for (None: none): a weight
    shared by ops on several devices is held by each of them, so moving ops one by one can."""
    spec = new.spec
    cap = weight_capacity(spec)
    # NOTE: only a device the repair gave more weights: ``place`` may leave one just past the
    # weight room when its activations are small (it checks weights and activations together)
    before = dict(zip(plan.spec.names, plan.weight_bytes.tolist()))
    grew = new.weight_bytes > np.array([before.get(n, 0.0) for n in spec.names]) + 0.5
    over = np.flatnonzero((new.weight_bytes > cap) & grew)
    return int(over[0]) if len(over) else None


def _window(w: Workload, moving: np.ndarray) -> tuple[int, int]:
    """The ops whose phases are recomputed exactly: from the first moved op to the last (after
    it, phases shift as one, which also orders the edges out of moved ops; see ``phases``)."""
    if not len(moving):
        return w.n, w.n
    return int(moving.min()), int(moving.max()) + 1


def _lose(plan: Plan, spec: ClusterSpec, lost: int, moving: np.ndarray, info: dict[str, Any]) -> Plan:
    """The repaired plan on ``spec`` once device ``lost`` of ``plan.spec`` is gone: the op-by-op
    repair (``rehome``) or, where the simulator finds it faster, a whole hand-over (``wholes``)."""
    merged = merge_lost(plan, lost) if is_pipeline(plan) else None
    if merged is not None:
        return repaired(plan, spec, np.where(merged > lost, merged - 1, merged), info)
    old = plan.device_of
    dev = np.where(old > lost, old - 1, old)
    dev[moving] = -1
    home = plan.spec.devices[lost]
    whole = fastest(wholes(plan, spec, dev, moving, home, info))
    if whole is None:
        return repaired(plan, spec, rehome(plan, spec, dev, moving, home), info)
    # NOTE: the op-by-op repair gives up once its chain of cuts alone outlasts the whole hand-over
    give_up_s = whole.makespan_s * (1 + BOUND_SLACK) - whole.schedule.client_s
    rehomed = rehome_within(plan, spec, dev, moving, home, -1, give_up_s)
    if rehomed is None:
        return whole
    op_by_op = repaired(plan, spec, rehomed, info)
    # NOTE: one that overfills a device through a weight its ops share loses to a hand-over that fits
    return whole if _overfilled(plan, op_by_op) is not None else rather(op_by_op, whole)
