"""What a model's config says of the tokens a session may hold, and the KV-cache room they take."""

from __future__ import annotations

from typing import Any

from ...errors import BadInput


def max_positions(cfg: Any) -> int | None:
    """The longest sequence a model's config allows (None when it says nothing)."""
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(n) if n else None


def kv_reserve(model: Any, sessions: int, context: int | None) -> tuple[int, int]:
    """KV-cache bytes per attention layer of ``model`` (a module, weights optional) for
    ``sessions`` of ``context`` tokens, and the context (default the model's maximum positions);
    (0, 0) when it is not a decoder with a config."""
    cfg = getattr(model, "config", None)
    if cfg is None or sessions <= 0:
        return 0, 0
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not heads or not hidden:
        return 0, 0
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    limit = int(context or max_positions(cfg) or 0)
    if limit <= 0:
        raise BadInput("context: the model has no maximum positions in its config; give context=")
    itemsize = 2 if str(getattr(cfg, "dtype", "") or "").endswith(("float16", "bfloat16")) else 4
    return int(sessions * limit * 2 * kv_heads * head_dim * itemsize), limit
