"""What a request's extras cost: log-probabilities, logit rules, structured output and tool calls.

SmolLM2-135M-Instruct (real weights, GGUF) deployed on 2 local worker processes and served over
HTTP, as ``seabiscuit serve`` does; one streaming chat client at a time (the official ``openai``
client). Per kind of request, medians over --reps requests: time to the first token and the time
per token after it (from the chunks' arrival times; a tool call's from its first piece), the
tokens, and the ratio to a plain greedy request measured in the same run. Every kind but the
structured ones (a grammar's matchers are in the server) has its tokens picked on the workers.
Every structured answer is validated (jsonschema).

With ``--clients N`` (N > 1) it then runs N streaming clients at once per kind, each kind alone,
and prints their tokens per second together over the wall time (``ignore_eos`` where the kind
allows it, so every answer runs to --max-tokens), against plain greedy clients in the same run.

    python benchmarks/bench_structured.py [--reps 3] [--max-tokens 48] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ASK = [{"role": "user", "content": "Which city is the capital of France, and how many people live there?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                         "country": {"type": "string", "maxLength": 24}},
        "required": ["city", "population", "country"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}

KINDS: dict[str, dict[str, Any]] = {
    "greedy (picked on the workers)": {},
    "greedy, logprobs top 5": {"logprobs": True, "top_logprobs": 5},
    "greedy, repetition_penalty 1.2": {"extra_body": {"repetition_penalty": 1.2}},
    "sampled, temperature 0.7, seed": {"temperature": 0.7, "seed": 1},
    "json_schema (strict)": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY, "strict": True}}},
    "tool_choice required": {"tools": [WEATHER], "tool_choice": "required",
                             "messages": [{"role": "user", "content": "What is the weather in Paris?"}]},
}


def one(api: Any, max_tokens: int, kind: dict[str, Any],
        to_the_end: bool = False) -> tuple[float, float, int, str]:
    """(seconds to the first chunk, seconds per token after it, tokens, the answer) of one request;
    ``to_the_end``: past its end-of-text token to ``max_tokens`` (where no structure ends it)."""
    import jsonschema

    args = {"model": "smollm2", "messages": ASK, "max_tokens": max_tokens, "temperature": 0, **kind}
    if to_the_end and "response_format" not in kind and "tools" not in kind:
        args["extra_body"] = {**args.get("extra_body", {}), "ignore_eos": True}
    t0 = time.perf_counter()
    first, text, tokens = None, "", 0
    calls: dict[int, list[str]] = {}       # NOTE: index -> [name, arguments]: a call streams in pieces
    for chunk in api.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if (delta.content or delta.tool_calls) and first is None:
            first = time.perf_counter()
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or "" if piece.function else ""
            call[1] += piece.function.arguments or "" if piece.function else ""
    end = time.perf_counter()
    if "response_format" in kind:
        jsonschema.validate(json.loads(text), CITY)
    if "tools" in kind:
        assert len(calls) == 1, calls
        (name, arguments), = calls.values()
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
        text = f"{name}({arguments})"
    first = first or end
    return first - t0, (end - first) / max(tokens - 1, 1), tokens, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--clients", type=int, default=1, help="then this many clients at once per kind")
    args = ap.parse_args()

    import openai

    from seabiscuit_dask.models import gguf_path
    from seabiscuit_dask.runtime.access import readable
    from seabiscuit_dask.serve import Server, make_app
    from seabiscuit_dask.serve.server import Source, deploy, load, running
    from tests.clusters import seabiscuit_cluster

    # NOTE: served as `seabiscuit serve` serves it: the GGUF kept quantized, read in place
    with readable([gguf_path()]), seabiscuit_cluster(2, 1_500_000_000) as client:
        lm = deploy(load(Source("gguf", None, "smollm2"), print), client, sessions=max(2, args.clients),
                    context=512, budget=None, device=None)
        with running(make_app(Server([lm]))) as url:
            api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            for kind in KINDS.values():        # NOTE: warm each path once (grammars compiled, first masks)
                one(api, args.max_tokens, kind)
            rows = []
            for name, kind in KINDS.items():
                got = [one(api, args.max_tokens, kind) for _ in range(args.reps)]
                rows.append((name, statistics.median(g[0] for g in got), statistics.median(g[1] for g in got),
                             statistics.median(g[2] for g in got), got[0][3]))
            together = []
            if args.clients > 1:
                for name, kind in KINDS.items():
                    rates = [at_once(api, args.max_tokens, kind, args.clients) for _ in range(args.reps)]
                    together.append((name, statistics.median(rates)))
        lm.dm.close()
    base = rows[0][2]
    print(f"\nSmolLM2 on 2 workers x 1 thread, one client, medians of {args.reps} (warm: each kind run once "
          "before)\n")
    print("| request | first token ms | ms per token after it | per token vs greedy | tokens | answer |")
    print("|---|---|---|---|---|---|")
    for name, ttft, per, tokens, text in rows:
        print(f"| {name} | {ttft * 1e3:.0f} | {per * 1e3:.1f} | {per / base:.2f}x | {tokens:.0f} | "
              f"{text[:60]!r} |")
    if together:
        print(f"\n{args.clients} clients at once, one kind at a time, tokens/s over the wall time (median of "
              f"{args.reps})\n")
        print("| request | tokens/s | vs greedy |")
        print("|---|---|---|")
        for name, rate in together:
            print(f"| {name} | {rate:.1f} | {rate / together[0][1]:.2f}x |")


def at_once(api: Any, max_tokens: int, kind: dict[str, Any], clients: int) -> float:
    """Tokens per second of ``clients`` requests of ``kind`` sent together, over their wall time."""
    import concurrent.futures

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(lambda _: one(api, max_tokens, kind, to_the_end=True), range(clients)))
    return sum(g[2] for g in got) / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
