"""The ``/seabiscuit`` page of the scheduler's dashboard (Bokeh), refreshed every second.

Per worker: memory (weights, activations, KV cache, free) and GPUs; per model (a
selector): devices x blocks, bytes between devices, predicted vs measured latency;
the links the data plane measured (a matrix coloured by bandwidth, and their history);
a timeline of block runs per worker coloured by model and layer; replans and drains.
Every figure reads ``dashboard.data``, as the JSON routes do.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    DatetimeTicker,
    DatetimeTickFormatter,
    FactorRange,
    HoverTool,
    NumeralTickFormatter,
)
from bokeh.models.annotations import Title
from bokeh.models.widgets.inputs import Select
from bokeh.models.widgets.markups import Div
from bokeh.models.widgets.tables import DataTable, NumberFormatter, TableColumn
from bokeh.palettes import Blues9, Category10_10, Greens9, Greys9, Greys256, Oranges9, Purples9, Reds9
from bokeh.plotting import figure
from bokeh.transform import linear_cmap

from ..ir import fmt_bytes
from . import data

REFRESH_MS = 1000
TIMELINE_S = 60.0          # seconds of block runs the timeline keeps
MEMORY_PARTS = ("weight_bytes", "activation_bytes", "kv_cache_bytes", "free_bytes")
MEMORY_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d9d9d9")
TITLES = {"serving_load": "Requests running, waiting (dashed)",
          "serving_tokens": "Tokens generated per second",
          "serving_latency": "First token, between tokens (dashed): ms",
          "memory": "Worker memory: weights, activations, KV cache, free",
          "gpu": "GPU memory used per worker (temperature in the tooltip)",
          "bytes": "Bytes between devices per request",
          "latency": "Request latency: predicted vs measured (ms)",
          "links": "Links measured by the data plane: bandwidth (Mbit/s)",
          "link_history": "Measured bandwidth per link over time (Mbit/s)",
          "timeline": "Block runs per worker (colour: model and layer)"}


MODEL_PALETTES = (Blues9, Oranges9, Greens9, Purples9, Reds9, Greys9)
SERVING_S = 600.0          # seconds of serving figures the page shows


def _shown(value: float) -> float:
    """A figure as Bokeh draws it: a missing one (no token in its window) as NaN, a gap."""
    return value if isinstance(value, (int, float)) else math.nan
LINK_DECADES = 6.0         # NOTE: the links' colour scale spans 1 Mbit/s to 1 Tbit/s


def link_level(bytes_per_s: float) -> float:
    """Where a link's bandwidth falls on the colour scale: decades above 1 Mbit/s, 0 to ``LINK_DECADES``."""
    return min(max(math.log10(max(bytes_per_s * 8 / 1e6, 1e-9)), 0.0), LINK_DECADES)


def run_color(model_index: int, layers: str) -> str:
    """A hue per model, a shade per first layer of the block (six shades, dark to light, repeating)."""
    first = int(layers.split("-")[0]) if layers[:1].isdigit() else 0
    return MODEL_PALETTES[model_index % len(MODEL_PALETTES)][first % 6]


class SeaBiscuitPage:
    """The figures and tables of one browser session of the page."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.since = time.time() - TIMELINE_S
        self.model_order: list[str] = []
        self.header = Div(text="<h2>SeaBiscuit</h2>")
        self._memory_figure()
        self._gpu_figure()
        self._plan_views()
        self._links_figures()
        self._timeline_figure()
        self._events_table()
        self._serving_views()
        self.root = column(
            self.header, self.serving_head, self.serving_table,
            row(self.serving_load, self.serving_tokens, self.serving_latency, sizing_mode="stretch_width"),
            row(self.memory, self.gpu, sizing_mode="stretch_width"),
            row(self.select, self.plan_summary, sizing_mode="stretch_width"),
            row(self.devices, self.bytes, self.latency, sizing_mode="stretch_width"),
            row(self.links, self.link_history, sizing_mode="stretch_width"),
            self.timeline, Div(text="<h3>Replans and drains</h3>"), self.events, sizing_mode="stretch_width")
        self.update()

    # --- construction ------------------------------------------------------------------------
    def _memory_figure(self) -> None:
        self.memory_source = ColumnDataSource({"name": [], **{k: [] for k in MEMORY_PARTS}, "text": []})
        self.memory_y = FactorRange(factors=[])
        f = figure(title=TITLES["memory"], y_range=self.memory_y, height=260,
                   sizing_mode="stretch_width", tools="", toolbar_location=None)
        f.hbar_stack(list(MEMORY_PARTS), y="name", height=0.7, color=list(MEMORY_COLORS),
                     source=self.memory_source,
                     legend_label=["weights", "activations", "KV cache", "free"])
        f.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        f.legend.orientation = "horizontal"
        f.add_layout(f.legend[0], "below")
        f.add_tools(HoverTool(tooltips=[("worker", "@name"), ("", "@text")]))
        self.memory = f

    def _gpu_figure(self) -> None:
        self.gpu_source = ColumnDataSource({k: [] for k in ("gpu", "used", "total", "temperature", "text")})
        self.gpu_y, self.gpu_title = FactorRange(factors=["none"]), Title(text=TITLES["gpu"])
        f = figure(title=self.gpu_title, y_range=self.gpu_y, height=260,
                   sizing_mode="stretch_width", tools="", toolbar_location=None)
        f.hbar(y="gpu", right="total", height=0.7, color="#e5e5e5", source=self.gpu_source)
        f.hbar(y="gpu", right="used", height=0.7, source=self.gpu_source,
               color=linear_cmap("temperature", "Turbo256", 30, 90))
        f.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        f.add_tools(HoverTool(tooltips=[("GPU", "@gpu"), ("", "@text")]))
        self.gpu = f

    def _plan_views(self) -> None:
        self.select = Select(title="model", options=[], width=320)
        self.select.on_change("value", lambda attr, old, new: self.update())
        self.plan_summary = Div(text="no model deployed")
        self.devices_source = ColumnDataSource({k: [] for k in (
            "name", "address", "kind", "blocks", "ops", "weights", "peak", "budget")})
        cols = [TableColumn(field="name", title="device"), TableColumn(field="address", title="address"),
                TableColumn(field="kind", title="kind"),
                TableColumn(field="blocks", title="blocks", formatter=NumberFormatter(format="0")),
                TableColumn(field="ops", title="micro-ops", formatter=NumberFormatter(format="0")),
                TableColumn(field="weights", title="weights"), TableColumn(field="peak", title="peak"),
                TableColumn(field="budget", title="budget")]
        self.devices = DataTable(source=self.devices_source, columns=cols, height=240, width=560,
                                 index_position=None)
        self.bytes_source = ColumnDataSource({"src": [], "dst": [], "nbytes": [], "text": []})
        self.bytes_x, self.bytes_y = FactorRange(factors=[]), FactorRange(factors=[])
        f = figure(title=TITLES["bytes"], x_range=self.bytes_x, y_range=self.bytes_y,
                   height=280, width=340, tools="", toolbar_location=None, x_axis_label="from",
                   y_axis_label="to")
        f.rect(x="src", y="dst", width=0.95, height=0.95, source=self.bytes_source,
               color=linear_cmap("nbytes", Greys256[::-1], 0, 1))
        f.add_tools(HoverTool(tooltips=[("from", "@src"), ("to", "@dst"), ("bytes", "@text")]))
        self.bytes = f
        self.latency_source = ColumnDataSource({"program": [], "kind": [], "ms": [], "text": []})
        self.latency_x = FactorRange(factors=[])
        f = figure(title=TITLES["latency"], x_range=self.latency_x, height=280,
                   sizing_mode="stretch_width", tools="", toolbar_location=None)
        f.vbar(x="program", top="ms", width=0.8, source=self.latency_source,
               color=linear_cmap("kind", ["#9ecae1", "#08519c"], 0, 1))
        f.xaxis.major_label_orientation = 1.0         # NOTE: "predicted" / "measured" under each program
        f.add_tools(HoverTool(tooltips=[("", "@program"), ("ms", "@ms{0.0}"), ("", "@text")]))
        self.latency = f

    def _links_figures(self) -> None:
        self.links_source = ColumnDataSource({k: [] for k in ("src", "dst", "level", "text")})
        self.links_x, self.links_y = FactorRange(factors=[]), FactorRange(factors=[])
        f = figure(title=TITLES["links"], x_range=self.links_x, y_range=self.links_y, height=280, width=340,
                   tools="", toolbar_location=None, x_axis_label="from", y_axis_label="to")
        f.rect(x="src", y="dst", width=0.95, height=0.95, source=self.links_source,
               color=linear_cmap("level", "Viridis256", 0, LINK_DECADES))
        f.add_tools(HoverTool(tooltips=[("from", "@src"), ("to", "@dst"), ("", "@text")]))
        self.links = f
        self.history_source = ColumnDataSource({k: [] for k in ("xs", "ys", "link", "color")})
        f = figure(title=TITLES["link_history"], x_axis_type="datetime", y_axis_type="log", height=280,
                   sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset")
        f.multi_line(xs="xs", ys="ys", line_color="color", line_width=2, source=self.history_source)
        f.add_tools(HoverTool(tooltips=[("link", "@link")]))
        self.link_history = f

    def _serving_views(self) -> None:
        """What ``seabiscuit serve`` processes report: a table of each served model now, and its
        requests, tokens per second and latencies over the last ``SERVING_S`` seconds."""
        self.serving_head = Div(text="<h3>Serving</h3><p>No <code>seabiscuit serve</code> process reports "
                                     "to this scheduler.</p>")
        columns = [("name", "model", None), ("running", "running", "0"), ("waiting", "waiting", "0"),
                   ("tokens_per_s", "tokens/s", "0.0"), ("requests_per_s", "requests/s", "0.00"),
                   ("ttft_ms", "first token p50 (ms)", "0"), ("itl_ms", "between tokens p50 (ms)", "0"),
                   ("errors", "HTTP errors (last 2 s)", None)]
        self.serving_source = ColumnDataSource({k: [] for k, _, _ in columns})
        self.serving_table = DataTable(source=self.serving_source, height=90, sizing_mode="stretch_width",
                                       index_position=None, columns=[
            TableColumn(field=k, title=t, formatter=NumberFormatter(format=f)) if f else
            TableColumn(field=k, title=t) for k, t, f in columns])
        self.serving_lines: dict[str, ColumnDataSource] = {}
        figures = []
        for key, title, y in (("load", TITLES["serving_load"], "requests"),
                              ("tokens", TITLES["serving_tokens"], "tokens/s"),
                              ("latency", TITLES["serving_latency"], "ms")):
            source = self.serving_lines[key] = ColumnDataSource({k: [] for k in ("xs", "ys", "label", "color",
                                                                                  "dash")})
            f = figure(title=title, x_axis_type="datetime", height=250, sizing_mode="stretch_width",
                       tools="", toolbar_location=None, y_axis_label=y)
            f.multi_line(xs="xs", ys="ys", line_color="color", line_dash="dash", line_width=2, source=source,
                         legend_field="label")
            f.legend.location = "top_left"
            f.legend.label_text_font_size = "11px"
            f.xaxis.formatter = DatetimeTickFormatter(milliseconds="%H:%M:%S", seconds="%H:%M:%S",
                                                      minsec="%H:%M:%S", minutes="%H:%M", hourmin="%H:%M",
                                                      context=None)
            f.xaxis.ticker = DatetimeTicker(desired_num_ticks=4)    # NOTE: clock times, none overlapping
            f.add_tools(HoverTool(tooltips=[("", "@label")]))
            figures.append(f)
        self.serving_load, self.serving_tokens, self.serving_latency = figures

    def _update_serving(self, served: list[dict[str, Any]]) -> None:
        if served:
            self.serving_head.text = "<h3>Serving</h3>"
        latest = [m["latest"] for m in served]
        self.serving_source.data = {
            "name": [m["name"] for m in served],
            **{k: [_shown(x[k]) for x in latest] for k in ("running", "waiting", "tokens_per_s",
                                                             "requests_per_s", "ttft_ms", "itl_ms")},
            "errors": [", ".join(f"{s}: {n}" for s, n in sorted(x["errors"].items())) or "none"
                       for x in latest]}
        lines: dict[str, list[tuple[str, str, str, list[float], list[float]]]] = {
            "load": [], "tokens": [], "latency": []}
        for i, m in enumerate(served):
            color = Category10_10[i % 10]
            xs = [t * 1e3 for t in m["time"]]
            lines["load"] += [(f"{m['name']} running", color, "solid", xs, m["running"]),
                              (f"{m['name']} waiting", color, "dashed", xs, m["waiting"])]
            lines["tokens"].append((m["name"], color, "solid", xs, m["tokens_per_s"]))
            lines["latency"] += [(f"{m['name']} first token", color, "solid", xs, m["ttft_ms"]),
                                 (f"{m['name']} between tokens", color, "dashed", xs, m["itl_ms"])]
        for key, parts in lines.items():
            self.serving_lines[key].data = {
                "label": [p[0] for p in parts], "color": [p[1] for p in parts], "dash": [p[2] for p in parts],
                "xs": [p[3] for p in parts], "ys": [[_shown(v) for v in p[4]] for p in parts]}

    def _timeline_figure(self) -> None:
        self.timeline_source = ColumnDataSource({k: [] for k in (
            "x", "width", "worker", "color", "model", "layers", "block", "request", "ms", "how")})
        self.timeline_y = FactorRange(factors=[])
        f = figure(title=TITLES["timeline"], x_axis_type="datetime", y_range=self.timeline_y,
                   height=240, sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset")
        f.rect(x="x", y="worker", width="width", height=0.8, color="color", source=self.timeline_source)
        f.add_tools(HoverTool(tooltips=[("model", "@model"), ("block", "@block"), ("layers", "@layers"),
                                        ("request", "@request"), ("ms", "@ms{0.00}"), ("", "@how")]))
        self.timeline = f

    def _events_table(self) -> None:
        self.events_source = ColumnDataSource({k: [] for k in (
            "when", "model", "action", "reason", "replan_ms", "moved")})
        cols = [TableColumn(field="when", title="when"), TableColumn(field="model", title="model"),
                TableColumn(field="action", title="what"),
                TableColumn(field="reason", title="why", width=480),
                TableColumn(field="replan_ms", title="replan ms", formatter=NumberFormatter(format="0.00")),
                TableColumn(field="moved", title="bytes moved")]
        self.events = DataTable(source=self.events_source, columns=cols, height=200,
                                sizing_mode="stretch_width", index_position=None)

    # --- refresh -----------------------------------------------------------------------------
    def update(self) -> None:
        p = self.plugin
        self._update_workers(data.workers_data(p.scheduler, p.state))
        plans = data.plans_data(p.state, p.activity)
        self._update_plan(plans)
        self._update_links(data.links_data(p.state))
        self._update_timeline(data.timeline_data(p.state, p.activity, self.since))
        self._update_events(data.events_data(p.events))
        self._update_serving(data.serving_data(getattr(p, "serving", None), time.time() - SERVING_S))

    def _update_workers(self, workers: list[dict[str, Any]]) -> None:
        names = [w["name"] for w in workers]
        self.memory_y.factors = names
        self.memory_source.data = {
            "name": names, **{k: [w[k] for w in workers] for k in MEMORY_PARTS},
            "text": [" ".join(f"{k.split('_')[0]} {fmt_bytes(w[k])}" for k in MEMORY_PARTS)
                     + f" of {fmt_bytes(w['budget_bytes'])}"
                     + (f" (drained: {w['drained']})" if w["drained"] else "") for w in workers]}
        gpus = [(w, g) for w in workers for g in w["gpus"]]
        labels = [f"{w['name']}:{g['index']}" for w, g in gpus]
        self.gpu_y.factors = labels or ["none"]
        self.gpu_title.text = TITLES["gpu"] if labels else TITLES["gpu"] + ": no worker reports a GPU"
        self.gpu_source.data = {
            "gpu": labels, "used": [g["memory_used_bytes"] for _, g in gpus],
            "total": [g["memory_total_bytes"] for _, g in gpus],
            "temperature": [g["temperature_c"] if g["temperature_c"] is not None else 0.0 for _, g in gpus],
            "text": [f"{g['name']} {fmt_bytes(g['memory_used_bytes'])} of "
                     f"{fmt_bytes(g['memory_total_bytes'])}, {g['temperature_c'] or 0:.0f} °C"
                     for _, g in gpus]}

    def _update_plan(self, plans: list[dict[str, Any]]) -> None:
        self.model_order = [pl["model"] for pl in plans]
        served = getattr(getattr(self.plugin, "serving", None), "names", {})   # NOTE: named as served
        labels = [f"{served[pl['model']]}: " if pl["model"] in served else "" for pl in plans]
        self.select.options = [(pl["model"], f"{lab}{pl['name']} ({pl['model']})")  # type: ignore[assignment]
                               for lab, pl in zip(labels, plans)]
        if plans and self.select.value not in self.model_order:
            self.select.value = plans[-1]["model"]
        pl = next((x for x in plans if x["model"] == self.select.value), None)
        if pl is None:
            self.plan_summary.text = "no model deployed"
            for s in (self.devices_source, self.bytes_source, self.latency_source):
                s.data = {k: [] for k in s.data}
            return
        self.plan_summary.text = (
            f"<b>{pl['name']}</b> plan v{pl['version']} by {pl['method']}: {len(pl['devices'])} devices, "
            f"{sum(d['blocks'] for d in pl['devices'])} blocks, {fmt_bytes(pl['cut_bytes'])} between devices "
            f"per request" + (f"; <b>stranded</b>: {pl['stranded']}" if pl["stranded"] else ""))
        devs = pl["devices"]
        self.devices_source.data = {
            "name": [d["name"] for d in devs], "address": [d["address"] for d in devs],
            "kind": [d["kind"] for d in devs], "blocks": [d["blocks"] for d in devs],
            "ops": [d["ops"] for d in devs], "weights": [fmt_bytes(d["weight_bytes"]) for d in devs],
            "peak": [fmt_bytes(d["peak_bytes"]) for d in devs],
            "budget": [fmt_bytes(d["memory_bytes"]) for d in devs]}
        names = [d["name"] for d in devs]
        bb = pl["bytes_between"]
        top = max((v for r in bb for v in r), default=0.0) or 1.0
        cells = [(names[i], names[j], bb[i][j]) for i in range(len(names)) for j in range(len(names))]
        self.bytes_x.factors = names
        self.bytes_y.factors = names
        self.bytes_source.data = {"src": [c[0] for c in cells], "dst": [c[1] for c in cells],
                                  "nbytes": [c[2] / top for c in cells],
                                  "text": [fmt_bytes(c[2]) for c in cells]}
        bars: list[tuple[tuple[str, str], int, float, str]] = []
        for prog in pl["programs"]:
            bars.append(((prog["label"], "predicted"), 0, prog["predicted_s"] * 1e3,
                         f"{prog['blocks']} blocks"))
            med = prog["measured_median_s"]
            bars.append(((prog["label"], "measured"), 1, (med or 0.0) * 1e3,
                         f"median of {prog['requests']} requests (not the first)" if med is not None
                         else "no request yet but the first (it loads the blocks)"))
        self.latency_x.factors = [b[0] for b in bars]
        self.latency_source.data = {"program": [b[0] for b in bars], "kind": [b[1] for b in bars],
                                    "ms": [b[2] for b in bars], "text": [b[3] for b in bars]}

    def _update_links(self, links: list[dict[str, Any]]) -> None:
        names = sorted({x["src_name"] for x in links} | {x["dst_name"] for x in links})
        self.links_x.factors = names
        self.links_y.factors = names
        self.links_source.data = {
            "src": [x["src_name"] for x in links], "dst": [x["dst_name"] for x in links],
            "level": [link_level(x["bandwidth_bytes_per_s"]) for x in links],
            "text": [f"{x['bandwidth_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s, {x['latency_s'] * 1e3:.2f} ms; "
                     f"{x['transfers']} transfers, {fmt_bytes(x['bytes'])}"
                     + (f"; relayed via {x['via_name']}" if x["via"] else "") for x in links]}
        now = time.time()         # NOTE: each link's last estimate holds until now
        history = [[*x["history"], [max(now, x["history"][-1][0]), *x["history"][-1][1:]]] if x["history"]
                   else [] for x in links]
        self.history_source.data = {
            "xs": [[t * 1e3 for t, _, _ in h] for h in history],
            "ys": [[bw * 8 / 1e6 for _, bw, _ in h] for h in history],
            "link": [f"{x['src_name']} -> {x['dst_name']}" for x in links],
            "color": [Category10_10[i % 10] for i in range(len(links))]}

    def _update_timeline(self, runs: list[dict[str, Any]]) -> None:
        if runs:
            self.since = max(r["start"] for r in runs)
            order = {m: i for i, m in enumerate(self.model_order)}
            new: dict[str, Any] = {"x": [(r["start"] + r["duration_s"] / 2) * 1e3 for r in runs],
                   "width": [max(r["duration_s"], 1e-4) * 1e3 for r in runs],
                   "worker": [self._worker_name(r["worker"]) for r in runs],
                   "color": [run_color(order.get(r["model"], len(order)), r["layers"]) for r in runs],
                   "model": [r["model"] for r in runs], "layers": [r["layers"] for r in runs],
                   "block": [r["block"] for r in runs], "request": [r["request"] for r in runs],
                   "ms": [r["duration_s"] * 1e3 for r in runs], "how": [r["how"] for r in runs]}
            self.timeline_source.stream(new, rollover=data.RUNS_KEPT)
        workers = {str(w) for w in self.timeline_source.data["worker"]}
        workers |= {str(w) for w in self.memory_y.factors}
        self.timeline_y.factors = sorted(workers)

    def _worker_name(self, address: str) -> str:
        device = self.plugin.state.devices.get(address)
        if device is not None:
            return str(device.name)
        ws = self.plugin.scheduler.workers.get(address)
        return str(ws.name) if ws is not None else address

    def _update_events(self, events: list[dict[str, Any]]) -> None:
        events = events[::-1]
        self.events_source.data = {
            "when": [datetime.fromtimestamp(e["time"]).strftime("%H:%M:%S.%f")[:-3] for e in events],
            "model": [e["model"] for e in events],
            "action": [e["action"] + (f" v{e['version']}" if e["version"] >= 0 else "") for e in events],
            "reason": [e["reason"] or e["address"] for e in events],
            "replan_ms": [e["replan_s"] * 1e3 for e in events],
            "moved": [fmt_bytes(e["moved_bytes"]) for e in events]}


# NOTE: the single figures dask-labextension lists as panes (``/individual-seabiscuit-<name>``)
PANES = {"memory": "memory", "gpu": "gpu", "bytes": "bytes", "latency": "latency", "timeline": "timeline",
         "replans": "events", "links": "links", "link-history": "link_history", "serving": "serving_tokens",
         "serving-load": "serving_load", "serving-latency": "serving_latency"}


def seabiscuit_doc(scheduler: Any, extra: dict[str, Any], doc: Any, pane: str = "") -> None:
    """The Bokeh document of one visit to ``/seabiscuit`` (distributed's application signature),
    or of one of its figures (``pane``, a key of ``PANES``)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    from ..runtime.worker.tasks import PLUGIN_NAME

    plugin = scheduler.plugins.get(PLUGIN_NAME)
    doc.title = "Dask: SeaBiscuit"
    if plugin is None:
        doc.add_root(Div(text="<h2>SeaBiscuit</h2><p>The SeaBiscuit scheduler plugin is not registered on "
                              "this scheduler: <code>client.register_plugin(sb.SeaBiscuitSchedulerPlugin())"
                              "</code>, or start it with <code>--preload seabiscuit_dask.plugins.preload"
                              "</code>.</p>"))
    else:
        page = SeaBiscuitPage(plugin)
        doc.add_root(getattr(page, PANES[pane]) if pane else page.root)
        doc.add_periodic_callback(page.update, REFRESH_MS)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def applications() -> dict[str, Any]:
    """The page and its panes, as entries of distributed's dashboard applications."""
    from functools import partial

    return {"/seabiscuit": seabiscuit_doc,
            **{f"/individual-seabiscuit-{name}": partial(_pane_doc, name) for name in PANES}}


def _pane_doc(pane: str, scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    seabiscuit_doc(scheduler, extra, doc, pane)
