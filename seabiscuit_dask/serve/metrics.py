"""``GET /metrics``: the server's figures in Prometheus' text format (``prometheus-client``),
named as vLLM names its own under a ``seabiscuit:`` prefix (``seabiscuit:num_requests_running``
where vLLM has ``vllm:num_requests_running``), each per model with a ``model_name`` label, so a
dashboard made for vLLM reads them with the prefix changed.

Counters and histograms are kept as requests run; requests running and waiting, sessions, KV
usage and the engines' step counts are read when scraped: from each deployment's generation
engine, and KV-cache bytes from the workers' plugins, per worker by its short name.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .models import ServedModel

logger = logging.getLogger("seabiscuit.serve")

PREFIX = "seabiscuit:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)        # NOTE: vLLM's, for whole requests and their queueing
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
MODEL = ["model_name"]
WINDOW_SAMPLES = 4096    # NOTE: latencies a report's window keeps per model


class Serving(Protocol):
    """What the figures read when scraped need of the server (``app.Server``): its models."""

    @property
    def models(self) -> Mapping[str, ServedModel]: ...


class Metrics:
    """The counters and histograms requests feed; the rest is read when scraped (``_Live``)."""

    def __init__(self, server: Serving) -> None:
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens read", MODEL, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", MODEL, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request to its first token", MODEL,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "between a request's tokens", MODEL,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request to its last token", MODEL,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "request to its start: waiting for room "
                               "and for the scheduler to admit it", MODEL, buckets=REQUEST_BUCKETS,
                               registry=r)
        self.request_prompt = Histogram(p + "request_prompt_tokens", "prompt tokens of a request", MODEL,
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation = Histogram(p + "request_generation_tokens", "tokens a request generated",
                                            MODEL, buckets=TOKEN_BUCKETS, registry=r)
        self.success = Counter(p + "request_success", "requests finished, by why they ended (stop, length, "
                               "abort: the caller went away, error)", [*MODEL, "finished_reason"], registry=r)
        r.register(_Live(server))

        self._lock = threading.Lock()
        self._windows: dict[str, Window] = {}
        self._statuses: dict[str, int] = {}

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # --- what the dashboard's serving view reads (``Server.report``) ---------------------------
    def window(self, model: str) -> Window:
        """What ``model``'s requests did since the last report (taken by ``take``)."""
        with self._lock:
            return self._windows.setdefault(model, Window())

    def status(self, code: int) -> None:
        if code >= 400:
            with self._lock:
                self._statuses[str(code)] = self._statuses.get(str(code), 0) + 1

    def take(self) -> tuple[dict[str, Window], dict[str, int]]:
        """Each model's window and the HTTP errors since the last call; both start anew."""
        with self._lock:
            windows, statuses = self._windows, self._statuses
            self._windows, self._statuses = {}, {}
        return windows, statuses


class Window:
    """A model's requests over one report's window: tokens generated, requests ended, the times to
    first token and between tokens seen (bounded: the newest ``WINDOW_SAMPLES`` of each)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.requests = 0
        self.ttft: deque[float] = deque(maxlen=WINDOW_SAMPLES)
        self.itl: deque[float] = deque(maxlen=WINDOW_SAMPLES)


class _Live:
    """Figures read when scraped: requests, sessions and KV usage per model, steps and prefix
    caching per model, KV-cache bytes per worker."""

    def __init__(self, server: Serving) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []          # NOTE: read at scrape time only, never while registering

    def collect(self) -> Iterator[Metric]:
        p = PREFIX
        gauges = {
            "num_requests_running": "requests being answered (their prompts prefilled or decoding)",
            "num_requests_waiting": "requests waiting to start (for room, or for the scheduler)",
            "num_sessions": "generation sessions open",
            "kv_cache_usage_perc": "KV-cache room in use, 0 to 1: tokens counted for the sessions open over "
                                   "the deployment's room (sessions over its sessions where it counts those)",
        }
        counters = {
            "steps": "generation steps run (prefill and decode)",
            "step_tokens": "tokens the generation steps computed, padding included",
            "prefix_cache_queries": "new sessions that looked for a kept cache",
            "prefix_cache_hits": "new sessions that started from a kept cache (prefix caching) or from "
                                 "another row of their request with the same prompt",
            "prefix_cache_tokens": "prompt tokens not prefilled again: read from a kept cache or another "
                                   "row's",
            "num_preemptions": "requests preempted where the KV room ran out mid-answer: their caches freed, "
                               "recomputed from their prompts and tokens so far once room freed",
        }
        g = {k: GaugeMetricFamily(p + k, doc, labels=MODEL) for k, doc in gauges.items()}
        c = {k: CounterMetricFamily(p + k, doc, labels=MODEL) for k, doc in counters.items()}
        kv = GaugeMetricFamily(p + "kv_cache_bytes", "KV-cache bytes held, per worker (by its name)",
                               labels=["worker"])
        clients = {}
        for m in self.server.models.values():
            engine = getattr(m.dm, "_engine", None)
            if m.kind == "generate":
                g["num_sessions"].add_metric([m.name], float(getattr(engine, "_open", 0)))
                load = getattr(engine, "load", None)
                if callable(load):
                    f = load()
                    g["num_requests_running"].add_metric([m.name], float(f["running"]))
                    g["num_requests_waiting"].add_metric([m.name], float(f["waiting"]))
                    g["kv_cache_usage_perc"].add_metric([m.name], float(f.get("kv_usage", 0.0)))
                    c["steps"].add_metric([m.name], float(f["steps"]))
                    c["step_tokens"].add_metric([m.name], float(f["step_tokens"]))
                    c["prefix_cache_queries"].add_metric([m.name], float(f.get("prefix_queries", 0)))
                    c["prefix_cache_hits"].add_metric([m.name], float(f["prefix_hits"]))
                    c["prefix_cache_tokens"].add_metric([m.name], float(f["prefix_tokens"]))
                    c["num_preemptions"].add_metric([m.name], float(f.get("preemptions", 0)))
            clients[id(m.dm.client)] = m.dm.client
        for client in clients.values():
            try:
                held = client.run(_kv_bytes, on_error="ignore")
                names = {a: str(w.get("name", a)) for a, w in client.scheduler_info(n_workers=-1)
                         .get("workers", {}).items()}
            except Exception as e:  # noqa: BLE001 - a scrape never fails for a worker that does not answer
                logger.warning("KV-cache bytes not read from the workers: %s", e)
                continue
            for worker, b in sorted(held.items()):
                kv.add_metric([names.get(worker, worker)], float(b))
        yield from (*g.values(), *c.values(), kv)


def _kv_bytes(dask_worker: Any) -> int:
    plugin = dask_worker.plugins.get("seabiscuit")
    return int(plugin.metrics().get("kv_cache_bytes", 0)) if plugin is not None else 0
