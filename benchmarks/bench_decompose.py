"""Trace and decompose a 40 GB (bf16) Llama-style model on the meta device.

Prints, per run, the micro-op count, the largest working set, the time to
build (without weights), trace and decompose, and the peak RSS of the process.
Cold runs start from an empty template cache; warm runs are fresh processes
that find the templates on disk. Each run is its own process, so peak RSS is
that run's alone.

Then long prompts (--long, default 2048 and 8192 tokens), one cold process each:
trace + decompose time, peak RSS, op count and largest working set; for the first
of them up to 2048 tokens also ``place`` on the 16-device synthetic cluster (feasible,
acyclic; Dask tasks per request, devices used and the predicted latency, Dask's costs
included) and ``replan`` after the loss of each device (median).

    python benchmarks/bench_decompose.py [--model llama-20b] [--budget 16MiB] [--long 2048 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def child(model_name: str, budget: str, seq: int | None = None, do_place: bool = False) -> dict:
    import torch

    import seabiscuit_dask as sb
    from seabiscuit_dask.decompose import largest_working_set
    from seabiscuit_dask.models import demo_model

    t0 = time.perf_counter()
    model, x = demo_model(model_name, materialize=False, dtype=torch.bfloat16, seq=seq)
    t1 = time.perf_counter()
    graph = sb.trace(model, x)
    t2 = time.perf_counter()
    micro = sb.decompose(graph, budget)
    t3 = time.perf_counter()
    budget_bytes = sb.config.to_bytes(budget)
    over = sum(1 for op in micro.ops if micro.working_set(op) > budget_bytes)
    name, ws = largest_working_set(micro)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    placed = place_and_replan(sb, micro) if do_place else {}
    return {**placed,
        "param_gb": graph.param_bytes / 1e9, "params_b": graph.param_bytes / 2 / 1e9,
        "traced_ops": len(graph.ops), "micro_ops": len(micro.ops), "largest_ws": ws,
        "largest_op": name, "over_budget": over, "build_s": t1 - t0, "trace_s": t2 - t1,
        "decompose_s": t3 - t2, "peak_rss_gb": rss, "seq": int(x[0].shape[-1]),
    }


def place_and_replan(sb, graph) -> dict:
    from seabiscuit_dask.placement import DeviceLost, place, replan

    spec = sb.ClusterSpec.synthetic("4x(3gpu+cpu)")
    t = time.perf_counter()
    plan = place(graph, spec)
    place_s = time.perf_counter() - t
    times, ok = [], plan.feasible and plan.acyclic
    for dev in spec.names:
        t = time.perf_counter()
        new = replan(plan, DeviceLost(dev))
        times.append(time.perf_counter() - t)
        ok = ok and new.feasible and new.acyclic
    return {"place_s": place_s, "replan_ms": statistics.median(times) * 1e3, "plans_ok": ok,
            "devices": len(spec.devices), "tasks": len(plan.block_device),
            "used": len(set(plan.device_of.tolist())), "makespan_ms": plan.makespan_s * 1e3,
            "tier": f"{plan.info.get('tier')}{', fused' if plan.fused else ''}"}


def run(model_name: str, budget: str, cache: str, seq: int | None = None, do_place: bool = False) -> dict:
    env = dict(os.environ, DASK_SEABISCUIT__CACHE__DIRECTORY=cache)
    extra = (["--seq", str(seq)] if seq else []) + (["--place"] if do_place else [])
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model_name,
                          "--budget", budget, *extra], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-20b")
    ap.add_argument("--budget", default="16MiB")
    ap.add_argument("--cold", type=int, default=2, help="cold runs (empty cache)")
    ap.add_argument("--warm", type=int, default=3, help="warm runs (templates on disk)")
    ap.add_argument("--long", type=int, nargs="*", default=[2048, 8192], help="long prompt lengths")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--place", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.budget, a.seq, a.place)))
        return
    rows = []
    for i in range(a.cold):
        with tempfile.TemporaryDirectory() as d:
            rows.append(("cold", run(a.model, a.budget, d)))
            if i == 0:
                for _ in range(a.warm):
                    rows.append(("warm", run(a.model, a.budget, d)))
    if rows:
        r0 = rows[0][1]
        print(f"model {a.model}: {r0['params_b']:.1f}B params, {r0['param_gb']:.1f} GB in bf16; "
              f"budget {a.budget}")
        print(f"traced ops {r0['traced_ops']}, micro-ops {r0['micro_ops']}, largest working set "
              f"{r0['largest_ws'] / 2**20:.2f} MiB ({r0['largest_op']}), over budget {r0['over_budget']}")
        print()
        print(f"{'run':<6} {'build s':>8} {'trace s':>8} {'decomp s':>9} {'trace+decomp s':>15} "
              f"{'peak RSS GB':>12}")
        for kind, r in rows:
            print(f"{kind:<6} {r['build_s']:>8.2f} {r['trace_s']:>8.2f} {r['decompose_s']:>9.2f} "
                  f"{r['trace_s'] + r['decompose_s']:>15.2f} {r['peak_rss_gb']:>12.2f}")
        for kind in ("cold", "warm"):
            sel = [r for k, r in rows if k == kind]
            if sel:
                med = statistics.median(r["trace_s"] + r["decompose_s"] for r in sel)
                print(f"median {kind} trace+decompose: {med:.2f} s over {len(sel)} run(s)")
    if a.long:
        print(f"\nlong prompts (cold, one process each), budget {a.budget}:")
        print(f"{'seq':>6} {'micro-ops':>10} {'largest MiB':>12} {'trace+decomp s':>15} {'peak RSS GB':>12} "
              f"{'place s':>8} {'replan ms':>10} {'plans ok':>9}")
        placed_rows: list[dict] = []
        for seq in a.long:
            with tempfile.TemporaryDirectory() as d:
                r = run(a.model, a.budget, d, seq, do_place=seq <= 2048)
            placed = (f"{r['place_s']:>8.2f} {r['replan_ms']:>10.1f} {r['plans_ok']!s:>9}"
                      if "place_s" in r else f"{'-':>8} {'-':>10} {'-':>9}")
            print(f"{r['seq']:>6} {r['micro_ops']:>10} {r['largest_ws'] / 2**20:>12.2f} "
                  f"{r['trace_s'] + r['decompose_s']:>15.2f} {r['peak_rss_gb']:>12.2f} {placed}")
            if "tasks" in r:
                placed_rows.append(r)
        for r in placed_rows:
            print(f"  seq {r['seq']}: {r['tasks']} Dask tasks per request on {r['used']}/{r['devices']} "
                  f"devices ({r['tier']}), predicted {r['makespan_ms']:.1f} ms per request")


if __name__ == "__main__":
    main()
