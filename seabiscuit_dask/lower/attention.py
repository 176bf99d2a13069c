"""Tile kernels for attention cut into query and key chunks (``decompose/rules/attention.py``).

A *part* is the attention of some queries over one chunk of keys, normalised within
the chunk, with each row's log-sum-exp of scores appended as one more column (float32).
Two parts over disjoint key chunks merge exactly: weights ``exp(lse - max)`` rescale
each, so any tree of merges gives the attention over all their keys.
"""

from __future__ import annotations

import math

import torch

from .registry import register_kernel


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, diag: int | None,
            scale: float | None) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:   # NOTE: grouped-query heads share their KV head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if diag is not None:
        rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(-1)
        cols = torch.arange(k.shape[-2], device=q.device)
        s = s.masked_fill(cols > rows + int(diag), float("-inf"))
    return s


def _values(v: torch.Tensor, heads: int) -> torch.Tensor:
    return v.repeat_interleave(heads // v.shape[1], dim=1) if v.shape[1] != heads else v


@register_kernel("sb.attention_part")
def attention_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   diag: int | None, scale: float | None) -> torch.Tensor:
    """Attention of ``q`` over these keys, normalised here, with the log-sum-exp column appended."""
    s = _scores(q, k, mask, diag, scale)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = (p @ _values(v, q.shape[1]).float()) / total.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.cat([out, top + torch.log(total)], dim=-1)


@register_kernel("sb.attention")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              diag: int | None, scale: float | None) -> torch.Tensor:
    """Attention of ``q`` over these keys (a causal ``diag``: query i sees key j iff j <= i + diag)."""
    return attention_part(q, k, v, mask, diag, scale)[..., :-1].to(q.dtype)


@register_kernel("sb.attention_merge")
def attention_merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The part over the keys of ``a`` and ``b`` together."""
    la, lb = a[..., -1:], b[..., -1:]
    top = torch.maximum(la, lb)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(la - top), torch.exp(lb - top)
    total = wa + wb
    out = (a[..., :-1] * wa + b[..., :-1] * wb) / total.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.cat([out, top + torch.log(total)], dim=-1)


@register_kernel("sb.attention_finish")
def attention_finish(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention output of a merged part: the log-sum-exp column dropped."""
    return part[..., :-1].to(dtype)
