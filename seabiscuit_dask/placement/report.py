"""A dry run of a plan: what it asks of the hardware, before any weight moves.

``report(plan, context=512, lose=())`` (also ``Plan.report``) states, for a person
choosing hardware:

- per device, the memory left over (budget less the plan's peak) and how much of
  generation's KV cache fits in it: bytes per token, tokens, sessions of ``context``
  tokens. A layer's cache lives with its attention ops (the device most of them run
  on, the rule ``follow`` places the decode step by), so the cluster holds as many
  sessions as its tightest cache-holding device;
- the bottleneck device (most simulated busy time) and link (most transfer time:
  bytes / bandwidth + latency);
- the predicted latency and throughput, serial (1 / latency) and pipelined
  (1 / the busiest serial resource: a device, or Dask's one scheduler);
- for each device (or group) named in ``lose``, the repair ``replan`` makes when it
  is lost: the new latency, the weights that move (and what the devices left must
  load: less where a shared weight is already there), the new bottleneck, or why
  the rest cannot hold the model.

KV bytes per token and layer come from the graph. A decode step (``trace_step``)
lists its cache layers in ``meta["kv_layers"]``: heads x (key dim + value dim) x
dtype bytes, as ``lower/kvcache.py`` allocates. A forward graph has its attention
ops: the keys and values they read (each tile once, grouped-query heads un-repeated
by walking back through views), divided by the tokens of one request (the graph
inputs that index an embedding, ``meta["index_ranges"]``). A graph with neither has
no KV cache. Sessions count exactly ``context`` tokens each, as
``distribute(sessions=, context=)`` reserves them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import ops as O
from ..errors import BadInput, ClusterTooSmall
from ..ir import DTYPE_BYTES, Op, OpGraph, fmt_bytes
from .plan import Plan
from .replan import DeviceLost, replan
from .workload import workload

DEFAULT_CONTEXT = 512


@dataclass(frozen=True)
class DeviceRoom:
    """One device's memory under the plan, and the KV cache its headroom holds."""

    name: str
    weight_bytes: int
    peak_bytes: int
    memory_bytes: int
    headroom_bytes: int             # memory less peak (negative: the plan does not fit here)
    busy_s: float                   # simulated compute time of one request
    kv_layers: tuple[int, ...]      # layers whose cache lives here
    kv_bytes_per_token: int         # what one token of one session adds here
    kv_tokens: int | None           # tokens that fit in the headroom (None: holds no cache)
    sessions: int | None            # sessions of ``context`` tokens that fit (None: no cache)


@dataclass(frozen=True)
class LinkLoad:
    """Bytes one request sends from ``src`` to ``dst``, and the time they take on the link."""

    src: str
    dst: str
    sent_bytes: int
    bandwidth_bytes_per_s: float
    latency_s: float
    transfer_s: float               # sent_bytes / bandwidth + latency


@dataclass(frozen=True)
class LossReport:
    """What the plan becomes when the devices ``lost`` leave the cluster together."""

    lost: tuple[str, ...]
    fits: bool
    makespan_s: float | None        # new latency (None: does not fit)
    moved_bytes: int                # weights of the ops that move (``replan``'s ``moved_bytes``)
    loaded_bytes: int               # what the devices left must load: the growth of their weights
                                    # (less than moved_bytes where a shared weight is already there)
    moved_ops: int
    bottleneck_device: str | None
    bottleneck_busy_s: float | None
    pipelined_requests_per_s: float | None
    pipelined_limited_by: str | None        # the bottleneck device, or the Dask scheduler
    sessions: int | None            # KV sessions the repaired plan holds (None: no cache / no fit)
    weight_bytes: int               # the model's weights, each once (the need)
    memory_bytes: int               # the memory of the devices left (the supply)
    reason: str = ""                # why it does not fit, with the numbers


@dataclass(frozen=True)
class PlanReport:
    """The figures of ``report(plan)``; ``str()`` prints them as aligned tables."""

    method: str
    context_tokens: int
    devices: tuple[DeviceRoom, ...]
    kv_bytes_per_token: int         # one session's token over all layers (0: no KV cache)
    kv_reserved_bytes: int          # per layer, already in the peaks (``meta["kv_reserve_bytes"]``)
    kv_tokens: int | None           # cache tokens the cluster holds: its tightest cache device's
    sessions: int | None
    kv_limited_by: str | None
    bottleneck_device: str
    bottleneck_busy_s: float
    bottleneck_link: LinkLoad | None
    makespan_s: float
    scheduler_s: float              # Dask scheduler time per request (one serial resource)
    pipelined_requests_per_s: float | None   # 1 / max(busiest device, scheduler); None: no work
    pipelined_limited_by: str
    serial_requests_per_s: float | None      # 1 / makespan
    losses: tuple[LossReport, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers, strings, lists and None: what ``json.loads(json.dumps(...))`` gives back."""
        return _plain(dataclasses.asdict(self))

    def __str__(self) -> str:
        return "\n".join(_lines(self))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return [_plain(v) for v in x] if isinstance(x, (list, tuple)) else x


# --- KV cache -----------------------------------------------------------------------------
def kv_bytes_per_token(graph: OpGraph) -> dict[int, int]:
    """Layer -> KV-cache bytes one token of one session adds there; empty without a cache."""
    layers = graph.meta.get("kv_layers")
    if layers:
        return {i: int(e["heads"]) * (int(e["dim"]) + int(e["value_dim"])) * DTYPE_BYTES.get(e["dtype"], 4)
                for i, e in enumerate(layers)}
    tokens = request_tokens(graph)
    if not tokens:
        return {}
    out: dict[int, int] = {}
    for layer, ops in _attention_by_layer(graph).items():
        kv = sum(_unique_bytes(graph, [op.attrs["args"][j] for op in ops]) for j in (1, 2))
        if kv:
            out[layer] = -(-kv // tokens)
    return out


def request_tokens(graph: OpGraph) -> int:
    """Tokens of one request: the elements of the graph inputs that index an embedding (0: none)."""
    ranges = graph.meta.get("index_ranges") or {}
    return max((graph.tensors[t].numel for t in ranges if t in graph.tensors), default=0)


def cache_devices(plan: Plan) -> dict[int, int]:
    """Layer -> device index that holds its KV cache: the device most of its attention ops run on
    (first seen on a tie), as ``follow`` places a decode step's cache attention."""
    votes: dict[int, Counter[int]] = {}
    idx = plan.workload.index
    for layer, ops in _attention_by_layer(plan.graph).items():
        votes[layer] = Counter(int(plan.device_of[idx[op.name]]) for op in ops)
    return {layer: v.most_common(1)[0][0] for layer, v in votes.items()}


def _attention_by_layer(graph: OpGraph) -> dict[int, list[Op]]:
    """Attention ops grouped by cache layer: the ``layer`` argument of a cache attention, else the
    layer number in the op's scope (as ``workload`` charges the KV reservation)."""
    w = workload(graph)
    out: dict[int, list[Op]] = {}
    for i, op in enumerate(graph.ops):
        if op.kind == "kv_attention":
            out.setdefault(int(op.attrs["args"][6]), []).append(op)
        elif op.kind == "attention" and op.target in O.ATTENTION:
            out.setdefault(int(w.layer[i]), []).append(op)
    return out


def _unique_bytes(graph: OpGraph, refs: Iterable[Any]) -> int:
    """Bytes of the distinct data behind tensor operands: each tensor once, and a view chain that
    repeats heads (expand) counted at its smallest tensor."""
    roots: dict[str, int] = {}
    for ref in refs:
        rn = O.ref_name(ref)
        if rn is None or rn[0] != "t":
            continue
        root, nbytes = _view_root(graph, rn[1])
        roots[root] = max(roots.get(root, 0), nbytes)
    return sum(roots.values())


def _view_root(graph: OpGraph, name: str) -> tuple[str, int]:
    """The tensor a chain of views starts from, and the smallest tensor on the chain in bytes."""
    # NOTE: going back along views only an expand's input is smaller than its output: the least
    # is the data before grouped-query attention repeated its heads.
    cur, least = name, graph.tensors[name].nbytes
    for _ in range(16):
        src = graph.producer.get(cur)
        op = graph.op_by_name[src] if src is not None else None
        if op is None or op.kind != "view" or len(op.inputs) != 1:
            break
        cur = op.inputs[0]
        least = min(least, graph.tensors[cur].nbytes)
    return cur, least


# --- per device -------------------------------------------------------------------------------
def device_rooms(plan: Plan, context: int,
                 per_token: Mapping[int, int] | None = None) -> tuple[DeviceRoom, ...]:
    """Weights, peak, budget and headroom of each device, and the KV cache that fits there."""
    per_token = kv_bytes_per_token(plan.graph) if per_token is None else per_token
    holder = cache_devices(plan) if per_token else {}
    busy = plan.schedule.busy_s
    out = []
    for d, dev in enumerate(plan.spec.devices):
        layers = tuple(sorted(layer for layer, h in holder.items() if h == d and layer in per_token))
        kv = sum(per_token[layer] for layer in layers)
        room = int(dev.memory_bytes - math.ceil(float(plan.peak_bytes[d])))
        tokens = max(0, room) // kv if kv else None
        out.append(DeviceRoom(dev.name, round(float(plan.weight_bytes[d])),
                              math.ceil(float(plan.peak_bytes[d])), int(dev.memory_bytes), room,
                              float(busy[d]), layers, int(kv), tokens,
                              None if tokens is None else tokens // context))
    return tuple(out)


def tightest(rooms: Sequence[DeviceRoom]) -> DeviceRoom | None:
    """The cache-holding device with room for the fewest tokens (None: no KV cache)."""
    holders = [r for r in rooms if r.kv_tokens is not None]
    return min(holders, key=lambda r: r.kv_tokens or 0) if holders else None


# --- time -------------------------------------------------------------------------------------
def bottleneck_link(plan: Plan) -> LinkLoad | None:
    """The device pair whose traffic of one request takes longest (None: nothing crosses)."""
    sent = plan.bytes_between
    if not (sent > 0).any():
        return None
    bw, lat = plan.spec.bandwidth, plan.spec.latency
    t = np.where(sent > 0, sent / bw + lat, -1.0)
    a, b = (int(x) for x in np.unravel_index(int(np.argmax(t)), t.shape))
    names = plan.spec.names
    return LinkLoad(names[a], names[b], int(sent[a, b]), float(bw[a, b]), float(lat[a, b]), float(t[a, b]))


def busiest(plan: Plan) -> tuple[str, float]:
    """The device with the most simulated compute per request, and that time."""
    busy = plan.schedule.busy_s
    d = int(np.argmax(busy))
    return plan.spec.names[d], float(busy[d])


def throughput(plan: Plan) -> tuple[float | None, str, float | None]:
    """(pipelined requests/s, what limits it, serial requests/s).

    Pipelined, requests overlap and the busiest serial resource sets the rate: a device,
    or the Dask scheduler, which spends ``task_s`` on every task of every request.
    """
    name, busy_s = busiest(plan)
    sched_s = float(plan.schedule.scheduler_s)
    limit, by = (busy_s, name) if busy_s >= sched_s else (sched_s, "the Dask scheduler")
    return (1 / limit if limit > 0 else None, by,
            1 / plan.makespan_s if plan.makespan_s > 0 else None)


# --- losses -----------------------------------------------------------------------------------
def lose_devices(plan: Plan, names: Sequence[str], context: int = DEFAULT_CONTEXT,
                 per_token: Mapping[int, int] | None = None) -> LossReport:
    """Replan after the devices ``names`` are lost together; say what it costs or why it fails
    (``ClusterTooSmall`` from ``replan`` or from the repaired plan's memory check)."""
    lost = tuple(dict.fromkeys(names))
    for n in lost:
        plan.spec.index(n)                  # NOTE: an unknown name is bad input, not a finding
    need = round(float(plan.workload.weight_bytes.sum()))     # NOTE: a shared weight once
    have = sum(d.memory_bytes for d in plan.spec.devices if d.name not in lost)
    p, moved, moved_ops, reason = plan, 0.0, 0, ""
    if have == 0:
        reason = "no device would be left"
    else:
        try:
            for n in lost:
                p = replan(p, DeviceLost(n))
                moved += float(p.info.get("moved_bytes", 0.0))
                moved_ops += int(p.info.get("moved_ops", 0))
            p.check()
        except ClusterTooSmall as e:
            reason = str(e)
    if reason:
        return LossReport(lost, False, None, round(moved), 0, moved_ops, None, None, None, None, None,
                          need, have, reason)
    before = dict(zip(plan.spec.names, plan.weight_bytes.tolist()))
    loaded = sum(max(0.0, w - before[n]) for n, w in zip(p.spec.names, p.weight_bytes.tolist()))
    name, busy_s = busiest(p)
    rate, by, _ = throughput(p)
    low = tightest(device_rooms(p, context, per_token))
    return LossReport(lost, True, p.makespan_s, round(moved), round(loaded), moved_ops, name, busy_s, rate,
                      by, None if low is None else low.sessions, need, have)


def loss_scenarios(plan: Plan, lose: str | Sequence[str | Sequence[str]]) -> list[tuple[str, ...]]:
    """``"all"``: each device alone; else each item one scenario (a name, or names lost together)."""
    if isinstance(lose, str):
        lose = list(plan.spec.names) if lose == "all" else [lose]
    return [(x,) if isinstance(x, str) else tuple(x) for x in lose]


# --- the report -------------------------------------------------------------------------------
def report(plan: Plan, context: int | None = None,
           lose: str | Sequence[str | Sequence[str]] = ()) -> PlanReport:
    """The dry-run figures of ``plan``; see the module docstring.

    Parameters
    ----------
    plan : Plan
    context : int, optional
        Tokens per generation session (prompt and answer), to turn KV tokens into sessions
        (default ``DEFAULT_CONTEXT``, 512).
    lose : "all", or a list of device names (or of lists of names, lost together)
        The losses to try, each on its own; ``"all"`` tries every device in turn.

    Examples
    --------
    >>> r = report(plan, context=1024, lose=["h0-gpu1"])                # doctest: +SKIP
    >>> r.sessions, r.bottleneck_device, r.losses[0].moved_bytes        # doctest: +SKIP
    """
    context = DEFAULT_CONTEXT if context is None else int(context)
    if context < 1:
        raise BadInput(f"context must be at least 1 token per session, got {context}")
    per_token = kv_bytes_per_token(plan.graph)
    rooms = device_rooms(plan, context, per_token)
    low = tightest(rooms)
    name, busy_s = busiest(plan)
    rate, by, serial = throughput(plan)
    losses = tuple(lose_devices(plan, s, context, per_token) for s in loss_scenarios(plan, lose))
    return PlanReport(
        method=plan.method, context_tokens=context, devices=rooms,
        kv_bytes_per_token=int(sum(per_token.values())),
        kv_reserved_bytes=int(plan.graph.meta.get("kv_reserve_bytes", 0) or 0),
        kv_tokens=None if low is None else low.kv_tokens, sessions=None if low is None else low.sessions,
        kv_limited_by=None if low is None else low.name, bottleneck_device=name, bottleneck_busy_s=busy_s,
        bottleneck_link=bottleneck_link(plan), makespan_s=plan.makespan_s,
        scheduler_s=float(plan.schedule.scheduler_s), pipelined_requests_per_s=rate, pipelined_limited_by=by,
        serial_requests_per_s=serial, losses=losses)


# --- text -------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}"


def _opt(n: int | None) -> str:
    return "-" if n is None else str(n)


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _lines(r: PlanReport) -> list[str]:
    return [*_memory_lines(r), *_time_lines(r), *_loss_lines(r)]


def _loss_lines(r: PlanReport) -> list[str]:
    """One line per loss; the losses of devices that hold no ops (nothing changes) share one."""
    idle = [x for x in r.losses if x.fits and x.moved_ops == 0]
    lines = [_loss_line(r, x) for x in r.losses if x not in idle]
    if len(idle) > 1:
        lines.append(f"lose any one of {', '.join('+'.join(x.lost) for x in idle)}: nothing moves "
                     f"(they hold no ops), latency {_ms(r.makespan_s)}")
    elif idle:
        lines.append(_loss_line(r, idle[0]))
    return lines


def _memory_lines(r: PlanReport) -> list[str]:
    if r.kv_bytes_per_token:
        n = sum(len(d.kv_layers) for d in r.devices)
        head = (f"memory and KV cache ({fmt_bytes(r.kv_bytes_per_token)} per token over {n} layers, "
                f"sessions of {r.context_tokens} tokens)")
    else:
        head = "memory (no KV cache: the graph has no attention over tokens)"
    lines = [head, f"{'device':<12} {'weights':>10} {'peak':>10} {'budget':>10} {'headroom':>10} "
                   f"{'layers':>6} {'KV/token':>10} {'tokens':>10} {'sessions':>8}"]
    for d in r.devices:
        kv = fmt_bytes(d.kv_bytes_per_token) if d.kv_bytes_per_token else "-"
        lines.append(f"{d.name:<12} {fmt_bytes(d.weight_bytes):>10} {fmt_bytes(d.peak_bytes):>10} "
                     f"{fmt_bytes(d.memory_bytes):>10} {fmt_bytes(d.headroom_bytes):>10} "
                     f"{len(d.kv_layers):>6} {kv:>10} {_opt(d.kv_tokens):>10} {_opt(d.sessions):>8}")
    if r.sessions is not None:
        lines.append(f"KV cache: room for {_n(r.kv_tokens or 0, 'token')} = {_n(r.sessions, 'session')} of "
                     f"{r.context_tokens} tokens, limited by {r.kv_limited_by}")
    if r.kv_reserved_bytes:
        lines.append(f"(beyond the {fmt_bytes(r.kv_reserved_bytes)} per layer the plan already reserves)")
    return lines


def _time_lines(r: PlanReport) -> list[str]:
    lines = [f"bottleneck device {r.bottleneck_device}: busy {_ms(r.bottleneck_busy_s)} per request"]
    link = r.bottleneck_link
    if link is None:
        lines.append("bottleneck link: none (nothing crosses devices)")
    else:
        lines.append(f"bottleneck link {link.src} -> {link.dst}: {fmt_bytes(link.sent_bytes)} per request in "
                     f"{_ms(link.transfer_s)} ({link.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                     f"{link.latency_s * 1e6:.0f} us latency)")
    lines.append(f"latency {_ms(r.makespan_s)} per request (simulated); throughput "
                 f"{_rate(r.pipelined_requests_per_s)} requests/s pipelined (limited by "
                 f"{r.pipelined_limited_by}; scheduler {_ms(r.scheduler_s)} per request), "
                 f"{_rate(r.serial_requests_per_s)} serial")
    return lines


def _loss_line(r: PlanReport, x: LossReport) -> str:
    what = f"lose {'+'.join(x.lost)}:"
    if not x.fits:
        return (f"{what} does not fit: the model's weights {fmt_bytes(x.weight_bytes)}, memory left "
                f"{fmt_bytes(x.memory_bytes)}; {x.reason}")
    rel = (x.makespan_s or 0) / r.makespan_s - 1 if r.makespan_s > 0 else 0.0
    change = f" ({0.0 if abs(rel) < 5e-3 else rel:+.0%})" if r.makespan_s > 0 else ""
    kv = f", {_n(x.sessions, 'session')}" if x.sessions is not None else ""
    sched = f" (limited by {x.pipelined_limited_by})" if x.pipelined_limited_by != x.bottleneck_device else ""
    load = f", {fmt_bytes(x.loaded_bytes)} to load" if x.loaded_bytes != x.moved_bytes else ""
    return (f"{what} latency {_ms(x.makespan_s)}{change}, {fmt_bytes(x.moved_bytes)} of weights move "
            f"({_n(x.moved_ops, 'op')}{load}), bottleneck {x.bottleneck_device} "
            f"({_ms(x.bottleneck_busy_s)}), {_rate(x.pipelined_requests_per_s)} requests/s pipelined"
            f"{sched}{kv}")
