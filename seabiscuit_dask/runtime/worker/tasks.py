"""What Dask tasks run on a worker: load a block's weights, run one block of one request.

They reach the worker's ``ResidentBlocks`` through the SeaBiscuit worker plugin
(by name, so runtime/ never imports plugins/) and fetch block specs they do not
hold from the scheduler plugin.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from distributed import get_worker
from distributed.utils import sync

from ...errors import AccessDenied, BadMessage, SpecUnavailable
from ...lower.blocks import BlockSpec, parse_key, task_name
from ..dataplane.wire import Tensors
from ..discover import PluginMissing
from ..generation.sampling import greedy
from .resident import ResidentBlocks

PLUGIN_NAME = "seabiscuit"
RUNS_TOPIC = "seabiscuit-runs"
INSTALL = ("install it on the scheduler (client.register_plugin(SeaBiscuitSchedulerPlugin()) or "
           "`dask scheduler --preload seabiscuit_dask.plugins.preload`)")


def resident(worker: Any = None) -> ResidentBlocks:
    """The ``ResidentBlocks`` of this worker's SeaBiscuit plugin."""
    w = worker or get_worker()
    blocks = getattr(w.plugins.get(PLUGIN_NAME), "resident", None)
    if not isinstance(blocks, ResidentBlocks):
        raise PluginMissing(f"worker {w.address} has no SeaBiscuit plugin: {INSTALL}")
    return blocks


def check_task(w: Any, model: str, version: int, request: int, block: int) -> None:
    """The running task is ``("sb-<model>", version, request, block)``: the scheduler plugin runs
    such tasks for the model's owner only, so no other client reaches the model by another key."""
    key = w.get_current_task()
    if parse_key(key) != (model, int(version), int(request), int(block)):
        raise AccessDenied(f"a block of model {model} runs only as its own task "
                           f"{(task_name(model), version, request, block)}, not as {key!r}")


def load_block(model: str, version: int, block: int) -> int:
    """Task: make a block resident on this worker; returns its weight bytes. Its spec comes from
    the scheduler plugin, never from the task, so whoever made the task chose no weight file."""
    w = get_worker()
    check_task(w, model, version, -1, block)
    return resident(w).load(BlockSpec.from_dict(fetch_spec(model, version, block))).nbytes


def fetch_spec(model: str, version: int, block: int, worker: Any = None) -> Mapping[str, Any]:
    """A block's spec from the scheduler plugin (called from a task or data-plane thread)."""
    w = worker or get_worker()
    plugin: Any = w.plugins.get(PLUGIN_NAME)
    if plugin is not None and not plugin.has_secret.wait(30):
        raise PluginMissing(f"worker {w.address} has not heard from the SeaBiscuit scheduler plugin: "
                            f"{INSTALL}")
    try:
        return sync(w.loop, w.scheduler.seabiscuit_block, model=model, version=version, block=block,
                    address=w.address, secret=getattr(plugin, "secret", ""))
    except Exception as e:
        raise SpecUnavailable(f"worker {w.address} could not get block b{block} of model {model} "
                              f"plan {version} from the scheduler: {e}") from e


PICK = "sb_pick"     # NOTE: a step's input_ids are the greedy tokens of the step it follows


def run_block_task(model: str, version: int, request: int, block: int, inputs: Mapping[str, Any],
                   *deps: Mapping[str, torch.Tensor]) -> Tensors:
    """Task: run one block of one request, or take its outputs from an intact checkpoint.

    A generation step queued behind the one before it carries ``inputs["sb_pick"]``: its
    ``input_ids`` are the greedy tokens of that step's logits, its last dependency.
    """
    w = get_worker()
    check_task(w, model, version, request, block)
    if PICK in inputs:
        inputs, deps = _picked(inputs, deps)
    started, t0 = time.time(), time.perf_counter()
    out, how = resident(w).run(model, version, request, block, inputs, deps, fetch_spec)
    # NOTE: the scheduler plugin counts these to report blocks computed more than once, and
    # learns each worker's speed from the times of the computed ones.
    w.log_event(RUNS_TOPIC, {"model": model, "version": version, "request": request, "block": block,
                             "how": how, "compute_s": time.perf_counter() - t0, "start": started,
                             "worker": w.address})
    return Tensors(out)     # NOTE: SeaBiscuit's serialization: activations of every dtype (bf16 too)


def _picked(inputs: Mapping[str, Any], deps: tuple[Mapping[str, torch.Tensor], ...]
            ) -> tuple[dict[str, torch.Tensor], tuple[Mapping[str, torch.Tensor], ...]]:
    pick = inputs[PICK]
    if not deps or not isinstance(pick, Mapping) or str(pick.get("logits")) not in deps[-1]:
        raise BadMessage(f"a chained step names logits {pick!r} that its last dependency lacks")
    logits = deps[-1][str(pick["logits"])]
    out = {k: v for k, v in inputs.items() if k != PICK}
    out["input_ids"] = greedy(logits[:, -1]).reshape(-1, 1).to(torch.long)
    return out, deps[:-1]
