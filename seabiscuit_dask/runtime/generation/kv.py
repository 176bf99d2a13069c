"""The caller's side of the sessions' KV caches: the room each may fill, and the frees it owes.

The caches themselves live on the workers that own the attention blocks
(``lower.kvcache.KVStore``); what the caller keeps is what it must tell them: that a
session holds no more tokens than the deployment's context (the room placement kept
for it), which caches to free (sessions that ended, or that their callers dropped on
any thread), and which to rename and cut back (a kept session's turn rewound).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ...errors import BadInput
from .sessions import Session

if TYPE_CHECKING:
    from .runner import Runner

logger = logging.getLogger(__name__)

Renamed = tuple[int, int, int]       # (old session, new session, slots kept): ``KVStore.rename``


class KVLedger:
    """What a deployment's engine knows and owes of its sessions' caches on the workers."""

    def __init__(self, runner: Runner, context: int | None, name: str) -> None:
        self.runner = runner
        self.context = context
        self.name = name
        self._dropped: list[int] = []      # sessions dropped by their callers, caches to free
        self._freeing = ThreadPoolExecutor(1, thread_name_prefix="seabiscuit-free")

    def check_call(self, prompts: Sequence[Sequence[int]], max_new: int) -> None:
        """Refuse a call whose longest prompt and new tokens would pass the context."""
        longest = max(len(p) for p in prompts)
        if self.context is not None and longest + max_new > self.context:
            raise BadInput(f"{self.name}: a prompt of {longest} tokens plus max_new_tokens={max_new} "
                           f"exceeds the context of {self.context} tokens; shorten the prompt or "
                           "ask for fewer tokens")

    def check_turn(self, s: Session, prompt: Sequence[int], max_new: int) -> None:
        """Refuse a kept session's turn that would pass the context."""
        if self.context is not None and len(s.tokens) + len(prompt) + max_new > self.context:
            raise BadInput(f"{self.name}: session {s.sid} would hold "
                           f"{len(s.tokens) + len(prompt) + max_new} tokens, more than the context of "
                           f"{self.context}")

    def drop_later(self, sid: int) -> None:
        """Owe the free of session ``sid``'s caches, sent from the engine's thread (lock held)."""
        self._dropped.append(sid)

    @property
    def owed(self) -> bool:
        """Whether frees are owed (lock held)."""
        return bool(self._dropped)

    def take_owed(self) -> list[int]:
        """The sessions whose frees are owed, now the caller's to send (lock held)."""
        out, self._dropped = self._dropped, []
        return out

    def fork(self, forks: Sequence[Renamed]) -> None:
        """Start each new session of ``forks`` ((source, new, slots) each) with a copy of the
        source's first slots on every worker (``KVStore.fork``); a failure is raised."""
        self.runner.end_sessions([], (), forks)

    def end(self, sids: Sequence[int]) -> None:
        """Free the caches of ``sids`` everywhere now; a failure is raised."""
        self.runner.end_sessions(sids)

    def free_then(self, sids: Sequence[int], moved: Sequence[Renamed], then: Callable[[], None]) -> None:
        """``free`` then ``then()``, in order: caches only freed go on a thread of their own (a free
        is a round trip through the scheduler to every worker: 0.1-0.4 s on a busy machine, which
        the engine's thread would not step meanwhile); renamed ones now (the session's next turn
        reads them by their new names)."""
        if moved or not sids:
            self.free(sids, moved)
            then()
            return

        def free_and_then() -> None:
            self.free(sids)
            then()

        try:
            self._freeing.submit(free_and_then)
        except RuntimeError:        # NOTE: shut down (the interpreter exits): here, then
            free_and_then()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the frees sent on their thread (the deployment closes)."""
        done = self._freeing.submit(lambda: None)
        try:
            done.result(timeout_s)
        except Exception:  # noqa: BLE001 - best effort, as every free
            pass

    def free(self, sids: Sequence[int], moved: Sequence[Renamed] = ()) -> None:
        """Free the caches of ``sids`` and rename those ``moved``, best effort: a cache not freed
        goes with its model, and one not cut back is replayed where it is read."""
        if sids or moved:
            try:
                self.runner.end_sessions(sids, moved)
            except Exception as e:  # noqa: BLE001 - best effort: a cache not cut back is replayed
                logger.warning("%s: caches of sessions %s not freed, nor %s cut back: %s", self.name,
                               list(sids), list(moved), e)
