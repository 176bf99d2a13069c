"""Decoder steps: a causal language model traced as one step over its KV cache.

``trace_step(model, batch, length)`` traces the model for ``length`` new tokens
in each of ``batch`` rows, with explicit ``position_ids`` and the logits of the
last position only, then turns every causal self-attention into
``sb.kv_attention`` (``lower/kvcache.py``): that op writes the new keys and
values into the session's cache on its worker and attends over the whole cache
(a soft-cap or ALiBi included: ``step_attention.py`` has the model trace them as SDPA).
Three graph inputs say what a step is:

``sb_sessions`` (B,) int64
    the session of each row (-1: an empty row, computed and ignored);
``sb_start`` (B,) int64
    the cache slot of the row's first real new token;
``sb_valid`` (B, L) bool
    which new tokens are real; padding is never cached, so it may sit anywhere.

Nothing in the graph depends on how long the cache already is, so one decode
program serves every step of every session, and a prefill program of ``L``
tokens serves every prompt chunk of up to ``L`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import ops as O
from ..errors import UnsupportedModel
from ..ir import Op, OpGraph, TensorSpec

SDPA = "aten.scaled_dot_product_attention.default"
KV_ATTENTION = "sb.kv_attention"
STEP_KEY = "sb-step"       # NOTE: in a step template's key: no plain trace of the same inputs shares it
STEP_INPUTS = ("sb_sessions", "sb_start", "sb_valid")
_REPEAT_VIEWS = {"aten.reshape.default", "aten.view.default", "aten.expand.default",
                 "aten.unsqueeze.default", "aten.slice.Tensor", "aten.alias.default",
                 "aten._unsafe_view.default"}


def trace_step(model: Any, batch: int, length: int) -> OpGraph:
    """The step program of ``model`` for ``batch`` rows of ``length`` new tokens.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face causal LM (``...ForCausalLM``) whose ``forward`` takes
        ``position_ids`` (or that places its tokens by ALiBi alone: Bloom, MPT); its
        parameters may live on the ``meta`` device.
    batch, length : int
        Rows per step and new tokens per row.

    Examples
    --------
    >>> g = trace_step(model, 1, 1)                      # the decode program  # doctest: +SKIP
    >>> [op.target for op in g.ops if op.kind == "kv_attention"][:1]           # doctest: +SKIP
    ['sb.kv_attention']
    """
    import inspect

    import torch

    from ..templates import cached_trace
    from . import index_ranges
    from .step_attention import positions_by_alibi, step_tracing
    from .torch_export import default_kwargs, trace_module

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    positioned = "position_ids" in params or positions_by_alibi(model)
    if not positioned or getattr(model, "config", None) is None:
        raise UnsupportedModel(f"{type(model).__name__} cannot generate through SeaBiscuit: its forward "
                               "takes no position_ids (a Hugging Face ...ForCausalLM is expected)")
    # NOTE: a model built without weights traces on meta inputs (its buffers are on meta too)
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {"input_ids": torch.zeros((batch, length), dtype=torch.long, device=device)}
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(length, device=device).repeat(batch, 1)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    kw = default_kwargs(model, kwargs)

    def traced() -> OpGraph:
        graph = trace_module(model, (), kw)
        notes.check()
        return graph.with_meta(step_attention=notes.kv_kwargs)

    with step_tracing(model) as notes:
        # NOTE: a step's template holds what its attentions add; its key is a step trace's own
        graph = cached_trace(model, (), {**kw, "sb_step": STEP_KEY}, traced)
    graph = graph.with_meta(index_ranges=index_ranges(graph))
    return kv_program(graph, batch, length, attention_windows(model.config, type(model).__name__))


def attention_windows(config: Any, name: str = "model") -> list[int | None] | None:
    """Per attention layer, how many of the latest tokens (itself included) a token sees (None:
    all), as Hugging Face masks them: ``layer_types`` where the config has them, else
    ``sliding_window`` on every layer; None when no layer has a window. A ``sliding_window``
    the config's class does not declare (an extra key, which e.g. Llama ignores) is no window."""
    import inspect

    declared = any("sliding_window" in getattr(k, "__annotations__", {}) for k in type(config).__mro__)
    try:
        declared = declared or "sliding_window" in inspect.signature(type(config).__init__).parameters
    except (TypeError, ValueError):
        pass
    window = getattr(config, "sliding_window", None) if declared else None
    types = getattr(config, "layer_types", None)
    if not window or (types is None and getattr(config, "use_sliding_window", True) is False):
        return None
    if types is None:
        return [int(window)] * int(getattr(config, "num_hidden_layers", 0) or 0) or None
    unknown = sorted({str(t) for t in types} - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModel(f"{name} has attention layers of kind {unknown[0]!r}; generation through "
                               "SeaBiscuit serves full and sliding-window attention only")
    return [int(window) if t == "sliding_attention" else None for t in types]


def kv_program(graph: OpGraph, batch: int, length: int,
               windows: list[int | None] | None = None) -> OpGraph:
    """``graph`` (a traced causal LM step) with its attentions reading and writing the KV cache;
    ``windows``: each attention's sliding window, in order (``attention_windows``). What each
    attention adds to its scores (``step_tracing`` notes it in ``meta["step_attention"]``) goes
    to its ``sb.kv_attention`` as keyword arguments."""
    name = graph.meta.get("name", "model")
    attn = [op for op in graph.ops if op.target == SDPA]
    if not attn:
        raise UnsupportedModel(f"{name} has no scaled_dot_product_attention to keep a KV cache for")
    if windows is not None and len(windows) != len(attn):
        raise UnsupportedModel(f"{name}: its config gives {len(windows)} attention windows for the "
                               f"{len(attn)} attentions traced; SeaBiscuit cannot tell which layer has which")
    extras = list(graph.meta.get("step_attention") or [])
    if extras and len(extras) != len(attn):
        raise UnsupportedModel(f"{name}: {len(extras)} of its attentions were traced as a step traces them, "
                               f"{len(attn)} attentions in all; SeaBiscuit cannot tell which layer is which")
    tensors = dict(graph.tensors)
    tensors["sb_sessions"] = TensorSpec((batch,), "int64")
    tensors["sb_start"] = TensorSpec((batch,), "int64")
    tensors["sb_valid"] = TensorSpec((batch, length), "bool")
    ops: list[Op] = []
    layers: list[dict[str, Any]] = []
    for op in graph.ops:
        if op.target != SDPA:
            ops.append(op)
            continue
        i = len(layers)
        ops.append(_cached(graph, op, i, tensors, windows[i] if windows else None,
                           extras[i] if extras else None))
        k = ops[-1].inputs[1]
        layers.append({"op": op.name, "heads": tensors[k].shape[1], "dim": tensors[k].shape[3],
                       "value_dim": tensors[ops[-1].inputs[2]].shape[3], "dtype": tensors[k].dtype})
    ops = _live(ops, graph.outputs)
    used = {t for op in ops for t in op.inputs}
    inputs = tuple(t for t in graph.inputs if t in used) + STEP_INPUTS
    kept = {t for op in ops for t in (*op.inputs, *op.outputs)} | set(inputs)
    params = {p for op in ops for p in op.params}
    meta = {k: v for k, v in graph.meta.items() if k != "step_attention"}
    meta.update(out_spec=None, kv_layers=layers, step={"batch": batch, "length": length},
                call={"positional": list(inputs)}, kwarg_order=[])
    meta["index_ranges"] = {k: v for k, v in dict(meta.get("index_ranges") or {}).items() if k in inputs}
    base = meta.get("template_key")
    if base:    # NOTE: the rewritten graph has a template key of its own (decomposition is cached)
        meta["template_key"] = f"{base}-kv{batch}x{length}-{_source_hash()}"
    return OpGraph(tuple(ops), {t: s for t, s in tensors.items() if t in kept},
                   {p: s for p, s in graph.params.items() if p in params}, inputs, graph.outputs, meta)


def _source_hash() -> str:
    import hashlib
    from pathlib import Path

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def _cached(graph: OpGraph, op: Op, layer: int, tensors: Mapping[str, TensorSpec],
            window: int | None = None, extra: Mapping[str, Any] | None = None) -> Op:
    """The ``sb.kv_attention`` op in place of one SDPA (dropout-free, causal self-attention);
    ``extra``: its keyword arguments (a soft-cap, ALiBi)."""
    args = list(op.attrs["args"])
    kwargs = dict(op.attrs.get("kwargs", {}))
    if float(O.operand(args, 4, kwargs.get("dropout_p", 0.0)) or 0.0) != 0.0:
        raise UnsupportedModel(f"attention {op.name!r} uses dropout; trace the model in eval mode")
    mask = O.ref_name(O.operand(args, 3, kwargs.get("attn_mask")))
    if mask is not None and (mask[0] != "t" or tensors[mask[1]].dtype != "bool"):
        raise UnsupportedModel(f"{graph.meta.get('name', 'model')}: attention {op.name!r} adds a float mask "
                               "to its scores, a bias (such as ALiBi) that generation through SeaBiscuit "
                               "does not know; it serves causal masks only")
    q, k, v = (O.ref_name(a)[1] for a in args[:3])   # type: ignore[index]
    scale = O.operand(args, 6, kwargs.get("scale"))
    qs = tensors[q].shape
    k, v = _unrepeated(graph, k, qs), _unrepeated(graph, v, qs)
    new_args = [{"t": q}, {"t": k}, {"t": v}, {"t": "sb_sessions"}, {"t": "sb_start"}, {"t": "sb_valid"},
                layer, None if scale is None else float(scale), window]
    return Op(op.name, "kv_attention", KV_ATTENTION, (q, k, v, *STEP_INPUTS), op.outputs, (),
              {"args": new_args, "kwargs": dict(extra or {})}, op.scope, op.flops)


def _unrepeated(graph: OpGraph, name: str, q_shape: tuple[int, ...]) -> str:
    """The keys (values) before grouped-query attention repeated their heads, so the cache holds
    each KV head once; ``name`` itself when it was not repeated."""
    b, h, n, e = graph.tensors[name].shape
    cur = name
    for _ in range(8):
        src = graph.producer.get(cur)
        if src is None:
            return name
        op = graph.op_by_name[src]
        if op.target not in _REPEAT_VIEWS or len(op.inputs) != 1:
            return name
        cur = op.inputs[0]
        shape = graph.tensors[cur].shape
        if len(shape) == 4 and shape[0] == b and shape[2] == n and shape[3] == e and shape[1] < h \
                and h % shape[1] == 0 and q_shape[1] == h:
            return cur if _is_repeat(graph, name, cur) else name
    return name


def _is_repeat(graph: OpGraph, out: str, src: str) -> bool:
    """Is ``out`` (B, H, L, E) ``src`` (B, Hk, L, E) with each head repeated H/Hk times in a row?

    Checked on numbers: the chain of views is run on a tensor of distinct values.
    """
    import torch

    chain: list[Op] = []
    cur = out
    while cur != src:
        op = graph.op_by_name[graph.producer[cur]]
        chain.append(op)
        cur = op.inputs[0]
    shape = graph.tensors[src].shape
    env = {src: torch.arange(float(torch.Size(shape).numel())).reshape(shape)}
    for op in reversed(chain):
        if O.kind_of(op.target) not in ("view", "elementwise") or len(op.outputs) != 1:
            return False
        _, name, overload = op.target.split(".")      # NOTE: a view of the graph just traced
        fn = getattr(getattr(torch.ops.aten, name), overload)
        args = [env[a["t"]] if isinstance(a, Mapping) and "t" in a else a for a in op.attrs["args"]]
        kwargs = dict(op.attrs.get("kwargs", {}))
        if any(isinstance(a, Mapping) for a in [*args[1:], *kwargs.values()]):
            return False          # NOTE: a second operand or a tagged value: no plain view
        env[op.outputs[0]] = fn(*args, **kwargs)
    want = env[src].repeat_interleave(graph.tensors[out].shape[1] // shape[1], dim=1)
    return bool(env[out].shape == want.shape and torch.equal(env[out], want))


def _live(ops: list[Op], outputs: tuple[str, ...]) -> list[Op]:
    """``ops`` less those whose outputs nothing reads (the causal mask the cache replaces)."""
    need = set(outputs)
    keep: list[Op] = []
    for op in reversed(ops):
        if any(t in need for t in op.outputs):
            keep.append(op)
            need.update(op.inputs)
    return keep[::-1]
