"""The programs of a deployment besides its own graph, each built once and then reused.

A generation step of a given (batch, tokens) shape, or a forward pass at input shapes other
than the traced ones, is a program of its own: traced from the model, decomposed where the
deployment cut its weights, bound to the same weight tiles, registered with the scheduler
plugin and placed where those tiles are. ``ProgramCache`` builds each one once; every program
follows the model's plan (``follow``), and derives its blocks under it when first asked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...decompose import decompose
from ...errors import BadInput, UnsupportedModel
from ...lower.blocks import BlockSpec, block_specs
from ...lower.dims import Dims, NotGeneral, generalize, over_budget
from ...placement import Plan
from ...placement.follow import follow
from ...trace import bind_checkpoint, decoder, load_hf_skeleton, trace
from ...trace.torch_export import EXPORT_FAILED
from ..dataplane import client as p2p
from ..local import bind_call
from ..worker.store import copied_if_unreadable
from .limits import max_positions

logger = logging.getLogger(__name__)

# NOTE: the shapes a general prefill program is traced at: a size of each (rows, length, or their
# product) differs between them in its own ratio (2, 19/17, 38/17), so each literal tells which it is
TRACE_SHAPES = ((1, 17), (2, 19))


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


def layout_of(specs: list[BlockSpec], graph: Any, version: int) -> StepLayout:
    """The layout of ``graph``'s blocks ``specs`` under plan ``version``."""
    leaves = set(graph.leaf_outputs)
    return StepLayout(version, specs, {t: s.index for s in specs for t in s.exports if t in leaves})


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
                # NOTE: one assignment: a step submitted under the old layout keeps reading the old one
                self._layout = layout_of(specs, self.graph, version)
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


def served_dims(graph: Any) -> Dims:
    """The shapes a general step program serves (its budget may have made them fewer than asked)."""
    d = graph.meta["dims"]
    return Dims(int(d["rows"]), int(d["length"]), int(d["tokens"]))


def max_chunk(graph: Any) -> int | None:
    """The tokens a row of a deployment's own input holds (the longest prefill chunk whose weight
    tiles it holds), for a model traced with (rows, tokens) inputs; else None."""
    first: tuple[int, ...] = tuple(graph.tensors[graph.inputs[0]].shape) if graph.inputs else ()
    return int(first[-1]) if len(first) == 2 else None


class ProgramCache:
    """The programs of one deployment, by shape: generation steps per (batch, tokens) and forward
    passes per input shapes, each built on first use (see module doc).

    What they are traced from is set by ``deploy`` and ``distribute``: ``source`` (the module, or
    the folder of a Hugging Face model), ``weights_path`` (the file they read their weights from),
    ``budget`` (bytes per micro-op), ``trace_kwargs`` (the non-tensor keywords of the traced call)
    and ``limits`` (the sessions and context the deployment kept room for).
    """

    def __init__(self, client: Any, graph: Any, model_id: str, token: str, verify_every: int = 0) -> None:
        self.client = client
        self.graph = graph
        self.model_id = model_id
        self._token = token
        self.verify_every = verify_every
        self.source: Any = None                      # the module or folder programs are traced from
        self.weights_path: str | None = None         # where those programs read the weights
        self.budget: int | None = None
        self.trace_kwargs: dict[str, Any] = {}       # the non-tensor keywords it was traced with
        self.limits: tuple[int | None, int | None] = (None, None)    # (sessions, context) reserved
        self.steps: dict[tuple[int | str, int], StepProgram] = {}   # (rows, tokens); (kind, 0)
        self.shapes: dict[tuple[Any, ...], StepProgram] = {}     # forward at other input shapes
        self.dims: dict[bool, Dims] = {}                         # decode? -> what its general program serves
        self.kinds: dict[bool, StepProgram | None] = {}          # decode? -> that program (None: per shape)
        # NOTE: step programs' graphs made before they were asked for (``make_ahead``): ("general", dims)
        # or (rows, tokens) -> the decomposed graph, or the ``NotGeneral`` that making it raised
        self.made: dict[tuple[Any, ...], Any] = {}
        self._build = threading.Lock()               # NOTE: one program is built at a time
        self._follow = threading.Lock()
        self._plan: tuple[Plan, int] | None = None   # the plan the programs follow, and its version

    # --- the model they are traced from -------------------------------------------------------
    def source_module(self) -> Any:
        """The module programs are traced from (a Hugging Face folder's skeleton, built once)."""
        if isinstance(self.source, (str, os.PathLike)):
            self.source = (load_hf_skeleton(self.source), self.source)
        return self.source[0] if isinstance(self.source, tuple) else self.source

    def kv_context(self) -> int:
        """The tokens a session of this deployment holds at most: the context it declared (that
        placement kept KV room for), else the model's positions; 0 where neither is known."""
        context = self.limits[1]
        if not context and self.source is not None:
            context = max_positions(getattr(self.source_module(), "config", None))
        return int(context or 0)

    # --- the plan they follow -----------------------------------------------------------------
    def follow(self, plan: Plan, version: int) -> None:
        """Have every program take its blocks under ``plan`` (the model's, now ``version``)."""
        with self._follow:
            self._plan = (plan, version)
            for prog in [*self.steps.values(), *self.shapes.values()]:
                prog.follow(plan, self.model_id, version, verify_every=self.verify_every)

    # --- programs -----------------------------------------------------------------------------
    def step_program(self, batch: int, length: int) -> StepProgram:
        """The step program of this shape: the general program of its kind where one serves it
        (``set_dims``), else one of this shape alone, traced, decomposed and registered once."""
        key = (batch, length)
        with self._build:
            kind = self._kind(batch, length)
            if kind is not None:
                return kind
            prog = self.steps.get(key)
            if prog is None:
                prog = self._built(self.steps, key, lambda: self.made.pop(key, None) or
                                   self._decomposed(self._trace_step(batch, length)))
            return prog

    def make_ahead(self, dims: tuple[Dims, Dims], shapes: Sequence[tuple[int, int]]) -> None:
        """Make now the graphs of the step programs a generation engine of these ``dims`` asks for
        first (``generation.engine.step_shapes``: the general decode and prefill programs, and a
        program of each shape of ``shapes`` neither serves), traced and decomposed, not registered:
        ``distribute`` has them made while the workers load the weights, and the engine's first
        asks only register them (``made``)."""
        served: dict[bool, Dims | None] = {}
        for decode, want in zip((True, False), dims):
            try:
                graph = self._generalized(want)
            except NotGeneral as e:
                self.made[("general", want)], served[decode] = e, None
                continue
            self.made[("general", want)], served[decode] = graph, served_dims(graph)
        for batch, length in shapes:
            d = served.get(length == 1)
            if (d is None or not d.covers(batch, length)) and (batch, length) not in self.made:
                self.made[(batch, length)] = self._decomposed(self._trace_step(batch, length))

    def set_dims(self, decode: Dims, prefill: Dims) -> None:
        """The shapes the general decode and prefill programs serve (built at their first step)."""
        with self._build:
            self.dims = {True: decode, False: prefill}

    def prefill_room(self) -> tuple[int, int]:
        """(tokens, rows) the general prefill program serves a step, once built; else (0, 0)."""
        dims = self.dims.get(False)
        return (dims.tokens, dims.rows) if dims is not None and self.kinds.get(False) is not None else (0, 0)

    def _kind(self, batch: int, length: int) -> StepProgram | None:
        """The general program that serves this shape, built on first use (lock held); None where
        no general program serves it (another shape, or a model whose traces differ in more)."""
        decode = length == 1
        dims = self.dims.get(decode)
        if dims is None or not dims.covers(batch, length):
            return None
        prog = self.kinds.get(decode)
        if prog is None and decode not in self.kinds:
            try:
                prog = self._built(self.steps, ("decode" if decode else "prefill", 0),
                                   lambda: self._generalized(dims))
            except NotGeneral as e:
                # NOTE: the text only: a record kept by a log handler must not hold the traceback's frames
                logger.warning("seabiscuit: model %s: a %s step is built per shape: %s", self.model_id,
                               "decode" if decode else "prefill", str(e))
            self.kinds[decode] = prog
            if prog is not None:     # NOTE: it may serve fewer tokens a step than asked (the budget)
                self.dims[decode] = served_dims(prog.graph)
        return prog if prog is not None and self.dims[decode].covers(batch, length) else None

    def _generalized(self, dims: Dims) -> Any:
        """The general program of ``dims``'s kind: traced at two shapes, each decomposed where the
        deployment cut its weights, made one (``lower.dims.generalize``), checked within the budget."""
        made = self.made.pop(("general", dims), None)
        if isinstance(made, NotGeneral):
            raise made
        if made is not None:
            return made
        at, bt = ((1, 1), (2, 1)) if dims.decode else TRACE_SHAPES
        a, b = (self._decomposed(self._trace_step(*s)) for s in (at, bt))
        budget = int(a.meta.get("budget_bytes") or self.budget or 0) or 1 << 62
        while True:     # NOTE: fewer tokens a step where the largest passes the budget (a tiny budget)
            graph = generalize(a, at, b, bt, dims)
            over = over_budget(graph, a, budget, dims)
            if not over:
                return graph
            # NOTE: fewer rows where a size of rows alone passes it (a tall step), else fewer tokens
            name, size, rows, length = over[0]
            tall = rows > 1 and length < dims.length
            fewer = Dims(max(1, dims.rows // 2), dims.length, dims.tokens) if tall \
                else Dims(dims.rows, dims.length, dims.tokens // 2)
            if fewer.tokens < bt[0] * bt[1] or fewer.rows < bt[0] or fewer == dims:
                raise NotGeneral(f"{len(over)} micro-op(s) pass the budget at a shape it serves, {name} "
                                 f"first ({size} bytes at {rows}x{length})")
            dims = fewer

    def _trace_step(self, batch: int, length: int) -> Any:
        """``trace_step`` of the model at this shape, once more where ``torch.export`` failed: it fails
        so for a while when another thread of this process runs a torch module as it traces (torch
        patches module calls process-wide meanwhile), and the model traced before, and a step's
        shapes are its own. A second failure names that cause and the cure."""
        tried = False
        while True:
            try:
                # NOTE: looked up on its module at each call, so a ``trace_step`` patched in is used
                return decoder.trace_step(self.source_module(), batch, length)
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

    def program_for(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> StepProgram | None:
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
        with self._build:
            prog = self.shapes.get(shapes)
            if prog is None:
                call = {**self.trace_kwargs, **ordered}
                try:
                    prog = self._built(self.shapes, shapes, lambda: self._decomposed(
                        trace(self.source_module(), tuple(args), call)))
                except UnsupportedModel as e:      # NOTE: it traced at its first shapes: these are wrong
                    got = ", ".join(f"{list(s)} {d}" for s, d in shapes)
                    want = ", ".join(f"{list(s)} {d}" for s, d in traced)
                    raise BadInput(f"model {self.model_id} does not take inputs of shapes {got} (it was "
                                   f"traced with {want}): {e}") from e
            return prog

    def _built(self, kept: dict[Any, StepProgram], key: Any, make: Callable[[], Any]) -> StepProgram:
        """Another program of this deployment, of ``make()``'s decomposed graph (``_registered``),
        following the model's plan and kept in ``kept`` under ``key``, its blocks derived: what
        building it cost is ``build_s``."""
        t0 = time.perf_counter()
        prog = self._registered(make())
        with self._follow:      # NOTE: kept and following at once: no plan comes between the two
            assert self._plan is not None, "the model's first plan comes before any program"
            plan, version = self._plan
            prog.follow(plan, self.model_id, version, verify_every=self.verify_every)
            kept[key] = prog
        _ = prog.layout          # NOTE: part of building it
        prog.build_s = time.perf_counter() - t0
        return prog

    def _decomposed(self, graph: Any) -> Any:
        """``graph`` decomposed where the deployment cut its weights."""
        return copied_if_unreadable(decompose(graph, self.budget, like=self.graph), self.source)

    def _registered(self, graph: Any) -> StepProgram:
        """Decomposed ``graph`` bound to the deployment's weight tiles and registered with the scheduler."""
        if any(p.source.kind == "model" for p in graph.params.values()):
            if self.weights_path is None:
                raise BadInput(f"model {self.model_id}: no weights file to bind another program to")
            graph = bind_checkpoint(graph, self.weights_path, kinds=("model",))
        graph = _with_checksums(graph, self.graph)
        context = self.kv_context()
        if context:      # NOTE: a session's cache grows to this at most: the room placement kept for it
            graph = graph.with_meta(kv_context=context)
        reply = self.client.sync(self.client.scheduler.seabiscuit_program, model=self.model_id,
                                 token=self._token, graph=graph.to_json())
        return StepProgram(graph, int(reply["program"]))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per (batch, tokens) step shape: its Dask tasks per step, what building it cost, its micro-ops."""
        return {(f"{b}x{n}" if isinstance(b, int) else str(b)):
                {"tasks": len(p.specs), "build_s": p.build_s, "micro_ops": len(p.graph.ops)}
                for (b, n), p in sorted(self.steps.items(), key=lambda kv: str(kv[0]))}
