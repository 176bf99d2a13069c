"""What the dashboard page and its JSON routes show, as plain data.

``Activity`` keeps what the scheduler plugin sees happen (block runs, requests
submitted), bounded; the ``*_data`` functions turn it, the plugin's
``PlacementState`` and the scheduler's worker states into JSON-able dicts. The
Bokeh page and the ``/seabiscuit/api/*`` routes both read these, so they never
disagree, and tests call them without a browser.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..lower.blocks import split_block
from ..placement import Plan
from ..placement.workload import layer_of
from ..runtime.scheduler import Deployment, PlacementState
from ..runtime.worker.tasks import PLUGIN_NAME

RUNS_KEPT = 5000           # block runs on the timeline
REQUESTS_KEPT = 500        # requests whose latency is kept, per model and program


@dataclass
class _Request:
    submitted: float
    blocks: set[int]
    done: set[int] = field(default_factory=set)
    last_stop: float = 0.0


class Activity:
    """Block runs and request latencies seen by the scheduler plugin (the newest ones only).

    ``submitted`` is called from ``update_graph`` with the parsed keys of block tasks,
    ``ran`` with each run report a worker sends; a request's latency is the time from
    its graph reaching the scheduler to the end of its last block. A program's first
    request is left out: its workers load its blocks then (a 32-row decode step's first
    run took 1 s where its later ones take 0.1), and a step program's first request is
    the warm-up's, which no caller waited for.
    """

    def __init__(self, runs: int = RUNS_KEPT, requests: int = REQUESTS_KEPT) -> None:
        self.runs: deque[dict[str, Any]] = deque(maxlen=runs)
        self._open: OrderedDict[tuple[str, int, int, int], _Request] = OrderedDict()
        self.latencies: dict[tuple[str, int], deque[float]] = {}
        self._keep = requests
        self._first: set[tuple[str, int]] = set()      # (model, program) whose first request was seen

    def submitted(self, parts: list[tuple[str, int, int, int]], now: float | None = None) -> None:
        now = time.time() if now is None else now
        for model, version, request, block in parts:
            program, local = split_block(block)
            key = (model, version, request, program)
            req = self._open.get(key)
            if req is None:
                req = self._open[key] = _Request(now, set())
                while len(self._open) > 4 * self._keep:
                    self._open.popitem(last=False)
            req.blocks.add(local)

    def ran(self, msg: dict[str, Any]) -> None:
        """A worker's report of one block run (``runtime.worker.tasks.run_block_task``)."""
        try:
            model, block = str(msg["model"]), int(msg["block"])
            version, request = int(msg.get("version", 0)), int(msg.get("request", -1))
            start, duration = float(msg.get("start", time.time())), float(msg.get("compute_s", 0.0))
        except (KeyError, TypeError, ValueError):
            return
        if not (math.isfinite(start) and math.isfinite(duration)):
            return
        program, local = split_block(block)
        self.runs.append({"worker": str(msg.get("worker", "")), "model": model, "version": version,
                          "request": request, "block": block, "program": program, "start": start,
                          "duration_s": duration, "how": str(msg.get("how", ""))})
        req = self._open.get((model, version, request, program))
        if req is None:
            return
        req.done.add(local)
        req.last_stop = max(req.last_stop, start + duration)
        if req.done >= req.blocks:
            del self._open[(model, version, request, program)]
            self._keep_latency(model, program, max(0.0, req.last_stop - req.submitted))

    def measured(self, msg: dict[str, Any]) -> None:
        """A request's latency measured on the data plane (``latency_s``, from its worker)."""
        try:
            model, program, seconds = str(msg["model"]), int(msg.get("program", 0)), float(msg["latency_s"])
        except (KeyError, TypeError, ValueError):
            return
        if math.isfinite(seconds) and seconds >= 0:
            self._keep_latency(model, program, seconds)

    def _keep_latency(self, model: str, program: int, seconds: float) -> None:
        """Keep a request's latency, unless it is its program's first (see the class doc)."""
        key = (model, program)
        if key not in self._first:
            self._first.add(key)
            return
        self.latencies.setdefault(key, deque(maxlen=self._keep)).append(seconds)

    def forget(self, model: str) -> None:
        for key in [k for k in self.latencies if k[0] == model]:
            del self.latencies[key]
        self._first = {k for k in self._first if k[0] != model}
        for req in [k for k in self._open if k[0] == model]:
            del self._open[req]


# --- workers ---------------------------------------------------------------------------------
def workers_data(scheduler: Any, state: PlacementState) -> list[dict[str, Any]]:
    """Per worker: budget, weights, activations, KV cache and free bytes; GPUs where present."""
    out = []
    for ws in list(scheduler.workers.values()):
        r = ws.metrics.get(PLUGIN_NAME) or {}
        budget = int(r.get("budget_bytes", 0) or 0)
        weights = int(r.get("weight_bytes", r.get("resident_bytes", 0)) or 0)
        kv = int(r.get("kv_cache_bytes", 0) or 0)
        activations = int(ws.nbytes)                 # NOTE: block outputs Dask holds on the worker
        used = [int(b) for b in r.get("gpu_memory_used_bytes", ()) or ()]
        gpus = [{"index": i, "name": str(g.get("name", "")),
                 "memory_total_bytes": int(g.get("memory_total_bytes", 0)),
                 "memory_used_bytes": used[i] if i < len(used) else int(g.get("memory_used_bytes", 0)),
                 "temperature_c": _at(r.get("gpu_temperature_c"), i, g.get("temperature_c")),
                 "utilization": _at(r.get("gpu_utilization"), i, g.get("utilization"))}
                for i, g in enumerate(r.get("gpus") or ())]
        device = state.devices.get(ws.address)
        out.append({
            "address": ws.address, "name": device.name if device is not None else str(ws.name),
            "host": ws.host, "device": r.get("device", "cpu"),
            "agent": bool(r), "drained": state.drained.get(ws.address, ""),
            "budget_bytes": budget, "weight_bytes": weights, "activation_bytes": activations,
            "kv_cache_bytes": kv, "free_bytes": max(0, budget - weights - kv - activations),
            "planned_bytes": state.held_bytes(ws.address),
            "process_memory_bytes": int(ws.memory.process), "memory_limit_bytes": int(ws.memory_limit or 0),
            "kv_sessions": dict(r.get("kv_sessions") or {}), "blocks": int(r.get("blocks", 0) or 0),
            "block_runs": int(r.get("block_runs", 0) or 0), "gpus": gpus})
    return sorted(out, key=lambda w: w["name"])


def _at(values: Any, i: int, default: Any) -> float | None:
    values = list(values or ())
    v = values[i] if i < len(values) else default
    return None if v is None else float(v)


# --- plans -----------------------------------------------------------------------------------
def plans_data(state: PlacementState, activity: Activity) -> list[dict[str, Any]]:
    """Per deployed model: its devices and blocks, bytes between devices, predicted and measured latency."""
    return [_plan_data(dep, state, activity) for dep in list(state.models.values())]


def _plan_data(dep: Deployment, state: PlacementState, activity: Activity) -> dict[str, Any]:
    plan = dep.plan
    names = plan.spec.names
    nblocks = [0] * len(names)
    for b in plan.blocks:
        nblocks[names.index(b.device)] += 1
    bb = plan.bytes_between
    scales = {d.address: state.learner.scale(d.address) for d in plan.spec.devices}
    programs = [_program_data(dep, 0, plan, scales, activity)]
    for p in sorted(dep.programs):
        pplan = dep.program_plan(p, dep.version)
        if pplan is not None:
            programs.append(_program_data(dep, p, pplan, scales, activity))
    return {
        "model": dep.model, "name": str(plan.graph.meta.get("name", "model")), "version": dep.version,
        "method": plan.method, "stranded": dep.stranded, "excluded": dict(dep.excluded),
        "devices": [{"name": d.name, "address": d.address, "kind": d.kind, "blocks": nblocks[i],
                     "ops": int((plan.device_of == i).sum()), "weight_bytes": int(plan.weight_bytes[i]),
                     "peak_bytes": int(plan.peak_bytes[i]), "memory_bytes": int(d.memory_bytes)}
                    for i, d in enumerate(plan.spec.devices)],
        "bytes_between": [[float(v) for v in row] for row in bb],
        "cut_bytes": float(plan.cut_bytes), "programs": programs}


ScalesKey = tuple[tuple[str, tuple[tuple[str, float], ...]], ...]     # learned scales, as a key
# NOTE: per plan (gone with it), the simulated latency at the last learned scales seen
_PREDICTED: weakref.WeakKeyDictionary[Plan, tuple[ScalesKey, float]] = weakref.WeakKeyDictionary()


def predicted_s(plan: Plan, scales: dict[str, dict[str, float]]) -> float:
    """Simulated latency of one request of ``plan``, with the speeds learned on its devices."""
    key: ScalesKey = tuple(sorted((a, tuple(sorted(s.items()))) for a, s in scales.items()))
    seen = _PREDICTED.get(plan)
    if seen is None or seen[0] != key:
        spec = plan.spec
        for d in spec.devices:
            if scales.get(d.address):
                spec = spec.with_changes(d.name, scale=dict(scales[d.address]))
        seen = _PREDICTED[plan] = (key, Plan(plan.graph, spec, plan.device_of, plan.method, plan.planning_s,
                                             dict(plan.info)).makespan_s)
    return seen[1]


def _program_data(dep: Deployment, program: int, plan: Plan, scales: dict[str, dict[str, float]],
                  activity: Activity) -> dict[str, Any]:
    seen = list(activity.latencies.get((dep.model, program), ()))
    step = plan.graph.meta.get("step") if program else None
    label = f"step {step['batch']}x{step['length']}" if isinstance(step, Mapping) else (
        f"program {program}" if program else "forward")
    return {"program": program, "label": label, "blocks": len(plan.blocks),
            "predicted_s": predicted_s(plan, scales), "measured_s": seen[-50:],
            "measured_median_s": statistics.median(seen) if seen else None, "requests": len(seen)}


# --- timeline and events ---------------------------------------------------------------------
_SCOPES: weakref.WeakKeyDictionary[Plan, dict[str, str]] = weakref.WeakKeyDictionary()   # op -> scope


def block_layers(dep: Deployment | None, version: int, block: int) -> str:
    """The layers a block's ops belong to, e.g. ``"3-5"`` (empty when not known)."""
    if dep is None:
        return ""
    program, local = split_block(block)
    plan = dep.program_plan(program, version) if program else dep.plan_at(version)
    if plan is None or not 0 <= local < len(plan.blocks):
        return ""
    scopes = _SCOPES.get(plan)
    if scopes is None:
        scopes = _SCOPES[plan] = {op.name: op.scope for op in plan.graph.ops}
    layers = sorted({n for n in (layer_of(scopes.get(o, "")) for o in plan.blocks[local].ops) if n >= 0})
    if not layers:
        return ""
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def timeline_data(state: PlacementState, activity: Activity, since: float = 0.0,
                  limit: int = RUNS_KEPT) -> list[dict[str, Any]]:
    """Block runs that started after ``since`` (seconds since the epoch), oldest first, with their layers."""
    runs = [r for r in list(activity.runs) if r["start"] > since][-max(1, limit):]
    return [{**r, "layers": block_layers(state.models.get(r["model"]), r["version"], r["block"])}
            for r in runs]


def events_data(events: Any) -> list[dict[str, Any]]:
    """Replans, drains and pressure reports: when, why, how long the repair took, bytes moved."""
    out = []
    for e in list(events):
        out.append({"time": float(e.get("time", 0.0)), "action": str(e.get("action", "")),
                    "model": str(e.get("model", "")), "address": str(e.get("address", "")),
                    "version": int(e.get("version", -1)),
                    "reason": str(e.get("reason", e.get("message", ""))),
                    "replan_s": float(e.get("replan_s", 0.0)),
                    "moved_bytes": float(e.get("moved_bytes", 0.0))})
    return out


def links_data(state: PlacementState) -> list[dict[str, Any]]:
    """Every link the data plane measured (``PlacementState.links_data``), with its ends' device names."""
    names = {a: d.name for a, d in state.devices.items()}
    return [{**x, "src_name": names.get(x["src"], x["src"]), "dst_name": names.get(x["dst"], x["dst"]),
             "via_name": names.get(x["via"], x["via"])} for x in state.links_data()]


def snapshot(plugin: Any, since: float = 0.0) -> dict[str, Any]:
    """Everything the page shows, at once."""
    return {"time": time.time(), "workers": workers_data(plugin.scheduler, plugin.state),
            "plans": plans_data(plugin.state, plugin.activity),
            "timeline": timeline_data(plugin.state, plugin.activity, since),
            "events": events_data(plugin.events), "links": links_data(plugin.state),
            "serving": serving_data(getattr(plugin, "serving", None), since)}


# --- serving: what a ``seabiscuit serve`` process reports -------------------------------------------
SERVING_KEPT = 300         # NOTE: samples per served model: 10 minutes at one every 2 s
SERVING_MODELS = 32        # served models kept at once (the oldest reported goes)
_FIGURES = ("running", "waiting", "tokens_per_s", "requests_per_s", "ttft_ms", "itl_ms")


class Serving:
    """Samples ``seabiscuit serve`` processes report (``record``): per served model, requests running
    and waiting, tokens and requests per second, the median time to first token and between
    tokens over the sample's window, HTTP errors by status. Samples are data from a client:
    checked, bounded, and only numbers and short names are kept."""

    def __init__(self, kept: int = SERVING_KEPT, models: int = SERVING_MODELS) -> None:
        self.samples: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self.names: dict[str, str] = {}          # model id -> the name it is served as
        self._kept, self._models = kept, models

    def record(self, sample: Mapping[str, Any]) -> None:
        name = sample.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ValueError("a serving sample names its model (a string of at most 200 characters)")
        clean: dict[str, Any] = {"time": time.time()}      # NOTE: the scheduler's clock, which the page reads
        for key in _FIGURES:
            clean[key] = _number(sample.get(key), math.nan)
        errors = sample.get("errors") or {}
        if not isinstance(errors, Mapping) or len(errors) > 20:
            raise ValueError("a serving sample's errors map at most 20 HTTP statuses to counts")
        clean["errors"] = {str(int(s)): int(n) for s, n in errors.items()
                           if str(s).isdigit() and 400 <= int(s) < 600 and isinstance(n, int) and n >= 0}
        model = sample.get("model")
        if isinstance(model, str) and len(model) <= 200:
            self.names[model] = name
        kept = self.samples.pop(name, None) or deque(maxlen=self._kept)
        kept.append(clean)
        self.samples[name] = kept
        while len(self.samples) > self._models:
            self.samples.popitem(last=False)
        if len(self.names) > self._models:        # NOTE: only the ids of models still shown are kept
            self.names = {m: n for m, n in self.names.items() if n in self.samples}


def _number(value: Any, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return default
    return float(value)


def serving_data(serving: Serving | None, since: float = 0.0) -> list[dict[str, Any]]:
    """Per served model its samples since ``since`` (lists of each figure, and its latest sample)."""
    if serving is None:
        return []
    out = []
    for name, kept in list(serving.samples.items()):
        rows = [s for s in kept if s["time"] >= since]
        if not rows:
            continue
        out.append({"name": name, "time": [s["time"] for s in rows],
                    **{k: [s[k] for s in rows] for k in _FIGURES},
                    "errors": [s["errors"] for s in rows], "latest": rows[-1]})
    return out


def record_serving(sample: dict[str, Any], dask_scheduler: Any = None) -> bool:
    """Run on the scheduler (``client.run_on_scheduler``) by a serving process: keep ``sample`` for
    the page. False where the SeaBiscuit plugin is not registered."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME) if dask_scheduler is not None else None
    serving = getattr(plugin, "serving", None)
    if serving is None:
        return False
    serving.record(sample)
    return True
