"""Tracing: models and checkpoints in, ``OpGraph`` out."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedModel
from .checkpoint import bind_checkpoint
from .skeleton import build_empty, empty_weights, load_hf_skeleton


def trace(model_or_path: Any, example_inputs: Any, kwargs: Mapping[str, Any] | None = None, *,
          checkpoint: str | os.PathLike[str] | None = None) -> Any:
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
    from .torch_export import as_example_tuple, default_kwargs, trace_module

    if isinstance(model_or_path, (str, os.PathLike)):
        model = load_hf_skeleton(model_or_path)
        checkpoint = checkpoint if checkpoint is not None else model_or_path
    elif isinstance(model_or_path, torch.nn.Module):
        model = model_or_path
    else:
        raise UnsupportedModel(f"sb.trace expects a torch.nn.Module or a model folder, got an "
                               f"object of type {type(model_or_path).__name__}")
    args = as_example_tuple(example_inputs)
    kw = default_kwargs(model, kwargs)
    graph = cached_trace(model, args, kw, lambda: trace_module(model, args, kw))
    if checkpoint is not None:
        graph = bind_checkpoint(graph, checkpoint)
    return graph


__all__ = ["bind_checkpoint", "build_empty", "empty_weights", "load_hf_skeleton", "trace"]
