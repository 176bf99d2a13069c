"""``reroute``: repair a plan when a link between two of its devices changes speed.

A link measured slower (or faster) than the plan assumes (``placement.links``) is a
``LinkChanged`` event. The repair weighs three answers on the new figures, each timed by
the simulator:

- *keep*: the same placement and routes; only the link's figures change.
- *relay*: transfers over a link whose path through a third device is faster go through it
  (``ClusterSpec.relays``), and relays that no longer pay go direct again. No weight moves;
  the data plane forwards chunk by chunk, so a relayed link is as fast as its slower leg.
- *recut*: the cut leaves the link. Two devices trade their ops (one of them an end of
  the link: a pipeline's stages keep their order, the stage boundaries land on other
  links), or one end's ops on the link's cut move whole, or half of them, to the other
  end where it has room; each on the best routes.

A repair is made only when it pays (``RepairPolicy``): a request is predicted faster by
``min_gain`` of its time, and the weights it moves load within ``payback_requests``
requests' gain. Of those that pay, the one that costs least over that many requests
(its time, and the loading spread over them) wins. ``replan(plan, LinkChanged(...))``
returns its plan.

>>> ev = LinkChanged("h0-gpu0", "h1-gpu0", LinkSpec(2.5e6, 1e-4))      # doctest: +SKIP
>>> reroute(plan, ev).kind                                             # doctest: +SKIP
'relay'
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import config
from .capacity import weight_capacity
from .cluster import ClusterSpec, LinkSpec
from .plan import Plan

SIMULATE_MAX_OPS = 20_000     # NOTE: past this only routes are weighed: a recut search would stall the loop


@dataclass(frozen=True)
class LinkChanged:
    """The link from device ``src`` to ``dst`` (names or addresses) now measures ``link``."""

    src: str
    dst: str
    link: LinkSpec


@dataclass(frozen=True)
class RepairPolicy:
    """When a repair pays (see module doc); ``from_config`` reads ``seabiscuit.routing.*``."""

    min_gain: float = 0.1
    payback_requests: float = 200.0
    load_bytes_per_s: float = 5e8

    @classmethod
    def from_config(cls) -> RepairPolicy:
        return cls(float(config.get("routing.min-gain")), float(config.get("routing.payback-requests")),
                   float(config.to_bytes(config.get("routing.load-rate"), "seabiscuit.routing.load-rate")))

    def cost_s(self, request_s: float, moved_bytes: float) -> float:
        """A request's time with the loading of ``moved_bytes`` spread over ``payback_requests``."""
        return request_s + moved_bytes / self.load_bytes_per_s / self.payback_requests

    def pays(self, keep_s: float, request_s: float, moved_bytes: float) -> bool:
        gain = keep_s - request_s
        load_s = moved_bytes / self.load_bytes_per_s
        return gain >= self.min_gain * keep_s and gain * self.payback_requests >= load_s


@dataclass(frozen=True)
class Repair:
    """What ``reroute`` decided: ``plan`` (the old placement on the new figures for ``"keep"``)."""

    kind: str                # "keep", "relay" or "recut"
    plan: Plan
    keep_s: float            # a request's predicted time on the new figures, unrepaired
    request_s: float         # ... with this repair
    moved_bytes: float = 0.0
    reason: str = ""


def reroute(plan: Plan, event: LinkChanged, policy: RepairPolicy | None = None) -> Repair:
    """The repair of ``plan`` after ``event`` that pays best, or ``"keep"`` (see module doc)."""
    t0 = time.perf_counter()
    policy = policy or RepairPolicy.from_config()
    spec = plan.spec.with_link(event.src, event.dst, event.link)
    keep = _on(plan, spec, plan.device_of)
    keep_s = keep.makespan_s
    where = f"link {spec.names[spec.index(event.src)]} -> {spec.names[spec.index(event.dst)]}"
    routed = best_routes(keep)
    cands: list[tuple[str, Plan, float]] = []
    if routed.relays != spec.relays:
        cands.append(("relay", _on(plan, routed, plan.device_of), 0.0))
    if plan.workload.n <= SIMULATE_MAX_OPS:
        w = plan.workload
        for dev in _recuts(plan, routed, spec.index(event.src), spec.index(event.dst)):
            moved = float(w.weight_bytes[dev != plan.device_of].sum())
            trial = _on(plan, routed, dev)
            routes = best_routes(trial)
            cands.append(("recut", trial if routes is routed else _on(plan, routes, dev), moved))
    paying = [(kind, p, moved, p.makespan_s) for kind, p, moved in cands
              if policy.pays(keep_s, p.makespan_s, moved)]
    if not paying:
        return Repair("keep", keep, keep_s, keep_s, 0.0, f"{where} now {_fmt(event.link)}: no repair pays")
    kind, best, moved, t = min(paying, key=lambda c: (policy.cost_s(c[3], c[2]), c[2]))
    why = (f"{where} now {_fmt(event.link)}: {_what(best, kind)}, {keep_s * 1e3:.1f} -> {t * 1e3:.1f} ms "
           "a request (predicted)")
    info = {**best.info, "event": repr(event), "moved_bytes": moved,
            "moved_ops": int((best.device_of != plan.device_of).sum())}
    best = Plan(best.graph, best.spec, best.device_of, best.method, time.perf_counter() - t0, info)
    return Repair(kind, best, keep_s, t, moved, why)


def _on(plan: Plan, spec: ClusterSpec, device_of: np.ndarray) -> Plan:
    """``plan``'s graph placed by ``device_of`` on ``spec`` (blocks cut as ``plan``'s are)."""
    info: dict[str, Any] = dict(plan.info) if device_of is plan.device_of else {"fused": plan.fused}
    return Plan(plan.graph, spec, device_of, plan.method, plan.planning_s, info)


def best_routes(plan: Plan) -> ClusterSpec:
    """``plan.spec`` with, for each pair of devices the plan sends bytes between, the route that moves
    them soonest: directly, or through the one relay whose path is fastest (and no relay for a pair
    it sends nothing between). The table is made whole, then one hop (``_one_hop``), then the spec:
    a table built pair by pair onto the relays of an older plan (another cut, or other figures) could
    relay a leg of a relay for a moment, which a spec refuses."""
    spec = plan.spec
    bb = plan.bytes_between
    bw, lat = spec.direct_bandwidth, spec.direct_latency
    relay_s = spec.dask.hop_s / 2
    gains: dict[tuple[int, int], tuple[int, float]] = {}      # (from, to) -> (via, seconds it saves)
    for i, j in zip(*np.nonzero(bb)):
        a, b = int(i), int(j)
        n = float(bb[a, b])
        direct_s = float(lat[a, b] + n / bw[a, b])
        best, best_s = -1, direct_s
        for c in range(len(spec.devices)):
            if c in (a, b):
                continue
            t = float(lat[a, c] + lat[c, b] + relay_s + n / min(bw[a, c], bw[c, b]))
            if t < best_s:
                best, best_s = c, t
        if best >= 0:
            gains[(a, b)] = (best, direct_s - best_s)
    names = spec.names
    table = {(names[a], names[b]): names[c] for (a, b), c in _one_hop(gains).items()}
    kept = tuple(r for r in spec.relays if table.get((r[0], r[1])) == r[2])
    relays = kept + tuple((a, b, c) for (a, b), c in table.items() if (a, b, c) not in kept)
    return spec if relays == spec.relays else replace(spec, relays=relays)


def _one_hop(gains: dict[tuple[int, int], tuple[int, float]]) -> dict[tuple[int, int], int]:
    """Of the relays ``gains`` holds ((from, to) -> (via, seconds saved)), the ones whose legs are not
    relayed themselves (a transfer takes one relay at most): those that save most first; a pair whose
    relay would take a relayed leg, or be a leg of one, goes directly."""
    out: dict[tuple[int, int], int] = {}
    for (a, b), (c, _) in sorted(gains.items(), key=lambda kv: -kv[1][1]):
        legs = {(a, c), (c, b)}
        if legs & out.keys() or any((a, b) in {(x, v), (v, y)} for (x, y), v in out.items()):
            continue
        out[(a, b)] = c
    return out


def _recuts(plan: Plan, spec: ClusterSpec, a: int, b: int) -> list[np.ndarray]:
    """Placements whose cut leaves the link a -> b: ``a`` or ``b`` trades its ops with another device
    of the plan, or one end's ops whose outputs cross the link move (all, then half) to the other
    end; only those whose devices hold their weights."""
    dev = plan.device_of
    used = sorted(set(dev.tolist()))
    cap = weight_capacity(spec)
    out = []
    for x in (a, b):
        for y in used:
            if y in (a, b):
                continue
            trial = dev.copy()
            trial[dev == x], trial[dev == y] = y, x
            out.append(trial)
    sends = _crossing(plan, a, b)
    for ops, to in ((sends, b), (np.flatnonzero(dev == b), a)):
        for part in (ops, ops[len(ops) // 2:]):
            if len(part):
                trial = dev.copy()
                trial[part] = to
                out.append(trial)
    room = np.maximum(cap, plan.weight_bytes)       # NOTE: a device past its room may stay as it is
    return [t for t in out
            if not np.array_equal(t, dev) and (Plan(plan.graph, spec, t).weight_bytes <= room).all()]


def _crossing(plan: Plan, a: int, b: int) -> np.ndarray:
    """The ops of device ``a`` from the first whose output device ``b`` reads to the last op of ``a``."""
    w, dev = plan.workload, plan.device_of
    t_idx, c_op = w.pairs
    src = w.t_src[t_idx]
    out = src[(dev[src] == a) & (dev[c_op] == b)]
    mine = np.flatnonzero(dev == a)
    return mine[mine >= int(out.min())] if len(out) else np.zeros(0, dtype=np.int64)


def _what(plan: Plan, kind: str) -> str:
    spec = plan.spec
    if kind == "relay":
        return "relay " + ", ".join(f"{a}->{b} via {c}" for a, b, c in spec.relays)
    return f"the cut moves ({plan.method})"


def _fmt(link: LinkSpec) -> str:
    return f"{link.bandwidth_bytes_per_s * 8 / 1e6:.1f} Mbit/s, {link.latency_s * 1e3:.2f} ms"
