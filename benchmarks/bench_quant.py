"""Quantized weights: SmolLM2-135M-Instruct deployed in fp32, as int8 and as int4
(``distribute(quantize=...)``, from its GGUF de-quantized by transformers) and from the GGUF file
itself read in place (``gguf``: its Q4_1 blocks as int4 tiles, ``gguf.py``) on the same
LocalCluster budget, in one run.

Printed, each against its anchors measured in the same run:

- the kernels: one thread, a SmolLM2 linear's weight, rows 1 to 145: fp32 ``linear`` against
  ``sb.qlinear``'s kernel over the int8 weight, each way it can take (the int8 weight-only kernel,
  bf16 GEMMs over the integers), the measurement ``qlinear.PACK_ROWS`` rests on;
- per deployment (warm: its programs built, one prompt run): one session's prefill of a
  --prompt-tokens chat prompt (time to its first token) and decode tokens/s (new tokens
  after the first over their time), and --sessions concurrent sessions' tokens/s over the
  window where all decode, medians over --reps; the workers' resident weight bytes;
- Hugging Face ``generate`` in fp32 on 1 thread in this process, and llama.cpp on the same
  GGUF (its own Q4_1 weights) on 1 and 2 threads where ``llama-cpp-python`` is installed, here or
  in the interpreter ``--llama-cpp-python`` names (``pip install llama-cpp-python``: it builds
  llama.cpp from source, about ten minutes on 2 cores), run before the cluster starts;
- fidelity: next-token agreement and perplexity over a paragraph, the quantized graph run in
  this process (``run_local``; the deployment's result is the local one, ``tests/test_quantize.py``)
  against the fp32 model.

    python benchmarks/bench_quant.py [--workers 2] [--new 64] [--sessions 4] [--reps 3]
        [--llama-cpp-python /path/to/venv/bin/python]
    python benchmarks/bench_quant.py --breakdown     # where one decode step goes, per scheme
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_generate import chat_prompt, hf_once, one_block, sb_concurrent, sb_once

PARAGRAPH = ("The river rose slowly through the night, and by morning the lower fields were under water. "
             "Farmers moved their animals to the hills, while the children watched from the old stone "
             "bridge. "
             "Nobody in the village could remember a flood like it, although the oldest stories spoke of one "
             "that had carried away the mill a hundred years before. When the rain finally stopped, the "
             "people began to clear the mud from their houses and to count what they had lost.")

SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "gate/up": (1536, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def median_ms(f, n: int = 5) -> float:
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


COLD_BYTES = 256 * 2**20     # NOTE: distinct weights cycled through, far more than this CPU's caches


def kernels(rows_list: tuple[int, ...]) -> None:
    """fp32 ``linear`` against ``sb.qlinear``'s kernel over the int8 weight (``bf16=True``) by the
    int8 weight-only kernel (pack) and by bf16 GEMMs (gemm), and ``sb.q4linear``'s int4 kernel over
    groups of 32 (where the weight is whole blocks of 64 rows), one thread, each call on a weight not
    in cache (as in a decode step, which streams every weight once): the median of 5 passes over
    enough copies of the weight to hold ``COLD_BYTES`` in fp32, per call; and ``q4linear_gemm``, the
    int4 path of many rows (``qlinear.Q4_GEMM_ROWS``) rests on."""
    from seabiscuit_dask import qlinear as ql
    from seabiscuit_dask.quantize import int4_fits, quantize_groups, quantize_rows

    old = torch.get_num_threads(), ql.PACK_ROWS, ql.Q4_GEMM_ROWS
    torch.set_num_threads(1)
    print("kernels, one thread, weights not in cache, ms a call: fp32 linear / int8 weight-only kernel / "
          "bf16 GEMM over the integers / int4 kernel / bf16 GEMM over int4 slabs de-quantized")
    print("| weight | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    try:
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-COLD_BYTES // (n * k * 4)))
            floats = [torch.randn(n, k) * 0.02 for _ in range(copies)]
            ints = [quantize_rows(w) for w in floats]
            fours = [(ql.pack_int4(q), sz) for q, sz in (quantize_groups(w, 32) for w in floats)] \
                if int4_fits(n, k, 32) else []
            cells = []
            for r in rows_list:
                x = torch.randn(r, k)

                def fp32() -> None:
                    for w in floats:
                        torch.nn.functional.linear(x, w)

                def int8() -> None:
                    for q, scale in ints:
                        ql.qlinear_kernel(x, q, scale, None, None, 0, True)

                def int4() -> None:
                    for q, sz in fours:
                        ql.q4linear_kernel(x, q, sz, None, 32)

                def int4_gemm() -> None:
                    for q, sz in fours:
                        ql.q4linear_gemm(x, q, sz, None, 32)

                got = [median_ms(fp32) / copies]
                for rows in (1 << 20, 0):       # NOTE: every row count by one way, then the other
                    ql.PACK_ROWS = rows
                    got.append(median_ms(int8) / copies)
                if fours:
                    ql.Q4_GEMM_ROWS = 1 << 30          # NOTE: the int4 kernel at every row count
                    got.append(median_ms(int4) / copies)
                    got.append(median_ms(int4_gemm) / copies)
                cells.append(" / ".join(f"{g:.3f}" for g in got))
            print(f"| {name} {n}x{k} | " + " | ".join(cells) + " |", flush=True)
            floats, ints, fours = [], [], []      # NOTE: freed before the next shape
    finally:
        torch.set_num_threads(old[0])
        ql.PACK_ROWS, ql.Q4_GEMM_ROWS = old[1], old[2]


MATMULS = ("sb.q4linear.default", "sb.qlinear.default", "aten.linear.default", "aten.embedding.default",
           "sb.embedding_rows")
"""Ops that stream a weight: what a decode step's bytes are spent in."""


def step_breakdown(model, scheme: str | None, context: int = 100, reps: int = 20,
                   fuse_ops: bool = True) -> tuple[dict[str, float], Callable[[], float]]:
    """Where one decode step of SmolLM2 goes, in this process on 1 thread: the step program decomposed
    and quantized as a deployment's (``scheme``), run as one ``BlockProgram`` (no data plane) over a
    KV cache of ``context`` tokens, its runs of small ops fused into one kernel each or not
    (``fuse_ops``, ``lower.patterns``). ms a step (medians of ``reps``): the whole step, weight matmuls,
    attention, the other ops (each kernel timed alone in other steps), and dispatch (the step, timed
    with no timer around its kernels, less its kernels: the program's own loop); the number of ops and
    of kernels run; and a function timing one more step (seconds, no timers around its kernels)."""
    import dask.config

    import seabiscuit_dask as sb
    from seabiscuit_dask.quantize import quantize
    from seabiscuit_dask.trace.decoder import trace_step

    graph = sb.decompose(quantize(trace_step(model, 1, 1), scheme), 16 * 2**20)
    with dask.config.set({"seabiscuit.lower.fuse-ops": fuse_ops}):
        block, program, step = one_block(model, graph)
    spent: dict[str, list[float]] = {"matmuls": [], "attention": [], "other": []}     # NOTE: ms, per step
    timing = [False]

    def timed(fn, kind: str):
        def run(*a, **kw):
            if not timing[0]:
                return fn(*a, **kw)
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent[kind][-1] += time.perf_counter() - t
            return out
        return run

    groups = {g.at: g for g in program.runs}
    inside = {j for g in groups.values() for j in g.ops}
    kinds = []
    for i, op in enumerate(block.ops):
        if i in groups:
            kinds.append("matmuls" if groups[i].kind == "q4_inputs" else "other")
        elif i not in inside:
            kinds.append("matmuls" if op.target in MATMULS else "attention" if op.target == "sb.kv_attention"
                         else "other")
    if len(program.steps) == len(kinds):     # NOTE: each kernel an op or a fused run (no linear groups)
        program.steps = [(timed(fn, kind), *rest) for (fn, *rest), kind in zip(program.steps, kinds)]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for at in range(context + 1):
            step(at)
        alone = statistics.median(step(context) for _ in range(reps))     # NOTE: no timer around each op
        whole = []
        timing[0] = True
        for _ in range(reps):
            for v in spent.values():
                v.append(0.0)
            whole.append(step(context))
    finally:
        torch.set_num_threads(old)
    out = {"step": alone * 1e3, "ops": float(len(block.ops)), "kernels": float(len(program.steps))}
    for kind in ("matmuls", "attention", "other"):
        out[kind] = statistics.median(spent[kind]) * 1e3
    out["dispatch"] = out["step"] - out["matmuls"] - out["attention"] - out["other"]
    timing[0] = False

    def again() -> float:
        torch.set_num_threads(1)
        try:
            return step(context)
        finally:
            torch.set_num_threads(old)
    return out, again


def fidelity(model, tok, scheme: str) -> tuple[float, float, float]:
    """(next-token agreement with fp32, fp32 perplexity, quantized perplexity) over ``PARAGRAPH``;
    scheme ``gguf``: int4 read from the GGUF's own blocks."""
    import seabiscuit_dask as sb
    from seabiscuit_dask.models import gguf_path
    from seabiscuit_dask.quantize import quantize
    from seabiscuit_dask.runtime.local import run_local

    ids = tok(PARAGRAPH, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model(ids).logits[0]
    source = gguf_path() if scheme == "gguf" else model
    graph = quantize(sb.trace(source, (ids,)), "int4" if scheme == "gguf" else scheme)
    with torch.no_grad():
        got = run_local(graph, (ids,), weights=None if scheme == "gguf" else model).logits[0]

    def ppl(logits: torch.Tensor) -> float:
        return float(torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])))

    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return agree, ppl(want), ppl(got)


LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, n_threads, new, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
llm = Llama(model_path=path, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=512, verbose=False)
rates = []
for _ in range(int(sys.argv[5])):
    llm.reset()
    stamps = []
    for i, _t in enumerate(llm.generate(tokens, temp=0.0)):
        stamps.append(time.perf_counter())
        if i + 1 >= new:
            break
    rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
print(json.dumps(sorted(rates)[len(rates) // 2]))
"""


def llama_cpp(python: str | None, ids: torch.Tensor, new: int, n_threads: int, reps: int) -> float | None:
    """llama.cpp's decode tokens/s on the same GGUF and prompt (new tokens after the first, the median
    of ``reps``), run by ``python`` (an interpreter with ``llama-cpp-python``: this one by default),
    or None where it has none."""
    import json
    import subprocess

    from seabiscuit_dask.models import gguf_path

    python = python or sys.executable
    tokens = json.dumps([int(t) for t in ids[0]])
    args = [python, "-c", LLAMA_CPP, gguf_path(), str(n_threads), str(new), tokens, str(reps)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        if "No module named 'llama_cpp'" not in done.stderr:
            print(f"llama.cpp failed: {done.stderr.strip()[-400:]}")
        return None
    return float(done.stdout.strip().splitlines()[-1])


def deployment(model, ids, prompts, scheme, args, budget, context) -> dict:
    """One deployment's figures; scheme ``gguf``: the GGUF file itself, read in place as int4."""
    import seabiscuit_dask as sb
    from seabiscuit_dask.models import gguf_path
    from seabiscuit_dask.runtime.access import readable
    from tests.clusters import seabiscuit_cluster

    source = gguf_path() if scheme == "gguf" else model
    with readable([gguf_path()]), seabiscuit_cluster(args.workers, budget) as client:
        t = time.perf_counter()
        dm = sb.distribute(source, client, torch.zeros(1, 256, dtype=torch.long),
                           kwargs={"logits_to_keep": 1}, sessions=args.sessions, context=context,
                           quantize="int4" if scheme == "gguf" else scheme)
        deploy_s = time.perf_counter() - t
        dm.generate(ids, 2, eos_token_id=[])
        for p in prompts:
            dm.generate(p, 1, eos_token_id=[])
        held = sum(client.run(_resident_bytes).values())
        single = [sb_once(dm, ids, args.new) for _ in range(args.reps + 1)][1:]
        many = [sb_concurrent(dm, prompts, args.new)[0] for _ in range(args.reps + 1)][1:]
        hf = [hf_once(model, ids, args.new, 1) for _ in range(args.reps)]
        dm.close()
    return {"deploy_s": deploy_s, "prefill_s": statistics.median(s[0] for s in single),
            "decode": statistics.median(s[1] for s in single), "many": statistics.median(many),
            "hf_decode": statistics.median(h[1] for h in hf),
            "hf_prefill": statistics.median(h[0] for h in hf), "held": held, "budget": budget}


def _resident_bytes(dask_worker=None) -> int:
    """Bytes of weight tiles a worker holds (every model's)."""
    from seabiscuit_dask.runtime.worker.tasks import resident

    return int(resident(dask_worker).weight_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=145)
    ap.add_argument("--new", type=int, default=64, help="new tokens per session")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--schemes", default="none,int8,int4,gguf",
                    help="deployments to run, in order (gguf: int4 read from the GGUF's own Q4_1 blocks)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="only where one decode step goes, per scheme, in this process on 1 thread")
    ap.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                    help="an interpreter with llama-cpp-python installed (default: this one)")
    args = ap.parse_args()

    from seabiscuit_dask.demo import worker_budget_bytes
    from seabiscuit_dask.models import load_gguf
    from seabiscuit_dask.runtime.client import kv_reserve

    if not args.no_kernels:
        kernels((1, 4, 8, 12, 16, 24, 32, 64, 145))
    model, tok = load_gguf()
    if args.breakdown:
        print("\none decode step of SmolLM2 in this process, 1 thread, 100 tokens cached: ms a step (medians "
              "of 20); dispatch is the step less its kernels' own time; fused: runs of small ops as one "
              "kernel each (seabiscuit.lower.fuse-ops), else every op its own\n")
        print("| weights | small ops | step | weight matmuls | attention | other ops | dispatch | ops "
              "| kernels |")
        print("|---|---|---|---|---|---|---|---|---|")
        speedups: list[str] = []
        for scheme in args.schemes.split(","):
            if scheme == "gguf":
                continue        # NOTE: the same ops and kernels as int4
            again = {}
            for fuse_ops in (False, True):
                b, again[fuse_ops] = step_breakdown(model, None if scheme == "none" else scheme,
                                                    fuse_ops=fuse_ops)
                print(f"| {scheme} | {'fused' if fuse_ops else 'one by one'} | {b['step']:.2f} | "
                      f"{b['matmuls']:.2f} | {b['attention']:.2f} | {b['other']:.2f} | {b['dispatch']:.2f} | "
                      f"{b['ops']:.0f} | {b['kernels']:.0f} |", flush=True)
            # NOTE: the two programs' steps taken in turns, so that the machine's drift falls on both alike
            turns: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(40):
                for fuse_ops in (False, True):
                    turns[fuse_ops].append(again[fuse_ops]())
            plain, fused = (statistics.median(turns[f]) * 1e3 for f in (False, True))
            speedups.append(f"{scheme}: {plain:.2f} ms one by one, {fused:.2f} fused ({plain / fused:.3f}x)")
        print("\nthe two ways in turns, 40 steps each (medians): " + "; ".join(speedups))
        return
    ids = chat_prompt(tok, args.prompt_tokens)
    prompts = [chat_prompt(tok, 20 + 7 * i) for i in range(args.sessions)]
    from seabiscuit_dask.quantize import held_bytes

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    context = args.prompt_tokens + args.new + 16
    reserve, _ = kv_reserve(model, args.sessions, context)
    print(f"\nSmolLM2-135M-Instruct on {args.workers} workers x 1 thread (fp32 weights {weights / 2**20:.0f} "
          "MiB), each with room for a share of the weights as the deployment holds them, never all; "
          f"{args.new} new tokens, medians of {args.reps}")
    if args.llama_cpp_python and not os.access(args.llama_cpp_python, os.X_OK):
        raise SystemExit(f"--llama-cpp-python {args.llama_cpp_python}: no interpreter there; give a venv's "
                         "bin/python with llama-cpp-python installed, or leave the option out")
    cpp = {n: llama_cpp(args.llama_cpp_python, ids, args.new, n, args.reps) for n in (1, 2)}
    if cpp[1] is None:
        print("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python, here or in a venv "
              "given by --llama-cpp-python; it builds from source, about ten minutes on 2 cores): no "
              "llama.cpp anchor this run")
    results = {}
    for scheme in args.schemes.split(","):
        q = None if scheme == "none" else scheme
        # NOTE: workers that cannot hold the weights alone: a deployment of 2 stages either way
        budget = worker_budget_bytes(held_bytes(model, "int4" if q == "gguf" else q), args.workers) + \
            reserve * model.config.num_hidden_layers // args.workers
        results[scheme] = r = deployment(model, ids, prompts, q, args, budget, context)
        print(f"  {scheme}: {r['budget'] / 2**20:.0f} MiB of budget a worker, deployed in "
              f"{r['deploy_s']:.1f} s, {r['held'] / 2**20:.0f} MiB of weights held", flush=True)
    base = results.get("none")
    print("\n| weights | prefill s (HF fp32 1 thread) | decode tok/s (HF 1 thread) | vs fp32 deployment | "
          f"{args.sessions} sessions tok/s | vs fp32 | llama.cpp 1 / 2 threads |")
    print("|---|---|---|---|---|---|---|")
    for scheme, r in results.items():
        vs = f"{r['decode'] / base['decode']:.2f}x" if base else "-"
        vs_many = f"{r['many'] / base['many']:.2f}x" if base else "-"
        cpp_cell = (f"{r['decode'] / cpp[1]:.2f}x / {r['decode'] / cpp[2]:.2f}x of {cpp[1]:.1f} / "
                    f"{cpp[2]:.1f}" if cpp[1] and cpp[2] else "not installed")
        print(f"| {scheme} | {r['prefill_s']:.3f} ({r['hf_prefill']:.3f}) | {r['decode']:.1f} "
              f"({r['hf_decode']:.1f}) | {vs} | {r['many']:.1f} | {vs_many} | {cpp_cell} |")
    for scheme in results:
        if scheme != "none":
            agree, p32, pq = fidelity(model, tok, scheme)
            print(f"\n{scheme} fidelity over a {len(tok(PARAGRAPH).input_ids)}-token paragraph: next-token "
                  f"agreement with fp32 {agree:.3f}; perplexity {pq:.2f} against fp32's {p32:.2f}")


if __name__ == "__main__":
    main()
