"""Weight-only quantization of a traced graph: ``quantize(graph, "int8")``.

Every ``aten.linear`` whose weight is a whole 2-D float param becomes an ``sb.qlinear``
(``qlinear.py``) over two params derived from that weight on load (``ParamSource.quant``):
its rows as int8 (``"int8"``) and one scale per row (``"int8-scale"``), symmetric per output
channel: ``w ~ q * scale`` with ``q = round(w / scale)`` in [-127, 127] and ``scale =
max|w| / 127`` over the row, held in bfloat16 (what the int8 kernel takes: no conversion per
call; the integers are rounded against the bf16 scale, so ``q * scale`` is the weight within
half a step, as with an exact scale). A tile of the int8 weight is any block of it; its rows are
quantized whole wherever the tile is loaded, so every tile holds exactly the integers the
whole weight would (``quantize_rows``), and a decomposed graph equals the graph it was cut
from. Only the integers and the scales are kept: the float rows are read, quantized and
dropped tile by tile (no full float copy on a worker).

Other ops reading the same weight (a tied embedding) keep the float param. The graph says
what was done in ``meta["quantize"]`` (the scheme) and ``meta["quantized"]`` (weights); a
step program decomposed ``like`` a quantized graph is quantized the same way
(``decompose``), so it reads the same tiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import ops as O
from .errors import BadInput
from .ir import OpGraph, ParamSpec, iter_refs

SCHEMES = ("int8",)
FLOATS = ("float32", "float16", "bfloat16", "float64")
LINEAR = "aten.linear.default"


def check_scheme(scheme: Any) -> str | None:
    """``scheme`` as a name of ``SCHEMES``, or None for none; else ``BadInput`` naming the choices."""
    if scheme is None or scheme in ("", "none", "None", False):
        return None
    if scheme not in SCHEMES:
        raise BadInput(f"quantize={scheme!r} is not a scheme here: choose one of {', '.join(SCHEMES)} "
                       "(weights as per-channel int8 with a scale per output), or None for float weights")
    return str(scheme)


def names_of(weight: str) -> tuple[str, str]:
    """The int8 param and the scale param derived from float param ``weight``."""
    return f"{weight}:int8", f"{weight}:int8.scale"


def quantize(graph: OpGraph, scheme: str | None) -> OpGraph:
    """``graph`` with its linear layers' weights quantized per ``scheme`` (None: ``graph``)."""
    scheme = check_scheme(scheme)
    if scheme is None or graph.meta.get("quantize") == scheme:
        return graph
    if graph.meta.get("quantize") is not None:
        raise BadInput(f"{graph.meta.get('name', 'the graph')} is already quantized as "
                       f"{graph.meta['quantize']!r}; quantize the float graph instead")
    if graph.meta.get("budget_bytes") is not None or graph.tilings \
            or any("view" in r for op in graph.ops for r in iter_refs(op.attrs.get("args", ()))):
        raise BadInput(f"{graph.meta.get('name', 'the graph')} is already decomposed; quantize the traced "
                       "graph, then decompose it")
    params: dict[str, ParamSpec] = dict(graph.params)
    ops = []
    done: list[str] = []
    for op in graph.ops:
        args = list(op.attrs.get("args", ()))
        w = _float_weight(args, graph.params) if op.target == LINEAR else None
        if w is None:
            ops.append(op)
            continue
        spec = graph.params[w]
        qname, sname = names_of(w)
        if qname not in params:
            whole = spec.shape
            params[qname] = ParamSpec(qname, whole, "int8", replace(spec.source, quant="int8", whole=whole))
            params[sname] = ParamSpec(sname, (whole[0],), "bfloat16",
                                      replace(spec.source, quant="int8-scale", whole=whole))
            done.append(w)
        bias = args[2] if len(args) > 2 else None
        new_args = [args[0], {"p": qname}, {"p": sname}, None, bias, 0, True]
        kept = tuple(p for p in op.params if p != w)
        ops.append(replace(op, target=O.QLINEAR, kind=O.kind_of(O.QLINEAR), params=(qname, sname, *kept),
                           attrs={**op.attrs, "args": new_args}))
    used = {p for op in ops for p in op.params}
    params = {n: p for n, p in params.items() if n in used or n not in graph.params}
    meta: dict[str, Any] = {"quantize": scheme, "quantized": len(done)}
    if graph.meta.get("template_key") is not None:      # NOTE: its decompositions are not the float one's
        meta["template_key"] = f"{graph.meta['template_key']}+{scheme}"
    return replace(graph, ops=tuple(ops), params=params).with_meta(**meta)


def _float_weight(args: list[Any], params: Mapping[str, ParamSpec]) -> str | None:
    """The param a linear's weight operand is, where it is a whole 2-D float param, else None."""
    if len(args) < 2 or not isinstance(args[1], Mapping) or set(args[1]) != {"p"}:
        return None
    spec = params.get(args[1]["p"])
    if spec is None or len(spec.shape) != 2 or spec.dtype not in FLOATS or spec.source.slices is not None \
            or spec.source.quant is not None or spec.source.kind == "inline":
        return None
    return str(args[1]["p"])


def quantize_rows(w: Any) -> tuple[Any, Any]:
    """``w`` ``[n, k]`` float as (int8 ``[n, k]``, bfloat16 scales ``[n]``), symmetric per row:
    ``w ~ q * scale[:, None]`` within half a step. An all-zero row has scale 1 (its integers are 0)."""
    import torch

    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def held_bytes(module: Any, scheme: str | None) -> int:
    """Bytes of ``module``'s weights as a deployment quantized per ``scheme`` holds them (each tensor
    once): a linear layer's weight as int8 and a bfloat16 scale per output, unless another module
    reads it too (a tied embedding keeps its float copy, and the head holds an int8 one beside it);
    for sizing workers' budgets before anything is traced."""
    import torch

    params = {p.data_ptr(): p for p in module.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if check_scheme(scheme) is None:
        return total
    linear: dict[int, Any] = {}
    other: set[int] = set()
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if isinstance(m, torch.nn.Linear) and name == "weight":
                linear[p.data_ptr()] = p
            else:
                other.add(p.data_ptr())
    for ptr, w in linear.items():
        quantized = w.numel() + 2 * w.shape[0]
        total += quantized - (0 if ptr in other else w.numel() * w.element_size())
    return total
