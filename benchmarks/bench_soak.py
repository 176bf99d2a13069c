"""A soak: mixed calls for minutes under drains, restores and a SIGKILL; does the client stay flat?

A seeded 2-layer Llama (as ``bench_churn``: hidden 64, vocab 512, 900 kB of budget a worker,
room for 16 sessions of 96 tokens) on a LocalCluster of 3 worker processes x 1 thread. Eight
threads send a seeded mix of forward passes (``dm(x)``, at the traced shape and at another),
``dm.generate`` and ``dm.stream`` calls, each answer checked against the model in this process
(Hugging Face ``generate``, the module itself). Meanwhile a fault thread drains and restores
the plan's workers in turn (``--pairs`` pairs, 3 a minute by default, spread over the run) and
SIGKILLs the worker holding the KV caches at about the middle (its nanny starts it again).

Before the start readings the load runs ``--warmup`` seconds with one drain/restore pair,
so what grows once (step programs built, connections opened, caches) is not counted.

    python benchmarks/bench_soak.py [--minutes 5] [--quick] [--scheduler-apart] [--diagnose]

Rows: calls by kind; wrong answers; errors by type; hangs (calls over ``HANG_S``, or still
running when the soak ends); the client process's RSS, open descriptors, sockets and threads
at start and end with the slope per minute (least squares over a reading every ``SAMPLE_S``);
the scheduler's RSS and the length of the dashboard's list of block runs; the reading nearest
each minute;
each worker's RSS at start and end (by worker name: the killed one is a new process).

A LocalCluster runs its scheduler in this process: the client's figures then count the
scheduler's too. ``--scheduler-apart`` starts the scheduler and the workers as an
operator does (``dask scheduler``/``dask worker --preload``), so the client's figures are the
client's alone.
``--diagnose``: also what this process holds more at the end than at the start (tracemalloc,
which slows the calls and takes memory of its own, by line and by stack; gc objects by type;
descriptors by kind and peer).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import seabiscuit_dask as sb
from tests.clusters import seabiscuit_cluster, stop, wait_for
from tests.test_generate import decoder, padded_batch
from tests.test_serving_guarantees import BUDGET, FAST_HANG, X, hf, kv_worker

THREADS = 8
WORKERS = 3
HANG_S = 60.0           # NOTE: a call that takes longer than this is a hang
SAMPLE_S = 10.0         # NOTE: how often the client's figures are read for the slope
NEW_TOKENS = 16
KINDS = ("forward", "generate", "stream")      # NOTE: the calls sent, in these proportions
WEIGHTS = (4, 4, 2)


# --- the answers ----------------------------------------------------------------------------------
def references(model: torch.nn.Module) -> dict[str, list[tuple[Any, Any]]]:
    """Per call kind, (input, expected answer) pairs computed in this process."""
    prompts = [padded_batch((k,), seed=k)[0] for k in range(3, 11)]
    want = [hf(model, p, NEW_TOKENS) for p in prompts]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(3, 500, (1, n), generator=g) for n in (16, 16, 8)]    # NOTE: (1, 8): another shape
    with torch.no_grad():
        forward = [(x, model(x).logits) for x in xs]
    return {"forward": forward, "generate": list(zip(prompts, want)),
            "stream": [(p, w[0, p.shape[1]:]) for p, w in zip(prompts, want)]}


def answer(dm: Any, kind: str, x: Any, want: Any) -> bool:
    """Send one call of ``kind``; whether its answer is the expected one."""
    if kind == "forward":
        return torch.allclose(dm(x).logits, want, rtol=1e-4, atol=1e-5)
    if kind == "generate":
        return torch.equal(dm.generate(x, NEW_TOKENS, pad_token_id=0, eos_token_id=[]), want)
    rows = list(dm.stream(x, NEW_TOKENS, pad_token_id=0, eos_token_id=[]))
    return torch.equal(torch.stack(rows, dim=1)[0], want)


class Load:
    """``THREADS`` callers sending the mix until stopped, counting what they get."""

    def __init__(self, dm: Any, refs: dict[str, list[tuple[Any, Any]]]) -> None:
        self.dm, self.refs = dm, refs
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.slow = 0
        self.longest_s = 0.0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._body, args=(i,), daemon=True) for i in range(THREADS)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.slow, self.longest_s = 0, 0.0

    def _body(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            kind = rng.choices(KINDS, WEIGHTS)[0]
            x, want = rng.choice(self.refs[kind])
            t0 = time.monotonic()
            try:
                what = "right" if answer(self.dm, kind, x, want) else "WRONG"
            except Exception as e:  # noqa: BLE001 - counted by type
                restless = isinstance(e, sb.StaleRun) and "replans faster" in str(e)
                what = "restless StaleRun" if restless else type(e).__name__
            took = time.monotonic() - t0
            with self._lock:
                self.counts[(kind, what)] += 1
                self.slow += took > HANG_S
                self.longest_s = max(self.longest_s, took)

    def finish(self) -> int:
        """Stop the callers; the calls still running ``HANG_S`` after the stop (hung)."""
        self.stop.set()
        deadline = time.monotonic() + HANG_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)


# --- the faults -------------------------------------------------------------------------------------
def drain_restore(dm: Any, k: int) -> bool:
    """Drain and restore the ``k``-th worker of the plan (in turn); whether both were done."""
    workers = [d.address for d in dm.plan.spec.devices]
    w = workers[k % len(workers)]
    try:
        dm.drain(w)
        dm.restore(w)
        return True
    except sb.SeaBiscuitError as e:
        print(f"  drain/restore of {w} refused: {e}", flush=True)
        return False


def kill_kv_worker(client: Any, dm: Any) -> str:
    """SIGKILL the worker holding the KV caches; wait for its nanny to bring a new one."""
    victim = kv_worker(dm)
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    wait_for(lambda: victim not in placed(client), "the killed worker gone", HANG_S)
    wait_for(lambda: len(placed(client)) == WORKERS, "the killed worker back", HANG_S)
    return victim


def placed(client: Any) -> list[str]:
    """The workers the scheduler plugin places on."""
    return client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins["seabiscuit"]
                                                               .state.devices))


def faults(client: Any, dm: Any, seconds: float, pairs: int, stop: threading.Event,
           log: dict[str, Any]) -> None:
    """``pairs`` drain/restore pairs spread over ``seconds``, a SIGKILL after half of them."""
    gap_s = seconds / (pairs + 2)
    for k in range(pairs):
        if stop.wait(gap_s):
            return
        log["pairs"] += drain_restore(dm, k)
        if k == (pairs - 1) // 2:
            try:
                log["killed"] = kill_kv_worker(client, dm)
            except Exception as e:  # noqa: BLE001 - reported
                log["kill_error"] = f"{type(e).__name__}: {e}"


# --- the readings -------------------------------------------------------------------------------------
def client_reading() -> dict[str, float]:
    gc.collect()
    p = psutil.Process()
    return {"t": time.monotonic(), "rss": p.memory_info().rss, "fds": p.num_fds(),
            "sockets": len(p.net_connections(kind="all")), "threads": threading.active_count()}


def worker_rss(client: Any) -> dict[str, int]:
    def rss(dask_worker: Any = None) -> tuple[str, int]:
        return str(dask_worker.name), psutil.Process().memory_info().rss

    return dict(client.run(rss).values())


def scheduler_reading(client: Any) -> dict[str, int]:
    """The scheduler's RSS and the length of its plugin's list of block runs (the dashboard's)."""
    def read(dask_scheduler: Any = None) -> dict[str, int]:
        plugin = dask_scheduler.plugins["seabiscuit"]
        return {"rss": psutil.Process().memory_info().rss, "dashboard runs": len(plugin.activity.runs)}

    return client.run_on_scheduler(read)


def slope_per_min(samples: list[dict[str, float]], key: str) -> float:
    """Least-squares growth of ``key`` per minute over ``samples``."""
    ts = [s["t"] / 60 for s in samples]
    vs = [s[key] for s in samples]
    if len(ts) < 2:
        return 0.0
    mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den if den else 0.0


def reading(client: Any) -> dict[str, float]:
    """The client's figures and the scheduler's (``scheduler rss``, ``dashboard runs``), now."""
    return {**client_reading(), **{f"scheduler {k}" if k == "rss" else k: v
                                   for k, v in scheduler_reading(client).items()}}


def sample(client: Any, samples: list[dict[str, float]], stop: threading.Event) -> None:
    while not stop.wait(SAMPLE_S):
        samples.append(reading(client))


# --- diagnosis -------------------------------------------------------------------------------------
def objects_by_type() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def descriptors(client: Any) -> collections.Counter[str]:
    """This process's open descriptors by kind; sockets by what is at either end."""
    names = client.run_on_scheduler(lambda dask_scheduler: {a: str(w.name)
                                                            for a, w in dask_scheduler.workers.items()})
    workers = {int(a.rsplit(":", 1)[1]): f"worker {name}" for a, name in names.items()}
    scheduler = int(client.scheduler.address.rsplit(":", 1)[1])
    out: collections.Counter[str] = collections.Counter()
    for c in psutil.Process().net_connections(kind="inet"):
        there = c.raddr.port if c.raddr else None
        what = ("into the scheduler" if c.laddr.port == scheduler else "to the scheduler"
                if there == scheduler else f"to {workers[there]}" if there in workers else f"to port {there}")
        out[f"socket {c.status} {what}"] += 1
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            out[target.split("[")[0].split(":")[0]] += 1
    return out


def print_growth(title: str, before: collections.Counter, after: collections.Counter, top: int = 15) -> None:
    grown = sorted(((after[k] - before[k], k) for k in after if after[k] > before[k]), reverse=True)[:top]
    print(f"\n{title}: " + (", ".join(f"{k} +{n}" for n, k in grown) if grown else "none"))


def print_changes(title: str, before: collections.Counter, after: collections.Counter) -> None:
    print(f"\n{title} (start -> end):")
    for k in sorted(set(before) | set(after)):
        print(f"  {before[k]:4d} -> {after[k]:4d}  {k}")


def print_traced(start: Any, end: Any, top: int = 15, stacks: int = 6) -> None:
    print("\nheld more at the end than at the start (tracemalloc, by line):")
    for st in end.compare_to(start, "lineno")[:top]:
        print(f"  {st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d} blocks  {st.traceback}")
    print("\nthe largest by call stack (innermost last):")
    for st in end.compare_to(start, "traceback")[:stacks]:
        print(f"  {st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d} blocks")
        for line in st.traceback.format()[-12:]:
            print(f"      {line}")


# --- the cluster -------------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster_apart() -> Iterator[Any]:
    """A Client of a scheduler and ``WORKERS`` workers (nannies) in processes of their own, started
    as an operator starts them (``dask scheduler``/``dask worker --preload``), configured as the
    in-process cluster: this process then holds the client alone."""
    from distributed import Client

    env = {**os.environ, **{"DASK_" + k.upper().replace(".", "__").replace("-", "_"): repr(v)
                            for k, v in FAST_HANG.items()}}
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        f = str(Path(d) / "scheduler.json")

        def dask_cli(*args: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", "from dask.cli import run_cli; run_cli()", *args,
                                     "--preload", "seabiscuit_dask.plugins.preload"], env=env)

        procs = [dask_cli("scheduler", "--scheduler-file", f, "--port", "0", "--dashboard-address", ":0")]
        try:
            wait_for(lambda: Path(f).exists(), "the scheduler to write its file", HANG_S)
            procs.append(dask_cli("worker", "--scheduler-file", f, "--nworkers", str(WORKERS), "--nthreads",
                                  "1", "--name", "w", "--no-dashboard", "--resources", f"MEM={BUDGET}"))
            with Client(scheduler_file=f, timeout="60s") as client:
                client.wait_for_workers(WORKERS, timeout=120)
                wait_for(lambda: len(placed(client)) == WORKERS, "every worker's agent report", HANG_S)
                yield client
        finally:
            stop(procs)


# --- the soak -------------------------------------------------------------------------------------------
class Diagnosis:
    """What this process holds at the start readings, to print what it holds more at the end."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.types, self.fds = objects_by_type(), descriptors(client)
        tracemalloc.start(8)
        self.traced = tracemalloc.take_snapshot()

    def print(self) -> None:
        print_traced(self.traced, tracemalloc.take_snapshot())
        tracemalloc.stop()
        print_growth("objects grown by type", self.types, objects_by_type())
        print_changes("descriptors", self.fds, descriptors(self.client))


def warm_up(dm: Any, load: Load, seconds: float) -> None:
    """Every step program built and run, then the load for ``seconds`` with one drain/restore pair."""
    dm.warm()
    load.start()
    time.sleep(seconds / 2)
    drain_restore(dm, 0)
    time.sleep(seconds / 2)
    load.reset()


def soak(client: Any, model: torch.nn.Module, minutes: float, warmup_s: float, pairs: int,
         diagnose: bool) -> dict[str, Any]:
    """The load and the faults for ``minutes`` after a warm-up; the figures ``report`` prints."""
    with sb.distribute(model, client, X, budget="64KiB", sessions=16, context=96) as dm:
        load = Load(dm, references(model))
        warm_up(dm, load, warmup_s)
        samples, workers = [reading(client)], [worker_rss(client)]
        log: dict[str, Any] = {"pairs": 0}
        diagnosis = Diagnosis(client) if diagnose else None
        stop = threading.Event()
        fault = threading.Thread(target=faults, args=(client, dm, minutes * 60, pairs, stop, log))
        fault.start()
        threading.Thread(target=sample, args=(client, samples, stop), daemon=True).start()
        stop.wait(minutes * 60)
        stop.set()
        fault.join()
        samples.append(reading(client))         # NOTE: under load, as the first
        workers.append(worker_rss(client))
        if diagnosis is not None:
            diagnosis.print()
        hung = load.finish()
    return {"load": load, "hung": hung, "samples": samples, "workers": workers, "log": log}


# --- the report ---------------------------------------------------------------------------------------
MiB = 2**20


def print_calls(r: dict[str, Any], minutes: float) -> None:
    load = r["load"]
    by_kind: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    for (kind, what), n in load.counts.items():
        by_kind[kind] += n
        if what not in ("right", "WRONG"):
            errors[f"{kind} {what}"] += n
    print(f"\nsoak of {minutes:g} min: {THREADS} threads, {r['log']['pairs']} drain/restore pairs, "
          f"killed {r['log'].get('killed', 'none')} {r['log'].get('kill_error', '')}")
    rows = [("calls", sum(by_kind.values())), *((f"  {k}", n) for k, n in sorted(by_kind.items())),
            ("wrong answers", sum(n for (_, what), n in load.counts.items() if what == "WRONG")),
            ("errors", sum(errors.values())), *((f"  {k}", n) for k, n in sorted(errors.items())),
            (f"hangs (> {HANG_S:.0f} s, or unfinished)", load.slow + r["hung"]),
            ("longest call s", f"{load.longest_s:.1f}")]
    print(f"{'figure':<34} {'value':>12}")
    for name, value in rows:
        print(f"{name:<34} {value:>12}")


def print_figures(title: str, samples: list[dict[str, float]], rows: list[tuple[str, str, float]]) -> None:
    """(key, name, scale) rows: the first and last sample, and the slope per minute over all."""
    print(f"\n{title:<31} {'start':>10} {'end':>10} {'per min':>10}")
    first, last = samples[0], samples[-1]
    for key, name, scale in rows:
        print(f"{name:<31} {first[key] / scale:10.1f} {last[key] / scale:10.1f} "
              f"{slope_per_min(samples, key) / scale:+10.2f}")


def print_minutes(samples: list[dict[str, float]]) -> None:
    """The sample nearest each whole minute."""
    print(f"\n{'minute':>6} {'client MiB':>11} {'fds':>5} {'sockets':>8} {'scheduler MiB':>14} "
          f"{'runs':>10}")
    t0 = samples[0]["t"]
    for m in range(int((samples[-1]["t"] - t0) // 60) + 1):
        s = min(samples, key=lambda s: abs(s["t"] - t0 - 60 * m))
        print(f"{(s['t'] - t0) / 60:6.1f} {s['rss'] / MiB:11.1f} {s['fds']:5.0f} {s['sockets']:8.0f} "
              f"{s['scheduler rss'] / MiB:14.1f} {s['dashboard runs']:10.0f}")


def print_workers(workers: list[dict[str, int]]) -> None:
    w0, w1 = workers
    print(f"\n{'worker':<12} {'RSS MiB at start':>17} {'at end':>10}")
    for name in sorted(set(w0) | set(w1)):
        a, b = w0.get(name), w1.get(name)
        print(f"{name:<12} {a / MiB if a else float('nan'):17.1f} {b / MiB if b else float('nan'):10.1f}")


def report(r: dict[str, Any], minutes: float, apart: bool) -> None:
    print_calls(r, minutes)
    samples = r["samples"]
    print_figures("client", samples, [("rss", "rss MiB", MiB), ("fds", "fds", 1), ("sockets", "sockets", 1),
                                      ("threads", "threads", 1)])
    print_figures("scheduler" + ("" if apart else " (in this process)"), samples,
                  [("scheduler rss", "rss MiB", MiB), ("dashboard runs", "dashboard runs", 1)])
    print_minutes(samples)
    print_workers(r["workers"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="a 1-minute soak")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the start readings")
    ap.add_argument("--pairs", type=int, default=None, help="drain/restore pairs (default 3 a minute)")
    ap.add_argument("--scheduler-apart", action="store_true",
                    help="the scheduler and workers in processes of their own (a LocalCluster runs its "
                         "scheduler in this process, so its figures count the scheduler's too)")
    ap.add_argument("--diagnose", action="store_true", help="print what the client holds more at the end")
    args = ap.parse_args()
    minutes = 1.0 if args.quick else args.minutes
    pairs = args.pairs if args.pairs is not None else max(1, round(3 * minutes))
    model = decoder("llama", seed=2)
    with dask.config.set(FAST_HANG), \
            cluster_apart() if args.scheduler_apart else seabiscuit_cluster(WORKERS, BUDGET) as client:
        r = soak(client, model, minutes, args.warmup, pairs, args.diagnose)
    report(r, minutes, args.scheduler_apart)


if __name__ == "__main__":
    main()
