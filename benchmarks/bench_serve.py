"""``seabiscuit serve`` under load, in the manner of vLLM's serving benchmark.

SmolLM2-135M-Instruct (real weights, GGUF) deployed on --workers local worker processes
(any two of which hold it), served over HTTP; streaming chat clients send prompts of
mixed lengths, --requests each, greedy, --max-tokens new tokens at most. Measured per
concurrency level (1, 8 and 32 clients by default):

- time to first token (request sent to the first text chunk), p50 and p99;
- inter-token latency (between a stream's chunks), p50 and p99;
- output tokens/s over the run (all clients' completion tokens / wall time);
- every answer checked against Hugging Face greedy ``generate`` on the same prompt.

Then one run with a worker SIGKILLed midway (after the clients have received
--kill-after chunks in all): every completion must still equal its reference, none lost.

Anchors in the same run, in this process on the same cores: Hugging Face's prefill of
the 37-token chat prompt (1 thread; what the first token costs in one process), and
Hugging Face ``generate`` with a padded batch of 8 prompts (2 threads; tokens/s).

    python benchmarks/bench_serve.py [--workers 3] [--levels 1,8,32] [--requests 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "What is the capital of France?",
    "Name three rivers of Europe.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Explain in two sentences why the sky is blue.",
    "Give me a short list of fruits that are red.",
    "Summarise this: The Rhine rises in the Swiss Alps, forms part of the border between Switzerland, "
    "Liechtenstein and Austria, then Switzerland and Germany, flows through Lake Constance and on through "
    "Germany and the Netherlands to the North Sea, and is one of the busiest waterways of Europe.",
    "Translate 'good morning' into French and Spanish.",
    "What does a compiler do? Answer briefly.",
    "Tell me a fact about the Moon.",
    "Which is larger, a kilometre or a mile? Explain your answer in a sentence, and mention how many "
    "metres each holds, and which countries use miles on their road signs today.",
    "How many legs does a spider have?",
]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def references(model: Any, tok: Any, max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy answer from Hugging Face generate, as text."""
    from seabiscuit_dask.demo import prompt_ids

    out = {}
    for p in PROMPTS:
        ids = prompt_ids(tok, p, True)
        with torch.no_grad():
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False)
        out[p] = tok.decode(got[0, ids.shape[1]:], skip_special_tokens=True)
    return out


def hf_anchors(model: Any, tok: Any, max_tokens: int, reps: int) -> tuple[float, float]:
    """(prefill seconds of the 37-token chat prompt, 1 thread; batch-8 generate tokens/s, 2 threads)."""
    from seabiscuit_dask.demo import prompt_ids

    ids = prompt_ids(tok, PROMPTS[0], True)
    torch.set_num_threads(1)
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t = time.perf_counter()
            model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
            times.append(time.perf_counter() - t)
    prefill = statistics.median(times)
    torch.set_num_threads(2)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                     tokenize=False) for p in PROMPTS[:8]]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    rates = []
    with torch.no_grad():
        for _ in range(max(1, reps // 2)):
            t = time.perf_counter()
            out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens)
            rates.append(8 * (out.shape[1] - batch["input_ids"].shape[1]) / (time.perf_counter() - t))
    torch.set_num_threads(1)
    return prefill, statistics.median(rates)


class Client:
    """One streaming chat client: its requests one after another."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, chunks: list[int]) -> None:
        import openai

        self.api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        self.prompts, self.max_tokens, self.chunks = prompts, max_tokens, chunks
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.answers: list[tuple[str, str]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        for p in self.prompts:
            try:
                t0 = last = time.perf_counter()
                text, first = "", True
                stream = self.api.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": p}], max_tokens=self.max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.usage is not None:
                        self.tokens += chunk.usage.completion_tokens
                    piece = chunk.choices[0].delta.content if chunk.choices else None
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if first:
                        self.ttft.append(now - t0)
                        first = False
                    else:
                        self.itl.append(now - last)
                    last = now
                    text += piece
                    self.chunks[0] += 1
                self.answers.append((p, text))
            except Exception as e:  # noqa: BLE001 - counted and shown: a lost request is a result
                self.errors.append(f"{type(e).__name__}: {e}")


def first_token_s(url: str, prompt: str, reps: int) -> float:
    """Median time to the first text of one streamed chat request of ``prompt``, one at a time."""
    import openai

    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    times = []
    for _ in range(reps):
        t, first = time.perf_counter(), None
        messages = [{"role": "user", "content": prompt}]
        for chunk in api.chat.completions.create(model="smollm2", messages=messages, max_tokens=1,
                                                 temperature=0, stream=True):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t
        times.append(first if first is not None else float("nan"))
    return statistics.median(times)


def load_run(url: str, clients: int, requests: int, max_tokens: int, refs: dict[str, str],
             kill: Any = None, kill_after: int = 0) -> dict[str, Any]:
    chunks = [0]
    cs = [Client(url, [PROMPTS[(i * requests + j) % len(PROMPTS)] for j in range(requests)], max_tokens,
                 chunks) for i in range(clients)]
    threads = [threading.Thread(target=c.run) for c in cs]
    t = time.perf_counter()
    for th in threads:
        th.start()
    killed = ""
    if kill is not None:
        while chunks[0] < kill_after and any(th.is_alive() for th in threads):
            time.sleep(0.005)
        killed = kill()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    answers = [a for c in cs for a in c.answers]
    wrong = [(p, got, refs[p]) for p, got in answers if got != refs[p]]
    return {"clients": clients, "requests": clients * requests, "done": len(answers),
            "errors": [e for c in cs for e in c.errors], "wrong": wrong,
            "ttft": [x for c in cs for x in c.ttft], "itl": [x for c in cs for x in c.itl],
            "tokens": sum(c.tokens for c in cs), "wall": wall, "killed": killed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--levels", default="1,8,32", help="concurrent clients per run")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kill-after", type=int, default=40, help="chunks received before a worker is killed")
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--quantize", choices=("int8", "int4", "gguf"), default=None,
                    help="serve int8 or int4 weights (budgets sized from what the workers then hold), or "
                         "gguf: the GGUF read in place as `seabiscuit serve` serves it by default (its Q4_1 "
                         "blocks as int4 tiles); answers are then set against fp32 greedy, and counted as "
                         "differing, not wrong")
    ap.add_argument("--sessions", type=int, default=0,
                    help="sessions the deployment serves at once (more clients wait in its queue); "
                         "0: as many as the most clients")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    from distributed import Client as DaskClient
    from distributed import LocalCluster

    import seabiscuit_dask as sb
    from seabiscuit_dask.models import gguf_path, load_gguf
    from seabiscuit_dask.quantize import held_bytes
    from seabiscuit_dask.runtime.access import readable
    from seabiscuit_dask.runtime.client import kv_reserve
    from seabiscuit_dask.serve import Server, make_app
    from seabiscuit_dask.serve.server import Loaded, Source, deploy, load, running

    torch.set_num_threads(1)
    model, tok = load_gguf()
    weights = held_bytes(model, "int4" if args.quantize == "gguf" else args.quantize)
    refs = references(model, tok, args.max_tokens)
    prefill_s, hf_batch = hf_anchors(model, tok, args.max_tokens, args.reps)
    sessions = args.sessions or max(levels)
    per_layer, _ = kv_reserve(model, sessions, args.context)
    # NOTE: any workers-1 of them hold the model, so one may be killed
    budget = int(weights * 1.25 / (args.workers - 1)) + per_layer * model.config.num_hidden_layers
    print(f"SmolLM2-135M-Instruct: {weights / 2**20:.0f} MiB of weights ({args.quantize or 'fp32'}); "
          f"{args.workers} workers x 1 thread, "
          f"{budget / 2**20:.0f} MiB of budget each; {sessions} sessions of {args.context} tokens",
          flush=True)
    # NOTE: the workers may read the GGUF in place (``--quantize gguf``), as an embedded ``serve``'s do
    with readable([gguf_path()]), \
            LocalCluster(n_workers=args.workers, threads_per_worker=1, resources={"MEM": budget},
                         dashboard_address=None) as cluster, DaskClient(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        server = Server()
        with running(make_app(server)) as url:
            t = time.perf_counter()
            say = lambda s: print(s, flush=True)
            item = load(Source("gguf", None, "smollm2"), say) if args.quantize == "gguf" else \
                Loaded(Source("gguf", None, "smollm2"), model, model, tok, "smollm2", "generate",
                       scheme=args.quantize)
            served = deploy(item, client, sessions=sessions, context=args.context, budget=None, device=None,
                            say=say)
            server.add(served)
            print(f"ready in {time.perf_counter() - t:.1f} s ({sessions} sessions)\n", flush=True)
            ttft37 = first_token_s(url, PROMPTS[0], args.reps)

            def preempted() -> int:
                return int(served.dm.generation_stats().get("preemptions", 0))

            def measured(*run_args: Any) -> dict[str, Any]:
                before = preempted()
                r = load_run(url, *run_args)
                r["preempted"] = preempted() - before
                return r

            runs = [measured(c, args.requests, args.max_tokens, refs) for c in levels]

            def kill() -> str:
                pids = client.run(os.getpid)
                addr = sorted(pids)[-1]
                os.kill(pids[addr], signal.SIGKILL)
                return addr

            if not args.no_kill:
                runs.append(measured(8, args.requests, args.max_tokens, refs, kill, args.kill_after))
            served.dm.close()

    wrong = "≠fp32" if args.quantize else "wrong"
    print(f"{'clients':>7} {'reqs':>5} {'done':>5} {wrong:>5} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'itl p50':>8} {'itl p99':>8} {'tok/s':>7} {'vs HF b8':>8} {'preempted':>9}  note")
    for r in runs:
        note = f"worker {r['killed']} SIGKILLed midway" if r["killed"] else ""
        print(f"{r['clients']:>7} {r['requests']:>5} {r['done']:>5} {len(r['wrong']):>5} "
              f"{pct(r['ttft'], 50) * 1e3:>7.0f}ms {pct(r['ttft'], 99) * 1e3:>7.0f}ms "
              f"{pct(r['itl'], 50) * 1e3:>6.1f}ms {pct(r['itl'], 99) * 1e3:>6.1f}ms "
              f"{r['tokens'] / r['wall']:>7.1f} {r['tokens'] / r['wall'] / hf_batch:>7.2f}x "
              f"{r['preempted']:>9}  {note}")
    print(f"\ntime to first token of the 37-token chat prompt, one request at a time: {ttft37 * 1e3:.0f} ms, "
          f"{ttft37 / prefill_s:.2f}x Hugging Face's prefill of it in this process "
          f"({prefill_s * 1e3:.0f} ms, 1 thread)")
    print(f"Hugging Face generate, padded batch of 8, 2 threads, in this process: {hf_batch:.1f} tok/s")
    for r in runs:
        for e in r["errors"][:3]:
            print(f"error ({r['clients']} clients): {e}")
        for p, got, want in r["wrong"][:3]:
            print(f"{'differs from fp32' if args.quantize else 'wrong'} ({r['clients']} clients): {p!r}: "
                  f"{got!r} != {want!r}")


if __name__ == "__main__":
    main()
