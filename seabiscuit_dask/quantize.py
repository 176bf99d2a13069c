"""Weight-only quantization of a traced graph: ``quantize(graph, "int8")``.

Every ``aten.linear`` whose weight is a whole 2-D float param becomes an ``sb.qlinear``
(``qlinear.py``) over two params derived from that weight on load (``ParamSource.quant``):
its rows as int8 (``"int8"``) and one scale per row (``"int8-scale"``), symmetric per output
channel: ``w ~ q * scale`` with ``q = round(w / scale)`` in [-127, 127] and ``scale =
max|w| / 127`` over the row, held in bfloat16 (what the int8 kernel takes: no conversion per
call; the integers are rounded against the bf16 scale, so ``q * scale`` is the weight within
half a step, as with an exact scale). A tile of the int8 weight is any block of it; its rows are
quantized whole wherever the tile is loaded, so every tile holds exactly the integers the
whole weight would (``quantize_rows``), and a decomposed graph is the graph it was cut from
up to the bf16 rounding of each tile's product. Only the integers and the scales are kept: the
float rows are read, quantized and dropped tile by tile (no full float copy on a worker).

An ``aten.embedding`` whose table is such a param looks up its int8 rows and their scales (a
``[n, 1]`` table of them, in the table's dtype) and multiplies the two (as llama.cpp keeps
embeddings at 8 bits): a head tied to the embedding reads the same int8 tiles, and no float copy
of the table is held. The graph says what was done in ``meta["quantize"]`` (the scheme) and
``meta["quantized"]`` (weights); a step program decomposed ``like`` a quantized graph is
quantized the same way (``decompose``), so it reads the same tiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import ops as O
from .errors import BadInput
from .ir import Op, OpGraph, ParamSpec, TensorSpec, iter_refs
from .ops import Q4_BLOCK

SCHEMES = ("int8", "int4", "int4-g64", "int4-g128")
GROUPS = {"int4": 32, "int4-g64": 64, "int4-g128": 128}
"""Weights in a group of an int4 row sharing one scale and zero, per scheme."""
FLOATS = ("float32", "float16", "bfloat16", "float64")
LINEAR = "aten.linear.default"
EMBEDDING = "aten.embedding.default"
TO_DTYPE = "aten.to.dtype"
MUL = "aten.mul.Tensor"


def check_scheme(scheme: Any) -> str | None:
    """``scheme`` as a name of ``SCHEMES``, or None for none; else ``BadInput`` naming the choices."""
    if scheme is None or scheme in ("", "none", "None", False):
        return None
    if scheme not in SCHEMES:
        raise BadInput(f"quantize={scheme!r} is not a scheme here: choose one of {', '.join(SCHEMES)} "
                       "(int8: weights as per-channel int8 with a scale per output; int4: linear weights "
                       "as int4 in groups of 32, 64 or 128 with a scale and zero each, the LM head and "
                       "embeddings as int8), or None for float weights")
    return str(scheme)


def names_of(weight: str) -> tuple[str, str]:
    """The int8 param and the scale param derived from float param ``weight``."""
    return f"{weight}:int8", f"{weight}:int8.scale"


def int4_kinds(group: int) -> tuple[str, str]:
    """The ``ParamSource.quant`` of an int4 weight in groups of ``group`` and of its scales and zeros."""
    return f"int4-g{group}", f"int4-g{group}-sz"


def int4_fits(n: int, k: int, group: int) -> bool:
    """Whether an ``[n, k]`` weight can be held as int4 in groups of ``group``: whole blocks of the
    kernel's 64 rows, whole groups along a row."""
    return n > 0 and k > 0 and n % Q4_BLOCK == 0 and k % group == 0


def quantize(graph: OpGraph, scheme: str | None) -> OpGraph:
    """``graph`` with its linear layers' weights and its embedding tables quantized per ``scheme``
    (None: ``graph``)."""
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
    tensors = dict(graph.tensors)
    ops: list[Op] = []
    done: set[str] = set()

    def derive(w: str, table: bool = False) -> tuple[str, str]:
        """The int8 param of float param ``w`` and its scales (``[n]``, or ``[n, 1]`` for a table)."""
        spec = graph.params[w]
        qname, sname = names_of(w)
        sname += "2d" if table else ""
        whole = spec.shape
        params.setdefault(qname, ParamSpec(qname, whole, "int8",
                                           replace(spec.source, quant="int8", whole=whole)))
        # NOTE: a table's scales in its own dtype: its rows come out as its lookups did
        params.setdefault(sname, ParamSpec(sname, (whole[0], 1) if table else (whole[0],),
                                           spec.dtype if table else "bfloat16",
                                           replace(spec.source, quant="int8-scale", whole=whole)))
        done.add(w)
        return qname, sname

    group = GROUPS.get(scheme, 0)
    # NOTE: tables, and heads as long as a table (a vocabulary), stay int8 under int4 (llama.cpp's
    # mixes keep them at 6-8 bits: int4 there costs most of the next-token agreement)
    tables = {str(op.attrs["args"][0]["p"]) for op in graph.ops if op.target == EMBEDDING
              and _float_weight(list(op.attrs.get("args", ())), graph.params, 0) is not None}
    vocab = {graph.params[t].shape[0] for t in tables}
    int4 = 0
    for op in graph.ops:
        args = list(op.attrs.get("args", ()))
        w = _float_weight(args, graph.params, 1 if op.target == LINEAR else 0) \
            if op.target in (LINEAR, EMBEDDING) else None
        if w is None:
            ops.append(op)
            continue
        kept = tuple(p for p in op.params if p != w)
        n, k = graph.params[w].shape
        if op.target == LINEAR and group and w not in tables and n not in vocab and int4_fits(n, k, group):
            source = graph.params[w].source
            wname, szname = f"{w}:int4", f"{w}:int4.sz"
            kinds = int4_kinds(group)
            params.setdefault(wname, ParamSpec(wname, (n // Q4_BLOCK, k, Q4_BLOCK // 2), "uint8",
                                               replace(source, quant=kinds[0], whole=(n, k))))
            params.setdefault(szname, ParamSpec(szname, (k // group, n, 2), "bfloat16",
                                                replace(source, quant=kinds[1], whole=(n, k))))
            done.add(w)
            int4 += 1
            q4_args = [args[0], {"p": wname}, {"p": szname}, args[2] if len(args) > 2 else None, group]
            ops.append(replace(op, target=O.Q4LINEAR, kind=O.kind_of(O.Q4LINEAR),
                               params=(wname, szname, *kept), attrs={**op.attrs, "args": q4_args}))
            continue
        if op.target == LINEAR:
            qname, sname = derive(w)
            bias = args[2] if len(args) > 2 else None
            new_args = [args[0], {"p": qname}, {"p": sname}, None, bias, 0, True]
            ops.append(replace(op, target=O.QLINEAR, kind=O.kind_of(O.QLINEAR), params=(qname, sname, *kept),
                               attrs={**op.attrs, "args": new_args}))
            continue
        # NOTE: a table: its int8 rows gathered, converted and scaled by their rows' scales
        qname, sname = derive(w, table=True)
        out = op.outputs[0]
        spec = tensors[out]
        names = (f"{out}:int8", f"{out}:float", f"{out}:scale")
        tensors[names[0]] = TensorSpec(spec.shape, "int8")
        tensors[names[1]] = TensorSpec(spec.shape, spec.dtype)
        tensors[names[2]] = TensorSpec((*spec.shape[:-1], 1), spec.dtype)
        rest = args[2:]
        ops += [replace(op, name=f"{op.name}.int8", outputs=(names[0],), params=(qname, *kept),
                        attrs={**op.attrs, "args": [{"p": qname}, *args[1:]]}),
                Op(f"{op.name}.float", O.kind_of(TO_DTYPE), TO_DTYPE, (names[0],), (names[1],),
                   attrs={"args": [{"t": names[0]}, {"dtype": spec.dtype}], "kwargs": {}}, scope=op.scope,
                   flops=math.prod(spec.shape)),
                replace(op, name=f"{op.name}.scale", outputs=(names[2],), params=(sname,),
                        attrs={**op.attrs, "args": [{"p": sname}, args[1], *rest]}),
                Op(f"{op.name}.scaled", O.kind_of(MUL), MUL, (names[1], names[2]), (out,),
                   attrs={"args": [{"t": names[1]}, {"t": names[2]}], "kwargs": {}}, scope=op.scope,
                   flops=math.prod(spec.shape))]
    used = {p for op in ops for p in op.params}
    params = {n: p for n, p in params.items() if n in used or n not in graph.params}
    meta: dict[str, Any] = {"quantize": scheme, "quantized": len(done), "int4": int4}
    if graph.meta.get("template_key") is not None:      # NOTE: its decompositions are not the float one's
        meta["template_key"] = f"{graph.meta['template_key']}+{scheme}"
    return replace(graph, ops=tuple(ops), params=params, tensors=tensors).with_meta(**meta)


def _float_weight(args: list[Any], params: Mapping[str, ParamSpec], at: int) -> str | None:
    """The param operand ``at`` (a linear's weight, an embedding's table) is, where it is a whole 2-D
    float param, else None."""
    if len(args) <= at or not isinstance(args[at], Mapping) or set(args[at]) != {"p"}:
        return None
    spec = params.get(args[at]["p"])
    if spec is None or len(spec.shape) != 2 or spec.dtype not in FLOATS or spec.source.slices is not None \
            or spec.source.quant is not None or spec.source.kind == "inline":
        return None
    return str(args[at]["p"])


def quantize_rows(w: Any) -> tuple[Any, Any]:
    """``w`` ``[n, k]`` float as (int8 ``[n, k]``, bfloat16 scales ``[n]``), symmetric per row:
    ``w ~ q * scale[:, None]`` within half a step. An all-zero row has scale 1 (its integers are 0)."""
    import torch

    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups(w: Any, group: int) -> tuple[Any, Any]:
    """``w`` ``[n, k]`` float as (integers 0..15 ``[n, k]``, bfloat16 ``[k / group, n, 2]`` scales and
    zeros), asymmetric per group of ``group`` weights of a row: ``w ~ (q - 8) * scale + zero`` within
    half a step, ``scale = (max - min) / 15`` and ``zero`` the value of 8, both rounded to bf16 first
    (the integers are rounded against them). A constant group has scale 1."""
    import torch

    n, k = w.shape
    g = w.to(torch.float32).reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).to(torch.bfloat16)
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8.0).clamp_(0, 15)
    sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
    return q.reshape(n, k).to(torch.uint8), sz


def held_bytes(module: Any, scheme: str | None) -> int:
    """Bytes of ``module``'s weights as a deployment quantized per ``scheme`` holds them (each tensor
    once): the weights of its linear layers and embeddings as int8, with a scale per row for each
    use (bf16 for a head, the table's dtype for a table: a tied head and embedding hold one int8
    table and both), under an int4 scheme the linear weights ``quantize`` makes int4 as half a byte
    a weight and 4 bytes a group; any other param as it is; for sizing workers' budgets before
    anything is traced."""
    import torch

    scheme = check_scheme(scheme)
    # NOTE: by identity, not storage: a skeleton on the meta device has no storage (a tied weight is
    # one Parameter, listed once)
    params = {id(p): p for p in module.parameters()}
    if scheme is None:
        return sum(p.numel() * p.element_size() for p in params.values())
    group = GROUPS.get(scheme, 0)
    uses: dict[int, set[str]] = {}
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            kind = "linear" if isinstance(m, torch.nn.Linear) and name == "weight" else \
                "table" if isinstance(m, torch.nn.Embedding) and name == "weight" else "other"
            uses.setdefault(id(p), set()).add(kind)
    vocab = {params[i].shape[0] for i, kinds in uses.items() if "table" in kinds}
    total = 0
    for ptr, p in params.items():
        kinds = uses.get(ptr, {"other"})
        n, k = (p.shape[0], p.shape[1]) if p.dim() == 2 else (0, 0)
        if group and kinds == {"linear"} and n not in vocab and int4_fits(n, k, group):
            total += p.numel() // 2 + p.numel() // group * 4
            continue
        float_bytes = p.numel() * p.element_size() if "other" in kinds else 0
        scales = p.shape[0] * (2 * ("linear" in kinds) + p.element_size() * ("table" in kinds))
        total += float_bytes + (p.numel() + scales if kinds - {"other"} else 0)
    return total
