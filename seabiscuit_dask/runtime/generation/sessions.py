"""Sessions and their token histories, the calls that answer them, and the table that counts them.

A ``Session`` is one sequence: every token it has seen, and how many of them are
cached on the workers. A ``Call`` is one generate call: its sessions (rows), how it
picks tokens, and the queue its caller reads. A session kept across calls (a chat,
``DistributedModel.session``) answers one call (a turn) at a time; a turn its caller
stopped reading or that failed is cut back (``SessionTable.rewind``), so the next
turn starts from what the caller heard.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import BadInput, Busy, ModelClosed, QueueTimeout, SessionClosed
from ...lower.kvcache import BLOCK_TOKENS
from .sampling import Sampling, TokenLogprob

if TYPE_CHECKING:
    import torch

    from .grammar import Matcher

TURN_WAIT_S = 120.0  # NOTE: how long a kept session's next turn waits for its last one to end
_CALL_IDS = itertools.count()


@dataclass(eq=False)
class Session:
    """One sequence: its tokens so far, and how many of them are cached on the workers."""

    sid: int
    tokens: list[int]
    cached: int = 0
    done: bool = False
    call: Call | None = None     # the call answering it now (a kept session's turn)
    closed: bool = False         # a kept session its caller closed
    room: int = 0                # KV tokens counted for it (a new session's: ``SessionTable.room``)


@dataclass(eq=False)
class Call:
    """One generate call: its sessions (rows), how to pick tokens, and where they go."""

    sessions: list[Session]
    max_new: int
    sampling: Sampling
    eos: frozenset[int]
    pad: int
    # NOTE: a (rows,) tensor of tokens per step, then None (the end) or the error that ended it
    out: queue.Queue[torch.Tensor | BaseException | None] = field(default_factory=queue.Queue)
    produced: int = 0
    keep: bool = False          # a caller-held session stays cached after the call
    cancelled: bool = False     # the caller stopped reading: end at the next step
    closing: BaseException | None = None    # the deployment closes: end at the next step with it
    seen: int | None = None     # rows the caller read before it stopped (a cancelled call)
    finished: bool = False      # the engine is done with it (under the engine's lock)
    ended: threading.Event = field(default_factory=threading.Event)     # and its caller was told
    room: int = 0               # KV tokens counted for its new sessions (``SessionTable.room``)
    before: list[int] = field(default_factory=list)   # each kept session's tokens before this turn
    base: list[int] = field(default_factory=list)     # with its prompt: where each answer starts
    # NOTE: per step read, each row's ``TokenLogprob`` (None: not live), when the call asks for them
    logprobs: deque[list[TokenLogprob | None]] = field(default_factory=deque)
    cid: int = field(default_factory=lambda: next(_CALL_IDS))     # what a step's record names it by
    admitted: float | None = None   # when the scheduler admitted it (``time.perf_counter``)
    matchers: list[Matcher] | None = None     # each row's place in the call's grammar, once it picked
    preempted: set[int] | None = None   # its rows to recompute, while it is preempted (``Engine._preempt``)
    waits_since: float | None = None    # when it was last preempted (``time.monotonic``)

    @property
    def live(self) -> list[Session]:
        return [s for s in self.sessions if not s.done]

    @property
    def stopping(self) -> bool:
        """Whether it ends at the next step: its caller stopped reading, or the deployment closes."""
        return self.cancelled or self.closing is not None


class SessionTable:
    """The sessions one deployment holds open, counted against its limit, and their ids. The
    counts change under the engine's lock.

    With a ``context`` (a deployment that kept KV room for ``max_sessions`` sessions of that many
    tokens), what bounds the sessions open is that room, in tokens: a new session counts the
    blocks (``lower.kvcache.BLOCK_TOKENS``, as a cache grows) its prompt and new tokens fill, a
    kept one the whole context, so room for 8 x 1024 tokens holds 32 chats of 200 tokens at once;
    ``max_rows`` bounds the sessions open all the same (``seabiscuit.generate.max-rows``).
    Without one, ``max_sessions`` sessions at most."""

    def __init__(self, max_sessions: int, name: str, max_queued: int = 0, context: int | None = None,
                 max_rows: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.context = context
        self.max_tokens = max_sessions * context if context else None     # the KV room, in tokens
        self.max_rows = max(max_sessions, int(max_rows or 0)) if context else max_sessions
        self.max_queued = max_queued         # rows that may wait for room, first come first served
        self.name = name
        self.open = 0
        self.tokens = 0                      # KV tokens counted for the sessions open
        self.queue: deque[tuple[object, int]] = deque()     # NOTE: (a waiter's token, its rows), in order
        self.held = 0       # rows of preempted calls waiting to be recomputed: they go before the queue
        self._ids = itertools.count()

    @property
    def usage(self) -> float:
        """The share of the KV room in use, 0 to 1: tokens counted over the room, or sessions open over
        ``max_sessions`` where the table counts sessions only."""
        if self.max_tokens:
            return min(1.0, self.tokens / self.max_tokens)
        return min(1.0, self.open / self.max_sessions) if self.max_sessions else 0.0

    @property
    def queued(self) -> int:
        """Rows of calls waiting for room."""
        return sum(rows for _, rows in self.queue)

    def next_id(self) -> int:
        return next(self._ids)

    def room(self, lengths: Sequence[int]) -> int:
        """KV tokens new sessions of ``lengths`` tokens each (prompt and new tokens) count: the
        blocks they fill (0 where the table counts sessions only)."""
        if not self.max_tokens or not self.context:
            return 0
        # NOTE: a cache never grows past the context (``KVStore``): nor does what it counts
        return sum(min(-(-int(n) // BLOCK_TOKENS) * BLOCK_TOKENS, self.context) for n in lengths)

    def fits(self, rows: int, tokens: int) -> bool:
        room = not self.max_tokens or self.tokens + tokens <= self.max_tokens
        return self.open + rows <= self.max_rows and room

    def check_rows(self, rows: int, tokens: int = 0) -> None:
        """Refuse a call of more rows (or KV tokens) than the deployment ever serves at once."""
        if rows > self.max_rows:
            raise BadInput(f"{self.name}: this call asks for {rows} sessions (rows) at once and the "
                           f"deployment serves at most {self.max_rows}; send fewer rows or deploy "
                           "with more sessions")
        if self.max_tokens and tokens > self.max_tokens:
            raise BadInput(f"{self.name}: this call's {rows} sessions fill {tokens} KV tokens and the "
                           f"deployment kept room for {self.max_tokens} ({self.max_sessions} sessions x "
                           f"{self.context}); send fewer rows or tokens, or deploy with more sessions")

    def reserve(self, rows: int, tokens: int = 0) -> None:
        """Count a call's ``rows`` new sessions open (``tokens`` of KV room), or raise ``Busy`` (lock
        held)."""
        if not self.fits(rows, tokens):
            raise Busy(f"{self.name} has {self.open} session(s) open and this call asks for {rows} more; "
                       f"the limit is {self.max_rows} (seabiscuit.generate.max-sessions){self._counted()}: "
                       "wait for calls to finish or raise the limit")
        self.open += rows
        self.tokens += tokens

    def wait(self, rows: int, cond: threading.Condition, timeout_s: float,
             closed: Callable[[], bool], tokens: int = 0) -> None:
        """Count a call's ``rows`` new sessions (``tokens`` of KV room) open once there is room, waiting
        behind the calls that came before it (``cond`` held; it is notified as sessions close).
        ``Busy`` at once when ``max_queued`` rows wait already, ``QueueTimeout`` after ``timeout_s``;
        ``ModelClosed`` when the deployment closes meanwhile (``closed``)."""
        if not self.queue and not self.held and self.fits(rows, tokens):
            self.open += rows
            self.tokens += tokens
            return
        if self.queued + rows > self.max_queued:
            raise Busy(f"{self.name} has {self.open} session(s) open of {self.max_sessions} and "
                       f"{self.queued} row(s) waiting, the most that may wait "
                       f"(seabiscuit.generate.max-queued = {self.max_queued}): try again once calls finish")
        token = object()
        self.queue.append((token, rows))
        try:
            ready = cond.wait_for(
                lambda: closed() or (self.queue[0][0] is token and not self.held and self.fits(rows, tokens)),
                timeout_s)
            if closed():
                raise ModelClosed(f"{self.name} was closed while this call waited for room")
            if not ready:
                raise QueueTimeout(f"{self.name}: this call waited {timeout_s:.0f} s for one of "
                                   f"{self.max_sessions} sessions (seabiscuit.generate.queue-timeout); "
                                   "try again later")
            self.open += rows
            self.tokens += tokens
        finally:
            self.queue = deque(e for e in self.queue if e[0] is not token)
            cond.notify_all()       # NOTE: the next in line may fit now

    def keep(self) -> Session:
        """A session kept across calls, counted open (a whole context of KV room) until it is closed
        (lock held)."""
        room = self.kept_room
        if not self.fits(1, room):
            raise Busy(f"{self.name} has {self.open} session(s) open; the limit is {self.max_rows} "
                       f"(seabiscuit.generate.max-sessions){self._counted()}")
        self.open += 1
        self.tokens += room
        return self.new([])

    def grow(self, tokens: int) -> bool:
        """Count ``tokens`` more KV room for a session open that decodes past what it counted, where
        the room holds them; whether it did (lock held)."""
        if self.max_tokens and self.tokens + tokens > self.max_tokens:
            return False
        self.tokens += tokens
        return True

    def release(self, rows: int, tokens: int = 0) -> None:
        """Count ``rows`` sessions closed, and the ``tokens`` of KV room they counted (lock held)."""
        self.open -= rows
        self.tokens -= tokens

    def _counted(self) -> str:
        return f" and {self.max_tokens} KV tokens, {self.tokens} counted" if self.max_tokens else ""

    @property
    def kept_room(self) -> int:
        """KV tokens a kept session counts."""
        return self.context if self.max_tokens and self.context else 0

    def new(self, tokens: Sequence[int]) -> Session:
        return Session(self.next_id(), list(tokens))

    def call(self, prompts: Sequence[Sequence[int]], max_new: int, sampling: Sampling,
             eos: Sequence[int], pad: int) -> Call:
        """A call of new sessions, one a prompt (counted open already: ``reserve``)."""
        return Call([self.new(p) for p in prompts], max_new, sampling, frozenset(eos), pad,
                    base=[len(p) for p in prompts])

    def turn(self, sessions: Sequence[Session], prompts: Sequence[Sequence[int]], max_new: int,
             sampling: Sampling, eos: Sequence[int], pad: int) -> Call:
        """The next turn of kept ``sessions``: each takes its prompt, and answers this call."""
        before = [len(s.tokens) for s in sessions]
        for s, p in zip(sessions, prompts):
            s.tokens.extend(p)
            s.done = False
        call = Call(list(sessions), max_new, sampling, frozenset(eos), pad, keep=True, before=before,
                    base=[len(s.tokens) for s in sessions])
        for s in sessions:
            s.call = call
        return call

    def rewind(self, call: Call, keep: Sequence[int]) -> list[tuple[int, int, int]]:
        """Cut each open kept session of ``call`` back to its first ``keep`` tokens: a turn's answer
        to the tokens its caller read (not the ones made meanwhile, nor what steps that ran ahead
        cached on the workers), or a failed turn away whole. Each goes on under a new id, its
        caches renamed and cut to as many slots (``KVStore.rename``), so a step of this call
        still running finds nothing to write to, and the next turn starts from what is kept.
        Returns the (old id, new id, slots kept) of each."""
        moved = []
        for s, n in zip(call.sessions, keep):
            if s.closed:
                continue
            del s.tokens[n:]
            new = self.next_id()
            moved.append((s.sid, new, n))
            s.sid, s.cached = new, min(s.cached, n)
        return moved


def after_turn(s: Session, name: str) -> None:
    """Wait for the call that answers kept session ``s`` (its last turn) to end: one its caller
    stopped reading ends at the engine's next step; one still being read is an error."""
    if s.closed:
        raise SessionClosed(f"{name}: session {s.sid} is closed; open another (dm.session())")
    prev = s.call
    if prev is None or prev.ended.is_set():
        return
    if not prev.cancelled:
        raise Busy(f"{name}: session {s.sid} is still answering its last turn ({prev.produced} of "
                   f"{prev.max_new} new tokens); read its stream to the end or close it first")
    if not prev.ended.wait(TURN_WAIT_S):
        raise Busy(f"{name}: session {s.sid}'s last turn, whose stream was closed, did not end "
                   f"within {TURN_WAIT_S:.0f} s; try the next turn again later")
