"""Whether tensor parallelism between two processes of one host would pay: a SmolLM2-shaped decode step.

Each of two processes holds half of every layer: the columns of q/k/v, gate/up and the
LM head, the rows of o and down. The two add their partial sums twice a layer (60
exchanges a step) through shared memory, double-buffered, each side woken by a semaphore
eventfd from a plain thread, as two workers' compute threads would be. This is measured
against the same matmuls whole in one process on 1 and 2 threads. Attention over the KV cache is left
out (a few percent of a step). It says what an exchange between workers on one host
costs when it skips the event loops; it is not yet a SeaBiscuit code path (Linux only).

    python benchmarks/bench_tensor_parallel.py [--batches 1 8] [--reps 15]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from multiprocessing import shared_memory
from typing import Any

import torch

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152      # NOTE: SmolLM2-135M's shapes


def weights(share: float, seed: int) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """A ``share`` of every layer's columns (rows of o and down), seeded."""
    g = torch.Generator().manual_seed(seed)

    def part(n: int) -> int:
        return int(n * share)

    layers = [{"qkv": torch.randn(part(HIDDEN) + 2 * part(KV), HIDDEN, generator=g) * 0.02,
               "o": torch.randn(HIDDEN, part(HIDDEN), generator=g) * 0.02,
               "gu": torch.randn(2 * part(INTER), HIDDEN, generator=g) * 0.02,
               "d": torch.randn(HIDDEN, part(INTER), generator=g) * 0.02} for _ in range(LAYERS)]
    return layers, torch.randn(part(VOCAB), HIDDEN, generator=g) * 0.02


def step(layers: list[dict[str, torch.Tensor]], head: torch.Tensor, x: torch.Tensor, add: Any) -> Any:
    """One decode step's matmuls; ``add`` sums a partial result with the other side's."""
    f = torch.nn.functional
    for w in layers:
        q = f.linear(f.rms_norm(x, (HIDDEN,)), w["qkv"])[:, :w["o"].shape[1]]
        x = x + add(f.linear(q, w["o"]))
        gate, up = f.linear(f.rms_norm(x, (HIDDEN,)), w["gu"]).chunk(2, dim=-1)
        x = x + add(f.linear(f.silu(gate) * up, w["d"]))
    return f.linear(f.rms_norm(x, (HIDDEN,)), head).max(dim=-1)


def side(name: str, batch: int, reps: int, me: int, mine: int, peer: int, out: Any) -> None:
    torch.set_num_threads(1)
    shm = shared_memory.SharedMemory(name=name)
    flat = torch.frombuffer(shm.buf, dtype=torch.float32, count=4 * batch * HIDDEN)
    held = [flat.view(2, 2, batch, HIDDEN)]     # NOTE: [exchange parity, side]
    del flat
    layers, head = weights(0.5, me)
    x, done = torch.randn(batch, HIDDEN), [0]
    times: list[float] = []

    def add(partial: torch.Tensor) -> torch.Tensor:
        # NOTE: slot k % 2: a side is never two exchanges ahead, so it never overwrites what is read
        slot = held[0][done[0] % 2]
        done[0] += 1
        slot[me].copy_(partial)
        os.eventfd_write(peer, 1)
        os.eventfd_read(mine)
        return partial + slot[1 - me]

    def run() -> None:
        with torch.inference_mode():
            for _ in range(reps + 3):
                t = time.perf_counter()
                step(layers, head, x, add)
                times.append(time.perf_counter() - t)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    if me == 0:
        out.put(statistics.median(times[3:]))
    held.clear()            # NOTE: no view of the buffer may outlive it
    shm.close()


def parallel(batch: int, reps: int) -> float:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    shm = shared_memory.SharedMemory(create=True, size=4 * batch * HIDDEN * 4)
    a, b = os.eventfd(0, os.EFD_SEMAPHORE), os.eventfd(0, os.EFD_SEMAPHORE)
    try:
        ps = [ctx.Process(target=side, args=(shm.name, batch, reps, 0, a, b, out)),
              ctx.Process(target=side, args=(shm.name, batch, reps, 1, b, a, out))]
        for p in ps:
            p.start()
        s = out.get(timeout=600)
        for p in ps:
            p.join()
        return float(s)
    finally:
        os.close(a)
        os.close(b)
        shm.close()
        shm.unlink()


def whole(batch: int, reps: int, threads: int) -> float:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layers, head = weights(1.0, 0)
        x, times = torch.randn(batch, HIDDEN), []
        with torch.inference_mode():
            for _ in range(reps + 3):
                t = time.perf_counter()
                step(layers, head, x, lambda p: p)
                times.append(time.perf_counter() - t)
        return statistics.median(times[3:])
    finally:
        torch.set_num_threads(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    print(f"SmolLM2-shaped decode step, fp32, {LAYERS} layers, 2 exchanges a layer; medians of {args.reps}\n")
    print(f"{'batch':>5} {'1 thread':>10} {'2 threads':>10} {'2 processes':>12} {'vs 2 threads':>13} "
          f"{'per exchange':>13}")
    for batch in args.batches:
        tp = parallel(batch, args.reps)         # NOTE: first: the forks carry no torch threads yet
        one, two = whole(batch, args.reps, 1), whole(batch, args.reps, 2)
        # NOTE: what the exchanges add: the parallel step less half the one-thread step
        per = (tp - one / 2) / (2 * LAYERS)
        print(f"{batch:>5} {one * 1e3:>8.1f}ms {two * 1e3:>8.1f}ms {tp * 1e3:>10.1f}ms {two / tp:>12.2f}x "
              f"{per * 1e6:>10.0f} us")


if __name__ == "__main__":
    main()
