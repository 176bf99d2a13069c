"""The KV cache: per session and layer, the keys and values of every token seen so far.

``KVStore`` holds the caches of one process (a worker, or a local run); the
``sb.kv_attention`` kernel reaches the store of the block it runs in through
``using(store, model, context)``. A cache of a deployment that declared its ``context``
(placement kept room for its sessions of that many tokens, and no more) grows a block
(``BLOCK_TOKENS``) at a time, to the blocks its tokens fill: the room the caller counts for
it (``generation.sessions.SessionTable``); any other doubles, in steps of ``GROW_TOKENS``.
Each growth is asked of the store's
``reserve`` callback, which a worker uses to keep caches and weights within its
budget. A cache is written only at its end: a step whose
tokens are already cached (a step run again, or a replay) reads them and writes
nothing, and a step that starts past the end (history lost with a worker) raises
``CacheLost`` naming the session, so the caller can replay the session's tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BadInput, WorkerLost
from .registry import register_kernel

GROW_TOKENS = 16
BLOCK_TOKENS = 32         # a cache of a declared context grows a block at a time (what the caller counts)
SCORE_BYTES = 4 << 20     # a query chunk's score matrix stays under this


class CacheLost(WorkerLost):
    """A step reached a worker that lacks the start of its session's cache (it moved there)."""

    def __init__(self, message: str, model: str = "", session: int = -1, have: int = 0) -> None:
        super().__init__(message)
        self.model, self.session, self.have = model, session, have

    def __reduce__(self) -> Any:     # NOTE: crosses processes with its fields
        return (CacheLost, (str(self), self.model, self.session, self.have))


@dataclass
class LayerCache:
    k: torch.Tensor          # (Hk, capacity, E)
    v: torch.Tensor          # (Hk, capacity, Ev)
    length: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVStore:
    """The KV caches of one process: ``(model, session) -> {layer: LayerCache}``.

    ``reserve(nbytes, what)`` is called before a cache grows (it raises to refuse);
    the lock guards the table, never a computation. The bytes held are counted as caches come,
    grow and go (``nbytes``: asked before every growth, so not summed over every cache each time).
    """

    def __init__(self, reserve: Callable[[int, str], None] | None = None) -> None:
        self.reserve = reserve
        self.caches: dict[tuple[str, int], dict[int, LayerCache]] = {}
        self._lock = threading.RLock()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self.caches.clear()
            self._bytes = 0

    def _bytes_of(self, layers: Mapping[int, LayerCache] | None) -> int:
        return sum(c.nbytes for c in layers.values()) if layers else 0

    def bytes_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for (model, _), layers in self.caches.items():
                out[model] = out.get(model, 0) + sum(c.nbytes for c in layers.values())
        return out

    def sessions(self, model: str) -> dict[int, int]:
        """Session -> tokens cached (the longest of its layers here)."""
        with self._lock:
            return {s: max((c.length for c in layers.values()), default=0)
                    for (m, s), layers in self.caches.items() if m == model}

    def cached(self, model: str, session: int, layers: Iterable[int]) -> int:
        """Slots of ``session`` cached in every one of ``layers`` here (0 where one has none)."""
        with self._lock:
            held = self.caches.get((model, int(session))) or {}
            return min((held[int(i)].length if int(i) in held else 0 for i in layers), default=0)

    def ready(self, model: str, spec: Any, imports: Mapping[str, torch.Tensor]) -> bool:
        """Whether the ``sb.kv_attention`` ops of block ``spec`` find, for every live row of the
        step in ``imports``, its session cached up to the row's first slot in their layers:
        what a step that follows another of the same session (a prompt's next chunk) waits for.
        A block without such ops, or that does not read the step's inputs whole, is ready."""
        layers = kv_layers(spec)
        sessions, start = imports.get("sb_sessions"), imports.get("sb_start")
        if not layers or not isinstance(sessions, torch.Tensor) or not isinstance(start, torch.Tensor):
            return True
        return all(self.cached(model, s, layers) >= st
                   for s, st in zip(sessions.flatten().tolist(), start.flatten().tolist()) if s >= 0)

    def drop(self, model: str, sessions: Container[int] | None = None) -> int:
        """Forget the caches of ``sessions`` of ``model`` (all when None); returns bytes freed."""
        with self._lock:
            keys = [k for k in self.caches if k[0] == model and (sessions is None or k[1] in sessions)]
            freed = sum(self._bytes_of(self.caches.pop(k)) for k in keys)
            self._bytes -= freed
            return freed

    def rename(self, model: str, old: int, new: int, keep: int) -> int:
        """Session ``old``'s caches become session ``new``'s, cut to their first ``keep`` slots (a
        conversation cut back, ``Engine._rewind``): a step of ``old`` still running finds nothing
        to write to. Returns the slots kept (the least over layers; 0 for none here)."""
        with self._lock:
            self._bytes -= self._bytes_of(self.caches.pop((model, new), None))
            layers = self.caches.pop((model, old), None)
            if not layers:
                return 0
            for c in layers.values():
                c.length = min(c.length, max(0, int(keep)))
            self.caches[(model, new)] = layers
            return min(c.length for c in layers.values())

    def fork(self, model: str, src: int, dst: int, keep: int) -> int:
        """Session ``dst`` starts with a copy of session ``src``'s first ``keep`` slots, in every layer
        held here (a prompt that shares that prefix: ``generation.prefix``); each counted through
        ``reserve`` as any growth. Returns the slots copied (the least over layers; 0 for none here)."""
        with self._lock:
            layers = dict(self.caches.get((model, int(src))) or {})
        out: dict[int, LayerCache] = {}
        for i, c in layers.items():
            n = min(c.length, max(0, int(keep)))
            cap = max(n, -(-n // BLOCK_TOKENS) * BLOCK_TOKENS)
            k = c.k.new_empty((c.k.shape[0], cap, c.k.shape[2]))
            v = c.v.new_empty((c.v.shape[0], cap, c.v.shape[2]))
            if self.reserve is not None:
                self.reserve(k.numel() * k.element_size() + v.numel() * v.element_size(),
                             f"the KV cache of session {dst} of model {model} (layer {i}), from {src}")
            k[:, :n], v[:, :n] = c.k[:, :n], c.v[:, :n]
            out[i] = LayerCache(k, v, n)
        if not out:
            return 0
        with self._lock:
            self._bytes += self._bytes_of(out) - self._bytes_of(self.caches.get((model, int(dst))))
            self.caches[(model, int(dst))] = out
        return min(c.length for c in out.values())

    def write(self, model: str, session: int, layer: int, start: int, k: torch.Tensor,
              v: torch.Tensor, context: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache ``k``, ``v`` ((Hk, n, E)) at slots ``start..start+n-1``; returns all keys and values
        up to the last of them. Slots already cached are read, not written; a cache grows to at
        most ``context`` slots (0: no bound) unless the step itself goes further. Under the
        store's lock, so a ``rename`` or ``drop`` comes wholly before or after it."""
        n = k.shape[1]
        with self._lock:
            layers = self.caches.get((model, session))
            c = layers.get(layer) if layers is not None else None
            have = c.length if c is not None else 0
            if start > have:
                raise CacheLost(f"session {session} of model {model}: layer {layer} holds {have} cached "
                                f"token(s) here, the step starts at token {start} (its cache was lost with "
                                "a worker; replay the session's tokens)", model, session, have)
            end = start + n
            if c is None or end > c.k.shape[1]:
                c = self._grow(model, session, layer, c, end, k, v, context)
            if end > c.length:
                first = c.length - start
                c.k[:, c.length:end] = k[:, first:]
                c.v[:, c.length:end] = v[:, first:]
                c.length = end
            return c.k[:, :end], c.v[:, :end]

    def _grow(self, model: str, session: int, layer: int, c: LayerCache | None, end: int,
              k: torch.Tensor, v: torch.Tensor, context: int = 0) -> LayerCache:
        old = c.k.shape[1] if c is not None else 0
        if context > 0:     # NOTE: the blocks its tokens fill: the room the caller counted for it
            cap = max(end, min(-(-end // BLOCK_TOKENS) * BLOCK_TOKENS, context))
        else:
            cap = max(end, 2 * old, GROW_TOKENS)
            cap = -(-cap // GROW_TOKENS) * GROW_TOKENS
        per_token = k.shape[0] * k.shape[2] * k.element_size() + v.shape[0] * v.shape[2] * v.element_size()
        if self.reserve is not None:
            self.reserve((cap - old) * per_token,
                         f"the KV cache of session {session} of model {model} (layer {layer}) to "
                         f"{cap} tokens")
        # NOTE: slots past ``length`` are never read: no zeroing
        new = LayerCache(k.new_empty((k.shape[0], cap, k.shape[2])),
                         v.new_empty((v.shape[0], cap, v.shape[2])))
        if c is not None:
            new.k[:, :c.length] = c.k[:, :c.length]
            new.v[:, :c.length] = c.v[:, :c.length]
            new.length = c.length
        with self._lock:
            layers = self.caches.setdefault((model, session), {})
            self._bytes += new.nbytes - (layers[layer].nbytes if layer in layers else 0)
            layers[layer] = new
        return new


_current: contextvars.ContextVar[tuple[KVStore, str, int] | None] = contextvars.ContextVar("sb_kv",
                                                                                          default=None)


@contextlib.contextmanager
def using(store: KVStore, model: str, context: int = 0) -> Iterator[None]:
    """Run blocks of ``model`` with ``store`` as their KV cache, each cache growing to at most
    ``context`` tokens (0: no bound)."""
    token = _current.set((store, model, int(context)))
    try:
        yield
    finally:
        _current.reset(token)


@dataclass(frozen=True)
class ScoreSpec:
    """What an attention adds to its scaled scores before the mask, as the model computes it:
    a logit ``softcap`` (``cap * tanh(s / cap)``, Gemma 2), then ALiBi, ``slopes[h] * slot`` per
    head and key slot (Bloom, MPT, Falcon), rounded to ``alibi_dtype`` and times ``alibi_scale``.
    NOTE: a slot counts the session's real tokens (padding is never cached), as the positions
    Hugging Face's ALiBi counts; a shift of every key's bias changes no softmax."""

    softcap: float | None = None
    slopes: tuple[float, ...] | None = None
    alibi_dtype: str = "float32"
    alibi_scale: float = 1.0

    def bias(self, slot: torch.Tensor) -> torch.Tensor:
        """(H, 1, S) ALiBi of key ``slot`` (S,)."""
        assert self.slopes is not None
        b = torch.tensor(self.slopes, device=slot.device)[:, None] * slot.float()[None, :]
        b = b.to(getattr(torch, self.alibi_dtype)).float()
        return (b if self.alibi_scale == 1.0 else b * self.alibi_scale).unsqueeze(1)


def kv_layers(spec: Any) -> tuple[int, ...]:
    """The cache layers the ``sb.kv_attention`` ops of a block (its ``ops``) write and read."""
    return tuple(sorted({int(op.attrs["args"][6]) for op in spec.ops if op.kind == "kv_attention"}))


@register_kernel("sb.kv_attention")
def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sessions: torch.Tensor,
                 start: torch.Tensor, valid: torch.Tensor, layer: int, scale: float | None,
                 window: int | None = None, *, softcap: float | None = None,
                 alibi: list[float] | None = None, alibi_dtype: str = "float32",
                 alibi_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each row's new tokens over its session's cache, after caching them;
    with a sliding ``window``, a token sees only the latest ``window`` slots (itself included);
    ``softcap`` and ``alibi`` (slopes per head) change the scores as ``ScoreSpec`` says.

    ``q`` is (B, H, L, E), ``k``/``v`` (B, Hk, L, E) with H a multiple of Hk. Row b's
    real tokens (``valid[b]``) take cache slots ``start[b]`` on, in order; real token r
    sees slots ``0..start[b] + r``. Padding and empty rows (session -1) give zeros.
    """
    ctx = _current.get()
    if ctx is None:
        raise BadInput("sb.kv_attention runs only inside a generation step (a KV store is needed)")
    store, model, context = ctx
    spec = None
    if softcap is not None or alibi is not None:
        spec = ScoreSpec(None if softcap is None else float(softcap),
                         None if alibi is None else tuple(float(a) for a in alibi), alibi_dtype,
                         float(alibi_scale))
    # NOTE: each row's session, start and whether all its tokens are real, read in three calls, not
    # three a row (a decode step's attention is mostly such small calls)
    ids = [int(v) for v in sessions.tolist()]
    starts = [int(v) for v in start.tolist()]
    full = valid.all(dim=1).tolist()
    layer = int(layer)
    if len(ids) == 1 and ids[0] >= 0 and full[0]:       # NOTE: one row of real tokens: no copy out
        keys, values = store.write(model, ids[0], layer, starts[0], k[0], v[0], context)
        return _attend(q[0], keys, values, starts[0], scale, window, spec).unsqueeze(0)
    out = q.new_zeros((*q.shape[:3], v.shape[3]))
    for b in range(q.shape[0]):
        s = ids[b]
        if s < 0:
            continue
        row = valid[b]
        st = starts[b]
        if full[b]:          # NOTE: every token real (most steps): slices, no gathers
            keys, values = store.write(model, s, layer, st, k[b], v[b], context)
            out[b] = _attend(q[b], keys, values, st, scale, window, spec)
            continue
        idx = row.nonzero().flatten()
        if not len(idx):
            continue
        keys, values = store.write(model, s, layer, st, k[b][:, idx], v[b][:, idx], context)
        out[b][:, idx] = _attend(q[b][:, idx], keys, values, st, scale, window, spec)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
            scale: float | None, window: int | None = None, spec: ScoreSpec | None = None) -> torch.Tensor:
    """(H, n, E) queries at slots start.. against (Hk, S, E) keys, causal, in chunks of queries.

    Query head h reads key head ``h // (H // Hk)`` (``enable_gqa``: the cache is read as it
    is, never repeated per head). A chunk's queries see the keys up to their own slot: the
    whole cache for one token, a causal mask from the top left when the chunk starts the
    cache (a fresh prompt), else from the bottom right; a sliding ``window`` reads only the
    slots some query of the chunk sees, masked to the latest ``window`` of each. With a
    ``spec`` the scores are computed here (``_scored``), not by SDPA.
    """
    heads, n, _ = q.shape
    total = k.shape[1]
    rows = max(1, SCORE_BYTES // max(1, 4 * heads * total))
    parts = []
    for a in range(0, n, rows):
        b = min(n, a + rows)
        m, seen = b - a, start + b
        lo = 0 if window is None else max(0, start + a - window + 1)
        if spec is not None:
            parts.append(_scored(q[:, a:b], k[:, lo:seen], v[:, lo:seen], start + a, lo, scale, window, spec))
            continue
        if lo == 0 and seen == total:       # NOTE: the whole cache (a decode step): no slice to make
            keys, values = k.unsqueeze(0), v.unsqueeze(0)
        else:
            keys, values = k[:, lo:seen].unsqueeze(0), v[:, lo:seen].unsqueeze(0)
        if m == 1:
            mask, causal = None, False        # NOTE: one token sees every slot up to its own
        elif m == seen and window is None:
            mask, causal = None, True
        else:
            # NOTE: causal from the bottom right (a later chunk), within the window if any; made here,
            # not by ``torch.nn.attention.bias.causal_lower_right``, whose import takes torch._dynamo's
            # (2.3 s on a worker's first later chunk)
            pos = (start + torch.arange(a, b, device=q.device)).unsqueeze(1)
            slot = torch.arange(lo, seen, device=q.device).unsqueeze(0)
            mask, causal = slot <= pos, False
            if window is not None:
                mask &= slot > pos - window
        out = torch.nn.functional.scaled_dot_product_attention(
            (q if m == n else q[:, a:b]).unsqueeze(0), keys, values, attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True)[0]
        parts.append(out)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _scored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, lo: int, scale: float | None,
            window: int | None, spec: ScoreSpec) -> torch.Tensor:
    """(H, m, E) queries at slots first.. against (Hk, S, E) keys at slots lo.., as Hugging Face's
    eager attention computes it: scaled scores, ``spec``'s soft-cap and ALiBi, the causal (window)
    mask, softmax in float32. Query head h reads key head ``h // (H // Hk)``, nothing repeated."""
    heads, m, e = q.shape
    groups, total = k.shape[0], k.shape[1]
    scores = (q.reshape(groups, heads // groups * m, e) @ k.transpose(1, 2)).reshape(heads, m, total)
    scores = scores * (e ** -0.5 if scale is None else scale)
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    slot = torch.arange(lo, lo + total, device=q.device)
    if spec.slopes is not None:
        scores = scores + spec.bias(slot)
    pos = torch.arange(first, first + m, device=q.device).unsqueeze(1)
    seen = slot.unsqueeze(0) <= pos
    if window is not None:
        seen &= slot.unsqueeze(0) > pos - window
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1, dtype=torch.float32).to(v.dtype)
    out = probs.reshape(groups, heads // groups * m, total) @ v
    return out.reshape(heads, m, v.shape[2])
