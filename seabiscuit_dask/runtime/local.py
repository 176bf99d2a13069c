"""In-process execution of an OpGraph: the reference every distributed run must match."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import BadInput
from ..ir import OpGraph, TensorSpec
from ..lower import dims
from ..lower.kernels import execute_op
from ..lower.registry import require_registered
from ..weights import WeightStore


def bind_call(graph: OpGraph, inputs: tuple[Any, ...],
              kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Match a call's positional and keyword inputs to the traced ones, as the signature allows.

    ``meta["call"]`` names the traced positional parameters and keywords; a
    positional parameter may be given by keyword and the other way round.
    """
    name = graph.meta.get("name", "graph")
    call = graph.meta.get("call") or {}
    positional, keywords = list(call.get("positional", ())), list(graph.meta.get("kwarg_order", ()))
    if not call:
        unknown = sorted(set(kwargs) - set(keywords))
        if unknown:
            raise BadInput(f"{name} was traced without keyword input(s) {unknown}; "
                           f"traced keywords: {keywords}")
        return tuple(inputs), {k: kwargs[k] for k in keywords if k in kwargs}
    if len(inputs) > len(positional):
        raise BadInput(f"{name} was traced with {len(positional)} positional input(s) {positional}, "
                       f"got {len(inputs)}")
    args = list(inputs)
    for p in positional[len(inputs):]:
        if p not in kwargs:
            raise BadInput(f"{name} needs input {p!r} (traced inputs: {positional + keywords})")
        args.append(kwargs[p])
    twice = sorted(set(positional[:len(inputs)]) & set(kwargs))
    unknown = sorted(set(kwargs) - set(positional) - set(keywords))
    if twice or unknown:
        raise BadInput(f"{name}: input(s) {twice or unknown} " + ("given twice, by position and keyword"
                       if twice else f"were not traced; traced inputs: {positional + keywords}"))
    # NOTE: keywords are flattened in traced order, so same-shaped ones cannot swap silently.
    return tuple(args), {k: kwargs[k] for k in keywords if k in kwargs}


def flatten_inputs(graph: OpGraph, inputs: tuple[Any, ...],
                   kwargs: Mapping[str, Any] | None = None) -> list[torch.Tensor]:
    """Tensors of a call, in graph-input order, checked against the traced shapes and ranges."""
    args, ordered = bind_call(graph, inputs, dict(kwargs or {}))
    leaves = [x for x in pytree.tree_leaves((args, ordered)) if isinstance(x, torch.Tensor)]
    if len(leaves) != len(graph.inputs):
        raise BadInput(f"{graph.meta.get('name', 'graph')} takes {len(graph.inputs)} tensor "
                       f"input(s) {list(graph.inputs)}, got {len(leaves)}")
    ranges = graph.meta.get("index_ranges") or {}
    shapes = {n: graph.tensors[n].shape for n in graph.inputs}
    if "dims" in graph.meta:        # NOTE: a step program of any shape: the one this step is
        try:
            shapes = dims.input_shapes(graph, dict(zip(graph.inputs, leaves)))
        except dims.NotGeneral as e:
            raise BadInput(str(e)) from None
    for name, x in zip(graph.inputs, leaves):
        check_input(name, TensorSpec(shapes[name], graph.tensors[name].dtype), x)
        if name in ranges:
            check_ids(name, x, int(ranges[name]))
    return leaves


def check_input(name: str, spec: TensorSpec, x: torch.Tensor) -> None:
    got = TensorSpec(tuple(x.shape), str(x.dtype).removeprefix("torch."))
    if got != spec:
        raise BadInput(f"input {name!r} has shape {got.shape} and dtype {got.dtype}; the graph "
                       f"was traced for shape {spec.shape} and dtype {spec.dtype}")


def check_ids(name: str, x: torch.Tensor, vocab: int) -> None:
    """Indices into a table of ``vocab`` rows must be in ``[0, vocab)``, as eager torch demands."""
    bad = (x < 0) | (x >= vocab)
    if x.numel() and bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise BadInput(f"input {name!r} holds id {int(x[pos])} at position {list(pos)}; it indexes a table "
                       f"of {vocab} rows, so ids must be in 0..{vocab - 1}")


def split_inputs(graph: OpGraph, feed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``feed`` (graph input -> value) with each tiled input replaced by its tiles."""
    out = {}
    for name, x in feed.items():
        tiling = graph.tilings.get(name)
        if tiling is None:
            out[name] = x
            continue
        for region, tile in tiling:
            out[tile] = x[tuple(slice(a, b) for a, b in region)].contiguous()
    return out


def assemble_outputs(graph: OpGraph, values: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The graph outputs from ``values`` of its ``leaf_outputs``: tiled ones put together."""
    out = []
    for name in graph.outputs:
        tiling = graph.tilings.get(name)
        if tiling is None:
            out.append(values[name])
            continue
        spec = graph.tensors[name]
        first = values[tiling[0][1]]
        whole = first.new_empty(spec.shape)
        for region, tile in tiling:
            whole[tuple(slice(a, b) for a, b in region)] = values[tile]
        out.append(whole)
    return out


def unflatten_outputs(graph: OpGraph, values: list[torch.Tensor]) -> Any:
    spec = graph.meta.get("out_spec")
    if spec:
        try:
            return pytree.tree_unflatten(values, pytree.treespec_loads(spec))
        except Exception:  # noqa: BLE001 - an unknown container type: fall back to a tuple
            pass
    return values[0] if len(values) == 1 else tuple(values)


def last_uses(graph: OpGraph) -> dict[str, int]:
    """tensor/param name -> index of the last op reading it (graph outputs never expire)."""
    last: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for name in (*op.inputs, *op.params):
            last[name] = i
    for name in graph.leaf_outputs:
        last[name] = len(graph.ops)
    return last


def run_local(graph: OpGraph, *inputs: Any, weights: Any = None, device: str = "cpu",
              store: WeightStore | None = None, **kwargs: Any) -> Any:
    """Execute ``graph`` in this process and return what the model returns.

    Parameters
    ----------
    graph : OpGraph
        A traced (and possibly decomposed) graph.
    *inputs, **kwargs
        The call's inputs, as given to the model; shapes must match the trace.
    weights : nn.Module, state dict or None
        Where parameters come from. ``None`` uses each param's own source
        (a bound safetensors checkpoint, or inline constants).
    store : WeightStore, optional
        A store to load through (its ``reads`` record which slices were read).

    Examples
    --------
    >>> g = sb.decompose(sb.trace(model, x), budget="1MiB")   # doctest: +SKIP
    >>> y = sb.run_local(g, x, weights=model)                  # doctest: +SKIP
    """
    require_registered(graph)      # NOTE: an op outside the registry is refused before any kernel runs
    dev = torch.device(device)
    store = store if store is not None else WeightStore.from_weights(weights, dev)
    env: dict[str, torch.Tensor] = {}
    feed = dict(zip(graph.inputs, flatten_inputs(graph, inputs, kwargs)))
    for name, x in split_inputs(graph, feed).items():
        env[name] = x.to(dev)
    last = last_uses(graph)
    loaded: set[str] = set()
    with torch.no_grad():
        for i, op in enumerate(graph.ops):
            for p in op.params:
                if p not in loaded:
                    env[p] = store.load(graph.params[p])
                    loaded.add(p)
            for name, value in zip(op.outputs, execute_op(op, env, dev)):
                env[name] = value
            for name in (*op.inputs, *op.params, *op.outputs):
                if last.get(name, -1) <= i:
                    env.pop(name, None)
    return unflatten_outputs(graph, assemble_outputs(graph, env))
