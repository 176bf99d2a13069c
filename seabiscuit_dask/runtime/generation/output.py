"""What a step was decided to be: the plain record a ``Scheduler`` returns and an ``Executor`` carries out.

A record names sessions and calls by id and holds the tokens each step writes, so it
can be printed, compared and tested with no cluster, and it says everything the
executor does: which calls end, which are admitted and how their prompts are cut into
chunks (each with the cache slots it fills), and which rows decode together in which
group, with or without a step queued behind it.

>>> print(scheduler.schedule())                                     # doctest: +SKIP
step 7: admit 2 call(s), 2 prompt(s) at once
  call 3: s5[0:145)/152
  call 4: s6[0:37)/40
>>> print(scheduler.schedule())                                     # doctest: +SKIP
step 8: decode 2 row(s) in 2 group(s)
  decode s5@145 in 1 rows, queued, next queued, loop 31
  decode s6@37 in 1 rows, queued, next queued, loop 31
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sampling import RowPick


@dataclass(frozen=True)
class Chunk:
    """Tokens of one session written to its cache from slot ``start`` on, in a step program of
    ``length`` tokens a row: a prompt chunk, a decode row, or part of a replay."""

    session: int
    start: int
    tokens: tuple[int, ...] = field(repr=False)
    length: int

    @property
    def stop(self) -> int:
        """The slot after its last token: what the session has cached once it ran."""
        return self.start + len(self.tokens)

    def __str__(self) -> str:
        return f"s{self.session}[{self.start}:{self.stop})/{self.length}"


@dataclass(frozen=True)
class Prefill:
    """A session's uncached tokens as chunks run one by one (``chunks``, largest first), or, where
    the runner pipelines a prompt, all sent at once, each following the one before (``ahead``,
    smallest first: the pipeline fills sooner); if those fail, ``chunks`` run after all.
    ``grouped``: its one chunk is a row of one of the step's ``PrefillGroup``s instead. ``twin``: a
    session of the same call with the same tokens to prefill from the same slot (``n`` answers to
    one prompt): this one prefills nothing, its cache starts as a copy of the twin's and its
    first token is picked from the twin's logits."""

    session: int
    chunks: tuple[Chunk, ...]
    ahead: tuple[Chunk, ...] = ()
    grouped: bool = False
    twin: int = -1

    def __str__(self) -> str:
        if self.twin >= 0:
            return f"s{self.session} as s{self.twin} (a copy of its cache)"
        if not self.chunks:
            return f"s{self.session}: nothing to prefill"
        if self.grouped:
            return f"{self.chunks[0]} in a group"
        ahead = f" (at once: {' '.join(map(str, self.ahead))})" if self.ahead else ""
        return " ".join(map(str, self.chunks)) + ahead


@dataclass(frozen=True)
class Admission:
    """A call admitted: each of its sessions prefilled in turn; its first tokens come of them."""

    call: int
    prefills: tuple[Prefill, ...]

    def __str__(self) -> str:
        return f"call {self.call}: " + "; ".join(map(str, self.prefills))


@dataclass(frozen=True)
class PrefillGroup:
    """Prompts prefilled together: one chunk each (their whole prompt), left-padded to ``length``,
    in one step program of ``len(rows)`` rows; its logits are each prompt's last token's."""

    rows: tuple[Chunk, ...]
    length: int

    @property
    def tokens(self) -> int:
        """Tokens the step computes, padding included."""
        return len(self.rows) * self.length

    def __str__(self) -> str:
        return f"prefill {' '.join(f's{r.session}[{r.start}:{r.stop})' for r in self.rows)} " \
               f"in {len(self.rows)}x{self.length}"


@dataclass(frozen=True)
class DecodeGroup:
    """Rows that decode together in one step program of ``batch`` rows (one new token each).

    ``queued``: the group is greedy and the runner chains steps, so its tokens are picked on
    the workers and the step may have been queued already behind the group's last one;
    ``more``: queue the next step behind this one (not its calls' last); ``steps``: the
    steps a group starting anew may start at once (a decode loop on the workers)."""

    rows: tuple[Chunk, ...]
    batch: int
    queued: bool = False
    more: bool = False
    steps: int = 1

    @property
    def key(self) -> tuple[int, ...]:
        """Its sessions: a group with the same ones next step finds its step queued."""
        return tuple(r.session for r in self.rows)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(r.start for r in self.rows)

    def __str__(self) -> str:
        how = f", queued{', next queued' if self.more else ''}, loop {self.steps}" if self.queued else ""
        return f"decode {' '.join(f's{r.session}@{r.start}' for r in self.rows)} in {self.batch} rows{how}"


@dataclass(frozen=True)
class LaneRow:
    """A row of a lane: its session's last token (``chunk``: not yet cached) and the steps it takes
    from there at most (its call's tokens still to come); ``pick``, how its tokens are picked where
    its logits are made (``sampling.RowPick``; None: greedily)."""

    chunk: Chunk
    steps: int
    pick: RowPick | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return f"s{self.chunk.session}@{self.chunk.start} x{self.steps}"


@dataclass(frozen=True)
class LaneStep:
    """One step of a lane (a decode loop on the workers whose rows change as it runs): its rows as
    the scheduler holds them now (``rows``: a row each, None where empty), in a loop of
    ``batch`` rows; ``joins``, the rows that took a session since the last step, and ``leaves``
    ((row, session)), those emptied. Where the lane's loop runs with ``batch`` rows, the
    executor sends the joins and leaves to it; else (none runs, it ended, it refused an edit,
    or the batch grew) it starts one anew from ``rows``."""

    lane: int
    batch: int
    rows: tuple[LaneRow | None, ...]
    joins: tuple[int, ...] = ()
    leaves: tuple[tuple[int, int], ...] = ()

    @property
    def sessions(self) -> tuple[int, ...]:
        return tuple(r.chunk.session for r in self.rows if r is not None)

    def __str__(self) -> str:
        rows = " ".join(str(r) if r is not None else "-" for r in self.rows)
        edits = "".join([f", join rows {list(self.joins)}" if self.joins else "",
                         f", leave {' '.join(f'{i}:s{s}' for i, s in self.leaves)}" if self.leaves else ""])
        return f"lane {self.lane} of {self.batch} rows: {rows}{edits}"


@dataclass(frozen=True)
class SchedulerOutput:
    """One step of generation as decided: the calls that end before it, then the calls admitted
    (their prompts prefilled ``together`` at once) or the groups that decode."""

    step: int
    ended: tuple[int, ...] = ()
    admitted: tuple[Admission, ...] = ()
    together: int = 1
    decodes: tuple[DecodeGroup, ...] = ()
    prefill_groups: tuple[PrefillGroup, ...] = ()     # admitted prompts prefilled together, side by side
    lanes: tuple[LaneStep, ...] = ()                   # lanes that step (their rows decode on the workers)

    def __str__(self) -> str:
        head = [f"step {self.step}:"]
        if self.ended:
            head.append(f"end calls {', '.join(map(str, self.ended))};")
        if self.admitted:
            head.append(f"admit {len(self.admitted)} call(s), {self.together} prompt(s) at once")
        if self.decodes:
            head.append(f"decode {sum(len(g.rows) for g in self.decodes)} row(s) in {len(self.decodes)} "
                        "group(s)")
        if self.lanes:
            head.append(f"step {sum(len(ls.sessions) for ls in self.lanes)} row(s) in {len(self.lanes)} "
                        "lane(s)")
        if len(head) == 1:
            head.append("nothing")
        return "\n  ".join([" ".join(head), *map(str, self.admitted), *map(str, self.prefill_groups),
                             *map(str, self.decodes), *map(str, self.lanes)])
