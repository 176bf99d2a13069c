"""Deploy claims: how the scheduler knows which client deploys a model.

A client sends a one-off nonce down its own batched stream, where the scheduler
fills in which client that is, and shows the nonce in its deploy RPC: the model is
then that client's (``Deployment.owner``), never what a payload says. A claim lasts
``ttl_s``; a client holds at most ``MAX_CLAIMS`` at once.
"""

from __future__ import annotations

from typing import Any

MAX_CLAIMS = 64                 # NOTE: claims one client may hold at once
NONCE_CHARS = (16, 128)         # NOTE: shortest and longest nonce taken


class Claims:
    """Claims not yet shown by a deploy: nonce -> (client, when it came)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.pending: dict[str, tuple[str, float]] = {}

    def claim(self, client: str, nonce: Any, now: float) -> bool:
        """Whether ``client``'s claim of ``nonce`` at ``now`` (seconds, monotonic) was taken: not one
        of a client unnamed, not a malformed nonce, not one too many. Expired claims go first."""
        for n in [n for n, (_, t) in self.pending.items() if now - t > self.ttl_s]:
            del self.pending[n]
        mine = sum(c == client for c, _ in self.pending.values())
        shortest, longest = NONCE_CHARS
        well_formed = isinstance(nonce, str) and shortest <= len(nonce) <= longest
        if not (client and well_formed and mine < MAX_CLAIMS):
            return False
        self.pending[nonce] = (client, now)
        return True

    def take(self, nonce: str) -> str | None:
        """The client that claimed ``nonce``, once (None: no such claim, or not yet)."""
        got = self.pending.pop(nonce, None)
        return None if got is None else got[0]

    def client_left(self, client: str) -> None:
        for n in [n for n, (c, _) in self.pending.items() if c == client]:
            del self.pending[n]
