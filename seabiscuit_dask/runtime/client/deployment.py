"""Putting a model onto a Dask cluster: ``deploy`` a ready plan, or ``distribute`` a model in one call.

``deploy(plan, client)`` sends the graph and the plan (its documented JSON, the one wire
format) to the scheduler plugin, which issues the model's id and a token that only this
client holds, and has every worker load the weight tiles of its own blocks from the
checkpoint's slices. ``distribute`` is trace, decompose, ``measure_cluster``, place and deploy,
keeping room for the KV caches of generation where asked.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from distributed import as_completed

from ... import config
from ...decompose import decompose
from ...errors import ClusterTooSmall, RoomTaken
from ...ir import fmt_bytes
from ...lower.blocks import BlockSpec, task_name
from ...placement import Plan, place
from ...placement.follow import follow
from ...placement.partition import place_stages
from ...quantize import check_scheme
from ...quantize import quantize as quantize_graph
from ...trace import decoder, load_hf_skeleton, trace
from ...trace.onnx import is_onnx, load_onnx
from ..discover import HOW_TO_INSTALL, PluginMissing, measure_cluster
from ..generation.engine import step_shapes
from ..generation.scheduler import decode_rows as rows_of_decode
from ..worker.resident import writable
from ..worker.store import stored
from ..worker.tasks import load_block
from .layouts import matmul_forms, weight_layouts
from .limits import kv_reserve
from .model import DistributedModel
from .programs import ProgramCache, max_chunk

Progress = Callable[[str], None]
logger = logging.getLogger(__name__)


def _quiet(msg: str) -> None:
    return None


class _StoreOwner:
    """Keeps a weight store folder alive; the folder is removed when this is collected."""


# --- deploy ---------------------------------------------------------------------------------------
def deploy(plan: Plan, client: Any, *, weights: Any = None,
           checkpoint_dir: str | os.PathLike[str] | None = None, verify_every: int | None = None,
           progress: Progress | None = None, decode_rows: int | None = None,
           meanwhile: Callable[[], Any] | None = None) -> DistributedModel:
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
    meanwhile : callable, optional
        Called once the weights are written, as the workers measure and load them: work
        of this process that may overlap theirs (``distribute`` starts making the step
        programs of generation then).

    Examples
    --------
    >>> plan = sb.place(sb.decompose(sb.trace(model, x)), sb.measure_cluster(client))  # doctest: +SKIP
    >>> dm = sb.deploy(plan, client, weights=model)                                   # doctest: +SKIP
    """
    say = progress or _quiet
    ckpt = _checkpoint_folder(checkpoint_dir)
    every = int(verify_every if verify_every is not None else config.get("integrity.verify-every") or 0)
    holder = _StoreOwner()
    graph, folder = stored(plan.graph, weights, holder)
    if folder is not None:
        say(f"wrote {fmt_bytes(graph.param_bytes)} of weights to {folder}")
    if meanwhile is not None:
        meanwhile()
    graph = _held_for_rows(client, plan, graph, decode_rows, say)
    if graph is not plan.graph:
        plan = Plan(graph, plan.spec, plan.device_of, plan.method, plan.planning_s, dict(plan.info))
    reply = client.sync(client.scheduler.seabiscuit_deploy, graph=graph.to_json(),
                        plan=plan.to_json(stats=False), checkpoint_dir=ckpt, verify_every=every,
                        claim=claim(client))
    dm = DistributedModel(client, plan, str(reply["model"]), str(reply["token"]), int(reply["version"]),
                          ckpt, every, str(reply.get("ticket", "")))
    dm._store = holder if folder is not None else None    # NOTE: the store lives as long as the model
    programs = dm._programs
    if isinstance(weights, torch.nn.Module):
        programs.source = weights
    if folder is not None:
        programs.weights_path = os.fspath(folder / "model.safetensors")
    programs.budget = plan.graph.meta.get("budget_bytes")
    try:
        _load(client, dm.specs, say)
    except BaseException:
        dm.close()      # NOTE: nothing half-deployed stays behind on the cluster
        raise
    return dm


def _checkpoint_folder(checkpoint_dir: str | os.PathLike[str] | None) -> str:
    """Where blocks checkpoint their outputs (``deploy``'s ``checkpoint_dir``); "" for nowhere."""
    ckpt = checkpoint_dir if checkpoint_dir is not None else config.get("checkpoint.directory")
    return os.fspath(writable(os.fspath(ckpt))) if ckpt else ""


def _held_for_rows(client: Any, plan: Plan, graph: Any, rows: int | None, say: Progress) -> Any:
    """``graph`` naming how the workers hold its matmul weights for the rows this deployment
    multiplies (``weight_layouts``, ``matmul_forms``), as measured on a worker."""
    layouts = weight_layouts(client, plan, graph, rows)
    if layouts:
        graph = graph.with_meta(weight_layouts=layouts)
        say(f"{len(layouts)} matmul weight tile(s) held transposed: their kernel ran faster that way on a "
            "worker, for the rows this deployment multiplies")
    forms = matmul_forms(client, plan, graph, rows)
    if forms:
        graph = graph.with_meta(matmul_forms=forms)
        say(f"{len(forms)} linear weight(s) multiplied in columns for a few rows: faster that way on a "
            "worker")
    return graph


def claim(client: Any) -> str:
    """A one-off secret this client sends down its own stream to the scheduler plugin: the deploy
    RPC that shows it makes this client the model's owner (an RPC alone says nothing of who asks)."""
    try:     # NOTE: an op the scheduler does not know would end this client's stream
        client.sync(client.scheduler.seabiscuit_hello, address="")
    except Exception as e:
        raise PluginMissing(f"the cluster at {client.scheduler.address} has no SeaBiscuit plugin: "
                            + HOW_TO_INSTALL) from e
    nonce = secrets.token_hex(16)
    client._send_to_scheduler({"op": "seabiscuit_claim", "nonce": nonce})
    return nonce


def _load(client: Any, specs: list[BlockSpec], say: Progress) -> None:
    """Every worker loads its blocks' weight tiles; progress by bytes."""
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


# --- distribute -----------------------------------------------------------------------------------
def distribute(model_or_path: Any, client: Any, example_inputs: Any, budget: int | str | None = None, *,
               kwargs: Mapping[str, Any] | None = None, checkpoint: str | os.PathLike[str] | None = None,
               checkpoint_dir: str | os.PathLike[str] | None = None, verify_every: int | None = None,
               sessions: int | None = None, context: int | None = None, device: str | None = None,
               quantize: str | None = None, progress: Progress | None = None) -> DistributedModel:
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
    quantize : {"int8", None}, optional
        Hold the weights of linear layers as int8 with a scale per output channel
        (``quantize.py``; default: config ``seabiscuit.quantize``, None: as the model holds
        them). Workers read the float weights tile by tile and keep the integers only; decode
        steps multiply them with the CPU's int8 kernel. Every program of the deployment
        (generation steps included) reads the same quantized tiles.
    checkpoint_dir, verify_every, progress
        As for ``deploy``.

    Examples
    --------
    >>> client.register_plugin(sb.SeaBiscuitSchedulerPlugin())        # doctest: +SKIP
    >>> dm = sb.distribute(model, client, (ids,), budget="16MiB")      # doctest: +SKIP
    >>> logits = dm(ids).logits                                        # doctest: +SKIP
    >>> print(dm.plan)                                                 # doctest: +SKIP
    """
    say = progress or _quiet
    nbytes = config.to_bytes(budget if budget is not None else config.get("budget"))
    n_sessions = config.to_count(sessions if sessions is not None
                                 else config.get("generate.reserve-sessions") or 0, "sessions")
    context = config.to_count(context, "context", minimum=1) if context is not None else None
    choice = config.device_choice(device)
    scheme = check_scheme(quantize if quantize is not None else config.get("quantize"))
    if is_onnx(model_or_path):        # NOTE: a module whose buffers are its initializers (trace/onnx.py)
        model_or_path = load_onnx(model_or_path, lazy=True)
    spec = _measured(client, choice, say)
    micro = _micro_ops(model_or_path, example_inputs, kwargs, checkpoint, nbytes, choice, say, scheme)
    module, reserve, limit = _kv_room(model_or_path, n_sessions, context)
    if reserve:
        micro = micro.with_meta(kv_reserve_bytes=reserve)
        say(f"keeping {fmt_bytes(reserve)} per attention layer for {n_sessions} session(s) of {limit} tokens")
    weights = model_or_path if not isinstance(model_or_path, (str, os.PathLike)) else None

    plan = _placed(micro, spec, module if reserve else None, nbytes, say)
    # NOTE: a generation deployment's step programs are traced and decomposed while the workers
    # measure and load the weights (once they are written: the two would share this process's
    # core); joined before anything else runs here (torch.export patches module calls process-wide)
    ahead: list[Callable[[], tuple[ProgramCache, float] | None]] = []

    def meanwhile() -> None:
        if reserve and not ahead:
            ahead.append(_programs_ahead(plan.graph, model_or_path, nbytes, n_sessions, limit))

    def deployed(plan: Plan) -> DistributedModel:
        return deploy(plan, client, weights=weights, checkpoint_dir=checkpoint_dir, verify_every=verify_every,
                      progress=say, decode_rows=rows_of_decode(n_sessions) if reserve else None,
                      meanwhile=meanwhile)

    try:
        dm = deployed(plan)
    except RoomTaken as e:      # NOTE: another model took the room meanwhile: measure, place again
        say(f"{e}; placing again")
        spec = measure_cluster(client, device=choice)
        dm = deployed(_placed(micro, spec, module if reserve else None, nbytes, say))
    finally:
        made = ahead[0]() if ahead else None
    _trace_programs_from(dm, model_or_path, nbytes, kwargs, checkpoint)
    dm._programs.limits = (n_sessions or None, limit if reserve else context)
    if made is not None and made[0].made:    # NOTE: placed again elsewhere (``RoomTaken``), the same graph
        dm._programs.made.update(made[0].made)
        say(f"{len(made[0].made)} step program graph(s) made while the weights loaded, in {made[1]:.2f} s")
    return dm


def _programs_ahead(graph: Any, source: Any, nbytes: int, sessions: int,
                    context: int) -> Callable[[], tuple[ProgramCache, float] | None]:
    """Start making, on a thread, the step programs a generation engine of ``graph`` (decomposed
    and placed) asks for first (``ProgramCache.make_ahead``); returns what waits for them: the
    cache that holds them and the seconds they took, or None where making them failed (the engine
    makes them when asked, and says what failed then)."""
    ahead = ProgramCache(None, graph, str(graph.meta.get("name") or "model"), "")
    ahead.source, ahead.budget = source, nbytes
    dims, shapes = step_shapes(sessions, context, max_chunk(graph))

    def make() -> float:
        t0 = time.perf_counter()
        ahead.make_ahead(dims, shapes)
        return time.perf_counter() - t0

    pool = ThreadPoolExecutor(1, thread_name_prefix="seabiscuit-programs-ahead")
    made = pool.submit(make)
    pool.shutdown(wait=False)

    def joined() -> tuple[ProgramCache, float] | None:
        try:
            return ahead, made.result()
        except Exception as e:  # noqa: BLE001 - made again when asked, where it fails as it did here
            logger.info("seabiscuit: step programs not made ahead: %s", e)
            return None
    return joined


def _measured(client: Any, choice: str, say: Progress) -> Any:
    """The cluster's ``ClusterSpec`` for the device ``choice``, said in a line."""
    t0 = time.perf_counter()
    spec = measure_cluster(client, device=choice)    # NOTE: fails early without the plugin or the device
    kinds = ", ".join(f"{sum(d.kind == k for d in spec.devices)} {k}" for k in ("gpu", "cpu")
                      if any(d.kind == k for d in spec.devices))
    say(f"cluster: {len(spec.devices)} workers ({kinds}, device={choice}), {fmt_bytes(spec.memory_bytes)} "
        f"of budget free (measured in {time.perf_counter() - t0:.2f} s)")
    return spec


def _micro_ops(model_or_path: Any, example_inputs: Any, kwargs: Mapping[str, Any] | None,
               checkpoint: str | os.PathLike[str] | None, nbytes: int, choice: str, say: Progress,
               scheme: str | None = None) -> Any:
    """The model traced at ``example_inputs``, quantized per ``scheme`` and decomposed to ``nbytes``
    per micro-op."""
    t0 = time.perf_counter()
    say("tracing ...")
    graph = trace(model_or_path, example_inputs, kwargs, checkpoint=checkpoint)
    if scheme is not None:
        graph = quantize_graph(graph, scheme)
        int4 = f", {graph.meta['int4']} of them int4" if graph.meta.get("int4") else ""
        say(f"{graph.meta['quantized']} weight(s) quantized as {scheme}{int4}")
    say(f"decomposing {len(graph.ops)} ops at {fmt_bytes(nbytes)} per op ...")
    micro = decompose(graph, nbytes)
    if choice != "auto":     # NOTE: repairs on the scheduler keep the model on this kind of device
        micro = micro.with_meta(device=choice)
    say(f"{len(micro.ops)} micro-ops in {time.perf_counter() - t0:.2f} s; placing ...")
    return micro


def _placed(micro: Any, spec: Any, module: Any, nbytes: int, say: Progress) -> Plan:
    """``micro`` placed on ``spec``: its weights where the decode step of ``module`` (for a
    deployment that keeps KV room) runs best (``place_for_decode``), else by its own graph."""
    plan = place_for_decode(module, micro, spec, nbytes, say) if module is not None else place(micro, spec)
    say(f"placed in {plan.planning_s:.2f} s: {len(plan.blocks)} blocks")
    return plan


def _kv_room(model_or_path: Any, sessions: int, context: int | None) -> tuple[Any, int, int]:
    """The module whose architecture sizes the KV caches (a folder's skeleton), and the bytes
    per attention layer and the tokens a session holds (``kv_reserve``; 0, 0 for no sessions)."""
    if sessions <= 0:
        return model_or_path, 0, 0
    module = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        module = load_hf_skeleton(model_or_path)     # NOTE: its architecture, for the cache sizes
    reserve, limit = kv_reserve(module, sessions, context)
    return module, reserve, limit


def _trace_programs_from(dm: DistributedModel, model_or_path: Any, nbytes: int,
                         kwargs: Mapping[str, Any] | None, checkpoint: str | os.PathLike[str] | None) -> None:
    """Have ``dm`` trace its other programs (generation steps, other input sizes) from the model,
    as it was traced, and bind them to its weights file."""
    programs = dm._programs
    programs.source, programs.budget = model_or_path, nbytes
    programs.trace_kwargs = {k: v for k, v in (kwargs or {}).items() if not isinstance(v, torch.Tensor)}
    if checkpoint is not None or isinstance(model_or_path, (str, os.PathLike)):
        programs.weights_path = os.fspath(checkpoint if checkpoint is not None else model_or_path)


def place_for_decode(module: Any, micro: Any, spec: Any, budget: int, say: Progress) -> Plan:
    """A generation deployment's plan: its weights placed for the decode step (one token, the
    step generation repeats most), the model's own graph following them.

    Falls back to placing the model's graph itself when its activations would not fit so.
    """
    t0 = time.perf_counter()
    # NOTE: looked up on its module at each call, so a ``trace_step`` patched in is used
    step = decompose(decoder.trace_step(module, 1, 1), budget, like=micro).with_meta(
        kv_reserve_bytes=micro.meta["kv_reserve_bytes"])
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
