"""Kernels for IR targets: ATen ops by name, plus SeaBiscuit's own tile ops."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

import torch

from ..errors import SeaBiscuitError
from ..ir import Op


def embedding_rows(weight: torch.Tensor, indices: torch.Tensor, row_start: int) -> torch.Tensor:
    """Lookup in rows ``[row_start, row_start + len(weight))`` of a vocabulary.

    Indices outside the tile contribute zeros, so the tiles of one embedding sum
    to the full lookup exactly (each index hits exactly one tile).
    """
    local = indices - row_start
    hit = (local >= 0) & (local < weight.shape[0])
    out = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * hit.unsqueeze(-1).to(out.dtype)


SB_KERNELS: dict[str, Callable[..., Any]] = {
    "sb.embedding_rows": embedding_rows,
}


@cache
def resolve_target(target: str) -> Callable[..., Any]:
    """``"aten.linear.default"`` -> ``torch.ops.aten.linear.default``."""
    if target in SB_KERNELS:
        return SB_KERNELS[target]
    try:
        ns, name, overload = target.split(".")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (ValueError, AttributeError) as e:
        raise SeaBiscuitError(f"no kernel for target {target!r}") from e


def decode_args(value: Any, env: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    """Replace operand references by tensors and tagged objects by torch objects.

    Devices recorded at trace time (possibly ``meta``) become ``device``.
    """
    if isinstance(value, Mapping):
        if len(value) == 1:
            (tag, v), = value.items()
            if tag in ("t", "p"):
                return env[v]
            if tag == "dtype":
                return getattr(torch, v)
            if tag == "device":
                return device
            if tag == "layout":
                return getattr(torch, v)
            if tag == "memory_format":
                return getattr(torch, v)
            if tag == "float":
                return float(v)
        return {k: decode_args(v, env, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [decode_args(v, env, device) for v in value]
    return value


def execute_op(op: Op, env: Mapping[str, torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Run one op, reading operands from ``env``; returns its outputs in order."""
    fn = resolve_target(op.target)
    args = decode_args(op.attrs.get("args", ()), env, device)
    kwargs = decode_args(op.attrs.get("kwargs", {}), env, device)
    out = fn(*args, **kwargs)
    if op.attrs.get("multi"):
        return list(out)
    return [out]
