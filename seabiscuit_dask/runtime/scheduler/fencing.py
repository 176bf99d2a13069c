"""Workers fenced for not answering, and what each missed while fenced.

A worker that stops answering mid-request is fenced: every model is replanned
around it as if it had left, and it is told nothing until it answers again. Then
it must drop what it no longer owns: the models released meanwhile, and the KV
caches of the sessions that ended (or were renamed) meanwhile, in the order they
came. A worker that leaves takes its caches with it: what it missed goes too.
"""

from __future__ import annotations

MAX_MISSED_ENDS = 100_000       # NOTE: session ends kept per fenced worker and model, for its return

SessionEnd = tuple[list[int], list[list[int]]]      # (session ids, [old id, new id, slots kept] each)


class Fencing:
    """Fenced workers (address -> why) and, per fenced worker, the session ends (per model, in
    order) and the model releases it missed."""

    def __init__(self) -> None:
        self.fenced: dict[str, str] = {}
        self.missed_ends: dict[str, dict[str, list[SessionEnd]]] = {}
        self.missed_releases: dict[str, set[str]] = {}

    def __contains__(self, address: object) -> bool:
        return address in self.fenced

    def fence(self, address: str, why: str) -> None:
        self.fenced[address] = why

    def lift(self, address: str) -> str | None:
        """``address`` is no longer fenced; why it was (None: it was not)."""
        return self.fenced.pop(address, None)

    def sessions_ended(self, model: str, sessions: list[int], renamed: list[list[int]]) -> None:
        """Every fenced worker missed this end of ``model``'s sessions (told once it answers)."""
        for address in self.fenced:
            ends = self.missed_ends.setdefault(address, {}).setdefault(model, [])
            if len(ends) < MAX_MISSED_ENDS:
                ends.append((sessions, renamed))

    def released(self, model: str) -> None:
        """Every fenced worker drops ``model`` once it answers; its session ends no longer matter."""
        for address in self.fenced:
            self.missed_releases.setdefault(address, set()).add(model)
            self.missed_ends.get(address, {}).pop(model, None)

    def take_releases(self, address: str) -> set[str]:
        """The models released while ``address`` was fenced (once)."""
        return self.missed_releases.pop(address, set())

    def take_ends(self, address: str) -> dict[str, list[SessionEnd]]:
        """The session ends ``address`` missed, per model in the order they came (once)."""
        return self.missed_ends.pop(address, {})

    def left(self, address: str) -> None:
        """``address`` left the cluster: its fence and what it missed go with it."""
        self.fenced.pop(address, None)
        self.missed_ends.pop(address, None)
        self.missed_releases.pop(address, None)
