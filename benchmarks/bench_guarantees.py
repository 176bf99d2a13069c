"""Serving under adversity: many calls across plan changes, a hung worker, a drain of it.

A seeded 2-layer Llama (hidden 64, vocab 512) on a LocalCluster of 3 worker
processes x 1 thread, 900 kB of budget each, room for 16 sessions of 96 tokens.

1. 16 concurrent greedy generate calls (24 new tokens each), undisturbed, then
   with two drains, two restores and a SIGKILL of a worker holding KV caches
   during the run: wall time, calls equal to Hugging Face, Dask tasks per decode
   step before and after.
2. A forward pass while a worker of it is SIGSTOPped (hung, not dead), against
   the median undisturbed request; the default hang settings and a 1 s floor.
3. ``dm.drain`` of a SIGSTOPped worker.

    python benchmarks/bench_guarantees.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import dask.config
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import seabiscuit_dask as sb
from seabiscuit_dask.runtime.worker.agent import median_s
from tests.clusters import seabiscuit_cluster
from tests.test_generate import decoder, padded_batch

X = torch.zeros(1, 16, dtype=torch.long)


def hf(model, prompt, new):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                              do_sample=False, pad_token_id=0, eos_token_id=None)


def calls(dm, prompts, new, disturb=None):
    got: dict = {}
    errors: dict = {}

    def call(i):
        try:
            got[i] = dm.generate(prompts[i], new, pad_token_id=0, eos_token_id=[])
        except Exception as e:  # noqa: BLE001 - counted
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if disturb is not None:
        disturb()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, got, errors


def tasks(dm):
    return max(p["tasks"] for p in dm.generation_stats()["programs"].values())


def generation_rows(client, model):
    prompts = [padded_batch((k,), seed=k)[0] for k in range(3, 19)]
    want = [hf(model, p, 24) for p in prompts]
    rows = []
    with sb.distribute(model, client, X, budget="64KiB", sessions=16, context=96) as dm:
        dm.generate(prompts[0], 2, pad_token_id=0)
        before = tasks(dm)
        wall, got, errors = calls(dm, prompts, 24)
        ok = sum(torch.equal(got[i], want[i]) for i in got)
        rows.append(("16 calls, undisturbed", wall, ok, len(errors), before, tasks(dm)))

        def disturb():
            steps = dm.generation_stats()["decode_steps"]
            while dm.generation_stats()["decode_steps"] < steps + 2:
                time.sleep(0.01)
            for w in [d.address for d in dm.plan.spec.devices][:2]:
                dm.drain(w)
                dm.restore(w)
            prog = dm._step_program(1, 1)
            victim = next(s.address for s in prog.specs if any(op.kind == "kv_attention" for op in s.ops))
            os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)

        wall, got, errors = calls(dm, prompts, 24, disturb)
        ok = sum(torch.equal(got[i], want[i]) for i in got)
        rows.append(("16 calls, 2 drains + 2 restores + SIGKILL", wall, ok, len(errors), before, tasks(dm)))
    return rows


def hang_rows(client, model, reps):
    rows = []
    for floor in ("5s", "1s"):
        with dask.config.set({"seabiscuit.runtime.hang-floor": floor}), \
                sb.distribute(model, client, X, budget="64KiB") as dm:
            usual = median_s(lambda: dm(X), reps)
            victim = dm.specs[-1].address
            pid = client.run(os.getpid, workers=[victim])[victim]
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.perf_counter()
                dm(X)
                hung = time.perf_counter() - t0
            finally:
                os.kill(pid, signal.SIGCONT)
            rows.append((f"forward, a worker SIGSTOPped (hang-floor {floor})", usual, hung))
            fenced = client.cluster.scheduler.plugins["seabiscuit"].fenced
            while victim in fenced:
                time.sleep(0.05)
    with sb.distribute(model, client, X, budget="64KiB") as dm:
        victim = dm.specs[0].address
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            dm.drain(victim)
            drained = time.perf_counter() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        rows.append(("dm.drain of a SIGSTOPped worker", float("nan"), drained))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model = decoder("llama", seed=2)
    with dask.config.set({"seabiscuit.learn.repair": False, "seabiscuit.routing.repair": False}), \
            seabiscuit_cluster(3, 900_000) as client:
        gen = generation_rows(client, model)
        hang = hang_rows(client, model, args.reps)
    print(f"\n{'generation':46s} {'wall s':>8s} {'equal HF':>9s} {'errors':>7s} {'tasks/step before':>18s} "
          f"{'after':>6s}")
    for name, wall, ok, err, before, after in gen:
        print(f"{name:46s} {wall:8.2f} {ok:>6d}/16 {err:7d} {before:18d} {after:6d}")
    print(f"\n{'hung worker':46s} {'usual s':>8s} {'this s':>8s}")
    for name, usual, this in hang:
        print(f"{name:46s} {usual:8.3f} {this:8.3f}")


if __name__ == "__main__":
    main()
