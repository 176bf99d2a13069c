"""``seabiscuit`` command line: plan a model, print its decomposition and its placement."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import config
from .errors import SeaBiscuitError
from .ir import OpGraph


def _plan(args: argparse.Namespace) -> int:
    import torch

    from .decompose import decompose, largest_working_set
    from .ir import fmt_bytes, verify
    from .models import MODELS, demo_model
    from .trace import trace

    budget = config.to_bytes(args.budget)
    t0 = time.perf_counter()
    if Path(args.model).exists():
        x: tuple[torch.Tensor, ...] = (torch.randint(0, 100, (1, args.seq or 16)),)
        print(f"model folder {args.model}", flush=True)
        graph = trace(args.model, x)
    else:
        if args.model not in MODELS:
            raise SeaBiscuitError(f"--model {args.model!r} is neither a model folder nor one of "
                                  f"{', '.join(MODELS)}")
        dtype = torch.bfloat16 if args.model == "llama-20b" else None
        print(f"building {args.model} ({MODELS[args.model].description}) without weights ...",
              flush=True)
        model, x = demo_model(args.model, materialize=False, dtype=dtype)
        if args.seq:
            x = (torch.zeros((1, args.seq), dtype=torch.long),)
        print(f"tracing at input shape {tuple(x[0].shape)} ...", flush=True)
        graph = trace(model, x)
    t1 = time.perf_counter()
    print(f"decomposing at a budget of {fmt_bytes(budget)} per op ...", flush=True)
    micro = decompose(graph, budget)
    t2 = time.perf_counter()
    verify(micro, budget=budget)
    name, ws = largest_working_set(micro)
    print()
    print(micro.summary())
    print()
    print(f"traced ops: {len(graph.ops)}  micro-ops: {len(micro.ops)}  "
          f"largest working set: {fmt_bytes(ws)} ({name})")
    print(f"trace {t1 - t0:.2f} s  decompose {t2 - t1:.2f} s")
    if args.json:
        Path(args.json).write_text(micro.to_json())
        print(f"wrote {args.json}")
    if args.cluster:
        _place(micro, args)
    return 0


def _place(graph: OpGraph, args: argparse.Namespace) -> None:
    from .placement import ClusterSpec, place
    from .placement.simulate import lower_bound_s

    c = args.cluster
    spec = ClusterSpec.from_yaml(c) if Path(c).exists() else ClusterSpec.synthetic(c)
    print(f"\nplacing on {spec!r} ...", flush=True)
    plan = place(graph, spec)
    print(plan.table())
    print(f"lower bound {lower_bound_s(graph, spec) * 1e3:.2f} ms")
    if args.plan_json:
        Path(args.plan_json).write_text(plan.to_json())
        print(f"wrote {args.plan_json}")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args.model, args.workers, args.requests, args.concurrency, args.scheduler, args.budget,
               args.seq, serve=args.serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seabiscuit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="trace and decompose a model, print the micro-op summary")
    p.add_argument("--model", default="gpt2-medium",
                   help="built-in model name or a Hugging Face model folder (default gpt2-medium)")
    p.add_argument("--budget", default=config.get("budget"), help="per-op memory budget")
    p.add_argument("--seq", type=int, default=None, help="sequence length of the example input")
    p.add_argument("--json", default=None, help="write the decomposed OpGraph to this file")
    p.add_argument("--cluster", default=None,
                   help="place on this cluster: a preset (4x(3gpu+cpu), 2x(1gpu+cpu), 4xcpu) or a YAML file")
    p.add_argument("--plan-json", default=None, help="write the Plan to this file (needs --cluster)")
    p.set_defaults(func=_plan)
    d = sub.add_parser("demo", help="serve a model bigger than any one worker on a Dask cluster")
    d.add_argument("--model", default="gpt2-medium",
                   help="gpt2-medium (355M params, default), gpt2-tiny, or minilm (real weights)")
    d.add_argument("--workers", type=int, default=4, help="worker processes of the embedded cluster")
    d.add_argument("--requests", type=int, default=3, help="requests per caller")
    d.add_argument("--concurrency", type=int, default=4, help="callers at once for the throughput run")
    d.add_argument("--scheduler", default=None, help="use the cluster at this address instead")
    d.add_argument("--budget", default=None, help="per-micro-op memory budget (default from config)")
    d.add_argument("--seq", type=int, default=None, help="sequence length of the requests")
    d.add_argument("--serve", action="store_true",
                   help="afterwards keep the cluster, the model and the dashboard up until Ctrl-C")
    d.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SeaBiscuitError as e:
        print(f"seabiscuit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
