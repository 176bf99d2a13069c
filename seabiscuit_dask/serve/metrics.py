"""``GET /metrics``: the server's figures in Prometheus' text format (``prometheus-client``).

Counters and histograms are kept as requests run; sessions and KV-cache bytes are read when
scraped: sessions from each deployment's generation engine, KV bytes from the workers' plugins.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .models import ServedModel

logger = logging.getLogger("seabiscuit.serve")

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class Serving(Protocol):
    """What the figures read when scraped need of the server (``app.Server``): its models."""

    @property
    def models(self) -> Mapping[str, ServedModel]: ...


class Metrics:
    def __init__(self, server: Serving) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("seabiscuit_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("seabiscuit_prompt_tokens", "prompt tokens read", ["model"],
                                     registry=self.registry)
        self.completion_tokens = Counter("seabiscuit_completion_tokens", "tokens generated", ["model"],
                                         registry=self.registry)
        self.ttft = Histogram("seabiscuit_time_to_first_token_seconds", "request to its first token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("seabiscuit_inter_token_latency_seconds", "between a stream's tokens", ["model"],
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_Live(server))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Live:
    """Figures read when scraped: open sessions per model, KV-cache bytes per worker."""

    def __init__(self, server: Serving) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []          # NOTE: read at scrape time only, never while registering

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = GaugeMetricFamily("seabiscuit_sessions", "generation sessions open", labels=["model"])
        running = GaugeMetricFamily("seabiscuit_requests_running", "generate calls being answered",
                                    labels=["model"])
        waiting = GaugeMetricFamily("seabiscuit_requests_waiting", "generate calls waiting to start",
                                    labels=["model"])
        steps = GaugeMetricFamily("seabiscuit_steps", "generation steps run (prefill and decode)",
                                  labels=["model"])
        hits = GaugeMetricFamily("seabiscuit_prefix_hits", "new sessions that started from a kept cache "
                                 "(prefix caching) or from another row of their request with the same "
                                 "prompt", labels=["model"])
        reused = GaugeMetricFamily("seabiscuit_prefix_tokens", "prompt tokens not prefilled again: read "
                                   "from a kept cache or another row's", labels=["model"])
        tokens = GaugeMetricFamily("seabiscuit_step_tokens", "tokens the generation steps computed, padding "
                                   "included (over seabiscuit_steps: tokens per step)", labels=["model"])
        kv = GaugeMetricFamily("seabiscuit_kv_cache_bytes", "KV-cache bytes held, per worker",
                               labels=["worker"])
        clients = {}
        for m in self.server.models.values():
            engine = getattr(m.dm, "_engine", None)
            if m.kind == "generate":
                sessions.add_metric([m.name], float(getattr(engine, "_open", 0)))
                load = getattr(engine, "load", None)
                if callable(load):
                    figures = load()
                    running.add_metric([m.name], float(figures["running"]))
                    waiting.add_metric([m.name], float(figures["waiting"]))
                    steps.add_metric([m.name], float(figures["steps"]))
                    tokens.add_metric([m.name], float(figures["step_tokens"]))
                    hits.add_metric([m.name], float(figures["prefix_hits"]))
                    reused.add_metric([m.name], float(figures["prefix_tokens"]))
            clients[id(m.dm.client)] = m.dm.client
        for client in clients.values():
            try:
                held = client.run(_kv_bytes, on_error="ignore")
            except Exception as e:  # noqa: BLE001 - a scrape never fails for a worker that does not answer
                logger.warning("KV-cache bytes not read from the workers: %s", e)
                continue
            for worker, b in sorted(held.items()):
                kv.add_metric([worker], float(b))
        yield from (sessions, running, waiting, steps, tokens, hits, reused, kv)


def _kv_bytes(dask_worker: Any) -> int:
    plugin = dask_worker.plugins.get("seabiscuit")
    return int(plugin.metrics().get("kv_cache_bytes", 0)) if plugin is not None else 0
