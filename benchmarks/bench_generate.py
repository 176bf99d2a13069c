"""Text generation with SmolLM2-135M-Instruct (real weights, GGUF) on a LocalCluster.

Measured in one run: the cluster (--workers processes x 1 thread, neither able to
hold the model) against Hugging Face ``generate`` in this process on the same
cores (1 thread, and 2 threads), medians over --reps. One session's prefill and decode
are set against HF on 1 thread run by run (each follows a run of HF; the ratio is the
median of the pairs': the machine drifts); HF on 2 threads runs with no cluster up
(before it starts and after it closes: an idle cluster's wake-ups cost 2 threads 20-25%):

- prefill latency of a --prompt-tokens chat prompt (time to the first new token);
- decode tokens/s of one session (steady state: new tokens after the first, over
  their time);
- aggregate decode tokens/s of --sessions concurrent sessions (each a thread calling
  ``generate``; continuous batching puts their steps into the same block tasks);
- blocks per token, and the cost of distribution per decode step (a step on the
  cluster, timed on the workers' timeline, less the same step program run in this
  process, 1 thread, over a KV cache as long as the session's, each side the median
  of its steps, the two measured back to back 3 x --reps times and the median
  difference taken), split into the block runs the workers report and the
  hand-offs between them;
- KV-cache bytes per session per token, and the cost of building a new step shape.

    python benchmarks/bench_generate.py [--workers 2] [--new 32] [--sessions 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def chat_prompt(tok, n_tokens: int) -> torch.Tensor:
    """A chat prompt of exactly ``n_tokens`` tokens (a question padded with context sentences)."""
    from seabiscuit_dask.demo import prompt_ids

    context = "France is a country in western Europe with a long history. "
    k = 0
    while prompt_ids(tok, context * k + "What is the capital of France?", True).shape[1] < n_tokens:
        k += 1
    ids = prompt_ids(tok, context * k + "What is the capital of France?", True)
    return torch.cat([ids[:, :1], ids[:, ids.shape[1] - n_tokens + 1:]], dim=1)   # BOS, then the last tokens


CHATS = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
         "Write a haiku about the sea.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
         "Explain what a noun is in one sentence.", "Give me a synonym for happy, and use it in a sentence."]


def burst_prompts(tok, n: int) -> list[torch.Tensor]:
    """``n`` different chat prompts (a question each, in the chat template)."""
    from seabiscuit_dask.demo import prompt_ids

    return [prompt_ids(tok, CHATS[i % len(CHATS)] + " " * (i // len(CHATS)), True) for i in range(n)]


def hf_burst(model, prompts: list[torch.Tensor], new: int, n_threads: int) -> float:
    """Tokens/s of one Hugging Face generate over ``prompts`` as one left-padded batch, over its
    whole wall time (prefill included): what 8 chats sent at once get from HF."""
    n = max(p.shape[1] for p in prompts)
    ids = torch.zeros((len(prompts), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, n - p.shape[1]:], mask[r, n - p.shape[1]:] = p[0], 1
    with threads(n_threads), torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return len(prompts) * new / (time.perf_counter() - t)


def sb_burst(dm, prompts: list[torch.Tensor], new: int) -> tuple[float, list[float]]:
    """(tokens/s over the whole wall time, first-token seconds of each) of ``prompts`` started together,
    each a stream from its own thread: what 8 chats sent at once get."""
    firsts: list[float] = []
    counts: list[int] = []
    barrier = threading.Barrier(len(prompts) + 1)

    def one(ids: torch.Tensor) -> None:
        barrier.wait()
        t, n = time.perf_counter(), 0
        for _ in dm.stream(ids, new, eos_token_id=[]):
            if not n:
                firsts.append(time.perf_counter() - t)
            n += 1
        counts.append(n)

    ths = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for th in ths:
        th.start()
    barrier.wait()
    t = time.perf_counter()
    for th in ths:
        th.join()
    return sum(counts) / (time.perf_counter() - t), sorted(firsts)


def cold_burst(model, tok, workers: int, sessions: int, new: int, reps: int) -> None:
    """The cold burst: a fresh deployment, one prompt warmed, then ``sessions`` different chats at
    once, --reps times (each a deployment of its own), against HF's padded batch on 2 threads of
    the same prompts right before (no cluster up)."""
    import seabiscuit_dask as sb
    from seabiscuit_dask.demo import worker_budget_bytes
    from seabiscuit_dask.runtime.client import kv_reserve
    from tests.clusters import seabiscuit_cluster

    prompts = burst_prompts(tok, sessions)
    context = max(p.shape[1] for p in prompts) + new + 16
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    reserve, _ = kv_reserve(model, sessions, context)
    budget = worker_budget_bytes(weights, workers) + reserve * model.config.num_hidden_layers // workers
    out = []
    for _ in range(reps):
        hf = hf_burst(model, prompts, new, 2)
        with seabiscuit_cluster(workers, budget) as client:
            t = time.perf_counter()
            dm = sb.distribute(model, client, torch.zeros(1, 256, dtype=torch.long),
                               kwargs={"logits_to_keep": 1}, sessions=sessions, context=context)
            deploy_s = time.perf_counter() - t
            dm.generate(prompts[0], 2, eos_token_id=[])
            warm_s = time.perf_counter() - t - deploy_s
            tps, firsts = sb_burst(dm, prompts, new)
            stats = dm.generation_stats()
            dm.close()
        out.append((tps / hf, tps, hf, deploy_s, warm_s, firsts, stats))
        print(f"  burst: {tps:.1f} tok/s vs HF padded batch {hf:.1f} tok/s on 2 threads = {tps / hf:.2f}x; "
              f"deploy {deploy_s:.1f} s, one prompt warmed {warm_s:.1f} s, first tokens "
              f"{firsts[0]:.2f}-{firsts[-1]:.2f} s; {stats['rows']} rows in {stats['decode_steps']} decode "
              f"steps, {stats['prefill_steps']} prefill steps; programs "
              + ", ".join(f"{k} {v['build_s']:.1f} s" for k, v in stats["programs"].items()), flush=True)
    ratio, tps, hf, deploy_s, warm_s, firsts, _ = sorted(out, key=lambda o: o[0])[len(out) // 2]
    lengths = ", ".join(str(p.shape[1]) for p in prompts)
    print(f"\ncold burst of {sessions} chats ({lengths} tokens, {new} new "
          f"each), whole wall time, the median of {reps} deployments:\n"
          f"  SeaBiscuit {tps:.1f} tok/s, HF padded batch on 2 threads {hf:.1f} tok/s: {ratio:.2f}x; "
          f"distribute {deploy_s:.1f} s + one prompt {warm_s:.1f} s, then first tokens after "
          f"{firsts[0]:.2f}-{firsts[-1]:.2f} s")


def hf_stamps(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> list[float]:
    """When Hugging Face greedy generate hands its streamer the prompt, then each new step."""
    from transformers import TextStreamer

    stamps: list[float] = []

    class Clock(TextStreamer):
        def __init__(self) -> None:
            pass

        def put(self, value: torch.Tensor) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       streamer=Clock())
    return stamps


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """``torch`` on ``n`` threads inside the ``with``."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def hf_once(model, ids: torch.Tensor, new: int, n_threads: int) -> tuple[float, float]:
    """(prefill s, decode tokens/s) of one Hugging Face generate on ``n_threads`` threads: decode
    counts the new tokens after the first, over their time."""
    with threads(n_threads):
        t = time.perf_counter()
        stamps = hf_stamps(model, ids, torch.ones_like(ids), new)
    return stamps[1] - t, (len(stamps) - 2) / (stamps[-1] - stamps[1])


def hf_batched_once(model, prompts: list[torch.Tensor], new: int, n_threads: int) -> float:
    """Aggregate decode tokens/s of one Hugging Face generate over ``prompts`` as one left-padded
    batch (the anchor for concurrent sessions), ``n_threads`` threads: new tokens after the first,
    over their time."""
    n = max(p.shape[1] for p in prompts)
    ids = torch.zeros((len(prompts), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, n - p.shape[1]:], mask[r, n - p.shape[1]:] = p[0], 1
    with threads(n_threads):
        stamps = hf_stamps(model, ids, mask, new)
    return len(prompts) * (len(stamps) - 2) / (stamps[-1] - stamps[1])


def sb_once(dm, ids: torch.Tensor, new: int) -> tuple[float, float]:
    """(prefill s, decode tokens/s) of one session on the cluster, as ``hf_once`` counts them."""
    stamps = []
    t = time.perf_counter()
    for _tok in dm.stream(ids, new, eos_token_id=[]):
        stamps.append(time.perf_counter())
    return stamps[0] - t, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def sb_concurrent(dm, prompts: list[torch.Tensor], new: int) -> tuple[float, float, tuple[float, float]]:
    """(aggregate decode tokens/s while every session decodes, seconds in all, that window in
    ``time.time()`` seconds) of ``len(prompts)`` sessions generating at once, each from its own thread."""
    stamps: list[list[float]] = []
    barrier = threading.Barrier(len(prompts))

    def one(ids: torch.Tensor) -> None:
        barrier.wait()
        stamps.append([time.time() for _ in dm.stream(ids, new, eos_token_id=[])])

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # NOTE: steady state: from the last session's first token to the first session's last one
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    tokens = sum(sum(start < x <= end for x in s) for s in stamps)
    return tokens / (end - start), max(s[-1] for s in stamps) - t, (start, end)


def block_runs(client, dm, since: float, until: float) -> list[dict]:
    """The block runs the workers reported to the scheduler's timeline (the dashboard's) that
    started at ``since`` or later and ended by ``until``, once ``dm``'s workers have reported every
    run so far (they send them in batches, a tick apart: a worker's last batch could still be on
    its way when another's had come in)."""
    from seabiscuit_dask.plugins.scheduler import PLUGIN_NAME

    def runs(dask_scheduler, since: float) -> list[dict]:
        from seabiscuit_dask.dashboard.data import timeline_data

        plugin = dask_scheduler.plugins[PLUGIN_NAME]
        return timeline_data(plugin.state, plugin.activity, since)

    dm._flush_runs()
    seen = client.run_on_scheduler(runs, since=since)
    return [r for r in seen if r["start"] >= since and r["start"] + r["duration_s"] <= until]


def one_block(model, graph):
    """``graph`` (a step program) as one ``BlockProgram`` in this process over ``model``'s weights, held
    as its graph says (``lower.layout``), with a KV store of its own: (the block's spec, the program,
    ``step(at)``: the seconds of one decode step of one row at cache slot ``at``)."""
    import numpy as np

    import seabiscuit_dask as sb
    from seabiscuit_dask.lower.blocks import BlockProgram, block_specs
    from seabiscuit_dask.lower.kvcache import KVStore, using
    from seabiscuit_dask.lower.layout import held
    from seabiscuit_dask.runtime.generation import step_inputs
    from seabiscuit_dask.weights import WeightStore

    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=1, cpu_memory="64GiB")
    one = sb.Plan(graph, spec, np.zeros(len(graph.ops), dtype=int), "one", 0.0, {})
    (block,) = block_specs(one, "0" * 16)
    weights = WeightStore.from_weights(model).load
    program = BlockProgram(block, {n: held(weights(p), block.layouts.get(n))
                                   for n, p in block.params.items()}, torch.device("cpu"))
    store = KVStore()

    def step(at: int) -> float:
        feed = step_inputs([(0, at, [1])], 1, 1)
        t = time.perf_counter()
        with using(store, "m"):
            program.run({n: feed[n] for n in graph.inputs})
        return time.perf_counter() - t

    return block, program, step


def local_step(model, lead, context: int = 0):
    """One decode step of the same step program in this process, 1 thread, run as the workers run
    it (its ops as one ``BlockProgram`` over the same tiles), with no data plane or Dask, over a KV
    cache that holds ``context`` tokens (as a session's does on the cluster): ``time(reps)`` gives
    the median seconds of ``reps`` more steps."""
    import seabiscuit_dask as sb
    from seabiscuit_dask.trace.decoder import trace_step

    graph = sb.decompose(trace_step(model, 1, 1), lead.meta.get("budget_bytes") or None, like=lead)
    # NOTE: its weights held and multiplied as the deployment's are (``lower.layout``)
    graph = graph.with_meta(**{key: {n: v for n, v in (lead.meta.get(key) or {}).items() if n in graph.params}
                               for key in ("weight_layouts", "matmul_forms")})
    _, _, step = one_block(model, graph)

    def timed(reps: int) -> float:
        with threads(1):
            # NOTE: each step at the same slot past ``context`` cached tokens: the same attention length
            return statistics.median(step(context) for _ in range(reps))

    for at in range(context + 1):      # NOTE: the cache fills to ``context`` tokens
        step(at)
    return timed


def step_breakdown(client, dm, ids: torch.Tensor, new: int) -> tuple[float, float, int, dict[str, float]]:
    """(step s, block compute s per step, block runs, hand-offs) of one session's decode on the
    cluster, from the workers' timeline: a step from one run of the block that makes the logits
    to the next (the caller hears of most tokens a block run later, of the last at once: its
    clock would make the steps look shorter), the median of the session's steps, and the median of
    what each step spends in block runs on the workers (the rest: hand-offs between blocks, workers
    and the caller); ``hand-offs``: the median gap from one block run's end to the next one's start,
    per boundary of the chain (``handoffs``). Medians, as the step in one process is taken: a
    shared machine's stalls land on a few steps of either."""
    stamps = [time.time() for _ in dm.stream(ids, new, eos_token_id=[])]
    runs = sorted(block_runs(client, dm, stamps[0], stamps[-1]), key=lambda r: r["start"])
    logits = [r["start"] + r["duration_s"] for r in runs if r["block"] == runs[-1]["block"]]
    inside = [r for r in runs if r["start"] >= logits[0] and r["start"] + r["duration_s"] <= logits[-1]]
    steps = [b - a for a, b in zip(logits, logits[1:])]
    blocks = [sum(r["duration_s"] for r in inside if a <= r["start"] and r["start"] + r["duration_s"] <= b)
              for a, b in zip(logits, logits[1:])]
    return statistics.median(steps), statistics.median(blocks), len(inside), handoffs(inside)


def handoffs(runs: list[dict]) -> dict[str, float]:
    """The median seconds from one block run's end to the next one's start in a decode loop's chain
    (one session: its runs follow one another), per boundary: "w0 b0 -> w1 b1" (workers by address
    order, blocks by their index in the step program)."""
    from seabiscuit_dask.lower.blocks import split_block

    names = {a: f"w{i}" for i, a in enumerate(sorted({r["worker"] for r in runs}))}
    chain = sorted(runs, key=lambda r: r["start"])
    gaps: dict[str, list[float]] = {}
    for a, b in zip(chain, chain[1:]):
        key = (f"{names[a['worker']]} b{split_block(int(a['block']))[1]} -> "
               f"{names[b['worker']]} b{split_block(int(b['block']))[1]}")
        gaps.setdefault(key, []).append(b["start"] - (a["start"] + a["duration_s"]))
    return {k: statistics.median(v) for k, v in gaps.items() if len(v) >= 2}


def busy(runs: list[dict], window: tuple[float, float]) -> dict[str, float]:
    """Each worker's share of ``window`` spent in block runs."""
    out: dict[str, float] = {}
    for r in runs:
        out[r["worker"]] = out.get(r["worker"], 0.0) + r["duration_s"] / (window[1] - window[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=145)
    ap.add_argument("--new", type=int, default=32, help="new tokens per session")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--burst-only", action="store_true", help="only the cold burst of --sessions chats")
    args = ap.parse_args()

    import seabiscuit_dask as sb
    from seabiscuit_dask.demo import worker_budget_bytes
    from seabiscuit_dask.models import load_gguf
    from seabiscuit_dask.runtime.client import kv_reserve
    from tests.clusters import seabiscuit_cluster

    model, tok = load_gguf()
    if args.burst_only:
        cold_burst(model, tok, args.workers, args.sessions, args.new, args.reps)
        return
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = chat_prompt(tok, args.prompt_tokens)
    prompts = [chat_prompt(tok, 20 + 7 * i) for i in range(args.sessions)]
    context = args.prompt_tokens + args.new + 16
    reserve, _ = kv_reserve(model, args.sessions, context)
    layers = model.config.num_hidden_layers
    budget = worker_budget_bytes(weights, args.workers) + reserve * layers // args.workers
    rows = []

    def alone_2t() -> list[tuple[float, float, float]]:
        """HF on 2 threads, with no cluster running: (prefill s, decode tok/s, batch tok/s) per run.
        A cluster's processes, idle, still wake on the cores now and then, and 2 threads that wait
        for each other at every op lose 20-25% to that (1 thread next to them: nothing measurable)."""
        runs = [(*hf_once(model, ids, args.new, 2), hf_batched_once(model, prompts, args.new, 2))
                for _ in range(args.reps + 1)]
        return runs[1:]

    before = alone_2t()
    with seabiscuit_cluster(args.workers, budget) as client:
        dm = sb.distribute(model, client, torch.zeros(1, 256, dtype=torch.long), kwargs={"logits_to_keep": 1},
                           sessions=args.sessions, context=context)
        t = time.perf_counter()
        dm.generate(ids, 2, eos_token_id=[])              # NOTE: builds the prefill and decode programs
        first_build_s = time.perf_counter() - t
        for p in prompts:                                 # NOTE: their prefill chunk programs, built once
            dm.generate(p, 1, eos_token_id=[])
        batch = 2
        while batch <= args.sessions:                     # the batch programs
            dm.generate(torch.cat([prompts[0]] * batch), 2, eos_token_id=[])
            batch *= 2
        # NOTE: each figure against its anchor measured right before it, --reps times (after one more
        # to warm up), the ratios' medians taken: a shared machine drifts by tens of percent in a minute
        single = [(hf_once(model, ids, args.new, 1), sb_once(dm, ids, args.new))
                  for _ in range(args.reps + 1)][1:]
        hf1 = statistics.median(h[0] for h, _ in single), statistics.median(h[1] for h, _ in single)
        prefill_s = statistics.median(s[0] for _, s in single)
        decode_tps = statistics.median(s[1] for _, s in single)
        prefill_x = statistics.median(h[0] / s[0] for h, s in single)
        decode_x = statistics.median(s[1] / h[1] for h, s in single)
        stats_before = dm.generation_stats()
        many = []
        for _ in range(args.reps + 1):
            anchor = hf_batched_once(model, prompts, args.new, 1)
            many.append((anchor, *sb_concurrent(dm, prompts, args.new)))
        many = sorted(many[1:], key=lambda m: m[1])
        agg_tps, agg_s, window = many[len(many) // 2][1:]
        shares = busy(block_runs(client, dm, *window), window)
        stats = dm.generation_stats()
        steps = max(1, stats["decode_steps"] - stats_before["decode_steps"])
        rows_per_step = (stats["rows"] - stats_before["rows"]) / steps
        # NOTE: the cost of distribution per step, paired: a session's decode on the cluster, then the
        # same program in this process, back to back, 3 x --reps times (a shared machine drifts)
        local = local_step(model, dm.graph, context=ids.shape[1] + args.new // 2)
        pairs = []
        for _ in range(3 * args.reps):
            pairs.append((*step_breakdown(client, dm, ids, args.new), local(16)))
        pairs.sort(key=lambda p: p[0] - p[4])
        step_s, compute_s, n_runs, hops, step_local = pairs[len(pairs) // 2]
        probe = dm.stream(ids, args.new, eos_token_id=[])
        for _ in range(8):
            next(probe)
        kv = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"].resident.kv.nbytes)
        cached = ids.shape[1] + 7
        probe.close()
        tasks = next(v["tasks"] for k, v in stats["programs"].items() if k in ("decode", "1x1"))
        dm_pipeline, p2p = dm._engine.pipeline, dm.p2p
        dm.close()
    after = alone_2t()
    hf2 = statistics.median(r[0] for r in before + after), statistics.median(r[1] for r in before + after)
    hf_batch = [statistics.median(m[0] for m in many), statistics.median(r[2] for r in before + after)]
    batch_x = agg_tps / hf_batch[1]
    rows += [
        (f"prefill, {ids.shape[1]}-token prompt", f"{prefill_s * 1e3:.0f} ms", f"{hf1[0] * 1e3:.0f} ms",
         f"{hf2[0] * 1e3:.0f} ms", f"{prefill_x:.2f}x"),
        ("decode, 1 session", f"{decode_tps:.1f} tok/s", f"{hf1[1]:.1f} tok/s", f"{hf2[1]:.1f} tok/s",
         f"{decode_x:.2f}x"),
        (f"decode, {args.sessions} sessions (aggregate)", f"{agg_tps:.1f} tok/s", f"{hf1[1]:.1f} tok/s",
         f"{hf2[1]:.1f} tok/s", f"{agg_tps / hf1[1]:.2f}x"),
        (f"  vs HF batch of {args.sessions} (padded)", f"{agg_tps:.1f} tok/s", f"{hf_batch[0]:.1f} tok/s",
         f"{hf_batch[1]:.1f} tok/s", f"{agg_tps / hf_batch[0]:.2f}x"),
    ]
    print(f"\nSmolLM2-135M-Instruct ({weights / 2**20:.0f} MiB fp32) on {args.workers} workers x 1 thread "
          f"(budget {budget / 2**20:.0f} MiB each) vs Hugging Face generate in one process\n")
    print(f"{'measure':<34} {'SeaBiscuit':>12} {'HF 1 thread':>12} {'HF 2 threads':>13} {'vs HF 1 thr':>12}")
    for r in rows:
        print(f"{r[0]:<34} {r[1]:>12} {r[2]:>12} {r[3]:>13} {r[4]:>12}")
    print("(each figure a median of --reps runs; the ratios of the first two rows are the medians of each\n"
          " run's against HF's run right before it; HF on 2 threads ran with no cluster up, before it\n"
          f" started and after it closed: batch of {args.sessions} "
          f"{statistics.median(r[2] for r in before):.1f} and "
          f"{statistics.median(r[2] for r in after):.1f} tok/s)")
    print(f"\n{args.sessions} sessions against HF's padded batch on 2 threads: {batch_x:.2f}x")
    plane = "data plane (p2p)" if p2p else "Dask tasks"
    print(f"\nblocks per decode step        {tasks} on the {plane} (1 session: {tasks} per token; "
          f"{args.sessions} sessions: {tasks / args.sessions:.2f} per token)")
    print(f"decode step                   {step_s * 1e3:.1f} ms on the cluster, {step_local * 1e3:.1f} ms "
          f"the same program in one process, measured back to back: coordination costs "
          f"{(step_s - step_local) * 1e3:.1f} ms per step (the pair with the median difference of "
          f"{len(pairs)}; each side the median of its steps)")
    print(f"  where it goes               a step of {step_s * 1e3:.1f} ms: {compute_s * 1e3:.1f} ms of block "
          f"runs on the workers ({compute_s / step_local:.2f}x the program in one process; {n_runs} runs), "
          f"{(step_s - compute_s) * 1e3:.1f} ms of hand-offs between them")
    print("  hand-offs                   " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                                      for k, v in sorted(hops.items()))
          + " (the median gap from a block run's end to the next one's start)")
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads \
        * (model.config.hidden_size // model.config.num_attention_heads) * 4
    held = sum(kv.values()) / 2**20
    print(f"KV cache per session          {per_token / 1024:.1f} KiB per token; {held:.2f} "
          f"MiB held for a session of {cached} tokens (grown a block of 32 tokens at a time)")
    print("step programs (built once)    " + ", ".join(
        f"{k}: {v['build_s']:.1f} s" for k, v in stats["programs"].items())
        + f"; first call with new shapes {first_build_s:.1f} s")
    print(f"{args.sessions} sessions                    {rows_per_step:.2f} rows per decode step on average "
          f"(in {dm_pipeline} groups in flight), {agg_s:.1f} s in all; while all decode, the workers spend "
          f"{', '.join(f'{v:.0%}' for v in sorted(shares.values(), reverse=True))} of the time in block runs")


if __name__ == "__main__":
    main()
