"""JSON routes on the scheduler's dashboard: ``/seabiscuit/api/{workers,plans,timeline,events,links,serving}``

Read-only views of ``dashboard.data``; ``/seabiscuit/api`` returns all of them at once.
The schema is documented in docs/dashboard.md.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tornado import web

from . import data

API = "seabiscuit/api"


class ApiHandler(web.RequestHandler):
    """One JSON view of the SeaBiscuit scheduler plugin."""

    def initialize(self, plugin: Any, view: str) -> None:
        self.plugin = plugin
        self.view = view

    def get(self) -> None:
        p = self.plugin
        try:
            since = float(self.get_argument("since", "0") or 0)
        except ValueError:
            raise web.HTTPError(400, reason="since must be seconds since the epoch, e.g. "
                                "since=1700000000.5") from None
        since = since if math.isfinite(since) else 0.0
        if self.view == "workers":
            body: Any = data.workers_data(p.scheduler, p.state)
        elif self.view in ("plans", "plan"):
            body = data.plans_data(p.state, p.activity)
        elif self.view == "timeline":
            body = data.timeline_data(p.state, p.activity, since)
        elif self.view == "events":
            body = data.events_data(p.events)
        elif self.view == "links":
            body = data.links_data(p.state)
        elif self.view == "serving":
            body = data.serving_data(getattr(p, "serving", None), since)
        else:
            body = data.snapshot(p, since)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(finite(body), allow_nan=False))


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None, so it is valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def handlers(plugin: Any, prefix: str = "/") -> list[tuple[str, type, dict[str, Any]]]:
    base = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    routes: list[tuple[str, type, dict[str, Any]]] = [
        (f"{base}{API}/{view}", ApiHandler, {"plugin": plugin, "view": view})
        for view in ("workers", "plans", "plan", "timeline", "events", "links", "serving")]
    routes.append((f"{base}{API}/?", ApiHandler, {"plugin": plugin, "view": "all"}))
    return routes
