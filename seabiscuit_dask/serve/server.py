"""``seabiscuit serve``: load models, deploy them on a Dask cluster, answer over HTTP.

The HTTP server starts first and answers ``GET /health`` with 503 while the models deploy
and their step programs are built (``DistributedModel.warm``), 200 once every model can
answer without building anything. Ctrl-C stops it, closes the models and the cluster.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dask.config
import torch

from .. import config
from ..errors import BadCheckpoint, BadInput, SeaBiscuitError, UnsupportedModel
from ..ir import fmt_bytes
from ..quantize import check_scheme, held_bytes
from ..runtime.access import readable
from ..runtime.serving import accepts, connect, local_cluster, page_link, say, worker_budget_bytes
from .app import Server, make_app
from .connections import uvicorn_config
from .models import EMBED_BUCKETS, ServedModel


class CannotListen(SeaBiscuitError):
    """The HTTP server did not start on its host and port (the port taken, or an address that is not
    this machine's): choose another ``--port`` or ``--host``."""


@dataclass
class Source:
    """A model to serve: ``kind`` gguf (a GGUF file; None: SmolLM2-135M-Instruct), folder (a
    Hugging Face folder: a causal LM is chatted with, any other model gives embeddings) or onnx
    (an encoder's ``.onnx`` file, or a folder with ``model.onnx``: embeddings; its tokenizer from
    ``tokenizer``, else from the file's folder)."""

    kind: str
    path: str | None
    name: str | None = None
    tokenizer: str | None = None

    @classmethod
    def parse(cls, kind: str, text: str | None, tokenizer: str | None = None) -> Source:
        """``PATH`` or ``NAME=PATH``."""
        if text and "=" in text and not os.path.exists(text):
            name, _, path = text.partition("=")
            return cls(kind, path, name, tokenizer)
        return cls(kind, text, None, tokenizer)


@dataclass
class Loaded:
    source: Source
    model: torch.nn.Module | str      # a module, or a folder for the workers to read
    weights: torch.nn.Module      # the module (or its skeleton) for the sizes
    tokenizer: Any
    name: str
    kind: str             # generate | embed
    inputs: tuple[str, ...] = ()      # an ONNX graph's inputs, fed by name
    scheme: str | None = None         # how its deployment quantizes its weights (``quantize.py``)

    @property
    def weight_bytes(self) -> int:
        """Bytes of its weights as a deployment holds them (``scheme``)."""
        return held_bytes(self.weights, self.scheme)


def name_of(source: Source) -> str:
    """The name a source's model is served under (what ``load`` names it), known before it loads."""
    from ..models import gguf_path

    if source.name:
        return source.name
    if source.kind == "gguf":
        return os.path.splitext(os.path.basename(gguf_path(source.path)))[0]
    path = source.path or ""
    if source.kind == "onnx":
        file = os.path.join(path, "model.onnx") if os.path.isdir(path) else path
        return os.path.splitext(os.path.basename(file))[0]
    return os.path.basename(os.path.abspath(path))


def load(source: Source, say: Callable[[str], None] = print) -> Loaded:
    """The model, its tokenizer and what it serves."""
    import transformers as tf

    from ..models import gguf_path, gguf_scheme, load_gguf, load_gguf_quantized

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if source.kind == "gguf":       # NOTE: kept quantized unless asked otherwise (``models.gguf_scheme``)
        file = gguf_path(source.path)
        scheme, lines = gguf_scheme(file)
        for line in lines:
            say(line)
        if scheme:
            file, skeleton, tok = load_gguf_quantized(file)
            return Loaded(source, file, skeleton, tok, name_of(source), "generate", scheme=scheme)
        lm, tok = load_gguf(file)
        return Loaded(source, lm, lm, tok, name_of(source), "generate")
    if source.kind == "onnx":
        import onnx

        from ..trace.onnx import load_onnx

        path = source.path or ""
        file = os.path.join(path, "model.onnx") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise BadCheckpoint(f"--onnx {path!r}: no such ONNX file (or folder with model.onnx)")
        where = source.tokenizer or os.path.dirname(os.path.abspath(file))
        try:
            tok = tf.AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError) as e:
            raise UnsupportedModel(f"--onnx {file}: no tokenizer in {where} ({type(e).__name__}); name a "
                                   "folder that has one with --tokenizer") from e
        graph = onnx.load(file, load_external_data=False).graph
        known = {i.name for i in graph.initializer}
        inputs = tuple(i.name for i in graph.input if i.name not in known)
        unread = [n for n in inputs if n not in ("input_ids", "attention_mask", "token_type_ids")]
        if "input_ids" not in inputs or unread:
            raise UnsupportedModel(f"--onnx {file}: an encoder reads input_ids (and attention_mask, "
                                   f"token_type_ids); this graph reads {list(inputs)}")
        name = name_of(source)
        say(f"reading {name} (an ONNX encoder: embeddings) ...")
        return Loaded(source, file, load_onnx(file, lazy=True), tok, name, "embed", inputs)
    folder = source.path or ""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UnsupportedModel(f"--model {folder!r} is not a Hugging Face model folder (no config.json)")
    cfg = tf.AutoConfig.from_pretrained(folder)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    name = name_of(source)
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in cfg.architectures or ())
    say(f"reading {name} ({'a causal LM' if causal else 'an encoder: embeddings'}) ...")
    with torch.device("meta"):
        skeleton = (tf.AutoModelForCausalLM if causal else tf.AutoModel).from_config(cfg)
    return Loaded(source, folder, skeleton.eval(), tok, name, "generate" if causal else "embed",
                  scheme=check_scheme(config.get("quantize")) if causal else None)


def deploy(item: Loaded, client: Any, *, sessions: int, context: int, budget: str | None,
           device: str | None, say: Callable[[str], None] = print) -> ServedModel:
    """``item`` distributed on ``client``'s workers, its programs built (ready to answer)."""
    import seabiscuit_dask as sb

    from ..runtime.client import max_positions

    cfg = getattr(item.weights, "config", None)
    most = max_positions(getattr(cfg, "get_text_config", lambda: cfg)()) or context
    context = min(context, most)
    t0 = time.perf_counter()
    if item.kind == "generate":
        example = torch.zeros((1, min(256, context)), dtype=torch.long)
        keep = {"logits_to_keep": 1} if accepts(item.weights, "logits_to_keep") else None
        dm = sb.distribute(item.model, client, example, budget=budget, kwargs=keep, sessions=sessions,
                           context=context, device=device, quantize=item.scheme or "none")
        gen = getattr(item.weights, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        eos = getattr(item.tokenizer, "eos_token_id", None) if eos is None else eos
        eos_ids = tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos or ()))
        served = ServedModel(item.name, dm, item.tokenizer, "generate", context, eos_ids,
                             sessions=sessions or None)
        say(f"{item.name}: deployed in {time.perf_counter() - t0:.1f} s; building its step programs ...")
        t1 = time.perf_counter()
        caching = bool(config.get("serve.prefix-caching"))
        with dask.config.set({"seabiscuit.generate.prefix-caching": caching}):
            shapes = dm.warm()          # NOTE: the deployment's engine is made here, reading it
        say(f"{item.name}: {len(shapes)} step programs ({', '.join(shapes)}) built in "
            f"{time.perf_counter() - t1:.1f} s")
    else:
        # NOTE: traced at the longest input it takes: shorter ones then read the same weight tiles
        context = max([b for b in EMBED_BUCKETS if b <= context] or [context])
        example = torch.zeros((1, context), dtype=torch.long)
        feed = {"input_ids": example, "attention_mask": torch.ones_like(example),
                "token_type_ids": torch.zeros_like(example)}
        if item.inputs:
            dm = sb.distribute(item.model, client, {n: feed[n] for n in item.inputs}, budget=budget,
                               device=device)
        else:
            dm = sb.distribute(item.model, client, example, budget=budget,
                               kwargs={"attention_mask": feed["attention_mask"]}, device=device)
        served = ServedModel(item.name, dm, item.tokenizer, "embed", context, inputs=item.inputs)
        t1 = time.perf_counter()
        for n in (b for b in EMBED_BUCKETS if b <= context):
            served.pool([0] * n)
        say(f"{item.name}: deployed in {t1 - t0:.1f} s; programs for inputs up to {context} tokens built in "
            f"{time.perf_counter() - t1:.1f} s")
    served.ready.set()
    return served


@contextlib.contextmanager
def running(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """``app`` served by uvicorn on a thread of its own; yields its base URL (``port=0``: any free port)."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, host, port))
    thread = threading.Thread(target=server.run, name="seabiscuit-serve-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise CannotListen(f"the HTTP server did not start on {host}:{port} (is the port taken?)")
        time.sleep(0.01)    # NOTE: uvicorn offers no event for "listening"; this only waits for it
    sock = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{sock[0]}:{sock[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def run(sources: list[Source], *, workers: int, scheduler: str | None, host: str, port: int, sessions: int,
        context: int, budget: str | None, api_key: str | None, device: str | None,
        stop: threading.Event | None = None, allowed_origins: str | None = None) -> int:
    """``seabiscuit serve``: until Ctrl-C (or until ``stop`` is set)."""
    from ..runtime.discover import cluster_workers

    api_key = api_key or os.environ.get(str(config.get("serve.api-key-env")) or "", "") or None
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        say(f"warning: listening on {host} with no API key: anyone who reaches it may use the models")
    names = [name_of(s) for s in sources]
    if len(set(names)) != len(names):
        raise BadInput(f"two models have the same name in {names}: name them with NAME=PATH")
    # NOTE: it listens at once (on a thread of its own): /health and every model route answer 503 with
    # Retry-After while the weights load, the cluster starts and the models deploy
    server = Server(api_key=api_key, allowed_origins=allowed_origins)     # NOTE: checked there
    server.loading = list(names)
    served: list[ServedModel] = []
    with running(make_app(server), host, port), contextlib.ExitStack() as stack:
        say(f"listening on http://{host}:{port} (GET /health answers 503 until the models are ready)")
        try:
            loaded = [load(s, say) for s in sources]
            client = _cluster(stack, loaded, scheduler, workers, sessions, context)
            for m in loaded:
                one = deploy(m, client, sessions=sessions, context=context, budget=budget, device=device,
                             say=say)
                served.append(one)
                server.add(one)
                server.loading.remove(m.name)
            weights = fmt_bytes(sum(m.weight_bytes for m in loaded))
            say(f"\nready: {len(served)} model(s), {weights} of weights on "
                f"{len(cluster_workers(client))} workers")
            say(f"chat page    http://{host}:{port}/")
            say(f"API          http://{host}:{port}/v1 (OpenAI-compatible: /chat/completions, "
                "/completions, /embeddings, /models)")
            say(f"dashboard    {page_link(client.dashboard_link)}")
            (stop or threading.Event()).wait()       # NOTE: Ctrl-C ends the wait with KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        finally:
            say("stopping ...")
            for one in served:
                one.dm.close()
    return 0


def _cluster(stack: contextlib.ExitStack, loaded: list[Loaded], scheduler: str | None, workers: int,
             sessions: int, context: int) -> Any:
    """A client of the cluster at ``scheduler`` (its plugin registered), or of an embedded one with
    room for the ``loaded`` models' weights and their sessions' KV caches; closed with ``stack``."""
    import seabiscuit_dask as sb

    from ..runtime.client import kv_reserve

    if scheduler:
        client = stack.enter_context(connect(scheduler))
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        return client
    stack.enter_context(readable([m.model for m in loaded if isinstance(m.model, str)]))
    total = sum(m.weight_bytes for m in loaded)
    reserve = 0
    for m in loaded:
        per_layer, _ = kv_reserve(m.weights, sessions if m.kind == "generate" else 0, context)
        layers = getattr(getattr(m.weights, "config", None), "num_hidden_layers", 0) or 0
        reserve += per_layer * layers
    budget_bytes = worker_budget_bytes(total, workers) + reserve // workers
    return stack.enter_context(local_cluster(workers, budget_bytes, sb.SeaBiscuitSchedulerPlugin()))
