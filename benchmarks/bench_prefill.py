"""Time to the first token of long prompts: SmolLM2-135M-Instruct (real weights) on
--workers worker processes x 1 thread, deployed at 256 tokens (so a longer prompt is
prefilled in chunks of 256), with a prompt's chunks sent at once (each chunk follows the one
before on the workers, ``seabiscuit.generate.pipeline-prefill``) and one by one, against
Hugging Face's forward pass of the whole prompt in one process on 1 and 2 threads.

Each repetition runs the four back to back (a shared machine's speed drifts); the table
gives medians, and checks that both ways give Hugging Face's greedy tokens.

    python benchmarks/bench_prefill.py [--lengths 145 400 700 1000] [--reps 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import dask
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def first_token_s(dm, ids: torch.Tensor, pipelined: bool) -> float:
    with dask.config.set({"seabiscuit.generate.pipeline-prefill": pipelined}):
        t = time.perf_counter()
        for _ in dm.stream(ids, 1, eos_token_id=[]):
            pass
        return time.perf_counter() - t


def forward_s(model, ids: torch.Tensor, threads: int) -> float:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            return time.perf_counter() - t
    finally:
        torch.set_num_threads(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[145, 400, 700, 1000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    import seabiscuit_dask as sb
    from seabiscuit_dask.demo import worker_budget_bytes
    from seabiscuit_dask.models import load_gguf
    from seabiscuit_dask.runtime.client import kv_reserve
    from tests.clusters import seabiscuit_cluster

    model, _ = load_gguf()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    context = max(args.lengths) + 8
    reserve, _ = kv_reserve(model, 1, context)
    layers = model.config.num_hidden_layers
    budget = worker_budget_bytes(weights, args.workers) + reserve * layers // args.workers
    prompts = {n: torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(n))
               for n in args.lengths}
    rows = []
    with seabiscuit_cluster(args.workers, budget) as client:
        dm = sb.distribute(model, client, torch.zeros(1, 256, dtype=torch.long), kwargs={"logits_to_keep": 1},
                           sessions=1, context=context)
        for n, ids in prompts.items():
            with torch.no_grad():
                torch.set_num_threads(1)
                want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                      do_sample=False)
            same = []
            for pipelined in (True, False):
                with dask.config.set({"seabiscuit.generate.pipeline-prefill": pipelined}):
                    # NOTE: builds the chunks' programs
                    same.append(torch.equal(dm.generate(ids, 3, eos_token_id=[]), want))
            chunks = len(dm._engine.chunking(n))
            times: dict[str, list[float]] = {"at once": [], "one by one": [], "hf1": [], "hf2": []}
            for _ in range(args.reps):
                times["at once"].append(first_token_s(dm, ids, True))
                times["one by one"].append(first_token_s(dm, ids, False))
                times["hf1"].append(forward_s(model, ids, 1))
                times["hf2"].append(forward_s(model, ids, 2))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((n, chunks, med, all(same)))
        dm.close()

    print(f"\nSmolLM2-135M-Instruct on {args.workers} workers x 1 thread, deployed at 256 tokens; time to "
          f"the first token, medians of {args.reps}")
    print(f"{'prompt':>7} {'chunks':>6} {'at once':>9} {'one by one':>11} {'HF 1 thr':>9} {'HF 2 thr':>9} "
          f"{'gain':>6} {'vs HF 1 thr':>12} {'tokens = HF':>12}")
    for n, chunks, m, same in rows:
        print(f"{n:>7} {chunks:>6} {m['at once'] * 1e3:>7.0f}ms {m['one by one'] * 1e3:>9.0f}ms "
              f"{m['hf1'] * 1e3:>7.0f}ms {m['hf2'] * 1e3:>7.0f}ms {m['one by one'] / m['at once']:>5.2f}x "
              f"{m['hf1'] / m['at once']:>11.2f}x {same!s:>12}")


if __name__ == "__main__":
    main()
