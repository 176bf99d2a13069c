"""``sb.distribute``: a model that fits no single worker, run across a Dask cluster.

``distribute`` traces and decomposes the model, measures the live cluster
(``ClusterSpec.from_client``), places the micro-ops, hands the plan to the
scheduler plugin and has every worker load the weight tiles of its own blocks,
from the checkpoint's slices. A model given in memory is written once to a
safetensors store the workers read (config ``seabiscuit.runtime.store-directory``;
on a multi-host cluster it must be a folder every host sees).

``dm(*inputs)`` submits one task per block for the request, never one per
micro-op; only activations travel. Calls from several threads at once pipeline
across the workers. When a worker leaves, the scheduler plugin repairs the plan
and tells this object on the ``seabiscuit`` event topic.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import config
from .errors import SeaBiscuitError, WorkerLost
from .ir import OpGraph, fmt_bytes
from .lower.blocks import BlockSpec, block_specs, request_graph, task_name
from .placement import ClusterSpec, Plan, place
from .runtime import flatten_inputs, unflatten_outputs

Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    return None


def tile_checksums(model: torch.nn.Module, graph: OpGraph) -> dict[str, int]:
    """CRC-32 of every weight tile ``graph`` reads from ``model``: the reference the workers check."""
    from .integrity import crc32
    from .weights import WeightStore

    store = WeightStore.from_weights(model)
    return {name: crc32(store.load(p)) for name, p in graph.params.items() if p.source.kind == "model"}


def write_store(model: torch.nn.Module, graph: OpGraph, folder: Path) -> Path:
    """Save the tensors ``graph`` reads from ``model`` to ``folder/model.safetensors``."""
    from safetensors.torch import save_file

    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    keys = sorted({p.source.key for p in graph.params.values() if p.source.kind == "model"})
    missing = [k for k in keys if k not in named]
    if missing:
        raise SeaBiscuitError(f"the model has no tensors {missing[:5]} that its graph reads")
    meta = [k for k in keys if named[k].is_meta]
    if meta:
        raise SeaBiscuitError(f"{len(meta)} tensor(s) of the model are on the meta device "
                              f"({meta[:3]}): pass real weights or a checkpoint")
    seen: set[int] = set()
    tensors = {}
    for k in keys:
        t = named[k].detach().contiguous()
        if t.data_ptr() in seen:        # NOTE: safetensors refuses two keys sharing memory
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[k] = t
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_file(tensors, os.fspath(path))
    return path


class DistributedModel:
    """A model deployed on a Dask cluster; call it like the model. See ``distribute``."""

    def __init__(self, client: Any, graph: OpGraph, plan: Plan, model_id: str, version: int,
                 store_dir: Path | None = None, checkpoint_dir: str = "", verify_every: int = 0) -> None:
        self.client = client
        self.graph = graph
        self.model_id = model_id
        self._store_dir = store_dir
        self.checkpoint_dir = checkpoint_dir
        self.verify_every = verify_every
        self._inflight: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self._requests = itertools.count()
        self._stranded: str | None = None
        self._closed = False
        self.events: list[dict[str, Any]] = []
        self._set_plan(plan, version)
        _listen(client, self)

    # --- plan ------------------------------------------------------------------------------
    def _set_plan(self, plan: Plan, version: int) -> None:
        specs = block_specs(plan, self.model_id, version, self.checkpoint_dir, self.verify_every)
        with self._lock:
            self._plan, self.version, self.specs = plan, version, specs
            self._out_blocks = self._output_blocks()

    def _output_blocks(self) -> dict[str, int]:
        out = {}
        for s in self.specs:
            for t in s.exports:
                if t in self.graph.outputs:
                    out[t] = s.index
        return out

    @property
    def plan(self) -> Plan:
        """The current plan; ``print(dm.plan)`` prints its table."""
        return self._plan

    def _on_event(self, event: Any) -> None:
        _, msg = event
        if not isinstance(msg, Mapping) or msg.get("model") != self.model_id:
            return
        self.events.append({k: v for k, v in msg.items() if k not in ("device_of", "cluster")})
        if msg.get("action") == "stranded":
            self._stranded = str(msg.get("message"))
            doomed = [f for futures in list(self._inflight.values()) for f in futures]
            if doomed:    # NOTE: this runs on the client's event loop: cancel from another thread
                threading.Thread(target=self.client.cancel, args=(doomed,), daemon=True).start()
        elif msg.get("action") == "plan" and int(msg["version"]) > self.version:
            plan = Plan(self.graph, ClusterSpec.from_dict(msg["cluster"]),
                        np.asarray(msg["device_of"], dtype=np.int64), method="replanned")
            self._set_plan(plan, int(msg["version"]))

    # --- requests -----------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run one request; returns what the model returns (same structure and values)."""
        if self._closed:
            raise SeaBiscuitError(f"distributed model {self.model_id} is closed")
        if self._stranded:
            raise WorkerLost(self._stranded)
        flat = flatten_inputs(self.graph, inputs, kwargs)
        feed = {name: x.cpu() for name, x in zip(self.graph.inputs, flat)}
        with self._lock:
            specs, out_blocks = self.specs, self._out_blocks
        request = next(self._requests)
        dsk, keys = request_graph(specs, request, feed, _run_block_task())
        wanted = sorted(set(out_blocks.values()))
        futures = self.client.get(dsk, [keys[b] for b in wanted], sync=False)
        self._inflight[request] = futures
        try:
            results = dict(zip(wanted, self.client.gather(futures)))
        except SeaBiscuitError:
            raise
        except Exception as e:
            raise _request_error(request, self.model_id, self._stranded, e) from e
        finally:
            self._inflight.pop(request, None)
            for f in futures:
                f.release()
            if self.checkpoint_dir:
                shutil.rmtree(Path(self.checkpoint_dir) / self.model_id / f"r{request}", ignore_errors=True)
        values = [results[out_blocks[t]][t] if t in out_blocks else feed[t] for t in self.graph.outputs]
        return unflatten_outputs(self.graph, values)

    # --- operations -------------------------------------------------------------------------
    def _address(self, worker: str) -> str:
        for d in self._plan.spec.devices:
            if worker in (d.name, d.address):
                return d.address
        from .plugins.discover import device_name

        info = self.client.scheduler_info()["workers"]
        for addr, w in info.items():
            alias = device_name({"name": w.get("name"), "address": addr}, set())   # "w0" for worker 0
            if worker in (addr, str(w.get("name")), alias):
                return str(addr)
        raise SeaBiscuitError(f"no worker {worker!r} in the cluster; workers: {sorted(info)}")

    def _wait_for(self, versions: Mapping[str, int], timeout_s: float = 30.0) -> None:
        want = versions.get(self.model_id)
        deadline = time.perf_counter() + timeout_s
        while want is not None and self.version < want and time.perf_counter() < deadline:
            time.sleep(0.01)

    def drain(self, worker: str, reason: str = "drained") -> dict[str, Any]:
        """Move this cluster's models off ``worker`` (name or address) while requests keep flowing.

        Returns the scheduler's report: ``replan_s`` per model moved, ``versions``.
        """
        reply = self.client.sync(self.client.scheduler.seabiscuit_drain, address=self._address(worker),
                                 reason=reason)
        self._wait_for(reply.get("versions", {}))
        return dict(reply)

    def restore(self, worker: str) -> dict[str, Any]:
        """Let a drained worker take work again; models spread onto it as onto a worker that joins."""
        reply = self.client.sync(self.client.scheduler.seabiscuit_restore, address=self._address(worker))
        self._wait_for(reply.get("versions", {}))
        return dict(reply)

    def set_budget(self, worker: str, memory: int | str) -> dict[str, Any]:
        """Give ``worker`` a new memory budget; what no longer fits moves elsewhere."""
        nbytes = config.to_bytes(memory, "memory budget")
        reply = self.client.sync(self.client.scheduler.seabiscuit_budget, address=self._address(worker),
                                 memory_bytes=nbytes)
        self._wait_for(reply.get("versions", {}))
        return dict(reply)

    def run_counts(self) -> dict[str, int]:
        """Blocks computed, read back from checkpoints, and computed more than once, for this model."""
        return dict(self.client.sync(self.client.scheduler.seabiscuit_runs, model=self.model_id))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: block runs, checkpoint resumes and writes, corruptions found, resident bytes."""
        from .plugins.worker import worker_report

        keys = ("block_runs", "resumed_from_checkpoint", "checkpoints_written", "corrupt_tiles",
                "corrupt_checkpoints", "prefetched_blocks", "resident_bytes", "budget_bytes")
        return {a: {k: r[k] for k in keys} for a, r in self.client.run(worker_report).items() if r}

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model's blocks on every worker and its plan on the scheduler."""
        if self._closed:
            return
        self._closed = True
        from .plugins.worker import release_model

        try:
            if self.checkpoint_dir:
                shutil.rmtree(Path(self.checkpoint_dir) / self.model_id, ignore_errors=True)
            _unlisten(self.client, self)
            self.client.sync(self.client.scheduler.seabiscuit_release, model=self.model_id)
            self.client.run(release_model, self.model_id)
        finally:
            if self._store_dir is not None:
                shutil.rmtree(self._store_dir, ignore_errors=True)

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<DistributedModel {self.graph.meta.get('name', 'model')} {self.model_id}: "
                f"{len(self.graph.ops)} micro-ops in {len(self.specs)} blocks on "
                f"{len(self._plan.spec.devices)} workers, plan v{self.version}>")


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


# One subscription per client to the scheduler plugin's topic, shared by its models.
_listeners: dict[str, dict[str, DistributedModel]] = {}
_listeners_lock = threading.Lock()


def _listen(client: Any, dm: DistributedModel) -> None:
    with _listeners_lock:
        models = _listeners.setdefault(client.id, {})
        first = not models
        models[dm.model_id] = dm
    if first:
        def dispatch(event: Any) -> None:
            msg = event[1]
            model = str(msg.get("model")) if isinstance(msg, Mapping) else ""
            target = _listeners.get(client.id, {}).get(model)
            if target is not None:
                target._on_event(event)

        client.subscribe_topic("seabiscuit", dispatch)


def _unlisten(client: Any, dm: DistributedModel) -> None:
    with _listeners_lock:
        models = _listeners.get(client.id, {})
        models.pop(dm.model_id, None)
        last = not models
        if last:
            _listeners.pop(client.id, None)
    if last:
        client.unsubscribe_topic("seabiscuit")


def _run_block_task() -> Callable[..., Any]:
    from .plugins.worker import run_block_task

    return run_block_task


def _load_tasks(specs: list[BlockSpec]) -> dict[Any, Any]:
    from .plugins.worker import load_block_json

    return {(task_name(s.model), s.version, -1, s.index): (load_block_json, json.dumps(s.to_dict()))
            for s in specs}


def distribute(model_or_path: Any, client: Any, example_inputs: Any, budget: int | str | None = None, *,
               kwargs: Mapping[str, Any] | None = None, checkpoint: str | os.PathLike[str] | None = None,
               checkpoint_dir: str | os.PathLike[str] | None = None, verify_every: int | None = None,
               progress: Progress | None = None) -> DistributedModel:
    """Deploy a model on the cluster behind ``client``; returns a callable ``DistributedModel``.

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
    checkpoint_dir : path, optional
        Checkpoint every block's outputs there (a folder every worker sees), so a
        block that must run again after a worker loss reads them back instead
        (default: config ``seabiscuit.checkpoint.directory``; None: no checkpoints).
    verify_every : int, optional
        Check each block's resident weight tiles against their checksums every N
        runs (1: before every run; 0: only when read). Default: config
        ``seabiscuit.integrity.verify-every``.
    progress : callable, optional
        Called with a line of text at each long step.

    Examples
    --------
    >>> client.register_plugin(sb.SeaBiscuitSchedulerPlugin())        # doctest: +SKIP
    >>> dm = sb.distribute(model, client, (ids,), budget="16MiB")      # doctest: +SKIP
    >>> logits = dm(ids).logits                                        # doctest: +SKIP
    >>> print(dm.plan)                                                 # doctest: +SKIP
    """
    from .decompose import decompose
    from .trace import bind_checkpoint, trace

    say = progress or _quiet
    nbytes = config.to_bytes(budget if budget is not None else config.get("budget"))
    t0 = time.perf_counter()
    spec = ClusterSpec.from_client(client)        # fails early without the plugin
    say(f"cluster: {len(spec.devices)} workers, {fmt_bytes(spec.memory_bytes)} of budget "
        f"(measured in {time.perf_counter() - t0:.2f} s)")
    t0 = time.perf_counter()
    say("tracing ...")
    graph = trace(model_or_path, example_inputs, kwargs, checkpoint=checkpoint)
    say(f"decomposing {len(graph.ops)} ops at {fmt_bytes(nbytes)} per op ...")
    micro = decompose(graph, nbytes)
    say(f"{len(micro.ops)} micro-ops in {time.perf_counter() - t0:.2f} s; placing ...")
    plan = place(micro, spec)
    say(f"placed in {plan.planning_s:.2f} s: {len(plan.blocks)} blocks")
    store_dir = None
    if any(p.source.kind == "model" for p in micro.params.values()):
        if not isinstance(model_or_path, torch.nn.Module):
            raise SeaBiscuitError("the graph reads weights from a model in memory, but no module was given")
        base = config.get("runtime.store-directory")
        store_dir = Path(tempfile.mkdtemp(prefix="seabiscuit-store-", dir=base))
        say(f"writing {fmt_bytes(micro.param_bytes)} of weights to {store_dir} ...")
        crcs = tile_checksums(model_or_path, micro)
        micro = bind_checkpoint(micro, write_store(model_or_path, micro, store_dir)).with_meta(
            tile_crc32=crcs)
        plan = Plan(micro, plan.spec, plan.device_of, plan.method, plan.planning_s, dict(plan.info))
    model_id = uuid.uuid4().hex[:10]
    ckpt = checkpoint_dir if checkpoint_dir is not None else config.get("checkpoint.directory")
    ckpt = os.fspath(Path(ckpt).expanduser().resolve()) if ckpt else ""
    every = int(verify_every if verify_every is not None else config.get("integrity.verify-every", 0) or 0)
    dm: DistributedModel | None = None
    try:
        reply = client.sync(client.scheduler.seabiscuit_deploy, model=model_id, graph=micro.to_json(),
                            device_of=plan.device_of.tolist(), cluster=plan.spec.to_dict(),
                            checkpoint_dir=ckpt, verify_every=every)
        dm = DistributedModel(client, micro, plan, model_id, int(reply["version"]), store_dir, ckpt,
                              every)
        _load(client, dm.specs, say)
    except BaseException:
        if dm is not None:
            dm.close()      # NOTE: nothing half-deployed stays behind on the cluster
        elif store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)
        raise
    return dm


def _load(client: Any, specs: list[BlockSpec], say: Progress) -> None:
    """Every worker loads its blocks' weight tiles; progress by bytes."""
    from distributed import as_completed

    dsk = _load_tasks(specs)
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
