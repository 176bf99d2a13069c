"""Prefix caching: the caches of finished sessions kept, for new prompts that begin as they did.

When a call's session ends, its cache (the KV of its tokens up to the last one cached) may be
kept on the workers instead of freed, while the deployment's KV room has space for it; a new
session whose prompt shares at least ``MIN_TOKENS`` leading tokens with a kept one starts with a
copy of those slots (``KVStore.fork``, on every worker that holds attention layers) and
prefills the rest only. A chat's system prompt, a conversation sent again with one more turn
(the OpenAI API sends the whole conversation each time), or ``n`` answers to one prompt sent one
after another reuse what was computed. What is kept counts against the room like a session and
goes first, oldest first, when a call needs the room; a kept cache being copied is not let go.
The engine's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

MIN_TOKENS = 16     # NOTE: a shorter shared prefix is prefilled again: a copy on every worker costs more


@dataclass
class Kept:
    """A finished session's cache kept: its tokens (each cached) and the KV room it counts."""

    tokens: tuple[int, ...]
    room: int
    pins: int = 0       # forks from it under way: it is not let go meanwhile


class PrefixCache:
    """The kept caches of one deployment, by session id, oldest first (see module doc)."""

    def __init__(self, min_tokens: int = MIN_TOKENS) -> None:
        self.min_tokens = min_tokens
        self.kept: OrderedDict[int, Kept] = OrderedDict()
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.kept)

    @property
    def room(self) -> int:
        """KV room the kept caches count."""
        return sum(k.room for k in self.kept.values())

    def keep(self, sid: int, tokens: Sequence[int], room: int) -> bool:
        """Keep session ``sid``'s cache of ``tokens``; False where it is too short to be worth it."""
        if len(tokens) < self.min_tokens:
            return False
        self.kept[sid] = Kept(tuple(tokens), room)
        return True

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(kept session, slots) of the kept cache sharing the longest prefix with ``tokens`` (at
        least ``min_tokens``, and never the last token: its logits are computed), pinned until
        ``unpin``; None where none does."""
        self.lookups += 1
        best: tuple[int, int] | None = None
        for sid, k in self.kept.items():
            n = _shared(k.tokens, tokens, len(tokens) - 1)
            if n >= self.min_tokens and (best is None or n > best[1]):
                best = (sid, n)
        if best is None:
            return None
        self.kept[best[0]].pins += 1
        self.kept.move_to_end(best[0])
        self.hits += 1
        self.hit_tokens += best[1]
        return best

    def unpin(self, sid: int) -> None:
        k = self.kept.get(sid)
        if k is not None:
            k.pins -= 1

    def evict(self) -> tuple[int, int] | None:
        """Let go of the oldest kept cache no fork is copying: (its session, the room it counted)."""
        for sid, k in self.kept.items():
            if not k.pins:
                del self.kept[sid]
                return sid, k.room
        return None

    def clear(self) -> list[int]:
        """Let go of every kept cache; their sessions."""
        out = list(self.kept)
        self.kept.clear()
        return out


def _shared(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, ``most`` at most."""
    n = min(len(a), len(b), most)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
