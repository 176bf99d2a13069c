"""GPU checks, as one script for a GPU machine (each part prints a table of measured figures).

1. GPT-2 medium (355M, seeded weights) served by one GPU worker (``device="cuda"``) against
   torch on the same GPU: median latency per forward pass at --seq tokens.
2. A model larger than an artificially small per-GPU budget (--gpu-share of its weights) on
   one GPU worker plus --cpu-workers CPU workers (``CUDA_VISIBLE_DEVICES=""``), placed with
   ``device="auto"``: which devices hold what, the output against torch, the latency.
3. The linear-tile fusion on the GPU (``bench_fuse.py --device cuda``).

    python benchmarks/bench_gpu.py [--seq 128] [--reps 10] [--gpu-share 0.4] [--cpu-workers 2]

``--device cpu`` runs parts 1 and 2 with CPU workers only, to check the script itself on a
machine without a GPU (the figures then say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

import seabiscuit_dask as sb
from seabiscuit_dask.ir import fmt_bytes
from seabiscuit_dask.models import demo_model
from seabiscuit_dask.runtime.worker.agent import median_s as agent_median_s


def median_s(fn, reps: int, sync: bool) -> float:
    """``agent.median_s`` after one warm-up call, each call waiting for the GPU when ``sync``."""
    def call() -> None:
        fn()
        if sync:
            torch.cuda.synchronize()

    call()
    return agent_median_s(call, reps)


def cluster(gpu_workers: int, cpu_workers: int, gpu_mem: float, cpu_mem: float, gpu: bool):
    """A SpecCluster: ``gpu_workers`` seeing GPU i each, ``cpu_workers`` seeing none."""
    from distributed import Nanny, Scheduler, SpecCluster

    workers = {}
    for i in range(gpu_workers):
        env = {"CUDA_VISIBLE_DEVICES": str(i)} if gpu else {"CUDA_VISIBLE_DEVICES": ""}
        workers[f"gpu{i}"] = {"cls": Nanny, "options": {"nthreads": 1, "env": env,
                                                         "resources": {"MEM": gpu_mem}}}
    for i in range(cpu_workers):
        workers[f"cpu{i}"] = {"cls": Nanny, "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": ""},
                                                         "resources": {"MEM": cpu_mem}}}
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": None}})


def part1(seq: int, reps: int, device: str) -> None:
    from distributed import Client

    model, _ = demo_model("gpt2-medium")
    x = torch.randint(0, 50257, (1, seq), generator=torch.Generator().manual_seed(0))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gpu = device == "cuda"
    with cluster(1, 0, nbytes * 2.5, 0, gpu) as c, Client(c) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        with sb.distribute(model, client, (x,), device=device) as dm, torch.no_grad():
            dist_s = median_s(lambda: dm(x), reps, False)
            out = dm(x).logits
            blocks = len(dm.plan.blocks)
    local = model.to(device)
    with torch.no_grad():
        xl = x.to(device)
        ref = local(xl).logits
        local_s = median_s(lambda: local(xl), reps, gpu)
    err = float((out.to(ref.device) - ref).abs().max() / ref.abs().max())
    print(f"\n1. GPT-2 medium ({fmt_bytes(nbytes)}), seq {seq}, 1 {device} worker, median of {reps}")
    print(f"{'run':<28} {'ms':>9}")
    print(f"{'torch on the same device':<28} {local_s * 1e3:>9.2f}")
    print(f"{f'SeaBiscuit ({blocks} block(s))':<28} {dist_s * 1e3:>9.2f}")
    print(f"ratio {dist_s / local_s:.2f}x, max relative error {err:.1e}")


def part2(seq: int, reps: int, share: float, cpu_workers: int, device: str) -> None:
    from distributed import Client

    model, _ = demo_model("gpt2-medium")
    x = torch.randint(0, 50257, (1, seq), generator=torch.Generator().manual_seed(0))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gpu_mem, cpu_mem = nbytes * share, nbytes * 1.2 / cpu_workers
    with cluster(1, cpu_workers, gpu_mem, cpu_mem, device == "cuda") as c, Client(c) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        with sb.distribute(model, client, (x,), device="auto") as dm, torch.no_grad():
            s = median_s(lambda: dm(x), reps, False)
            out = dm(x).logits
            plan = dm.plan
    with torch.no_grad():
        ref = model(x).logits
    err = float((out - ref).abs().max() / ref.abs().max())
    print(f"\n2. GPT-2 medium ({fmt_bytes(nbytes)}) on 1 GPU worker with {fmt_bytes(gpu_mem)} "
          f"({share:.0%} of the weights) + {cpu_workers} CPU workers, seq {seq}, median of {reps}")
    print(f"{'device':<10} {'kind':<5} {'blocks':>6} {'weights':>11} {'budget':>11}")
    for i, d in enumerate(plan.spec.devices):
        n = sum(b.device == d.name for b in plan.blocks)
        print(f"{d.name:<10} {d.kind:<5} {n:>6} {fmt_bytes(plan.weight_bytes[i]):>11} "
              f"{fmt_bytes(d.memory_bytes):>11}")
    print(f"latency {s * 1e3:.1f} ms, max relative error vs torch {err:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gpu-share", type=float, default=0.4)
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)         # NOTE: as each worker (1 thread): a like-for-like check
    print(f"device {a.device}" + (f": {torch.cuda.get_device_name(0)}" if a.device == "cuda" else
                                  " (no GPU: checking the script, not measuring a GPU)"))
    part1(a.seq, a.reps, a.device)
    part2(a.seq, a.reps, a.gpu_share, a.cpu_workers, a.device)
    if a.device == "cuda":
        subprocess.run([sys.executable, str(Path(__file__).with_name("bench_fuse.py")), "--device", "cuda"],
                       check=True)


if __name__ == "__main__":
    main()
