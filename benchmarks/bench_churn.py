"""Serving while the plan changes all the time: drains and restores back to back under load.

A seeded 2-layer Llama (as ``bench_guarantees``) on a LocalCluster of 3 worker processes
x 1 thread. Eight threads generate (16 new greedy tokens each, over and over) and two
send forward passes, while the main thread drains and restores the plan's first two
workers in turn, ``--pause`` seconds after each. Each call's answer is checked against
the model in this process. A call may fail only with ``StaleRun`` saying the cluster
replans faster than it runs (after ``STALE_TRIES`` sends); any other error, a wrong
answer or a request lost till its progress bound is a fault.

    python benchmarks/bench_churn.py [--seconds 60] [--pause 0.05 1]

Columns: drain-and-restore rounds, the plan version at the end, calls, right answers, calls
that failed as restless, faults, requests lost till their progress bound, calls over 5 s.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import threading
import time
from pathlib import Path

import dask.config
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import seabiscuit_dask as sb
from tests.clusters import seabiscuit_cluster
from tests.test_generate import decoder, padded_batch
from tests.test_serving_guarantees import BUDGET, FAST_HANG, X


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def churn(client, model, seconds: float, pause: float) -> dict:
    prompts = [padded_batch((k,), seed=k)[0] for k in range(3, 11)]
    with torch.no_grad():
        want = [model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=16, do_sample=False,
                               pad_token_id=0, eos_token_id=None) for p in prompts]
        x = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
        ref = model(x).logits
    lines = Lines()
    logging.getLogger("seabiscuit_dask").addHandler(lines)
    counts: collections.Counter = collections.Counter()
    slow: list[float] = []
    stop = threading.Event()
    with sb.distribute(model, client, X, budget="64KiB", sessions=16, context=96) as dm:
        def call(kind: str, one) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    counts[(kind, "right" if one() else "WRONG")] += 1
                except sb.SeaBiscuitError as e:
                    restless = isinstance(e, sb.StaleRun) and "replans faster" in str(e)
                    counts[(kind, "restless" if restless else f"FAULT {type(e).__name__}")] += 1
                slow.append(time.perf_counter() - t)

        def gen(i: int):
            return lambda: torch.equal(dm.generate(prompts[i], 16, pad_token_id=0, eos_token_id=[]), want[i])

        def fwd() -> bool:
            return torch.allclose(dm(x).logits, ref, rtol=1e-4, atol=1e-5)

        threads = [threading.Thread(target=call, args=("generate", gen(i))) for i in range(len(prompts))]
        threads += [threading.Thread(target=call, args=("forward", fwd)) for _ in range(2)]
        for t in threads:
            t.start()
        end, rounds, refused = time.time() + seconds, 0, 0
        while time.time() < end:
            for w in [d.address for d in dm.plan.spec.devices][:2]:
                try:
                    dm.drain(w)
                    dm.restore(w)
                    rounds += 1
                except sb.SeaBiscuitError:
                    refused += 1
                time.sleep(pause)
        stop.set()
        for t in threads:
            t.join()
        version = dm.version
    logging.getLogger("seabiscuit_dask").removeHandler(lines)
    lost = sum("it was lost" in line for line in lines.lines)
    return {"counts": counts, "rounds": rounds, "refused": refused, "versions": version, "lost": lost,
            "over_5s": sum(s > 5 for s in slow), "calls": len(slow)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--pause", type=float, nargs="+", default=[0.05, 1.0])
    args = ap.parse_args()
    model = decoder("llama", seed=2)
    print(f"{'pause s':>8} {'rounds':>7} {'version':>7} {'calls':>6} {'right':>6} {'restless':>9} "
          f"{'faults':>7} {'lost':>5} {'>5 s':>5}  refused drains")
    with dask.config.set(FAST_HANG), seabiscuit_cluster(3, BUDGET) as client:
        for pause in args.pause:
            r = churn(client, model, args.seconds, pause)
            c = r["counts"]
            right = sum(n for (_, what), n in c.items() if what == "right")
            restless = sum(n for (_, what), n in c.items() if what == "restless")
            faults = {f"{k} {what}": n for (k, what), n in c.items() if what not in ("right", "restless")}
            print(f"{pause:8.2f} {r['rounds']:7d} {r['versions']:7d} {r['calls']:6d} {right:6d} "
                  f"{restless:9d} {sum(faults.values()):7d} {r['lost']:5d} {r['over_5s']:5d}  {r['refused']}"
                  + (f"  {faults}" if faults else ""))


if __name__ == "__main__":
    main()
