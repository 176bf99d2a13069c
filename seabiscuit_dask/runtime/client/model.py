"""``DistributedModel``: a model deployed on a Dask cluster, called like the model.

``dm(*inputs)`` sends each worker the inputs of its blocks on the data plane
(``runtime.dataplane``): blocks run as their inputs arrive and their outputs go worker to
worker, never through the scheduler (or, with ``seabiscuit.runtime.data-plane: tasks``, one
Dask task per block, never one per micro-op); only activations travel. Calls from several
threads pipeline across the workers. When the plan changes (a worker left, joined or was
drained), the scheduler plugin tells this object on the ``seabiscuit`` event topic.

The class is a facade over parts, each in a module of its own: the plan it follows
(``plans.PlanFollower``), the programs it builds besides its own graph (``programs.ProgramCache``),
the requests it sends (``requests.RequestSender``) and what its owner asks of the cluster about it
(``operations.ModelOperations``). It is also the ``Runner`` its generation engine drives
(``runtime.generation.runner``), each step a program of the cache sent by the request sender.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ... import config
from ...errors import BadInput, StaleRun
from ...lower.blocks import BlockSpec
from ...placement import Plan
from ..dataplane.loops import Edit
from ..discover import releasing
from ..generation import STEP_INPUTS, Engine, GenerateArgs, TokenStream, generate_tokens, stream_tokens
from ..generation.hf import RULES
from ..local import bind_call, check_ids, flatten_inputs, split_inputs
from . import events
from .chat import ChatSession
from .limits import max_positions
from .operations import ModelOperations
from .plans import PlanFollower
from .programs import ProgramCache, StepProgram, max_chunk
from .requests import Handle, RequestSender

logger = logging.getLogger(__name__)


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
        self.checkpoint_dir = checkpoint_dir
        self.verify_every = verify_every
        self._store: object | None = None            # keeps a weight store folder alive
        self._engine: Engine | None = None
        self._label: str | None = None        # how generation's messages name it (``name_as``)
        self._programs = ProgramCache(client, self.graph, model_id, token, verify_every)
        self._plans = PlanFollower(client, plan, model_id, token, version, self._programs.follow,
                                   checkpoint_dir, verify_every)
        self._sender = RequestSender(client, self._plans, model_id, token, ticket,
                                     config.data_plane() == "p2p" and bool(ticket), checkpoint_dir)
        self._operations = ModelOperations(client, self._plans, self._sender, model_id, token)
        events.listen(client, model_id, self._on_event)
        # NOTE: a model its caller drops unclosed is released all the same (``_release_dropped``)
        self._finalizer = weakref.finalize(self, _release_dropped, client, model_id, token, checkpoint_dir)
        self._finalizer.atexit = False

    # --- plan ---------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The current plan; ``print(dm.plan)`` prints its table."""
        return self._plans.plan

    @property
    def version(self) -> int:
        """The version of the current plan (the scheduler's numbering: 0 as deployed)."""
        return self._plans.version

    @property
    def specs(self) -> list[BlockSpec]:
        """The blocks of the model's own program under the current plan."""
        return self._plans.layout.specs

    @property
    def events(self) -> deque[dict[str, Any]]:
        """The latest scheduler events about this model (``plans.EVENTS_KEPT``), oldest first."""
        return self._plans.events

    @property
    def p2p(self) -> bool:
        """Whether requests travel on the data plane (else as Dask tasks, a block each)."""
        return self._sender.p2p

    @property
    def _stranded(self) -> str | None:
        """Why the rest of the cluster cannot hold the model, as last heard; None while it can."""
        return self._plans.stranded

    def _on_event(self, msg: Mapping[str, Any]) -> None:
        if self._plans.on_event(msg):
            doomed = list(self._sender.inflight.values())
            if doomed:    # NOTE: this runs on the client's event loop: cancel from another thread
                threading.Thread(target=self._sender.cancel, args=(doomed,), daemon=True).start()

    def unavailable(self) -> str | None:
        """None while the model serves; else why it does not: closed, or stranded (the rest of the
        cluster cannot hold it), as the scheduler says now."""
        return self._plans.unavailable()

    # --- requests -----------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run one request; returns what the model returns (same structure and values).

        A request stuck on a worker that stopped answering runs again on the plan that
        fences it (``seabiscuit.runtime.hang-*``), with the same result.
        """
        self._plans.check_open()
        self._check_inputs(inputs, kwargs)
        prog = self._programs.program_for(inputs, kwargs)
        graph = prog.graph if prog is not None else self.graph
        flat = flatten_inputs(graph, inputs, kwargs)
        feed = split_inputs(graph, {name: x.cpu() for name, x in zip(graph.inputs, flat)})
        return self._sender.call(prog, graph, feed)

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
        positions = max_positions(getattr(self._programs.source_module(), "config", None)) \
            if self._programs.source is not None else None
        if positions and x.dim() >= 1 and x.shape[-1] > positions:
            raise BadInput(f"input {name!r} of model {self.model_id} holds {x.shape[-1]} tokens a row, "
                           f"more than the model's {positions} positions; shorten it")
        if vocab:
            check_ids(name, x, vocab)

    @property
    def _next_request(self) -> Callable[[], int]:
        """What numbers the next request (``RequestSender``); a test may set a fixed one."""
        return self._sender.next_request

    @_next_request.setter
    def _next_request(self, number: Callable[[], int]) -> None:
        self._sender.next_request = number

    @property
    def _requests(self) -> Any:
        """The counter of the requests' high bits (``RequestSender``)."""
        return self._sender.requests

    # --- generation ---------------------------------------------------------------------------
    def generate(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
                 do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
                 generator: Any = None, streamer: Any = None, **rules: Any) -> Any:
        """Generate as Hugging Face ``model.generate`` does, on the cluster: returns the prompt
        followed by the new tokens ((batch, length + new) LongTensor, ``pad_token_id`` after EOS).

        Greedy decoding gives Hugging Face's tokens; sampling (``do_sample=True`` with
        ``temperature``, ``top_k``, ``top_p``) is reproducible from a seeded ``generator``.
        ``rules`` shape the logits first (``LogitRules``): ``min_new_tokens`` and
        ``repetition_penalty`` as Hugging Face's, ``frequency_penalty``, ``presence_penalty`` and
        ``logit_bias`` ({token id: value}) as OpenAI's; ``grammar`` (``json_grammar``,
        ``lark_grammar``) keeps every answer a sentence of it. Defaults come from the model's
        generation config. Every row is a session whose KV cache lives on the workers that own its
        attention blocks; rows of different lengths (left padding and an ``attention_mask``) are
        fine.
        ``streamer``: a Hugging Face streamer (``TextStreamer``), fed the prompt and then each new
        token. A call with logit rules or a grammar, or sampled, reads its logits back each step:
        greedy decoding alone is picked on the workers.

        Examples
        --------
        >>> ids = tok.apply_chat_template(msgs, add_generation_prompt=True,
        ...                               return_tensors="pt")["input_ids"]   # doctest: +SKIP
        >>> out = dm.generate(ids, max_new_tokens=32)                         # doctest: +SKIP
        >>> print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))  # doctest: +SKIP
        """
        engine, args = self._generation_args(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                                             eos_token_id, pad_token_id, generator, attention_mask, **rules)
        return generate_tokens(engine, input_ids, args, attention_mask, streamer)

    def stream(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
               do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
               generator: Any = None, streamer: Any = None, logprobs: int | None = None,
               **rules: Any) -> TokenStream:
        """``generate``, yielding the new tokens as they come: a (batch,) LongTensor per step.
        ``logprobs=k``: after each step, the stream's ``logprobs`` holds each row's token's
        log-probability and its ``k`` likeliest tokens' (``TokenLogprob``, 0 <= k <= 20).

        Examples
        --------
        >>> for t in dm.stream(ids, max_new_tokens=32):                    # doctest: +SKIP
        ...     print(tok.decode(t[0]), end="", flush=True)
        """
        engine, args = self._generation_args(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                                             eos_token_id, pad_token_id, generator, attention_mask,
                                             logprobs=logprobs, **rules)
        return stream_tokens(engine, input_ids, args, attention_mask, streamer)

    @property
    def label(self) -> str | None:
        """How generation's messages name this deployment, when it was named (``name_as``)."""
        return self._label

    def name_as(self, label: str) -> None:
        """Name this deployment as ``label`` in generation's messages (``"model 'smollm2'"``) instead
        of by its id: a server names each model as its callers do."""
        self._label = label
        if self._engine is not None:
            self._engine.rename(label)

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

    @property
    def max_rows(self) -> int:
        """Sessions (rows) this deployment's generation runs at once at most: its sessions, or where
        it kept KV room counted in tokens, as many shorter ones as the room and
        ``seabiscuit.generate.max-rows`` allow (a call of more rows is refused). NOTE: read on the
        server's event loop: an engine made already is read as it is, with no call to the scheduler."""
        engine = self._engine
        return (engine if engine is not None else self._generation_engine()).max_sessions

    def generation_stats(self) -> dict[str, Any]:
        """Steps, tokens and seconds of generation so far (``step_tokens``: what the steps computed,
        padding included; ``tokens_per_step`` its mean), the sessions open, the KV room they count
        and what is free of it (``kv_tokens``, ``kv_tokens_free``: 0 where the deployment kept
        none), the calls running and waiting to start and the rows of calls waiting for room now,
        the finished sessions' caches kept and the share of new sessions that reused one
        (``prefix_kept``, ``prefix_hit_rate``; ``prefix_hits`` and ``prefix_tokens`` so far), the calls
        preempted where the KV room ran out mid-answer and recomputed (``preemptions``),
        and the step programs built: per program (a shape, or ``decode`` and ``prefill`` of any
        shape) its Dask tasks per step and what building it cost."""
        stats: dict[str, Any] = self._engine.stats.as_dict() if self._engine is not None else {}
        if self._engine is not None:
            table, load = self._engine.sessions, self._engine.load()
            stats.update(sessions_open=table.open, rows_queued=table.queued, kv_tokens=table.tokens,
                         kv_tokens_free=(table.max_tokens or 0) - table.tokens, running=load["running"],
                         waiting=load["waiting"], tokens_per_step=load["tokens_per_step"],
                         prefix_kept=load["prefix_kept"], prefix_hit_rate=load["prefix_hit_rate"])
        stats["programs"] = self._programs.stats()
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
                         attention_mask: Any = None, **rules: Any) -> tuple[Engine, GenerateArgs]:
        unknown = sorted(set(rules) - set(RULES) - {"logprobs"})
        if unknown:
            raise BadInput(f"unknown generate arguments {unknown}; the logit rules are {', '.join(RULES)}")
        engine = self._generation_engine()
        module = self._programs.source_module()
        cfg = getattr(module, "config", None)
        vocab = (self.graph.meta.get("index_ranges") or {}).get("input_ids") or \
            getattr(getattr(cfg, "get_text_config", lambda: cfg)(), "vocab_size", None)
        if isinstance(input_ids, torch.Tensor):      # NOTE: the engine checks the type and the context
            kept = input_ids if not isinstance(attention_mask, torch.Tensor) or \
                attention_mask.shape != input_ids.shape else input_ids[attention_mask.bool()]
            check_ids("input_ids", kept, int(vocab) if vocab else 2**62)
        length = int(input_ids.shape[-1]) if hasattr(input_ids, "shape") else 0
        args = GenerateArgs.make(getattr(module, "generation_config", None), length,
                                 max_new_tokens, do_sample, temperature, top_k, top_p, eos, pad, generator,
                                 **rules)
        args.sampling.rules.check_vocab(int(vocab) if vocab else 2**62)
        return engine, args

    def _generation_engine(self) -> Engine:
        """The engine of this deployment's generate calls, made on first use."""
        self._plans.check_open()
        if self._programs.source is None:
            raise BadInput(f"model {self.model_id} was deployed from a plan alone: generation traces its "
                           "step programs from the model, so deploy with weights=model or use sb.distribute")
        if self._engine is None:
            sessions, context = self._programs.limits
            context = context or max_positions(getattr(self._programs.source_module(), "config", None))
            self._engine = Engine(self, max_sessions=sessions, context=int(context) if context else None,
                                  max_chunk=max_chunk(self.graph),
                                  name=self._label or f"model {self.model_id}")
            self._programs.set_dims(*self._engine.spec.dims(self._engine.max_sessions))
        return self._engine

    def _step_program(self, batch: int, length: int) -> StepProgram:
        """The step program of this shape (``ProgramCache.step_program``)."""
        return self._programs.step_program(batch, length)

    @property
    def _shape_programs(self) -> dict[tuple[Any, ...], StepProgram]:
        """The forward programs built at input shapes other than the traced ones, by shapes."""
        return self._programs.shapes

    # --- what the generation engine drives (``runtime.generation.runner.Runner``) -------------
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
        return self.p2p and bool(config.get("generate.pipeline-prefill"))

    @property
    def prefill_stages(self) -> int:
        """The workers a prompt's chunks flow through, one after another (a chunk runs on one
        while the chunk before runs on the next): those holding blocks of the model's plan."""
        return max(1, len({s.address for s in self.specs if s.ops}))

    @property
    def prefill_room(self) -> tuple[int, int]:
        """(tokens, rows) a prefill step of several prompts may hold: those the general prefill
        program serves once it is built (``lower.dims``); 0 before, or where steps are built per shape."""
        return self._programs.prefill_room()

    def prepare(self, batch: int, length: int) -> StepProgram:
        """Build the step program of this shape (if not yet) before a step is timed; it is returned
        (one general program serves many shapes)."""
        return self._programs.step_program(batch, length)

    def run_step(self, batch: int, length: int, feed: dict[str, Any]) -> Any:
        """One step of generation on the cluster: logits (batch, vocab) of each row's last token."""
        prog = self._programs.step_program(batch, length)
        handle = self._sender.submit(prog, prog.layout, split_inputs(prog.graph, feed))
        return self._sender.step_result(handle)

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
        prog = self._programs.step_program(batch, length)
        if self.p2p and after is not None:
            return after.next
        # NOTE: one layout, whatever plan event comes meanwhile
        layout = prog.layout
        inputs = split_inputs(prog.graph, feed())
        one_tile = len(prog.graph.leaf_outputs) == 1 and "input_ids" not in prog.graph.tilings
        if self.p2p and steps > 1 and one_tile and set(inputs) == set(STEP_INPUTS):
            return self._sender.submit_loop(prog, layout, inputs, steps)
        return self._sender.submit(prog, layout, inputs, after)

    @property
    def edits_loops(self) -> bool:
        """Whether ``start_lane`` starts decode loops whose rows change as they run (the data plane)."""
        return self.p2p

    def start_lane(self, batch: int, feed: dict[str, Any], steps: int, left: list[int],
                   picks: list[Any] | None = None) -> Handle | None:
        """Start a decode loop of ``steps`` steps of ``batch`` rows whose rows change as it runs
        (``dataplane.Lane``): ``left``, each row's steps (the first included; -1: no bound);
        ``picks``, each row's ``RowPick`` (None: greedy), followed where its logits are made. The
        first step's handle (each one's ``next`` the step after it), or None where this model's
        decode program cannot loop so (its logits in several tiles)."""
        prog = self._programs.step_program(batch, 1)
        layout = prog.layout
        inputs = split_inputs(prog.graph, feed)
        one_tile = len(prog.graph.leaf_outputs) == 1 and "input_ids" not in prog.graph.tilings
        if not (self.p2p and one_tile and set(inputs) == set(STEP_INPUTS)):
            return None
        return self._sender.submit_loop(prog, layout, inputs, steps, left, picks)

    def edit_lane(self, handle: Handle, edits: list[Edit], after: Any = None) -> Any:
        """Edit the rows of the lane ``handle`` is a step of: each (row, session or -1 to empty it,
        first slot, token, steps or -1), applied to the next step its worker builds, after the
        edits of ``after`` (the future an edit before returned); a future of whether the lane
        took them: the count of edit messages it took with these (0: it runs no more steps)."""
        return self._sender.edit_lane(handle, edits, after)

    def step_future(self, handle: Handle) -> Any:
        """A future that is done once a submitted step's outputs are here to read (None: unknown)."""
        return handle.pending

    def step_rows(self, handle: Handle, picks: Sequence[Any] = ()) -> tuple[Any, Any, int, dict[str, Any]]:
        """The tokens (batch,) of a submitted step, and for a lane's later step the sessions it ran
        (batch,) and the edit messages it was built with (None and 0 for a step fed from here:
        its caller knows them), and the log-probabilities its rows asked for. A lane's first
        step (its logits come here) is picked here, each row of ``picks`` (``RowPick``s) as it
        says (``dataplane.loops.pick_rows``)."""
        return self._sender.step_rows(handle, picks)

    def submit_chunk(self, length: int, feed: dict[str, Any], follows: Handle | None = None) -> Handle:
        """Send one prefill chunk of one session without waiting; ``follows``: the chunk of the same
        prompt before it, which may still run (each worker holds this chunk's blocks until that
        one cached what they read: one chunk runs on a stage while the one before runs on the next)."""
        prog = self._programs.step_program(1, length)
        layout = prog.layout
        if follows is not None and follows.version != layout.version:
            raise StaleRun(f"model {self.model_id} moved to plan v{layout.version} between two chunks of a "
                           f"prompt (the one before ran on v{follows.version}): they run again one by one")
        return self._sender.submit(prog, layout, split_inputs(prog.graph, feed), follows=follows)

    def step_result(self, handle: Handle) -> Any:
        """The logits (batch, vocab) of a submitted step's last position."""
        return self._sender.step_result(handle)

    def step_tokens(self, handle: Handle) -> Any:
        """The greedy tokens (batch,) of a submitted step: all a decode loop's later steps send
        back (the worker picks them from its logits), the argmax of the logits for another."""
        return self._sender.step_tokens(handle)

    def discard(self, handle: Handle) -> None:
        """Let go of a submitted step (one read ahead that is not needed runs out unseen), and of
        the steps of a decode loop after it."""
        self._sender.discard(handle)

    def end_sessions(self, sessions: Any, renamed: Any = (), forked: Any = ()) -> None:
        """Free the KV caches of ``sessions`` on every worker, rename those of ``renamed`` ((old,
        new, slots kept) each, ``KVStore.rename``) and start those of ``forked`` ((source, new,
        slots) each, ``KVStore.fork``) with a copy of another's first slots."""
        if self.client.status == "running" and not self._plans.closed:
            self.client.sync(self.client.scheduler.seabiscuit_end_sessions, model=self.model_id,
                             token=self._token, sessions=[int(s) for s in sessions],
                             renamed=[[int(o), int(n), int(k)] for o, n, k in renamed],
                             forked=[[int(o), int(n), int(k)] for o, n, k in forked])

    def recover(self, error: BaseException) -> None:
        """After a worker loss in a step: take the plan the scheduler holds now (the event that
        brings it may still be on its way, or have come already), unless the model is stranded.
        A data-plane run that failed under plan v (a worker could not be reached) waits for a plan
        newer than v, up to ``sync-timeout``: the scheduler may hear of a worker's death after the
        caller did, and its repair takes a moment on a loaded machine (the wait ends as it comes)."""
        self._plans.recover(error)

    # --- operations on this model (``operations.ModelOperations``) --------------------------
    def drain(self, worker: str, reason: str = "drained") -> dict[str, Any]:
        """Move this model off ``worker`` (name or address) while requests keep flowing.

        Returns the scheduler's report: ``replan_s``, ``versions``.
        """
        return self._operations.drain(worker, reason)

    def restore(self, worker: str) -> dict[str, Any]:
        """Let this model use a drained worker again; it spreads onto it as onto a worker that joins."""
        return self._operations.restore(worker)

    def set_budget(self, worker: str, memory: int | str) -> dict[str, Any]:
        """Give this model ``memory`` on ``worker``; what no longer fits moves elsewhere."""
        return self._operations.set_budget(worker, memory)

    def run_counts(self) -> dict[str, int]:
        """Blocks computed, read back from checkpoints, and computed more than once, for this model."""
        return self._operations.run_counts()

    def learned(self, last: int = 100) -> dict[str, Any]:
        """What the scheduler learned from this model's block runs: per worker, measured over
        modelled time per op class (``scales``), and the mean relative error of the last
        ``last`` block-time predictions (``error``)."""
        return self._operations.learned(last)

    def _flush_runs(self) -> None:
        """Have the plan's workers report their data plane's block runs to the scheduler now."""
        self._operations.flush_runs()

    def predicted_s(self, learned: bool = True) -> float:
        """The simulated latency of one request on the current plan, or as first modelled.

        ``learned``: with the scales the scheduler learned (``learned()``) on its devices,
        and with this client's own submit and post-gather times, measured on its
        requests, in place of the probes' (the graph of a real request is larger).
        """
        return self._operations.predicted_s(learned)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: block runs, checkpoint resumes and writes, corruptions found, resident bytes."""
        return self._operations.stats()

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model's blocks on every worker and its plans on the scheduler."""
        if self._plans.closed:
            return
        self._finalizer.detach()
        self._plans.close()
        # NOTE: calls in flight end now, as ModelClosed
        self._sender.cancel(list(self._sender.inflight.values()))
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
                f"{len(self.plan.spec.devices)} workers, plan v{self.version}>")
