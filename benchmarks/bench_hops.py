"""What one hop between two worker processes costs: SeaBiscuit's data plane against a Dask task chain.

A chain of ``--hops`` elementwise ops (ReLU) is deployed with each op on the other of
two workers (2 worker processes x 1 thread), so every op is one block and every block
boundary one hop of an activation of the given size. Measured in one run, medians over
``--reps`` requests: the request's latency divided by its hops, on the data plane
(``seabiscuit.runtime.data-plane: p2p``) and as one Dask task per block (``tasks``),
less the compute of one op (the same chain run in this process).

    python benchmarks/bench_hops.py [--hops 40] [--reps 7] [--sizes 4KiB 1MiB]
"""

from __future__ import annotations

import argparse

import dask
import numpy as np
import torch
from dask.utils import format_bytes, parse_bytes

import seabiscuit_dask as sb
from seabiscuit_dask.placement import Plan
from seabiscuit_dask.runtime.worker.agent import median_s


def chain(hops: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.ReLU() for _ in range(hops + 1)]).eval()


def alternating(graph, spec) -> Plan:
    """Every op on the other of the two devices: one block per op, one hop per boundary."""
    device_of = np.arange(len(graph.ops)) % 2
    return Plan(graph, spec, device_of, "alternating", 0.0, {})


def main() -> None:
    from distributed import Client, LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hops", type=int, default=40)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", nargs="+", default=["4KiB", "1MiB"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    # NOTE: the learners would repair so poor a plan (every op on the other worker) onto one worker
    with dask.config.set({"seabiscuit.learn.repair": False, "seabiscuit.routing.repair": False}), \
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None,
                         resources={"MEM": 200e6}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        spec = sb.measure_cluster(client)
        for size in args.sizes:
            n = parse_bytes(size) // 4
            x = torch.randn(1, n)
            model = chain(args.hops)
            graph = sb.decompose(sb.trace(model, (x,)), "64MiB")
            ops = len(graph.ops)
            local = median_s(lambda: sb.run_local(graph, x, weights=model), args.reps) / ops
            row = {"size": format_bytes(4 * n), "blocks": ops, "compute_ms": local * 1e3}
            for plane in ("p2p", "tasks"):
                with dask.config.set({"seabiscuit.runtime.data-plane": plane}):
                    dm = sb.deploy(alternating(graph, spec), client, weights=model)
                try:
                    assert len(dm.specs) == ops, "one block per op"
                    torch.testing.assert_close(dm(x), model(x))
                    dm(x)
                    total = median_s(lambda: dm(x), args.reps)
                    assert dm.version == 0, "the plan changed while it was measured"
                    # NOTE: ops - 1 hops between blocks, plus the caller's send and receive
                    row[plane] = (total - ops * local) / (ops + 1) * 1e3
                finally:
                    dm.close()
            rows.append(row)
    print(f"\nmedian hop between two worker processes, {args.hops}-hop chains, medians of {args.reps}")
    print(f"{'activation':>10} {'data plane ms':>14} {'Dask task ms':>13} {'ratio':>6} {'compute/op ms':>14}")
    for r in rows:
        print(f"{r['size']:>10} {r['p2p']:>14.3f} {r['tasks']:>13.3f} {r['tasks'] / r['p2p']:>5.1f}x "
              f"{r['compute_ms']:>14.3f}")


if __name__ == "__main__":
    main()
