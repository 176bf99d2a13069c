"""Tracing: models and checkpoints in, ``OpGraph`` out."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedModel
from ..ir import OpGraph
from .checkpoint import bind_checkpoint
from .skeleton import build_empty, empty_weights, load_hf_skeleton

if TYPE_CHECKING:
    from .onnx import OnnxModule


def trace(model_or_path: Any, example_inputs: Any, kwargs: Mapping[str, Any] | None = None, *,
          checkpoint: str | os.PathLike[str] | None = None) -> OpGraph:
    """Trace a model at the shapes of ``example_inputs`` into an ``OpGraph``.

    Parameters
    ----------
    model_or_path : nn.Module or path
        A PyTorch module (parameters may be on the ``meta`` device), or a
        Hugging Face model folder (``config.json`` + safetensors), which is
        built without its weights and bound to its checkpoint.
    example_inputs : tensor or tuple
        Positional inputs; the graph is specialised to their shapes and dtypes.
    kwargs : dict, optional
        Keyword inputs. Hugging Face models get ``use_cache=False`` unless given.
    checkpoint : path, optional
        A safetensors file or folder to load weights from (``bind_checkpoint``).

    Examples
    --------
    >>> g = sb.trace(model, torch.randint(0, 100, (1, 8)))     # doctest: +SKIP
    >>> print(g.summary())                                       # doctest: +SKIP
    """
    import torch

    from ..templates import cached_trace
    from .onnx import OnnxModule, is_onnx, load_onnx
    from .torch_export import as_example_tuple, default_kwargs, trace_module

    if is_onnx(model_or_path):
        model_or_path = load_onnx(model_or_path, lazy=True)
    model: torch.nn.Module
    if isinstance(model_or_path, OnnxModule):
        model = model_or_path
        args = _onnx_inputs(model_or_path, example_inputs)
    elif isinstance(model_or_path, (str, os.PathLike)):
        model = load_hf_skeleton(model_or_path)
        checkpoint = checkpoint if checkpoint is not None else model_or_path
    elif isinstance(model_or_path, torch.nn.Module):
        model = model_or_path
    else:
        raise UnsupportedModel(f"sb.trace expects a torch.nn.Module or a model folder, got an "
                               f"object of type {type(model_or_path).__name__}")
    if not isinstance(model, OnnxModule):
        args = as_example_tuple(example_inputs)
    kw = default_kwargs(model, kwargs)
    graph = cached_trace(model, args, kw, lambda: trace_module(model, args, kw))
    if isinstance(model, OnnxModule):     # NOTE: after the cache: the files are this model's own
        graph = model.bind_stored(graph)
    graph = graph.with_meta(call=call_signature(model, len(args)), index_ranges=index_ranges(graph))
    if checkpoint is not None:
        graph = bind_checkpoint(graph, checkpoint)
    return graph


def _onnx_inputs(model: OnnxModule, example_inputs: Any) -> tuple[Any, ...]:
    """Example inputs of an ONNX model in its input order: a tuple, or a dict by input name."""
    from ..errors import BadInput
    from .onnx import symbolic_inputs
    from .torch_export import as_example_tuple

    names = model.input_names
    if example_inputs is None:
        sym = symbolic_inputs(model)
        raise BadInput(f"ONNX model {model.onnx_name} needs example inputs for {', '.join(names)}"
                       + (f"; symbolic dims: {sym}" if sym else "") + ": the graph is traced at their shapes")
    if isinstance(example_inputs, Mapping):
        missing = [n for n in names if n not in example_inputs]
        if missing:
            raise BadInput(f"ONNX model {model.onnx_name} needs inputs {names}; missing {missing}")
        args = tuple(example_inputs[n] for n in names)
    else:
        args = as_example_tuple(example_inputs)
    if len(args) != len(names):
        raise BadInput(f"ONNX model {model.onnx_name} takes {len(names)} input(s) ({', '.join(names)}), "
                       f"got {len(args)}")
    model.example_shapes(args)
    return args


def call_signature(model: Any, n_positional: int) -> dict[str, list[str]]:
    """Names of the first ``n_positional`` parameters of ``model.forward`` (for keyword calls);
    an ONNX model's are its graph's input names."""
    import inspect

    if hasattr(model, "input_names") and hasattr(model, "onnx_name"):
        return {"positional": list(model.input_names)[:n_positional]}

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {"positional": [f"arg{i}" for i in range(n_positional)]}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    if len(names) < n_positional:       # NOTE: *args: positional inputs have no names
        names += [f"arg{i}" for i in range(len(names), n_positional)]
    return {"positional": names[:n_positional]}


def index_ranges(graph: OpGraph) -> dict[str, int]:
    """Graph inputs used as embedding indices (directly or through views) -> rows of the table."""
    out: dict[str, int] = {}
    for op in graph.ops:
        if op.kind != "embedding" or op.target != "aten.embedding.default":
            continue
        weight, idx = op.attrs["args"][0], op.attrs["args"][1]
        if not (isinstance(weight, Mapping) and "p" in weight and isinstance(idx, Mapping) and "t" in idx):
            continue
        name = idx["t"]
        while name in graph.producer:
            src = graph.op_by_name[graph.producer[name]]
            if src.kind != "view" or len(src.inputs) != 1:
                break
            name = src.inputs[0]
        if name in graph.inputs:
            rows = graph.params[weight["p"]].shape[0]
            out[name] = min(rows, out.get(name, rows))
    return out


__all__ = ["bind_checkpoint", "build_empty", "empty_weights", "load_hf_skeleton", "trace"]
