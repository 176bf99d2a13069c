"""Kernels for IR targets: registered ATen ops, plus SeaBiscuit's own tile ops.

Every target resolves through the op registry (``registry.py``); ``SUPPORTED``
lists the targets a graph may name.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import UnsupportedOp
from ..ir import Op
from . import dims
from .dims import has_dim, is_dim
from .registry import (
    KERNELS,
    SUPPORTED,
    register_kernel,
    require_registered,
    resolve_target,
    tagged_value,
)

__all__ = ["KERNELS", "SUPPORTED", "compile_args", "decode_args", "embedding_rows", "execute_op",
           "register_kernel",
           "require_registered", "resolve_target"]


@register_kernel("sb.embedding_rows")
def embedding_rows(weight: torch.Tensor, indices: torch.Tensor, row_start: int) -> torch.Tensor:
    """Lookup in rows ``[row_start, row_start + len(weight))`` of a vocabulary.

    Indices outside the tile contribute zeros, so the tiles of one embedding sum
    to the full lookup exactly (each index hits exactly one tile).
    """
    local = indices - row_start
    hit = (local >= 0) & (local < weight.shape[0])
    out = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * hit.unsqueeze(-1).to(out.dtype)


@register_kernel("sb.region")
def region(x: torch.Tensor, bounds: list[list[int]]) -> torch.Tensor:
    """``x[a0:b0, a1:b1, ...]``: the part of a tile another tile reads."""
    return x[tuple(slice(int(a), int(b)) for a, b in bounds)]


@register_kernel("sb.assemble")
def assemble(parts: list[torch.Tensor], regions: list[list[list[int]]], shape: list[int]) -> torch.Tensor:
    """A tensor of ``shape`` made of ``parts``, each placed at its region (which cover it)."""
    out = parts[0].new_empty([int(n) for n in shape])
    for part, bounds in zip(parts, regions):
        out[tuple(slice(int(a), int(b)) for a, b in bounds)] = part
    return out


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise UnsupportedOp(f"tagged float {v!r} is not a number") from None


def decode_args(value: Any, env: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    """Replace operand references by tensors and tagged objects by torch objects.

    Devices recorded at trace time (possibly ``meta``) become ``device``; dtypes,
    layouts and memory formats come from the registry's tables only.
    """
    if isinstance(value, Mapping):
        if is_dim(value):                 # NOTE: a size of a step read at run time (``dims``)
            return dims.value(value, *env[dims.VALID].shape)
        if set(value) == {"t", "view"}:   # NOTE: a region of a tile, read in place
            view = value["view"]
            if has_dim(view):
                view = dims.resolved(view, *env[dims.VALID].shape)
            return env[value["t"]][tuple(slice(int(a), int(b)) for a, b in view)]
        tag, v = next(iter(value.items())) if len(value) == 1 else (None, None)
        # NOTE: a tag holds a string; kwargs like {"dtype": {"dtype": "float16"}} are no tag.
        if isinstance(v, str):
            if tag in ("t", "p"):
                return env[v]
            if tag in ("dtype", "layout", "memory_format"):
                return tagged_value(tag, v)
            if tag == "device":
                return device
            if tag == "float":
                return _float(v)
        return {k: decode_args(v, env, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [decode_args(v, env, device) for v in value]
    return value


def compile_args(value: Any, device: torch.device) -> Callable[[Mapping[str, torch.Tensor]], Any]:
    """``decode_args(value, env, device)`` as a function of ``env``: references become lookups,
    and the constant parts (shapes, dtypes, scalars) are decoded once, not on every run."""
    const, got = _compile(value, device)
    if const:
        return lambda env: got
    return got  # type: ignore[no-any-return]


def _compile(value: Any, device: torch.device) -> tuple[bool, Any]:
    """(True, the decoded constant) or (False, a function of ``env``)."""
    if isinstance(value, Mapping):
        if set(value) == {"t", "view"}:
            name = value["t"]
            if has_dim(value["view"]):     # NOTE: a region as wide as the step: read at run time
                bounds = value["view"]
                return False, lambda env: env[name][tuple(slice(*(b if isinstance(b, int) else dims.value(
                    b, *env[dims.VALID].shape) for b in ab)) for ab in bounds)]
            window = tuple(slice(int(a), int(b)) for a, b in value["view"])
            return False, lambda env: env[name][window]
        if is_dim(value):
            c, i, j = (int(x) for x in value[dims.DIM])
            return False, lambda env: c * env[dims.VALID].shape[0] ** i * env[dims.VALID].shape[1] ** j
        tag, v = next(iter(value.items())) if len(value) == 1 else (None, None)
        if isinstance(v, str):
            if tag in ("t", "p"):
                return False, operator.itemgetter(v)
            if tag in ("dtype", "layout", "memory_format"):
                return True, tagged_value(tag, v)
            if tag == "device":
                return True, device
            if tag == "float":
                return True, _float(v)
        items = {k: _compile(x, device) for k, x in value.items()}
        if all(c for c, _ in items.values()):
            return True, {k: x for k, (_, x) in items.items()}
        fixed = {k: x for k, (c, x) in items.items() if c}
        read = [(k, f) for k, (c, f) in items.items() if not c]

        def mapping(env: Mapping[str, torch.Tensor]) -> dict[str, Any]:
            out = dict(fixed)
            for k, f in read:
                out[k] = f(env)
            return out
        return False, mapping
    if isinstance(value, (list, tuple)):
        parts = [_compile(x, device) for x in value]
        if all(c for c, _ in parts):
            return True, [x for _, x in parts]
        names = [_ref(x) for x in value]
        if all(names) and len(names) > 1:        # NOTE: only tensors (most ops): one C-level lookup
            return False, operator.itemgetter(*names)
        template = [x if c else None for c, x in parts]
        reads = [(i, f) for i, (c, f) in enumerate(parts) if not c]

        def sequence(env: Mapping[str, torch.Tensor]) -> list[Any]:
            out = template.copy()
            for i, f in reads:
                out[i] = f(env)
            return out
        return False, sequence
    return True, value


def _ref(value: Any) -> str | None:
    """The name a plain tensor or param reference (``{"t": name}``, ``{"p": name}``) reads, else None."""
    if isinstance(value, Mapping) and len(value) == 1:
        tag, v = next(iter(value.items()))
        if tag in ("t", "p") and isinstance(v, str):
            return v
    return None


def execute_op(op: Op, env: Mapping[str, torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Run one op, reading operands from ``env``; returns its outputs in order."""
    fn = resolve_target(op.target, op)
    args = decode_args(op.attrs.get("args", ()), env, device)
    kwargs = decode_args(op.attrs.get("kwargs", {}), env, device)
    out = fn(*args, **kwargs)
    if op.attrs.get("multi"):
        return list(out)
    return [out]


from .. import qlinear as _qlinear  # noqa: E402  (defines torch.ops.sb.qlinear)
from . import attention as _attention  # noqa: E402,F401  (registers the attention tile kernels)
from . import kvcache as _kvcache  # noqa: E402,F401  (registers sb.kv_attention)
from . import spatial  # noqa: E402,F401  (registers sb.conv_strip and the pooling strips)

register_kernel("sb.qlinear.default", _qlinear.qlinear_kernel)      # NOTE: a plain call, no dispatch
register_kernel("sb.q4linear.default", _qlinear.q4linear_kernel)
