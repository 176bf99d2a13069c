"""Attention as a generation step traces it: one SDPA per layer, and what that SDPA leaves out.

``kv_program`` turns each ``scaled_dot_product_attention`` of a traced step into
``sb.kv_attention``. Some models attend otherwise, and ``step_tracing(model)`` has them trace
through SDPA while it notes, per SDPA in order, the keyword arguments ``sb.kv_attention`` then
needs to compute what the model computes (``ScoreSpec`` in ``lower/kvcache.py``):

- a model on Hugging Face's attention interface (``_supports_attention_backend``) that runs
  eager attention (Gemma 2: SDPA has no logit soft-cap) attends through ``step_attention``,
  registered there as ``seabiscuit_step``: it notes the ``softcap`` a layer passes, refuses
  attention sinks (``s_aux``, GPT-OSS) and other inputs it cannot serve, and, once traced,
  checks on numbers that the model's own eager attention computes what ``sb.kv_attention`` does;
- a model whose attention adds ALiBi inline (Bloom, MPT, Falcon with ``alibi``) gets a step
  forward from ``ALIBI``, keyed by attention class: its queries, keys and values as its own
  forward makes them, then SDPA; the slopes per head are those Hugging Face's code builds.

A model on ``sdpa`` is traced as it is (nothing is noted).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnsupportedModel

STEP_IMPL = "seabiscuit_step"
# NOTE: a layer's inputs that say where its tokens are, not how it attends: the KV cache knows
_POSITIONS = {"position_ids", "cache_position"}
_REFUSED = {"s_aux": "attention sinks (s_aux)", "position_bias": "a position bias (position_bias)"}


@dataclass
class StepNotes:
    """What tracing one step noted: ``kv_kwargs`` per SDPA, in order (empty: plain attention),
    and the eager attentions still to be checked on numbers (``check``)."""

    model: str
    kv_kwargs: list[dict[str, Any]] = field(default_factory=list)
    eager: dict[tuple[Any, ...], Callable[[], None]] = field(default_factory=dict)

    def check(self) -> None:
        for run in self.eager.values():
            run()


_notes: contextvars.ContextVar[StepNotes | None] = contextvars.ContextVar("sb_step_notes", default=None)
# NOTE: step_tracing changes a model's configs and modules while it traces: one at a time
_LOCK = threading.Lock()


@contextlib.contextmanager
def step_tracing(model: torch.nn.Module) -> Iterator[StepNotes]:
    """While tracing ``model``'s step, every attention of it that SDPA alone does not compute
    traces through SDPA, and the notes say what ``sb.kv_attention`` adds (module docstring)."""
    notes = StepNotes(type(model).__name__)
    with _LOCK, _eager_through_step_attention(model), _alibi_forwards(model, notes):
        token = _notes.set(notes)
        try:
            yield notes
        finally:
            _notes.reset(token)


def positions_by_alibi(model: torch.nn.Module) -> bool:
    """Has ``model`` attention of a class ``ALIBI`` serves? Then it needs no ``position_ids``: the
    cache slots place its tokens (Bloom and MPT take none; Falcon's go to its rotary layers)."""
    return any(_qualname(type(m)) in ALIBI for m in model.modules())


# --- Hugging Face's attention interface -------------------------------------------------------
@contextlib.contextmanager
def _eager_through_step_attention(model: torch.nn.Module) -> Iterator[None]:
    """The eager attention of a model on Hugging Face's attention interface goes through
    ``step_attention``; the configs are restored afterwards."""
    changed: list[Any] = []
    if getattr(model, "_supports_attention_backend", False):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(STEP_IMPL, step_attention)
        AttentionMaskInterface.register(STEP_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        seen: set[int] = set()
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is None or id(cfg) in seen or getattr(cfg, "_attn_implementation", None) != "eager":
                continue
            seen.add(id(cfg))
            cfg._attn_implementation = STEP_IMPL
            changed.append(cfg)
    try:
        yield
    finally:
        for cfg in changed:
            cfg._attn_implementation = "eager"


def step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention interface while a step traces: the layer's SDPA, with the
    ``softcap`` it passes noted for ``sb.kv_attention``, and its eager attention to be checked.
    Its masks are SDPA's (boolean or none), so a float mask is a bias of the model's own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    notes = _notes.get()
    if notes is None:     # NOTE: another thread runs the model mid-trace: its own eager attention
        return _eager_fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               **kwargs)
    where = f"{notes.model}: its attention {type(module).__name__}"
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModel(f"{where} adds {what}; generation through SeaBiscuit does not serve that")
    odd = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _POSITIONS)
    if odd:
        raise UnsupportedModel(f"{where} takes {odd[0]!r}, which generation through SeaBiscuit does not "
                               "serve")
    if attention_mask is not None and attention_mask.is_floating_point():
        raise UnsupportedModel(f"{where} adds a float mask of its own to its scores (a bias); generation "
                               "through SeaBiscuit serves causal masks only")
    causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if causal is None else causal):
        raise UnsupportedModel(f"{where} is not causal; generation through SeaBiscuit serves causal "
                               "self-attention only")
    softcap = kwargs.pop("softcap", None)
    extra = {} if softcap is None else {"softcap": float(softcap)}
    notes.kv_kwargs.append(extra)
    flags = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    shape = (query.shape[1], key.shape[1], query.shape[3], value.shape[3])
    check = (type(module), shape, scaling, softcap, repr(sorted(flags.items())))
    notes.eager.setdefault(check, lambda: _check_eager(notes.model, module, shape, scaling, softcap, flags))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _eager_fallback(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, **kwargs: Any) -> Any:
    """The layer's own eager attention, with SDPA's mask (none when causal alone) made additive."""
    n, total = query.shape[2], key.shape[2]
    if mask is None and n > 1:
        mask = torch.ones(n, total, dtype=torch.bool, device=query.device).tril(total - n)[None, None]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return _eager_of(module)(module, query, key, value, mask, **kwargs)


def _eager_of(module: torch.nn.Module) -> Callable[..., Any]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise TypeError(f"{type(module).__module__} has no eager_attention_forward")
    return fn  # type: ignore[no-any-return]


def _check_eager(model: str, module: torch.nn.Module, shape: tuple[int, int, int, int], scaling: float | None,
                 softcap: float | None, flags: dict[str, Any]) -> None:
    """Does ``module``'s own eager attention compute what ``sb.kv_attention`` does (causal softmax
    attention, its scores scaled and soft-capped)? Checked on numbers: 7 random tokens, with scores
    well past the soft-cap, against ``causal_attention``."""
    heads, groups, dim, value_dim = shape
    n, g = 7, torch.Generator().manual_seed(0)
    # NOTE: scores of about twice the cap, so that a cap missed or added shows
    spread = 2.0 * (softcap or 4.0) / ((scaling or dim ** -0.5) * dim ** 0.5)
    q = torch.randn(1, heads, n, dim, generator=g) * spread
    k = torch.randn(1, groups, n, dim, generator=g)
    v = torch.randn(1, groups, n, value_dim, generator=g)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    cap = {} if softcap is None else {"softcap": softcap}
    where = f"{model}: the eager attention of {type(module).__name__}"
    try:
        with torch.no_grad():
            want = _eager_of(module)(module, q, k, v, mask, dropout=0.0, scaling=scaling, **cap, **flags)[0]
    except Exception as e:
        raise UnsupportedModel(f"{where} could not be checked against SeaBiscuit's ({type(e).__name__}: "
                               f"{e}); generation through SeaBiscuit does not serve it") from e
    got = causal_attention(q, k, v, scaling, softcap)
    if want.shape != (1, n, heads, value_dim) or not torch.allclose(got, want.transpose(1, 2), rtol=1e-4,
                                                                    atol=1e-5):
        raise UnsupportedModel(f"{where} computes something other than causal softmax attention"
                               f"{' with a logit soft-cap' if softcap else ''}; generation through "
                               "SeaBiscuit does not serve it")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None,
                     softcap: float | None) -> torch.Tensor:
    """Causal softmax attention, (B, H, L, E) queries over (B, Hk, L, E) keys, its scores scaled
    (default ``E ** -0.5``) and soft-capped (``cap * tanh(s / cap)``): what ``sb.kv_attention``
    computes of a prompt, as plain torch (the kernel itself is tested against Hugging Face)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


# --- ALiBi ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlibiRule:
    """How one attention class adds ALiBi: ``forward``, the step's forward of a module of it (its
    queries, keys and values as its own forward makes them, then one SDPA), and ``kv_kwargs``,
    what ``sb.kv_attention`` adds for a module of it (None: the module adds no ALiBi)."""

    forward: Callable[..., Any]
    kv_kwargs: Callable[[torch.nn.Module, str], dict[str, Any] | None]


@contextlib.contextmanager
def _alibi_forwards(model: torch.nn.Module, notes: StepNotes) -> Iterator[None]:
    """Each attention module of ``model`` that adds ALiBi runs its ``ALIBI`` step forward, which
    notes its ``kv_kwargs``; the modules' own forwards are restored afterwards."""
    swapped: list[tuple[torch.nn.Module, Any]] = []
    try:
        for m in model.modules():
            rule = ALIBI.get(_qualname(type(m)))
            kv = rule.kv_kwargs(m, notes.model) if rule is not None else None
            if rule is None or kv is None:
                continue
            swapped.append((m, m.__dict__.get("forward")))
            m.forward = types.MethodType(_noting(rule.forward, kv, notes), m)  # type: ignore[method-assign]
        yield
    finally:
        for m, own in swapped:
            if own is None:
                del m.forward
            else:
                m.forward = own  # type: ignore[method-assign]


def _noting(forward: Callable[..., Any], kv: dict[str, Any], notes: StepNotes) -> Callable[..., Any]:
    def step_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        notes.kv_kwargs.append(kv)
        return forward(self, *args, **kwargs)
    return step_forward


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal SDPA (B, H, L, E): what ``kv_program`` turns into ``sb.kv_attention``."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale)


def _module_of(m: torch.nn.Module) -> Any:
    return sys.modules[type(m).__module__]


def _dtype_name(m: torch.nn.Module) -> str:
    return str(next(m.parameters()).dtype).removeprefix("torch.")


def _bloom_forward(self: Any, hidden_states: torch.Tensor, residual: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    b, n, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))
    out = _sdpa(q, k, v, self.inv_norm_factor).transpose(1, 2).reshape(b, n, self.hidden_size)
    # NOTE: eval mode: Bloom's dropout_add is the sum
    return residual + self.dense(out), None


def _bloom_kv(m: Any, model: str) -> dict[str, Any]:
    # NOTE: baddbmm(alibi, q, k, alpha=1/sqrt(E)): the bias is not scaled; alibi is in the model's dtype
    slopes = _module_of(m).build_alibi_tensor(torch.ones(1, 2), m.num_heads, torch.float32)[:, 0, 1]
    return {"alibi": slopes.tolist(), "alibi_dtype": _dtype_name(m)}


def _mpt_forward(self: Any, hidden_states: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    b, n = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(b, n, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    out = _sdpa(q, k, v, self.softmax_scale)
    return self.out_proj(out.transpose(1, 2).reshape(b, n, self.hidden_size)), None


def _mpt_kv(m: Any, model: str) -> dict[str, Any]:
    # NOTE: MptModel builds its bias with the default alibi_bias_max, over positions 1-S..0
    slopes = -_module_of(m).build_mpt_alibi_tensor(m.n_heads, 2)[:, 0, 0]
    return {"alibi": slopes.float().tolist()}


def _falcon_forward(self: Any, hidden_states: torch.Tensor, *args: Any,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    q, k, v = (t.transpose(1, 2) for t in _falcon_split(self, self.query_key_value(hidden_states)))
    b, _, n, _ = q.shape
    out = _sdpa(q, k, v, None).transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
    return self.dense(out), None


def _falcon_split(self: Any, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Falcon's fused projection as (batch, length, heads, head_dim) queries, keys and values (what
    ``FalconAttention._split_heads`` gave before transformers 5.25 dropped it)."""
    b, n, _ = fused.shape
    if self.new_decoder_architecture:
        qkv = fused.view(b, n, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        q, k, v = qkv[:, :, :, :-2], qkv[:, :, :, [-2]], qkv[:, :, :, [-1]]
        k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
        return q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3)
    if not self.multi_query:
        qkv = fused.view(b, n, self.num_heads, 3, self.head_dim)
        return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    qkv = fused.view(b, n, self.num_heads + 2, self.head_dim)
    return qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]


def _falcon_kv(m: Any, model: str) -> dict[str, Any] | None:
    if not m.config.alibi:
        return None
    if m.config._attn_implementation != "sdpa":
        raise UnsupportedModel(f"{model} adds ALiBi in its {m.config._attn_implementation} attention, which "
                               "generation through SeaBiscuit does not serve (load it with "
                               "attn_implementation='sdpa')")
    # NOTE: Falcon makes its ALiBi in bfloat16 and adds it over sqrt(E) to the scaled scores
    slopes = _module_of(m).build_alibi_tensor(torch.ones(1, 2), m.num_heads, torch.float32)[:, 0, 1]
    return {"alibi": slopes.tolist(), "alibi_dtype": "bfloat16",
            "alibi_scale": 1.0 / math.sqrt(m.config.hidden_size // m.num_heads)}


ALIBI: dict[str, AlibiRule] = {
    "transformers.models.bloom.modeling_bloom.BloomAttention": AlibiRule(_bloom_forward, _bloom_kv),
    "transformers.models.mpt.modeling_mpt.MptAttention": AlibiRule(_mpt_forward, _mpt_kv),
    "transformers.models.falcon.modeling_falcon.FalconAttention": AlibiRule(_falcon_forward, _falcon_kv),
}
