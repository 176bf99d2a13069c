"""The client side: ``deploy`` a plan onto a Dask cluster, ``distribute`` a model in one call.

``deploy(plan, client)`` sends the graph and the plan (its documented JSON, the one
wire format) to the scheduler plugin, which issues the model's id and a token
that only this client holds, and has every worker load the weight tiles of its
own blocks from the checkpoint's slices. ``distribute`` is trace, decompose,
``measure_cluster``, place and deploy.

``dm(*inputs)`` sends each worker the inputs of its blocks on the data plane
(``runtime.dataplane``): blocks run as their inputs arrive and their outputs go
worker to worker, never through the scheduler (or, with ``seabiscuit.runtime.data-plane:
tasks``, one Dask task per block, never one per micro-op); only activations travel.
Calls from several threads pipeline across the workers. When the plan changes (a worker
left, joined or was drained), the scheduler plugin tells this object on the ``seabiscuit``
event topic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import secrets
import shutil
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import config
from ..errors import (
    STALE_TRIES,
    BadInput,
    ModelClosed,
    RoomTaken,
    RunFailed,
    SeaBiscuitError,
    SessionClosed,
    StaleRun,
    UnsupportedModel,
    WorkerHung,
    WorkerLost,
    restless,
)
from ..ir import fmt_bytes
from ..lower.blocks import BlockSpec, block_specs, request_graph, task_name
from ..placement import Plan, place
from ..placement.follow import follow
from . import events
from .dataplane import client as p2p
from .discover import measure_cluster, releasing, workers_info
from .generation import STEP_INPUTS, Engine, GenerateArgs, generate_tokens, greedy, stream_tokens
from .generation.scheduler import batch_buckets, decode_rows
from .local import assemble_outputs, bind_call, check_ids, flatten_inputs, split_inputs, unflatten_outputs
from .resident import writable
from .store import copied_if_unreadable, stored
from .tasks import PICK, load_block, run_block_task
from .watch import Deadline, seconds

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

EVENTS_KEPT = 1000    # NOTE: the latest scheduler events a model keeps (``dm.events``), as the scheduler does


def _quiet(msg: str) -> None:
    return None


def _release_dropped(client: Any, model_id: str, token: str, checkpoint_dir: str) -> None:
    """Free a ``DistributedModel`` its caller dropped without ``close()`` (a notebook cell run
    again): its blocks on every worker and its plans on the scheduler, as ``close`` does, sent
    from whatever thread collected it without waiting (``measure_cluster`` waits)."""
    try:
        events.unlisten(client, model_id)
        if client.status != "running":
            return
        release = asyncio.run_coroutine_threadsafe(
            client.scheduler.seabiscuit_release(model=model_id, token=token), client.loop.asyncio_loop)
    except Exception as e:  # noqa: BLE001 - a client closing frees everything of its own
        logger.info("seabiscuit: model %s, dropped unclosed, not released: %s", model_id, e)
        return
    finally:
        if checkpoint_dir:
            shutil.rmtree(Path(checkpoint_dir) / model_id, ignore_errors=True)
    releasing(release, lambda e: logger.info("seabiscuit: model %s, dropped unclosed, not released: %s",
                                             model_id, e))


class DistributedModel:
    """A model deployed on a Dask cluster; call it like the model. See ``deploy``."""

    def __init__(self, client: Any, plan: Plan, model_id: str, token: str, version: int,
                 checkpoint_dir: str = "", verify_every: int = 0, ticket: str = "") -> None:
        self.client = client
        self.graph = plan.graph
        self.model_id = model_id
        self._token = token
        self._ticket = ticket                        # NOTE: what data-plane messages of this model show
        self.p2p = config.data_plane() == "p2p" and bool(ticket)
        self.checkpoint_dir = checkpoint_dir
        self.verify_every = verify_every
        self._inflight: dict[int, Handle] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)     # NOTE: notified on a new plan or a stranding
        self._requests = itertools.count()
        self._stranded: str | None = None
        self._closed = False
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)      # oldest first
        self._store: object | None = None            # keeps a weight store folder alive
        self._client_s: deque[tuple[float, float]] = deque(maxlen=64)   # (submit, after gather) per request
        self._source: Any = None                     # the module or folder step programs are traced from
        self._weights_path: str | None = None        # where those programs read the weights
        self._budget: int | None = None
        self._programs: dict[tuple[int, int], StepProgram] = {}
        self._shape_programs: dict[tuple[Any, ...], StepProgram] = {}   # forward at other input shapes
        self._trace_kwargs: dict[str, Any] = {}       # the non-tensor keywords it was traced with
        self._program_lock = threading.Lock()
        self._engine: Engine | None = None
        self._limits: tuple[int | None, int | None] = (None, None)    # (sessions, context) reserved
        self._deadline = Deadline()                  # usual times per program: the hang bound
        self.version = -1
        self._set_plan(plan, version)
        events.listen(client, model_id, self._on_event)
        # NOTE: a model its caller drops unclosed is released all the same (``_release_dropped``)
        self._finalizer = weakref.finalize(self, _release_dropped, client, model_id, token, checkpoint_dir)
        self._finalizer.atexit = False

    # --- plan ------------------------------------------------------------------------------
    def _set_plan(self, plan: Plan, version: int) -> None:
        specs = block_specs(plan, self.model_id, version, self.checkpoint_dir, self.verify_every)
        leaves = set(self.graph.leaf_outputs)
        out = {t: s.index for s in specs for t in s.exports if t in leaves}
        with self._lock:
            if version < self.version:
                return      # NOTE: the event and a catch-up may bring the same plan twice
            self._plan, self.version, self._layout = plan, version, StepLayout(version, specs, out)
            self._stranded = None       # NOTE: a newer plan holds the model again
            for prog in [*self._programs.values(), *self._shape_programs.values()]:
                prog.follow(plan, self.model_id, version, verify_every=self.verify_every)
            self._changed.notify_all()

    @property
    def plan(self) -> Plan:
        """The current plan; ``print(dm.plan)`` prints its table."""
        return self._plan

    @property
    def specs(self) -> list[BlockSpec]:
        """The blocks of the model's own program under the current plan."""
        return self._layout.specs

    def _on_event(self, msg: Mapping[str, Any]) -> None:
        self.events.append({k: v for k, v in msg.items() if k != "plan"})
        if msg.get("action") == "stranded":
            with self._changed:
                self._stranded = str(msg.get("message"))
                self._changed.notify_all()
            doomed = list(self._inflight.values())
            if doomed:    # NOTE: this runs on the client's event loop: cancel from another thread
                threading.Thread(target=self._cancel, args=(doomed,), daemon=True).start()
        elif msg.get("action") == "plan" and int(msg["version"]) > self.version:
            self._set_plan(Plan.from_json(msg["plan"], self.graph), int(msg["version"]))

    # --- requests -----------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run one request; returns what the model returns (same structure and values).

        A request stuck on a worker that stopped answering runs again on the plan that
        fences it (``seabiscuit.runtime.hang-*``), with the same result.
        """
        self._check_open()
        self._check_inputs(inputs, kwargs)
        prog = self._program_for(inputs, kwargs)
        graph = prog.graph if prog is not None else self.graph
        flat = flatten_inputs(graph, inputs, kwargs)
        feed = split_inputs(graph, {name: x.cpu() for name, x in zip(graph.inputs, flat)})
        failed = stale = 0
        while True:
            try:
                return self._request(prog, graph, feed)
            except StaleRun as e:         # NOTE: the plan changed under it: cheap to send again
                stale += 1
                if stale > STALE_TRIES:
                    raise restless(f"a request of model {self.model_id}", stale, e) from e
                self.recover(e)
            except (WorkerHung, RunFailed) as e:
                failed += 1
                if failed == 3:
                    raise
                self.recover(e)

    def _check_inputs(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse, before any tracing, a call too large (``seabiscuit.runtime.max-input-elements``),
        longer than the model's positions, or with token ids outside its vocabulary."""
        args, ordered = bind_call(self.graph, inputs, dict(kwargs))
        leaves = [x for x in pytree.tree_leaves((args, ordered)) if isinstance(x, torch.Tensor)]
        n, limit = sum(x.numel() for x in leaves), int(config.get("runtime.max-input-elements"))
        if n > limit:
            raise BadInput(f"model {self.model_id}: the call's inputs hold {n} elements, more than "
                           f"seabiscuit.runtime.max-input-elements={limit}; send smaller inputs (or "
                           "raise the limit)")
        ranges = self.graph.meta.get("index_ranges") or {}
        for name, x in zip(self.graph.inputs, leaves):
            if name in ranges:
                self._check_tokens(name, x, int(ranges[name]))

    def _check_tokens(self, name: str, x: torch.Tensor, vocab: int | None) -> None:
        positions = max_positions(getattr(self._source_module(), "config", None)) \
            if self._source is not None else None
        if positions and x.dim() >= 1 and x.shape[-1] > positions:
            raise BadInput(f"input {name!r} of model {self.model_id} holds {x.shape[-1]} tokens a row, "
                           f"more than the model's {positions} positions; shorten it")
        if vocab:
            check_ids(name, x, vocab)

    def unavailable(self) -> str | None:
        """None while the model serves; else why it does not: closed, or stranded (the rest of the
        cluster cannot hold it), as the scheduler says now."""
        if self._closed:
            return f"distributed model {self.model_id} is closed"
        if self._stranded:
            try:
                self._catch_up()      # NOTE: the plan that holds it again may be on its way
            except Exception as e:  # noqa: BLE001 - no answer: what it last heard stands
                logger.info("seabiscuit: model %s: the scheduler did not say whether it serves: %s",
                            self.model_id, e)
        return self._stranded or None

    def _check_open(self) -> None:
        """Refuse a call to a closed model, or to a stranded one (``WorkerLost``, at once). A model
        seen stranded is asked about first: the plan that holds it again may be on its way."""
        if self._closed:
            raise ModelClosed(f"distributed model {self.model_id} is closed")
        if self._stranded:
            self._catch_up()
        if self._stranded:
            raise WorkerLost(self._stranded)

    def _next_request(self) -> int:
        """A new request number: in order (the scheduler runs requests in it), with 32 random
        low bits, so no other client can name a request of this model before it is sent."""
        return (next(self._requests) << 32) | secrets.randbits(32)

    def _request(self, prog: StepProgram | None, graph: Any, feed: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        layout = prog.layout if prog is not None else self._layout
        handle = self._submit(prog, layout, feed)
        t1 = time.perf_counter()
        try:
            outputs = self._outputs(handle)
            t2 = time.perf_counter()
        finally:
            if self.checkpoint_dir:
                shutil.rmtree(Path(self.checkpoint_dir) / self.model_id / f"r{handle.request}",
                              ignore_errors=True)
        values = {t: outputs[t] if t in outputs else feed[t] for t in graph.leaf_outputs}
        out = unflatten_outputs(graph, assemble_outputs(graph, values))
        # NOTE: what this client spends on a request besides waiting: part of Dask's cost
        self._client_s.append((t1 - t0, time.perf_counter() - t2))
        return out

    # --- generation -----------------------------------------------------------------------------
    def generate(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
                 do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
                 generator: Any = None, streamer: Any = None) -> Any:
        """Generate as Hugging Face ``model.generate`` does, on the cluster: returns the prompt
        followed by the new tokens ((batch, length + new) LongTensor, ``pad_token_id`` after EOS).

        Greedy decoding gives Hugging Face's tokens; sampling (``do_sample=True`` with
        ``temperature``, ``top_k``, ``top_p``) is reproducible from a seeded ``generator``.
        Defaults come from the model's generation config. Every row is a session whose
        KV cache lives on the workers that own its attention blocks; rows of different
        lengths (left padding and an ``attention_mask``) are fine. ``streamer``: a Hugging
        Face streamer (``TextStreamer``), fed the prompt and then each new token.

        Examples
        --------
        >>> ids = tok.apply_chat_template(msgs, add_generation_prompt=True,
        ...                               return_tensors="pt")["input_ids"]   # doctest: +SKIP
        >>> out = dm.generate(ids, max_new_tokens=32)                         # doctest: +SKIP
        >>> print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))  # doctest: +SKIP
        """
        engine, args = self._generation_args(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                                             eos_token_id, pad_token_id, generator, attention_mask)
        return generate_tokens(engine, input_ids, args, attention_mask, streamer)

    def stream(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
               do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
               generator: Any = None, streamer: Any = None) -> Any:
        """``generate``, yielding the new tokens as they come: a (batch,) LongTensor per step.

        Examples
        --------
        >>> for t in dm.stream(ids, max_new_tokens=32):                    # doctest: +SKIP
        ...     print(tok.decode(t[0]), end="", flush=True)
        """
        engine, args = self._generation_args(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                                             eos_token_id, pad_token_id, generator, attention_mask)
        return stream_tokens(engine, input_ids, args, attention_mask, streamer)

    def session(self) -> ChatSession:
        """A conversation whose KV cache stays on the workers between calls: each ``generate``
        prefills only the new turn's tokens (one prompt per call).

        Examples
        --------
        >>> with dm.session() as chat:                                      # doctest: +SKIP
        ...     first = chat.generate(turn1, 32)
        ...     second = chat.generate(turn2, 32)    # turn1, its answer and turn2 are cached
        """
        return ChatSession(self, self._generation_engine().open_session())

    def generation_stats(self) -> dict[str, Any]:
        """Steps, tokens and seconds of generation so far, and the step programs built:
        per (batch, tokens) shape its Dask tasks per step and what building it cost."""
        stats: dict[str, Any] = self._engine.stats.as_dict() if self._engine is not None else {}
        stats["programs"] = {f"{b}x{n}": {"tasks": len(p.specs), "build_s": p.build_s,
                                          "micro_ops": len(p.graph.ops)}
                             for (b, n), p in sorted(self._programs.items())}
        return stats

    def warm(self, lengths: Sequence[int] | None = None, batches: Sequence[int] | None = None,
             progress: Any = None) -> list[str]:
        """Build now the step programs generation asks for, and run each once, so no request pays
        for building one, nor for the workers' first run of its blocks (their kernels' first
        calls, the data plane's connections): by default every one (a prefill program per bucket
        length, ``seabiscuit.generate.prefill-buckets``, and a decode program per batch size,
        ``batch-buckets``, up to the deployment's sessions); ``lengths``: only the prefill chunks
        of prompts this long; ``batches``: only these decode batch sizes. Returns the shapes
        ("batch x tokens") made ready; ``progress``: called with a line each.

        Examples
        --------
        >>> dm.warm()                                   # doctest: +SKIP
        ['1x16', '1x32', ..., '1x1', '2x1', '4x1', '8x1']
        """
        return self._generation_engine().warm(lengths, batches, progress)

    def _generation_args(self, input_ids: Any, max_new_tokens: Any, do_sample: Any, temperature: Any,
                         top_k: Any, top_p: Any, eos: Any, pad: Any, generator: Any,
                         attention_mask: Any = None) -> tuple[Engine, GenerateArgs]:
        engine = self._generation_engine()
        if isinstance(input_ids, torch.Tensor):      # NOTE: the engine checks the type and the context
            cfg = getattr(self._source_module(), "config", None)
            vocab = (self.graph.meta.get("index_ranges") or {}).get("input_ids") or \
                getattr(getattr(cfg, "get_text_config", lambda: cfg)(), "vocab_size", None)
            kept = input_ids if not isinstance(attention_mask, torch.Tensor) or \
                attention_mask.shape != input_ids.shape else input_ids[attention_mask.bool()]
            check_ids("input_ids", kept, int(vocab) if vocab else 2**62)
        length = int(input_ids.shape[-1]) if hasattr(input_ids, "shape") else 0
        args = GenerateArgs.make(getattr(self._source_module(), "generation_config", None), length,
                                 max_new_tokens, do_sample, temperature, top_k, top_p, eos, pad, generator)
        return engine, args

    def _generation_engine(self) -> Engine:
        """The engine of this deployment's generate calls, made on first use."""
        self._check_open()
        if self._source is None:
            raise BadInput(f"model {self.model_id} was deployed from a plan alone: generation traces its "
                           "step programs from the model, so deploy with weights=model or use sb.distribute")
        if self._engine is None:
            sessions, context = self._limits
            context = context or max_positions(getattr(self._source_module(), "config", None))
            first = self.graph.tensors[self.graph.inputs[0]].shape if self.graph.inputs else ()
            self._engine = Engine(self, max_sessions=sessions, context=int(context) if context else None,
                                  max_chunk=int(first[-1]) if len(first) == 2 else None,
                                  name=f"model {self.model_id}")
        return self._engine

    def _kv_context(self) -> int:
        """The tokens a session of this deployment holds at most: the context it declared (that
        placement kept KV room for), else the model's positions; 0 where neither is known."""
        context = self._limits[1]
        if not context and self._source is not None:
            context = max_positions(getattr(self._source_module(), "config", None))
        return int(context or 0)

    def _source_module(self) -> Any:
        if isinstance(self._source, (str, os.PathLike)):
            from ..trace import load_hf_skeleton

            self._source = (load_hf_skeleton(self._source), self._source)
        return self._source[0] if isinstance(self._source, tuple) else self._source

    def _step_program(self, batch: int, length: int) -> StepProgram:
        """The step program of this shape: traced, decomposed and registered once, then reused."""
        key = (batch, length)
        with self._program_lock:
            prog = self._programs.get(key)
            if prog is None:
                prog = self._programs[key] = self._register(lambda: self._trace_step(batch, length))
            return prog

    def _trace_step(self, batch: int, length: int) -> Any:
        """``trace_step`` of the model at this shape, once more where ``torch.export`` failed: it fails
        so for a while when another thread of this process runs a torch module as it traces (torch
        patches module calls process-wide meanwhile), and the model traced before, and a step's
        shapes are its own. A second failure names that cause and the cure."""
        from ..trace.decoder import trace_step
        from ..trace.torch_export import EXPORT_FAILED

        tried = False
        while True:
            try:
                return trace_step(self._source_module(), batch, length)
            except UnsupportedModel as e:
                if not str(e).startswith(EXPORT_FAILED):
                    raise
                if tried:
                    raise UnsupportedModel(
                        f"model {self.model_id}: the step program of {batch} row(s) x {length} token(s) "
                        f"did not trace, twice: {e}. The model traced at its deployment's shapes; if another "
                        "thread of this process ran torch modules meanwhile, that is the cause (torch.export "
                        "patches every module call in the process while it traces): build the step "
                        "programs first, dm.warm()") from e
                logger.warning("seabiscuit: model %s: step program %sx%s: %s; tracing it again",
                               self.model_id, batch, length, e)
                tried = True

    def _program_for(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> StepProgram | None:
        """None for a call at the traced shapes; else the program of the call's shapes (traced,
        decomposed like the deployment and registered once: a forward pass of any input size)."""
        args, ordered = bind_call(self.graph, inputs, dict(kwargs))
        leaves = [x for x in pytree.tree_leaves((args, ordered)) if isinstance(x, torch.Tensor)]
        shapes = tuple((tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in leaves)
        traced = tuple((self.graph.tensors[n].shape, self.graph.tensors[n].dtype) for n in self.graph.inputs)
        # NOTE: other sizes of the same inputs only; anything else is refused by the traced graph
        if len(leaves) != len(traced) or shapes == traced or any(
                d != td or len(s) != len(ts) for (s, d), (ts, td) in zip(shapes, traced)):
            return None
        with self._program_lock:
            prog = self._shape_programs.get(shapes)
            if prog is None:
                from ..trace import trace

                call = {**self._trace_kwargs, **ordered}
                try:
                    prog = self._register(lambda: trace(self._source_module(), tuple(args), call))
                except UnsupportedModel as e:      # NOTE: it traced at its first shapes: these are wrong
                    got = ", ".join(f"{list(s)} {d}" for s, d in shapes)
                    want = ", ".join(f"{list(s)} {d}" for s, d in traced)
                    raise BadInput(f"model {self.model_id} does not take inputs of shapes {got} (it was "
                                   f"traced with {want}): {e}") from e
                self._shape_programs[shapes] = prog
            return prog

    def _register(self, make: Callable[[], Any]) -> StepProgram:
        """Another program of this deployment: ``make()``'s graph, decomposed where the deployment
        cut its weights, bound to the same weight tiles, registered with the scheduler and placed
        where those tiles are."""
        from ..decompose import decompose
        from ..trace import bind_checkpoint

        t0 = time.perf_counter()
        graph = copied_if_unreadable(decompose(make(), self._budget, like=self.graph), self._source)
        if any(p.source.kind == "model" for p in graph.params.values()):
            if self._weights_path is None:
                raise BadInput(f"model {self.model_id}: no weights file to bind another program to")
            graph = bind_checkpoint(graph, self._weights_path, kinds=("model",))
        graph = _with_checksums(graph, self.graph)
        context = self._kv_context()
        if context:      # NOTE: a session's cache grows to this at most: the room placement kept for it
            graph = graph.with_meta(kv_context=context)
        reply = self.client.sync(self.client.scheduler.seabiscuit_program, model=self.model_id,
                                 token=self._token, graph=graph.to_json())
        prog = StepProgram(graph, int(reply["program"]))
        with self._lock:
            prog.follow(self._plan, self.model_id, self.version, verify_every=self.verify_every)
        _ = prog.layout          # NOTE: part of building it
        prog.build_s = time.perf_counter() - t0
        return prog

    def prepare(self, batch: int, length: int) -> None:
        """Build the step program of this shape (if not yet) before a step is timed."""
        self._step_program(batch, length)

    def run_step(self, batch: int, length: int, feed: dict[str, Any]) -> Any:
        """One step of generation on the cluster: logits (batch, vocab) of each row's last token."""
        prog = self._step_program(batch, length)
        return self.step_result(self._submit(prog, prog.layout, split_inputs(prog.graph, feed)))

    def submit_step(self, batch: int, length: int, feed: Callable[[], dict[str, Any]],
                    after: Handle | None = None, steps: int = 1) -> Handle | None:
        """Submit one step of the inputs ``feed()`` makes, without waiting; ``after``: a step of the
        same program whose greedy tokens are this step's ``input_ids`` (picked on the worker, so
        the step is queued before the one it follows has finished: Dask's cost per step overlaps
        the computing; a decode loop's next step runs already, and ``feed`` is not called).

        On the data plane ``steps`` > 1 starts a decode loop on the workers: each step after
        the first is fed by the worker that makes the logits, from their greedy tokens, with no
        caller in between; each step's handle is the ``after`` of the one before (None past
        the last), and discarding one stops the loop there."""
        prog = self._step_program(batch, length)
        if self.p2p and after is not None:
            return after.next
        # NOTE: one layout, whatever plan event comes meanwhile
        layout = prog.layout
        inputs = split_inputs(prog.graph, feed())
        one_tile = len(prog.graph.leaf_outputs) == 1 and "input_ids" not in prog.graph.tilings
        if self.p2p and steps > 1 and one_tile and set(inputs) == set(STEP_INPUTS):
            return self._submit_loop(prog, layout, inputs, steps)
        return self._submit(prog, layout, inputs, after)

    def _submit_loop(self, prog: StepProgram, layout: StepLayout, inputs: dict[str, Any],
                     steps: int) -> Handle:
        self._check_open()
        requests = [self._next_request() for _ in range(steps)]
        wanted = sorted(set(layout.out_at.values()))
        futures = p2p.start_loop(self.client, self.model_id, self._ticket, layout.version, requests,
                                 layout.route(wanted), inputs, prog.graph.leaf_outputs[0])
        handles = [Handle(prog, layout, r, wanted, [], f) for r, f in zip(requests, futures)]
        for h, nxt in zip(handles, [*handles[1:], None]):
            h.next = nxt
            if nxt is not None:
                nxt.tokens = True       # NOTE: collected as greedy tokens (``p2p.start_loop``)
            self._inflight[h.request] = h
        return handles[0]

    @property
    def chains_steps(self) -> bool:
        """Whether ``submit_step(after=...)`` queues a step behind another: a task chained to the
        one before, or a step of a decode loop on the data plane (``steps``)."""
        return True

    @property
    def pipelines_prefill(self) -> bool:
        """Whether ``submit_chunk`` sends a prompt's next chunk before the one before it has
        finished (the data plane orders their cache writes on each worker;
        ``seabiscuit.generate.pipeline-prefill``)."""
        return self.p2p and bool(config.get("generate.pipeline-prefill", True))

    @property
    def prefill_stages(self) -> int:
        """The workers a prompt's chunks flow through, one after another (a chunk runs on one
        while the chunk before runs on the next): those holding blocks of the model's plan."""
        return max(1, len({s.address for s in self.specs if s.ops}))

    def submit_chunk(self, length: int, feed: dict[str, Any], follows: Handle | None = None) -> Handle:
        """Send one prefill chunk of one session without waiting; ``follows``: the chunk of the same
        prompt before it, which may still run (each worker holds this chunk's blocks until that
        one cached what they read: one chunk runs on a stage while the one before runs on the next)."""
        prog = self._step_program(1, length)
        layout = prog.layout
        if follows is not None and follows.version != layout.version:
            raise StaleRun(f"model {self.model_id} moved to plan v{layout.version} between two chunks of a "
                           f"prompt (the one before ran on v{follows.version}): they run again one by one")
        return self._submit(prog, layout, split_inputs(prog.graph, feed), follows=follows)

    def _submit(self, prog: StepProgram | None, layout: StepLayout, inputs: dict[str, Any],
                after: Handle | None = None, follows: Handle | None = None) -> Handle:
        """Send one request of ``prog`` (None: the model's own program) under ``layout``; every
        request and generation step goes this way. ``follows``: a request (on the data plane)
        whose cache writes this one reads."""
        self._check_open()
        request = self._next_request()
        wanted = sorted(set(layout.out_at.values()))
        if self.p2p:
            if after is not None:
                raise SeaBiscuitError("the p2p data plane chains no steps: see chains_steps")
            pending = p2p.start(self.client, self.model_id, self._ticket, layout.version, request,
                                layout.route(wanted), inputs,
                                after=-1 if follows is None else follows.request)
            handle = Handle(prog, layout, request, wanted, [], pending)
        else:
            dsk, keys = request_graph(layout.specs, request, inputs, run_block_task)
            if after is not None:
                for key in keys:
                    mine = dsk[key][5]
                    if "input_ids" in mine:
                        mine = {k: v for k, v in mine.items() if k != "input_ids"}
                        mine[PICK] = {"logits": after.logits, "rows": int(inputs["input_ids"].shape[0])}
                        dsk[key] = (*dsk[key][:5], mine, *dsk[key][6:], after.out)
            at = {s.index: i for i, s in enumerate(layout.specs)}
            handle = Handle(prog, layout, request, wanted, self.client.get(dsk, [keys[at[b]] for b in wanted],
                                                                           sync=False))
        self._inflight[request] = handle
        return handle

    def step_result(self, handle: Handle) -> Any:
        """The logits (batch, vocab) of a submitted step's last position."""
        assert handle.program is not None
        if handle.tokens:
            raise SeaBiscuitError(f"request {handle.request} is a decode-loop step: its caller gets its "
                                  "greedy tokens (step_tokens), not its logits")
        logits = assemble_outputs(handle.program.graph, self._outputs(handle))[0]
        return logits[:, -1]

    def step_tokens(self, handle: Handle) -> Any:
        """The greedy tokens (batch,) of a submitted step: all a decode loop's later steps send
        back (the worker picks them from its logits), the argmax of the logits for another."""
        if not handle.tokens:
            return greedy(self.step_result(handle))
        (tokens,) = self._outputs(handle).values()
        return tokens

    def discard(self, handle: Handle) -> None:
        """Let go of a submitted step (one read ahead that is not needed runs out unseen), and of
        the steps of a decode loop after it."""
        chain: list[Handle] = []
        h: Handle | None = handle
        while h is not None:
            chain.append(h)
            h = h.next
        for h in chain:
            self._release(h, done=h.pending is not None)      # NOTE: the data plane's, forgotten at once
            if h.pending is not None:
                h.pending.cancel()
        if handle.pending is not None:
            p2p.forget(self.client, self.model_id, self._ticket, [h.request for h in chain],
                       handle.layout.addresses)

    def _outputs(self, handle: Handle) -> dict[str, Any]:
        """The graph output tiles a request computed; it is then let go; a failure as a SeaBiscuitError."""
        done = False
        try:
            self._await(handle)
            if handle.pending is not None:
                results = handle.pending.result()
            else:
                results = dict(zip(handle.wanted, self.client.gather(handle.futures)))
            done = True
        except SeaBiscuitError as e:
            if isinstance(e, WorkerLost):
                e.version = handle.version       # type: ignore[attr-defined]   # NOTE: see recover
            if self._closed and not isinstance(e, ModelClosed):
                raise self._request_error(handle.request, e) from e
            raise
        except Exception as e:
            raise self._request_error(handle.request, e) from e
        finally:
            self._release(handle, done)
        out_at = handle.layout.out_at
        return {t: results[b][t] for t, b in out_at.items()}

    def _await(self, handle: Handle) -> None:
        """Wait for a request; past its program's bound (``watch.Deadline``) have the scheduler
        probe the request's workers: one that does not answer is fenced, and this raises
        ``WorkerHung`` once the plan that goes around it is here."""
        from distributed import wait

        request, program = handle.request, handle.program.number if handle.program is not None else 0
        t0 = time.perf_counter()
        bound = self._deadline.bound_s(program)
        while True:
            try:
                if handle.pending is not None:
                    concurrent.futures.wait([handle.pending], timeout=bound)
                    if not handle.pending.done():
                        raise TimeoutError
                else:
                    wait(handle.futures, timeout=bound)
                break
            except TimeoutError:
                self._check_open()
                reply = self.client.sync(self.client.scheduler.seabiscuit_stalled, model=self.model_id,
                                         token=self._token, request=request)
                if reply.get("stranded"):
                    with self._changed:
                        self._stranded = str(reply["stranded"])
                    raise WorkerLost(f"request {request} of model {self.model_id} cannot finish: "
                                     f"{reply['stranded']}") from None
                if reply.get("fenced"):
                    self._catch_up(reply.get("version"))
                    raise WorkerHung(
                        f"request {request} of model {self.model_id} made no progress for "
                        f"{time.perf_counter() - t0:.1f} s (bound {bound:.1f} s): worker(s) "
                        f"{', '.join(reply['fenced'])} did not answer a probe, were fenced and the work "
                        "runs again on the others") from None
                if handle.pending is not None and self._lost(handle):
                    lost = RunFailed(
                        f"request {request} of model {self.model_id} made no progress for "
                        f"{time.perf_counter() - t0:.1f} s (bound {bound:.1f} s) and no worker of "
                        f"{handle.layout.addresses} holds any of it that moves: it was lost, and runs "
                        "again")
                    logger.warning("seabiscuit: %s", lost)     # NOTE: the retry hides it from the caller
                    raise lost from None
                bound *= 2       # NOTE: every worker answered: slow, not hung; look again later
        self._deadline.observe(program, time.perf_counter() - t0)

    def _lost(self, handle: Handle) -> bool:
        """Whether a data-plane request past its bound is lost: no worker runs a block of it, and
        what they hold of it stays the same over a probe timeout while its reply does not come."""
        assert handle.pending is not None

        def look() -> list[list[int]]:
            return p2p.progress(self.client, self.model_id, self._ticket, handle.request,
                                handle.layout.addresses, seconds("runtime.probe-timeout"))

        first = look()
        if any(p[0] for p in first):
            return False
        concurrent.futures.wait([handle.pending], timeout=seconds("runtime.probe-timeout"))
        return not handle.pending.done() and look() == first and not handle.pending.done()

    def _request_error(self, request: int, e: BaseException) -> SeaBiscuitError:
        if self._closed:
            return ModelClosed(f"request {request} of model {self.model_id} did not finish: the model was "
                               f"closed ({type(e).__name__})")
        return _request_error(request, self.model_id, self._stranded, e)

    def _release(self, handle: Handle, done: bool) -> None:
        """Let go of a request: its futures, and (unless it finished) what workers hold of it."""
        self._inflight.pop(handle.request, None)
        for f in handle.futures:
            f.release()
        if handle.pending is not None and not done:
            handle.pending.cancel()
            p2p.forget(self.client, self.model_id, self._ticket, [handle.request],
                       handle.layout.addresses)

    def _cancel(self, handles: list[Handle]) -> None:
        """End requests in flight (the model closes or is stranded): their waits end at once."""
        futures = [f for h in handles for f in h.futures]
        if futures and self.client.status == "running":
            self.client.cancel(futures)
        for h in handles:
            if h.pending is not None:
                h.pending.cancel()

    def end_sessions(self, sessions: Any, renamed: Any = ()) -> None:
        """Free the KV caches of ``sessions`` on every worker, and rename those of ``renamed``
        ((old, new, slots kept) each, ``KVStore.rename``)."""
        if self.client.status == "running" and not self._closed:
            self.client.sync(self.client.scheduler.seabiscuit_end_sessions, model=self.model_id,
                             token=self._token, sessions=[int(s) for s in sessions],
                             renamed=[[int(o), int(n), int(k)] for o, n, k in renamed])

    def recover(self, error: BaseException) -> None:
        """After a worker loss in a step: take the plan the scheduler holds now (the event that
        brings it may still be on its way, or have come already), unless the model is stranded.
        A data-plane run that failed under plan v (a worker could not be reached) waits for a plan
        newer than v, up to ``sync-timeout``: the scheduler may hear of a worker's death after the
        caller did, and its repair takes a moment on a loaded machine (the wait ends as it comes)."""
        self._check_open()
        self._catch_up()
        failed_at = getattr(error, "version", None)
        if isinstance(error, RunFailed) and not isinstance(error, StaleRun) \
                and failed_at is not None and self.version <= int(failed_at):
            with self._changed:
                self._changed.wait_for(lambda: self.version > int(failed_at) or self._closed
                                       or bool(self._stranded), timeout=seconds("runtime.sync-timeout"))
            self._catch_up()
        if self._stranded:
            raise WorkerLost(self._stranded) from error

    def _catch_up(self, version: int | None = None) -> None:
        """Hold the scheduler's current plan of this model (or at least ``version``)."""
        if version is not None and self.version >= int(version):
            return
        reply = self.client.sync(self.client.scheduler.seabiscuit_plan, model=self.model_id,
                                 token=self._token)
        if reply.get("stranded"):
            with self._changed:
                self._stranded = str(reply["stranded"])
        elif int(reply["version"]) > self.version:
            self._set_plan(Plan.from_json(reply["plan"], self.graph), int(reply["version"]))

    def _wait_version(self, want: int) -> None:
        """Block until this object holds plan ``want`` (its event comes on the client's loop)."""
        if self.version >= want:
            return
        with self._changed:
            self._changed.wait_for(lambda: self.version >= want or self._closed or bool(self._stranded),
                                   timeout=seconds("runtime.sync-timeout"))
        self._catch_up(want)      # NOTE: the event was late or lost: ask

    # --- operations on this model ------------------------------------------------------------
    def _address(self, worker: str) -> str:
        for d in self._plan.spec.devices:
            if worker in (d.name, d.address):
                return d.address
        from .discover import cluster_workers, device_name

        info = cluster_workers(self.client)
        for addr, w in info.items():
            alias = device_name({"name": w.get("name"), "address": addr}, set())   # "w0" for worker 0
            if worker in (addr, str(w.get("name")), alias):
                return str(addr)
        raise SeaBiscuitError(f"no worker {worker!r} in the cluster; workers: {sorted(info)}")

    def _ask(self, op: str, **kwargs: Any) -> dict[str, Any]:
        """Call the scheduler plugin's ``seabiscuit_<op>`` for this model and wait for the new plan."""
        reply = dict(self.client.sync(getattr(self.client.scheduler, f"seabiscuit_{op}"),
                                      model=self.model_id, token=self._token, **kwargs))
        want = reply.get("versions", {}).get(self.model_id)
        if want is not None:
            self._wait_version(int(want))
        return reply

    def drain(self, worker: str, reason: str = "drained") -> dict[str, Any]:
        """Move this model off ``worker`` (name or address) while requests keep flowing.

        Returns the scheduler's report: ``replan_s``, ``versions``.
        """
        return self._ask("drain", address=self._address(worker), reason=reason)

    def restore(self, worker: str) -> dict[str, Any]:
        """Let this model use a drained worker again; it spreads onto it as onto a worker that joins."""
        return self._ask("restore", address=self._address(worker))

    def set_budget(self, worker: str, memory: int | str) -> dict[str, Any]:
        """Give this model ``memory`` on ``worker``; what no longer fits moves elsewhere."""
        nbytes = config.to_bytes(memory, "memory budget")
        return self._ask("budget", address=self._address(worker), memory_bytes=nbytes)

    def run_counts(self) -> dict[str, int]:
        """Blocks computed, read back from checkpoints, and computed more than once, for this model."""
        self._flush_runs()
        return dict(self.client.sync(self.client.scheduler.seabiscuit_runs, model=self.model_id,
                                     token=self._token))

    def learned(self, last: int = 100) -> dict[str, Any]:
        """What the scheduler learned from this model's block runs: per worker, measured over
        modelled time per op class (``scales``), and the mean relative error of the last
        ``last`` block-time predictions (``error``)."""
        self._flush_runs()
        return dict(self.client.sync(self.client.scheduler.seabiscuit_learned, model=self.model_id,
                                     token=self._token, last=last))

    def _flush_runs(self) -> None:
        """Have the plan's workers report their data plane's block runs to the scheduler now."""
        if not self.p2p:
            return

        async def flush() -> None:
            async def one(addr: str) -> None:
                try:
                    await self.client.rpc(addr).seabiscuit_dp_flush()
                except Exception:  # noqa: BLE001 - a worker gone has nothing to report
                    pass
            await asyncio.gather(*(one(d.address) for d in self._plan.spec.devices))

        self.client.sync(flush)

    def predicted_s(self, learned: bool = True) -> float:
        """The simulated latency of one request on the current plan, or as first modelled.

        ``learned``: with the scales the scheduler learned (``learned()``) on its devices,
        and with this client's own submit and post-gather times, measured on its
        requests, in place of the probes' (the graph of a real request is larger).
        """
        plan = self._plan
        if learned:
            scales = self.learned()["scales"]
            spec = plan.spec
            for d in spec.devices:
                if d.address in scales:
                    spec = spec.with_changes(d.name, scale=dict(scales[d.address]))
            if self._client_s:
                submit = statistics.median(s for s, _ in self._client_s)
                after = statistics.median(a for _, a in self._client_s)
                spec = spec.with_dask(replace(spec.dask, submit_s=max(spec.dask.submit_s, submit),
                                              gather_s=spec.dask.gather_s + after))
            plan = Plan(plan.graph, spec, plan.device_of, plan.method, plan.planning_s, dict(plan.info))
        return plan.makespan_s

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: block runs, checkpoint resumes and writes, corruptions found, resident bytes."""
        keys = ("block_runs", "resumed_from_checkpoint", "checkpoints_written", "checkpoint_write_failures",
                "corrupt_tiles", "corrupt_checkpoints", "prefetched_blocks", "resident_bytes", "budget_bytes")
        return {i["address"]: {k: i["report"].get(k, 0) for k in keys}
                for i in workers_info(self.client, everyone=True)}

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model's blocks on every worker and its plans on the scheduler."""
        if self._closed:
            return
        self._finalizer.detach()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._cancel(list(self._inflight.values()))     # NOTE: calls in flight end now, as ModelClosed
        if self._engine is not None:
            self._engine.close()
        try:
            events.unlisten(self.client, self.model_id)
            if self.client.status == "running":
                self.client.sync(self.client.scheduler.seabiscuit_release, model=self.model_id,
                                 token=self._token)
        finally:
            if self.checkpoint_dir:
                shutil.rmtree(Path(self.checkpoint_dir) / self.model_id, ignore_errors=True)

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<DistributedModel {self.graph.meta.get('name', 'model')} {self.model_id}: "
                f"{len(self.graph.ops)} micro-ops in {len(self.specs)} blocks on "
                f"{len(self._plan.spec.devices)} workers, plan v{self.version}>")


class ChatSession:
    """A session of a ``DistributedModel`` kept across calls (``dm.session()``)."""

    def __init__(self, dm: DistributedModel, session: Any) -> None:
        self.dm, self._session, self._closed = dm, session, False
        self._engine = dm._generation_engine()
        # NOTE: a session its caller drops unclosed frees its slot and caches all the same
        self._finalizer = weakref.finalize(self, self._engine.close_session, session, False)
        self._finalizer.atexit = False

    @property
    def tokens(self) -> list[int]:
        """Every token of the conversation so far (prompts and answers)."""
        return list(self._session.tokens)

    def stream(self, input_ids: Any, max_new_tokens: int | None = None, **kwargs: Any) -> Any:
        """``DistributedModel.stream`` for this conversation's next turn (a (1, n) LongTensor)."""
        if self._closed:
            raise SessionClosed(f"session {self._session.sid} of model {self.dm.model_id} is closed; open "
                                "another (dm.session())")
        if getattr(input_ids, "shape", (0,))[0] != 1:
            raise BadInput(f"a session takes one prompt per turn, got input_ids of shape "
                           f"{tuple(getattr(input_ids, 'shape', ()))}")
        streamer = kwargs.pop("streamer", None)
        mask = kwargs.pop("attention_mask", None)
        names = ("do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "generator")
        do_sample, temperature, top_k, top_p, eos, pad, generator = [kwargs.pop(n, None) for n in names]
        engine, args = self.dm._generation_args(input_ids, max_new_tokens, do_sample, temperature, top_k,
                                                top_p, eos, pad, generator, attention_mask=mask)
        if kwargs:
            raise BadInput(f"unknown generate arguments {sorted(kwargs)}")
        return self._holding(stream_tokens(engine, input_ids, args, mask, streamer, session=self._session))

    def _holding(self, tokens: Any) -> Any:
        """``tokens`` as they come, this session kept alive meanwhile (``dm.session().stream(...)``
        drops the session at once, and its finalizer would close it under its own turn)."""
        yield from tokens

    def generate(self, input_ids: Any, max_new_tokens: int | None = None, **kwargs: Any) -> Any:
        """This turn's prompt followed by its answer, as ``DistributedModel.generate`` returns it."""
        rows = list(self.stream(input_ids, max_new_tokens, **kwargs))
        return torch.cat([input_ids.cpu(), torch.stack(rows, dim=1)], dim=1)

    def close(self) -> None:
        """Free the conversation's KV cache on every worker."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            self._engine.close_session(self._session)

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Handle:
    """A submitted request or step: the blocks it was submitted as (its plan version's, which a
    later plan does not change), and its futures (tasks) or its pending reply (data plane),
    and what a step that follows it reads of it."""

    def __init__(self, program: StepProgram | None, layout: StepLayout, request: int, wanted: list[int],
                 futures: list[Any], pending: concurrent.futures.Future[Any] | None = None) -> None:
        self.program, self.layout, self.request, self.wanted, self.futures, self.pending = (
            program, layout, request, wanted, futures, pending)
        self.next: Handle | None = None         # the next step of its decode loop (data plane)
        self.tokens = False                     # its outputs come back as greedy tokens (a loop step)
        graph = program.graph if program is not None else None
        chainable = graph is not None and len(graph.leaf_outputs) == 1 and len(wanted) == 1 \
            and "input_ids" not in graph.tilings and bool(futures)
        self.logits = graph.leaf_outputs[0] if chainable and graph is not None else ""
        self.out = futures[0] if chainable else None

    @property
    def version(self) -> int:
        return self.layout.version


@dataclass(frozen=True)
class StepLayout:
    """A program's blocks under one plan version: specs, and where each graph output tile is."""

    version: int
    specs: list[BlockSpec]
    out_at: dict[str, int]       # graph output tile -> index of the block that makes it
    routes: dict[tuple[int, ...], Any] = field(default_factory=dict, compare=False)

    @property
    def addresses(self) -> list[str]:
        """The workers its blocks run on."""
        return sorted({s.address for s in self.specs})

    def route(self, wanted: list[int]) -> Any:
        """Where a data-plane request of this layout sends inputs and collects outputs (once)."""
        key = tuple(wanted)
        if key not in self.routes:
            self.routes[key] = p2p.route(self.specs, wanted)
        return self.routes[key]


class StepProgram:
    """A program of a deployment (a generation step, a forward pass at another input size): its
    graph, its number, and its blocks under the current plan (``layout``, replaced whole)."""

    def __init__(self, graph: Any, number: int) -> None:
        self.graph = graph
        self.number = number
        self.build_s = 0.0
        self._layout = StepLayout(-1, [], {})
        self._target: tuple[Plan, str, int, int] | None = None
        self._derive = threading.Lock()

    @property
    def layout(self) -> StepLayout:
        """The blocks under the plan last given to ``follow``, derived on first use (not on the
        client's event loop, where plan events arrive)."""
        with self._derive:
            t = self._target
            if t is not None and t[2] != self._layout.version:
                plan, model_id, version, verify_every = t
                specs = block_specs(follow(plan, self.graph), model_id, version, "", verify_every,
                                    self.number)
                leaves = set(self.graph.leaf_outputs)
                out_at = {o: s.index for s in specs for o in s.exports if o in leaves}
                # NOTE: one assignment: a step submitted under the old layout keeps reading the old one
                self._layout = StepLayout(version, specs, out_at)
            return self._layout

    @property
    def specs(self) -> list[BlockSpec]:
        return self.layout.specs

    @property
    def out_at(self) -> dict[str, int]:
        return self.layout.out_at

    def follow(self, plan: Plan, model_id: str, version: int, verify_every: int = 0) -> None:
        """Take the blocks where ``plan`` holds the weights (as the scheduler does) from now on."""
        self._target = (plan, model_id, version, verify_every)


def _with_checksums(graph: Any, model_graph: Any) -> Any:
    """``graph`` with the tile checksums and weight layouts of the model's graph, for the tiles
    both read (so every program holds a shared tile the same way)."""
    shared = {n for n, p in graph.params.items()
              if n in model_graph.params and model_graph.params[n].source == p.source}
    meta = {}
    for key in ("tile_crc32", "weight_layouts", "matmul_forms"):
        of_model = model_graph.meta.get(key) or {}
        if any(n in of_model for n in shared):
            meta[key] = {n: of_model[n] for n in shared if n in of_model}
    return graph.with_meta(**meta) if meta else graph


def _request_error(request: int, model_id: str, stranded: str | None, e: BaseException) -> SeaBiscuitError:
    """What a failed request raises: ``WorkerLost`` when workers went away, else ``SeaBiscuitError``."""
    from asyncio import CancelledError

    from distributed.scheduler import KilledWorker, NoValidWorkerError

    where = f"request {request} of model {model_id}"
    if stranded:
        return WorkerLost(f"{where} cannot finish: {stranded}")
    if isinstance(e, (KilledWorker, NoValidWorkerError, CancelledError)):
        return WorkerLost(f"{where} cannot finish: {type(e).__name__}: {e}")
    return SeaBiscuitError(f"{where} failed in a block: {type(e).__name__}: {e}")


def deploy(plan: Plan, client: Any, *, weights: Any = None,
           checkpoint_dir: str | os.PathLike[str] | None = None, verify_every: int | None = None,
           progress: Progress | None = None, decode_rows: int | None = None) -> DistributedModel:
    """Put a ready ``plan`` onto the cluster behind ``client``; returns a callable ``DistributedModel``.

    Parameters
    ----------
    plan : Plan
        A plan whose devices are this cluster's workers (``place(graph, measure_cluster(client))``,
        or one saved with ``Plan.to_json`` and loaded back).
    client : distributed.Client
        A client of a cluster running ``SeaBiscuitSchedulerPlugin``.
    weights : nn.Module, optional
        The model, when the graph reads its weights from memory; they are written once
        to a safetensors store (config ``seabiscuit.runtime.store-directory``) the workers read.
    checkpoint_dir : path, optional
        Checkpoint every block's outputs there (a folder every worker sees, inside
        ``seabiscuit.roots``), so a block that must run again after a worker loss reads
        them back (default: config ``seabiscuit.checkpoint.directory``; None: none).
    verify_every : int, optional
        Check each block's resident tiles against their checksums every N runs
        (default: config ``seabiscuit.integrity.verify-every``; 0: only when read).
    progress : callable, optional
        Called with a line of text at each long step.
    decode_rows : int, optional
        Generation: the rows a decode step multiplies (``distribute`` gives it from
        ``sessions``). Each matmul weight on a CPU is held in the order its kernel runs
        fastest for these rows, else for the rows of the plan's graph, measured on one
        worker (config ``seabiscuit.lower.weight-layout``; ``lower.layout``).

    Examples
    --------
    >>> plan = sb.place(sb.decompose(sb.trace(model, x)), sb.measure_cluster(client))  # doctest: +SKIP
    >>> dm = sb.deploy(plan, client, weights=model)                                   # doctest: +SKIP
    """
    say = progress or _quiet
    ckpt = checkpoint_dir if checkpoint_dir is not None else config.get("checkpoint.directory")
    ckpt = os.fspath(writable(os.fspath(ckpt))) if ckpt else ""
    every = int(verify_every if verify_every is not None else config.get("integrity.verify-every", 0) or 0)
    holder = _StoreOwner()
    graph, folder = stored(plan.graph, weights, holder)
    if folder is not None:
        say(f"wrote {fmt_bytes(graph.param_bytes)} of weights to {folder}")
    layouts = weight_layouts(client, plan, graph, decode_rows)
    if layouts:
        graph = graph.with_meta(weight_layouts=layouts)
        say(f"{len(layouts)} matmul weight tile(s) held transposed: their kernel ran faster that way on a "
            "worker, for the rows this deployment multiplies")
    forms = matmul_forms(client, plan, graph, decode_rows)
    if forms:
        graph = graph.with_meta(matmul_forms=forms)
        say(f"{len(forms)} linear weight(s) multiplied in columns for a few rows: faster that way on a "
            "worker")
    if graph is not plan.graph:
        plan = Plan(graph, plan.spec, plan.device_of, plan.method, plan.planning_s, dict(plan.info))
    reply = client.sync(client.scheduler.seabiscuit_deploy, graph=graph.to_json(),
                        plan=plan.to_json(stats=False), checkpoint_dir=ckpt, verify_every=every,
                        claim=claim(client))
    dm = DistributedModel(client, plan, str(reply["model"]), str(reply["token"]), int(reply["version"]),
                          ckpt, every, str(reply.get("ticket", "")))
    dm._store = holder if folder is not None else None    # NOTE: the store lives as long as the model
    if isinstance(weights, torch.nn.Module):
        dm._source = weights
    if folder is not None:
        dm._weights_path = os.fspath(folder / "model.safetensors")
    dm._budget = plan.graph.meta.get("budget_bytes")
    try:
        _load(client, dm.specs, say)
    except BaseException:
        dm.close()      # NOTE: nothing half-deployed stays behind on the cluster
        raise
    return dm


def weight_layouts(client: Any, plan: Plan, graph: Any, rows: int | None = None) -> dict[str, str]:
    """How the workers hold ``graph``'s matmul weights on CPU devices of ``plan``
    (``lower.layout``): measured on the plan's first CPU worker, unless config
    ``seabiscuit.lower.weight-layout`` says ``traced`` (as the model holds them) or
    ``transposed`` (every one the other way, small ones too)."""
    from ..lower import layout

    setting = str(config.get("lower.weight-layout", "auto")).lower()
    if setting not in ("auto", "traced", "transposed"):
        raise BadInput(f"seabiscuit.lower.weight-layout is {setting!r}: use auto, traced or transposed")
    if setting == "traced" or graph.meta.get("weight_layouts"):
        return dict(graph.meta.get("weight_layouts") or {})
    on_cpu, timer = _cpu_timing(client, plan, graph)
    if not on_cpu:
        return {}
    if setting == "transposed":
        return layout.decide(graph, lambda cases: {c.key(): (2.0, 1.0) for c in cases}, rows, on_cpu, 0)
    return layout.decide(graph, timer, rows, on_cpu)


def _cpu_timing(client: Any, plan: Plan, graph: Any, columns: bool = False) -> tuple[set[str], Any]:
    """The params of ``graph`` on CPU devices of ``plan``, and a timer of matmul cases on the plan's
    first CPU worker (``lower.layout.measure``; ``columns``: as linear and in columns)."""
    from ..lower import layout

    cpu = {i for i, d in enumerate(plan.spec.devices) if d.kind == "cpu"}
    on_cpu = {p for op, d in zip(graph.ops, plan.device_of.tolist()) if d in cpu for p in op.params}
    address = next((plan.spec.devices[i].address for i in sorted(cpu)), "")

    def timer(cases: list[Any]) -> Mapping[str, tuple[float, float]]:
        return client.run(layout.measure_off_loop, cases, 5, columns, workers=[address])[address]
    return on_cpu, timer


def matmul_forms(client: Any, plan: Plan, graph: Any, rows: int | None = None) -> dict[str, list[int]]:
    """The rows counts each linear weight of ``graph`` on a CPU device of ``plan`` runs in columns
    (``lower.layout.columns``): measured on the plan's first CPU worker for the decode batches up
    to ``rows`` (a forward deployment: its graph's rows, when that few), unless config
    ``seabiscuit.lower.matmul-form`` says ``linear`` (never) or the graph names them already."""
    from ..lower import layout

    setting = str(config.get("lower.matmul-form", "auto")).lower()
    if setting not in ("auto", "linear"):
        raise BadInput(f"seabiscuit.lower.matmul-form is {setting!r}: use auto or linear")
    if setting == "linear" or "matmul_forms" in graph.meta:
        return dict(graph.meta.get("matmul_forms") or {})
    on_cpu, timer = _cpu_timing(client, plan, graph, columns=True)
    if not on_cpu:
        return {}
    if rows is not None:
        counts = [b for b in batch_buckets() if b <= max(1, int(rows))]
    else:
        counts = sorted({c.rows for c in layout.matmul_cases(graph).values()})
    return layout.decide_forms(graph, timer, counts, on_cpu, graph.meta.get("weight_layouts") or {})


def claim(client: Any) -> str:
    """A one-off secret this client sends down its own stream to the scheduler plugin: the deploy
    RPC that shows it makes this client the model's owner (an RPC alone says nothing of who asks)."""
    from .discover import HOW_TO_INSTALL, PluginMissing

    try:     # NOTE: an op the scheduler does not know would end this client's stream
        client.sync(client.scheduler.seabiscuit_hello, address="")
    except Exception as e:
        raise PluginMissing(f"the cluster at {client.scheduler.address} has no SeaBiscuit plugin: "
                            + HOW_TO_INSTALL) from e
    nonce = secrets.token_hex(16)
    client._send_to_scheduler({"op": "seabiscuit_claim", "nonce": nonce})
    return nonce


class _StoreOwner:
    """Keeps a weight store folder alive; the folder is removed when this is collected."""


def distribute(model_or_path: Any, client: Any, example_inputs: Any, budget: int | str | None = None, *,
               kwargs: Mapping[str, Any] | None = None, checkpoint: str | os.PathLike[str] | None = None,
               checkpoint_dir: str | os.PathLike[str] | None = None, verify_every: int | None = None,
               sessions: int | None = None, context: int | None = None, device: str | None = None,
               progress: Progress | None = None) -> DistributedModel:
    """Trace, decompose, place and deploy a model on the cluster behind ``client``.

    Parameters
    ----------
    model_or_path : nn.Module or path
        A PyTorch module with real weights, a module on ``meta`` plus ``checkpoint``,
        or a Hugging Face model folder (its safetensors are read slice by slice).
    client : distributed.Client
        A client of a cluster running ``SeaBiscuitSchedulerPlugin``.
    example_inputs : tensor or tuple
        Inputs of the shape and dtype every request will have.
    budget : bytes or str, optional
        Per-micro-op memory budget (default: config ``seabiscuit.budget``).
    sessions, context : int, optional
        Generation: keep room on the workers for the KV caches of ``sessions``
        sessions of ``context`` tokens each (defaults: config
        ``seabiscuit.generate.reserve-sessions``, 0, and the model's maximum
        positions), next to the attention blocks that will hold them; at most
        ``sessions`` may be open at once (else ``seabiscuit.generate.max-sessions``).
    device : {"auto", "cuda", "cpu"}, optional
        Where the model runs (default: config ``seabiscuit.device``, ``"auto"``): ``"auto"``
        on each worker's GPU where it has one, else on its CPU; ``"cuda"`` on GPU workers
        only (``DeviceUnavailable`` at once, before any weight moves, when there are none);
        ``"cpu"`` on CPUs and host memory only, GPU workers included (with their host-memory
        budgets). The choice is part of the plan (its devices' kinds) and holds after repairs.
    checkpoint_dir, verify_every, progress
        As for ``deploy``.

    Examples
    --------
    >>> client.register_plugin(sb.SeaBiscuitSchedulerPlugin())        # doctest: +SKIP
    >>> dm = sb.distribute(model, client, (ids,), budget="16MiB")      # doctest: +SKIP
    >>> logits = dm(ids).logits                                        # doctest: +SKIP
    >>> print(dm.plan)                                                 # doctest: +SKIP
    """
    from ..decompose import decompose
    from ..trace import trace
    from ..trace.onnx import is_onnx, load_onnx

    say = progress or _quiet
    nbytes = config.to_bytes(budget if budget is not None else config.get("budget"))
    n_sessions = config.to_count(sessions if sessions is not None
                                 else config.get("generate.reserve-sessions", 0) or 0, "sessions")
    context = config.to_count(context, "context", minimum=1) if context is not None else None
    choice = config.device_choice(device)
    if is_onnx(model_or_path):        # NOTE: a module whose buffers are its initializers (trace/onnx.py)
        model_or_path = load_onnx(model_or_path, lazy=True)
    t0 = time.perf_counter()
    spec = measure_cluster(client, device=choice)    # NOTE: fails early without the plugin or the device
    kinds = ", ".join(f"{sum(d.kind == k for d in spec.devices)} {k}" for k in ("gpu", "cpu")
                      if any(d.kind == k for d in spec.devices))
    say(f"cluster: {len(spec.devices)} workers ({kinds}, device={choice}), {fmt_bytes(spec.memory_bytes)} "
        f"of budget free (measured in {time.perf_counter() - t0:.2f} s)")
    t0 = time.perf_counter()
    say("tracing ...")
    graph = trace(model_or_path, example_inputs, kwargs, checkpoint=checkpoint)
    say(f"decomposing {len(graph.ops)} ops at {fmt_bytes(nbytes)} per op ...")
    micro = decompose(graph, nbytes)
    if choice != "auto":     # NOTE: repairs on the scheduler keep the model on this kind of device
        micro = micro.with_meta(device=choice)
    say(f"{len(micro.ops)} micro-ops in {time.perf_counter() - t0:.2f} s; placing ...")
    reserve, limit, module = 0, 0, model_or_path
    if n_sessions > 0:
        if isinstance(model_or_path, (str, os.PathLike)):
            from ..trace import load_hf_skeleton

            module = load_hf_skeleton(model_or_path)     # NOTE: its architecture, for the cache sizes
        reserve, limit = kv_reserve(module, n_sessions, context)
    if reserve:
        micro = micro.with_meta(kv_reserve_bytes=reserve)
        say(f"keeping {fmt_bytes(reserve)} per attention layer for {n_sessions} session(s) of {limit} tokens")
    weights = model_or_path if not isinstance(model_or_path, (str, os.PathLike)) else None
    for attempt in range(2):
        plan = place_for_decode(module, micro, spec, nbytes, say) if reserve else place(micro, spec)
        say(f"placed in {plan.planning_s:.2f} s: {len(plan.blocks)} blocks")
        try:
            dm = deploy(plan, client, weights=weights, checkpoint_dir=checkpoint_dir,
                        verify_every=verify_every, progress=say,
                        decode_rows=decode_rows(n_sessions) if reserve else None)
            break
        except RoomTaken as e:      # NOTE: another model took the room meanwhile: measure, place again
            if attempt:
                raise
            say(f"{e}; placing again")
            spec = measure_cluster(client, device=choice)
    dm._source, dm._budget = model_or_path, nbytes
    dm._trace_kwargs = {k: v for k, v in (kwargs or {}).items() if not isinstance(v, torch.Tensor)}
    dm._limits = (n_sessions or None, limit if reserve else context)
    if checkpoint is not None or isinstance(model_or_path, (str, os.PathLike)):
        dm._weights_path = os.fspath(checkpoint if checkpoint is not None else model_or_path)
    return dm


def place_for_decode(module: Any, micro: Any, spec: Any, budget: int, say: Progress) -> Plan:
    """A generation deployment's plan: its weights placed for the decode step (one token, the
    step generation repeats most), the model's own graph following them.

    Falls back to placing the model's graph itself when its activations would not fit so.
    """
    from ..decompose import decompose
    from ..errors import ClusterTooSmall
    from ..trace.decoder import trace_step

    t0 = time.perf_counter()
    step = decompose(trace_step(module, 1, 1), budget, like=micro).with_meta(
        kv_reserve_bytes=micro.meta["kv_reserve_bytes"])
    from ..placement.partition import place_stages

    decode = place_stages(step, spec)
    plan = follow(decode, micro)
    try:
        plan.check()
    except ClusterTooSmall as e:
        say(f"the model's graph does not fit where the decode step puts the weights ({e}): placing it")
        return place(micro, spec)
    say(f"weights placed for the decode step in {time.perf_counter() - t0:.2f} s: {len(decode.blocks)} "
        "block(s) per token")
    return Plan(micro, spec, plan.device_of, "follow-decode", time.perf_counter() - t0, dict(plan.info))


def max_positions(cfg: Any) -> int | None:
    """The longest sequence a model's config allows (None when it says nothing)."""
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(n) if n else None


def kv_reserve(model: Any, sessions: int, context: int | None) -> tuple[int, int]:
    """KV-cache bytes per attention layer of ``model`` (a module, weights optional) for
    ``sessions`` of ``context`` tokens, and the context (default the model's maximum positions);
    (0, 0) when it is not a decoder with a config."""
    cfg = getattr(model, "config", None)
    if cfg is None or sessions <= 0:
        return 0, 0
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not heads or not hidden:
        return 0, 0
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    limit = int(context or max_positions(cfg) or 0)
    if limit <= 0:
        raise BadInput("context: the model has no maximum positions in its config; give context=")
    itemsize = 2 if str(getattr(cfg, "dtype", "") or "").endswith(("float16", "bfloat16")) else 4
    return int(sessions * limit * 2 * kv_heads * head_dim * itemsize), limit


def _load(client: Any, specs: list[BlockSpec], say: Progress) -> None:
    """Every worker loads its blocks' weight tiles; progress by bytes."""
    from distributed import as_completed

    dsk = {(task_name(s.model), s.version, -1, s.index): (load_block, s.model, s.version, s.index)
           for s in specs}
    total = sum(s.weight_bytes for s in specs)
    futures = client.get(dsk, list(dsk), sync=False)
    done, shown, t0 = 0, -1, time.perf_counter()
    try:
        for f in as_completed(futures):
            done += int(f.result())
            pct = int(100 * done / total) if total else 100
            if pct // 20 > shown:
                shown = pct // 20
                say(f"loading weights on the workers: {fmt_bytes(done)} / {fmt_bytes(total)} ({pct}%)")
    finally:
        for f in futures:
            f.release()
    say(f"weights loaded in {time.perf_counter() - t0:.2f} s")


__all__ = ["DistributedModel", "deploy", "distribute"]
