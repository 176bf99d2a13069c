"""Weights of a model given in memory, written once for the workers to read slice by slice.

A store folder (``seabiscuit-store-*``) lives as long as its deployment's client
object. A client process that dies leaves it behind; the scheduler plugin removes
the stores of a model whose client left (``remove_store``), and the next store
written on a host removes those whose writing process is gone (``remove_orphans``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from ... import config
from ...errors import AccessDenied, BadCheckpoint
from ...ir import OpGraph
from ...trace import bind_checkpoint
from ...weights import WeightStore
from .integrity import crc32


def tile_checksums(model: torch.nn.Module, graph: OpGraph) -> dict[str, int]:
    """CRC-32 of every weight tile ``graph`` reads from ``model``, and of every tile it reads in
    place from an ONNX file (``raw``) whose values ``model`` holds as it read them: the reference
    the workers check, so a file rewritten since the trace is refused by name, not read at the
    old offsets. External data that ``model`` left unread (lazy) has no reference."""
    store = WeightStore.from_weights(model)
    return {name: crc32(store.load(p)) for name, p in graph.params.items()
            if p.source.kind == "model" or (p.source.kind == "raw" and p.source.key in store.tensors
                                            and not store.tensors[p.source.key].is_meta)}


def write_store(model: torch.nn.Module, graph: OpGraph, folder: Path) -> Path:
    """Save the tensors ``graph`` reads from ``model`` to ``folder/model.safetensors``."""
    from safetensors.torch import save_file

    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    keys = sorted({p.source.key for p in graph.params.values() if p.source.kind == "model"})
    missing = [k for k in keys if k not in named]
    if missing:
        raise BadCheckpoint(f"the model has no tensors {missing[:5]} that its graph reads")
    meta = [k for k in keys if named[k].is_meta]
    if meta:
        raise BadCheckpoint(f"{len(meta)} tensor(s) of the model are on the meta device "
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


def stored(graph: OpGraph, weights: Any, owner: object) -> tuple[OpGraph, Path | None]:
    """``graph`` bound to a store written from ``weights`` when it reads a model in memory.

    The store folder goes away with ``owner`` (or at interpreter exit), so a client
    that never calls ``close()`` leaves nothing behind.
    """
    graph = copied_if_unreadable(graph, weights)
    crcs = tile_checksums(weights, graph) if isinstance(weights, torch.nn.Module) else {}
    if not any(p.source.kind == "model" for p in graph.params.values()):
        return (graph.with_meta(tile_crc32=crcs) if crcs else graph), None
    if not isinstance(weights, torch.nn.Module):
        raise BadCheckpoint("the graph reads weights from a model in memory, but no module was given "
                            "(pass weights=model)")
    remove_orphans()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=store_root()))
    weakref.finalize(owner, shutil.rmtree, folder, ignore_errors=True)
    (folder / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    bound = bind_checkpoint(graph, write_store(weights, graph, folder), kinds=("model",))
    bound = bound.with_meta(tile_crc32=crcs)
    return bound, folder


def copied_if_unreadable(graph: OpGraph, weights: Any) -> OpGraph:
    """``graph`` with the params whose file lies outside ``seabiscuit.roots`` taken from ``weights``
    (so ``stored`` copies them to the store), where ``weights`` holds them: an ONNX model bound to
    its own file (``sb.trace``) deploys from a folder the workers may not read, as a model in
    memory does. Params ``weights`` does not hold stay as they are (the workers refuse them)."""
    from dataclasses import replace

    from ...ir import ParamSource, ParamSpec
    from ..access import check_source

    if not isinstance(weights, torch.nn.Module):
        return graph
    held = dict(weights.named_buffers(remove_duplicate=False))
    held.update(weights.named_parameters(remove_duplicate=False))
    lazy = set(getattr(weights, "lazy_buffers", ()))
    unreadable: dict[str, bool] = {}
    params = {}
    for name, p in graph.params.items():
        src = p.source
        if src.file and src.key in held and src.key not in lazy:
            if src.file not in unreadable:
                try:
                    check_source(src)
                    unreadable[src.file] = False
                except AccessDenied:
                    unreadable[src.file] = True
            if unreadable[src.file]:
                p = ParamSpec(name, p.shape, p.dtype,
                              ParamSource("model", src.key, src.slices, quant=src.quant, whole=src.whole))
        params[name] = p
    return replace(graph, params=params) if any(unreadable.values()) else graph


PREFIX = "seabiscuit-store-"
OWNER = "owner.json"        # NOTE: host and process id of the client that wrote the store


def store_root() -> Path:
    """The folder stores are written in (``seabiscuit.runtime.store-directory``, else the temp folder)."""
    return Path(config.get("runtime.store-directory") or tempfile.gettempdir()).resolve()


def _store_folder(path: str | os.PathLike[str]) -> Path | None:
    """The store folder holding ``path``, if ``path`` is a weights file of one; else None."""
    p = Path(os.fspath(path)).resolve()
    folder = p.parent
    if folder.parent == store_root() and folder.name.startswith(PREFIX) and (folder / OWNER).exists():
        return folder
    return None


def remove_store(graph: OpGraph) -> list[Path]:
    """Remove the store folders ``graph`` reads its weights from (its client is gone)."""
    folders = {f for p in graph.params.values() if p.source.file and (f := _store_folder(p.source.file))}
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)
    return sorted(folders)


def remove_orphans() -> list[Path]:
    """Remove the stores written on this host by processes that no longer run."""
    import psutil

    gone = []
    host = socket.gethostname()
    for folder in store_root().glob(f"{PREFIX}*"):
        try:
            owner = json.loads((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue           # NOTE: not a store this code wrote (or one being written)
        if owner.get("host") == host and not psutil.pid_exists(int(owner.get("pid", -1))):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone
