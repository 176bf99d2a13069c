"""Binding a graph's parameters to a safetensors checkpoint, with full validation."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ..errors import BadCheckpoint
from ..ir import OpGraph, ParamSource, ParamSpec, quant_region
from ..weights import StoredTensor, read_safetensors_header, safetensors_files


def _candidates(key: str, aliases: Iterable[str]) -> list[str]:
    keys = [key, *aliases]
    extra = []
    for k in keys:
        if "." in k:
            extra.append(k.split(".", 1)[1])      # checkpoint saved without the head's prefix
    return keys + extra


def bind_checkpoint(graph: OpGraph, path: str | os.PathLike[str],
                    kinds: tuple[str, ...] = ("model", "safetensors")) -> OpGraph:
    """Return a graph whose parameters load from the safetensors checkpoint at ``path``.

    Works before or after ``decompose``: tiles keep their slices. Every param whose
    source is of one of ``kinds`` must be found (by key, a tied alias, or without its
    top-level prefix) with a stored shape that holds its slices; otherwise
    ``BadCheckpoint`` lists what is missing and which shapes differ. Params of other
    kinds keep their sources (``kinds=("model",)``: bind only what is read from memory).
    A ``.gguf`` file binds to its tensors (``gguf.bind_gguf``).
    """
    from ..gguf import bind_gguf, is_gguf

    if is_gguf(path):
        return bind_gguf(graph, path, kinds)
    stored: dict[str, StoredTensor] = {}
    for f in safetensors_files(path):
        stored.update(read_safetensors_header(f))
    aliases: dict[str, Any] = dict(graph.meta.get("aliases", {}))
    full_shapes: dict[str, tuple[int, ...]] = dict(
        (k, tuple(v)) for k, v in graph.meta.get("param_shapes", {}).items())
    missing: list[str] = []
    mismatched: list[str] = []
    params: dict[str, ParamSpec] = {}
    for name, p in graph.params.items():
        src = p.source
        if src.kind not in kinds:     # NOTE: inline, raw: their bytes are in the graph, or in their own file
            params[name] = p
            continue
        hit = next((stored[k] for k in _candidates(src.key, aliases.get(src.key, ()))
                    if k in stored), None)
        if hit is None:
            missing.append(src.key)
            continue
        # NOTE: a quantized weight's integers or scales read rows of the float weight ``whole``
        whole = src.whole if src.quant is not None else None
        expected = full_shapes.get(src.key, whole or (p.shape if src.slices is None else None))
        if expected is not None and hit.shape != tuple(expected):
            mismatched.append(f"{src.key}: checkpoint {hit.shape}, model {tuple(expected)}")
            continue
        # NOTE: a derived tile's slices are in its own units (int4: blocks, groups): its float region
        region = quant_region(src) if whole is not None and src.slices is not None else None
        if src.slices is not None and (any(b > s for (_, b), s in zip(region, hit.shape)) if region else (
                len(src.slices) != len(hit.shape) or any(b > s for (_, b), s in zip(src.slices, hit.shape)))):
            mismatched.append(f"{src.key}: tile {list(src.slices)} outside stored {hit.shape}")
            continue
        params[name] = ParamSpec(name, p.shape, p.dtype,
                                 ParamSource("safetensors", hit.key, src.slices, hit.file,
                                             quant=src.quant, whole=src.whole))
    if missing or mismatched:
        parts = []
        if missing:
            uniq = sorted(set(missing))
            parts.append(f"{len(uniq)} key(s) missing: {', '.join(uniq[:5])}"
                         + (" ..." if len(uniq) > 5 else ""))
        if mismatched:
            uniq = sorted(set(mismatched))
            parts.append(f"{len(uniq)} shape mismatch(es): {'; '.join(uniq[:5])}"
                         + (" ..." if len(uniq) > 5 else ""))
        raise BadCheckpoint(f"checkpoint {os.fspath(path)} does not match "
                            f"{graph.meta.get('name', 'the model')}: " + "; ".join(parts))
    return OpGraph(graph.ops, graph.tensors, params, graph.inputs, graph.outputs,
                   {**dict(graph.meta), "checkpoint": os.fspath(path)}, graph.tilings)
