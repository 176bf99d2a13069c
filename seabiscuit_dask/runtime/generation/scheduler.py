"""The scheduler: decides each step of generation and returns it as a plain record.

``Scheduler.schedule()`` looks at the calls waiting and running and returns a
``SchedulerOutput`` (``output.py``) that the executor carries out; it runs no step and
holds no runner, so its decisions are tested with no cluster and can change without
touching execution. The policy:

- a step admits every call waiting (their prompts prefilled ``pipeline`` at a time:
  sessions share no cache, so one prompt runs on a stage while another runs on the
  next), unless the step before admitted calls that run now: then every running row
  decodes once first, so no running call waits more than one admission;
- where the runner's prefill program takes any number of rows (``lower.dims``), the prompts
  admitted that fit one chunk are prefilled together in groups (``prefill_groups``): as many
  rows a step as ``seabiscuit.generate.step-tokens`` holds, ``pipeline`` groups side by side;
- a prompt is cut into chunks of the bucketed lengths of ``seabiscuit.generate.prefill-buckets``
  (``chunking``: the fewest tokens computed, a step's fixed cost counted), so any prompt length
  reuses a handful of programs; where the runner pipelines a prompt's chunks, a prompt prefilled
  alone is cut for the stages its chunks flow through, and they are sent smallest first;
- the running rows decode in ``seabiscuit.generate.pipeline`` groups at least, none over the
  largest of ``seabiscuit.generate.batch-buckets``, each padded to a bucket; a greedy group on a
  runner that chains steps is ``queued``: its tokens are picked on the workers, and its next
  step is queued behind this one (a decode loop of ``seabiscuit.generate.loop-steps`` at most);
- where the runner chains steps (``seabiscuit.generate.overlap-prefill``), an admission does not
  stop the decoding: its prompts prefill while the running rows decode (one admission in flight
  at a time), and its calls join the decode groups once their first tokens are out (``joined``);
  its steps then hold ``seabiscuit.generate.prefill-while-decoding`` tokens at most where that
  is set, so a decode step never waits long behind one (chunked prefill);
- where the runner's decode loops take edits (``Runner.edits_loops``, ``seabiscuit.generate.lanes``),
  calls decode in ``pipeline`` lanes instead (a row that samples, shapes its logits, asks for
  log-probabilities or follows a grammar is picked where its logits are made, ``RowPick``):
  a call takes empty rows of the lane with the fewest, and leaves them when it ends; a lane's
  rows are its loop's, which changes between steps without a restart (``LaneStep``); a lane
  with no empty row for a call grows (its loop starts anew with more rows), an empty one
  shrinks to nothing;
- rows of one call with the same prompt (``n`` answers to it) are prefilled once: the others
  start from a copy of that cache and pick their first tokens from its logits (``twins_of``);
- a call its caller stopped reading, or that the deployment's close ends, ends before the step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ... import config
from ...errors import BadInput
from ...lower.dims import Dims
from .output import Admission, Chunk, DecodeGroup, LaneRow, LaneStep, Prefill, PrefillGroup, SchedulerOutput
from .sessions import Call, Session

# NOTE: a step's fixed cost (every weight read once) in tokens' worth of compute
STEP_TOKENS = 48
# NOTE: rows of one call with the same prompt are prefilled once from this many tokens on (fewer: a copy
# of the cache on every worker costs more than their rows in the prefill)
TWIN_TOKENS = 16

# NOTE: the prefill buckets: each length at most 1.25x the one before from 32 on (a prompt up to 256
# tokens computes 6.5% more than its own length on average, step cost included, 7.1% without 40 and
# 56, 10% with 96, 160 and 192 after 64 as well; a SmolLM2 145-token prompt's first token came 3%
# sooner in 152 than in 160, a 37-token chat prompt's 10% sooner in 40 than in 48); each is one
# program to build

PrefillFlow = Callable[[], tuple[bool, int]]


def one_by_one() -> tuple[bool, int]:
    """A runner that runs a prompt's chunks one by one, on one stage."""
    return False, 1


def buckets(key: str) -> tuple[int, ...]:
    """The sizes of ``seabiscuit.generate.<key>``, sorted, each one step program."""
    value = config.get(f"generate.{key}")
    out = tuple(sorted({int(v) for v in value or ()}))
    if not out or out[0] < 1:
        raise BadInput(f"seabiscuit.generate.{key} must list positive sizes, got {value!r}")
    return out


def prefill_buckets() -> tuple[int, ...]:
    """The token lengths prompts are prefilled in (``seabiscuit.generate.prefill-buckets``)."""
    return buckets("prefill-buckets")


def batch_buckets() -> tuple[int, ...]:
    """The row counts sessions decode in (``seabiscuit.generate.batch-buckets``)."""
    return buckets("batch-buckets")


def pipeline_groups() -> int:
    """Decode groups (and prompts) in flight at once (``seabiscuit.generate.pipeline``)."""
    return max(1, int(config.get("generate.pipeline")))


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest size that holds ``n``, else the largest."""
    return next((s for s in sizes if s >= n), sizes[-1])


def group_size(sessions: int, top: int, pipeline: int) -> int:
    """Rows per group when ``sessions`` decode together: ``pipeline`` groups at least (when there
    are that many sessions), none over ``top`` rows."""
    n = max(-(-sessions // top), min(pipeline, sessions))
    return -(-sessions // max(1, n))


def decode_rows(sessions: int) -> int:
    """The rows a decode step multiplies when ``sessions`` decode together (a batch bucket)."""
    sizes = batch_buckets()
    return bucket(group_size(max(1, sessions), sizes[-1], pipeline_groups()), sizes)


@dataclass(frozen=True)
class SchedulerSpec:
    """What a scheduler decides within: the program sizes, the groups in flight, the decode loops."""

    prefill_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    pipeline: int = 1
    loop_steps: int = 1
    lookahead: bool = False      # greedy groups queue their next step (the runner chains steps)
    overlap: bool = False        # admissions prefill while the running rows decode (the runner chains steps)
    overlap_tokens: int = 0      # and then hold at most this many tokens a step (0: no bound)
    step_tokens: int = 256       # tokens one step computes at most (``generate.step-tokens``)
    lanes: int = 0               # calls decode in this many lanes (0: in groups)
    lane_steps: int = 256        # steps a lane's loop runs at most before it starts anew

    @classmethod
    def from_config(cls, *, max_chunk: int | None = None, chains_steps: bool = False,
                    edits_loops: bool = False) -> SchedulerSpec:
        """The spec the configuration gives, for a deployment whose own input is ``max_chunk``
        tokens long and whose runner chains steps or not."""
        # NOTE: chunks no longer than the deployment's own input: its weight tiles fit them too,
        # so every step program reads the tiles the workers already hold
        fit = tuple(b for b in prefill_buckets() if max_chunk is None or b <= max_chunk)
        return cls(fit or (max(1, int(max_chunk or 1)),), batch_buckets(), pipeline_groups(),
                   max(1, int(config.get("generate.loop-steps") or 1)),
                   bool(config.get("generate.lookahead")) and chains_steps,
                   bool(config.get("generate.overlap-prefill")) and chains_steps,
                   int(config.get("generate.prefill-while-decoding") or 0),
                   max(1, int(config.get("generate.step-tokens"))),
                   pipeline_groups() if edits_loops and config.get("generate.lanes") else 0,
                   max(2, int(config.get("generate.lane-steps") or 256)))

    def dims(self, sessions: int) -> tuple[Dims, Dims]:
        """The shapes the general decode and prefill programs serve for ``sessions`` at once: any
        rows up to the largest batch (no decode or prefill group has more) and the sessions, any
        chunk up to the largest prefill bucket, ``step_tokens`` in all (never under one chunk of
        the largest bucket)."""
        rows = min(self.batch_sizes[-1], max(1, int(sessions)))
        length = self.prefill_sizes[-1]
        tokens = max(self.step_tokens, length)
        return Dims(min(rows, tokens), 1, min(rows, tokens)), Dims(min(rows, tokens), length, tokens)


class Scheduler:
    """Decides each step of one deployment's generation (see module doc). Plain Python: the
    engine calls it under its lock; ``flow()`` says whether the runner sends a prompt's chunks
    at once, and through how many stages they flow (read each time: the plan may change)."""

    def __init__(self, spec: SchedulerSpec, flow: PrefillFlow = one_by_one,
                 grouping: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self.spec = spec
        self.flow = flow
        self.grouping = grouping
        self.waiting: list[Call] = []
        self.running: list[Call] = []
        self.prefilling: list[Call] = []      # admitted, their prompts prefilling (``spec.overlap``)
        self._calls: dict[int, Call] = {}
        self._steps = itertools.count()
        self._admitted_last = False
        # NOTE: the lanes: each row's (call, session) or None, the rows of each lane's loop (0: none
        # yet), the call in each, and the rows emptied since the lane's last step
        self._lanes: list[list[tuple[int, int] | None]] = [[] for _ in range(spec.lanes)]
        self._in_lane: dict[int, int] = {}
        self._leaves: list[list[tuple[int, int]]] = [[] for _ in range(spec.lanes)]

    # --- calls ----------------------------------------------------------------------------
    def add(self, call: Call, first: bool = False) -> None:
        """A call to admit at the next admission; ``first``: before those waiting (a preempted call)."""
        self._calls[call.cid] = call
        self.waiting.insert(0 if first else len(self.waiting), call)

    def call(self, cid: int) -> Call:
        """The call a record names."""
        return self._calls[cid]

    def finish(self, call: Call) -> int | None:
        """Forget a call the engine finished; the lane it decoded in (its rows emptied), if any."""
        for calls in (self.running, self.prefilling):
            if call in calls:
                calls.remove(call)
        self._calls.pop(call.cid, None)
        lane = self._in_lane.pop(call.cid, None)
        if lane is not None:
            rows = self._lanes[lane]
            for i, row in enumerate(rows):
                if row is not None and row[0] == call.cid:
                    rows[i] = None
                    self._leaves[lane].append((i, row[1]))
        return lane

    def in_lane(self, call: Call) -> int | None:
        """The lane ``call`` decodes in, if any."""
        return self._in_lane.get(call.cid)

    def joined(self, call: Call) -> None:
        """An admitted call's prompts are cached and its first tokens out: it decodes from the next step."""
        if call in self.prefilling:
            self.prefilling.remove(call)
            self.running.append(call)

    @property
    def has_calls(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.lanes_leaving)

    @property
    def lanes_leaving(self) -> bool:
        """Whether rows of a lane were emptied that its loop has not heard of yet."""
        return any(self._leaves)

    # --- steps ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step: an admission of the calls waiting, or a decode step of the running rows;
        with ``spec.overlap`` both at once (the admission prefills while the rows decode), one
        admission in flight at a time."""
        step = next(self._steps)
        if self.spec.overlap:
            out = self._decode(step) if self.running or self.lanes_leaving else SchedulerOutput(step)
            if self.waiting and not self.prefilling:
                new = self._admit(step)
                out = dataclasses.replace(new, ended=out.ended + new.ended, decodes=out.decodes,
                                          lanes=out.lanes)
            return out
        if self.waiting and not (self._admitted_last and self.running):
            self._admitted_last = True
            return self._admit(step)
        self._admitted_last = False
        return self._decode(step)

    def _admit(self, step: int) -> SchedulerOutput:
        new, self.waiting = self.waiting, []
        now = time.perf_counter()
        for c in new:
            c.admitted = now if c.admitted is None else c.admitted    # NOTE: a preempted call keeps its place
        ended = [c for c in new if c.stopping]
        todo = [c for c in new if c not in ended]
        together = max(1, min(self.spec.pipeline, len(todo)))
        # NOTE: prompts prefilled while rows decode go in small steps: a decode step waits behind one
        limit = self.spec.overlap_tokens if self.spec.overlap and self.running else 0
        (self.prefilling if self.spec.overlap else self.running).extend(todo)
        # NOTE: a preempted call's live rows only: the rows that ended before it was are not recomputed
        twins = {sid: twin for c in todo for sid, twin in twins_of(c.live).items()}
        groups = self.prefill_groups([(s.sid, s.cached, s.tokens[s.cached:])
                                      for c in todo for s in c.live if s.sid not in twins], limit)
        grouped = {r.session: Prefill(r.session, (r,), grouped=True) for g in groups for r in g.rows}
        grouped.update((sid, Prefill(sid, (), twin=twin)) for sid, twin in twins.items())
        admitted = tuple(Admission(c.cid, tuple(grouped.get(s.sid) or self.prefill(
            s.sid, s.cached, s.tokens[s.cached:], together, limit) for s in c.live)) for c in todo)
        return SchedulerOutput(step, tuple(c.cid for c in ended), admitted, together, prefill_groups=groups)

    def sizes(self, limit: int = 0) -> tuple[int, ...]:
        """The prefill lengths, none over ``limit`` tokens (0: all)."""
        sizes = self.spec.prefill_sizes
        return tuple(n for n in sizes if n <= limit) or sizes[:1] if limit else sizes

    def prefill_groups(self, rows: Sequence[tuple[int, int, Sequence[int]]],
                       limit: int = 0) -> tuple[PrefillGroup, ...]:
        """The prompts of ``rows`` ((session, first slot, tokens)) that fit one chunk, prefilled in
        groups instead of one by one, where the runner's prefill program takes any rows
        (``grouping()``: the tokens and rows one step holds; 0 tokens: none): longest first, in as
        few groups as the step's tokens allow and ``pipeline`` at least (one runs on a stage while
        another runs on the next), each padded to the bucket of its longest. Two prompts at least, else none.
        ``limit``: the tokens a step holds at most (prompts prefilled while rows decode)."""
        (budget, most), sizes = self.grouping(), self.sizes(limit)
        budget = min(budget, limit) if limit else budget
        fit = sorted((r for r in rows if 0 < len(r[2]) <= sizes[-1]), key=lambda r: -len(r[2]))
        if budget <= 0 or len(fit) < 2:
            return ()
        top = min(most, self.spec.batch_sizes[-1])
        n = min(self.spec.pipeline, len(fit))
        while True:
            size = -(-len(fit) // n)
            parts = [fit[i:i + size] for i in range(0, len(fit), size)]
            if all(len(p) <= top and len(p) * bucket(len(p[0][2]), sizes) <= budget for p in parts) \
                    or size == 1:
                break
            n += 1
        if size == 1:
            return ()       # NOTE: one prompt a step: each goes as a prompt alone goes (chunks pipelined)
        lengths = [bucket(len(p[0][2]), sizes) for p in parts]
        return tuple(PrefillGroup(tuple(Chunk(sid, start, tuple(toks), n) for sid, start, toks in p), n)
                     for p, n in zip(parts, lengths))

    def _decode(self, step: int) -> SchedulerOutput:
        ended = [c for c in self.running if c.stopping]
        self.running = [c for c in self.running if c not in ended]
        lanes = self._lane_steps([c for c in self.running if self._lane_fit(c)])
        rows = [(c, s) for c in self.running if c.cid not in self._in_lane for s in c.live]
        size = group_size(len(rows), self.spec.batch_sizes[-1], self.spec.pipeline) if rows else 1
        groups = tuple(self._group(rows[i:i + size]) for i in range(0, len(rows), size))
        return SchedulerOutput(step, tuple(c.cid for c in ended), decodes=groups, lanes=lanes)

    # --- lanes -------------------------------------------------------------------------------
    def _lane_fit(self, call: Call) -> bool:
        """Whether ``call`` decodes in a lane: lanes are on (its tokens are picked on the workers,
        ``Sampling.row_pick``), not a kept session's turn
        (whose next turn writes where a row still running would), and its rows fit one."""
        return bool(self.spec.lanes) and not call.keep \
            and not call.stopping and 0 < len(call.live) <= self.spec.batch_sizes[-1]

    def _lane_steps(self, calls: list[Call]) -> tuple[LaneStep, ...]:
        """Place the calls of ``calls`` in no lane yet (each in the lane with the fewest rows taken
        that has room for it, else growing that lane), then each lane's step: those with rows
        taken, or rows emptied since their last step (the loop of a lane left empty stops)."""
        if not self.spec.lanes:
            return ()
        sessions = {c.cid: {s.sid: s for s in c.sessions} for c in calls}
        calls_of = {c.cid: c for c in calls}
        joins: list[list[int]] = [[] for _ in self._lanes]
        waiting = sum(len(c.live) for c in calls)
        target = -(-waiting // self.spec.lanes)
        for c in calls:
            if c.cid in self._in_lane:
                continue
            lane = self._place(c, target)
            if lane is not None:
                self._in_lane[c.cid] = lane
                rows = self._lanes[lane]
                free = iter([i for i, r in enumerate(rows) if r is None])
                for s in c.live:
                    i = next(free)
                    rows[i] = (c.cid, s.sid)
                    joins[lane].append(i)
        out = []
        for lane, rows in enumerate(self._lanes):
            leaves, self._leaves[lane] = tuple(self._leaves[lane]), []
            taken = [r for r in rows if r is not None]
            if not taken and not leaves:
                continue
            made = tuple(None if r is None or r[0] not in calls_of else
                         _lane_row(calls_of[r[0]], sessions[r[0]][r[1]]) for r in rows)
            out.append(LaneStep(lane, len(rows), made, tuple(joins[lane]), leaves))
            if not taken:
                self._lanes[lane] = []        # NOTE: its loop stops; the next call sizes it anew
        return tuple(out)

    def _place(self, call: Call, target: int) -> int | None:
        """The lane ``call``'s live rows go in: of those with room, the one with the fewest rows
        taken; else that one grown to the next batch bucket that holds them (a lane with no
        rows yet takes the bucket of ``target``, its share of the rows decoding); None where
        none can hold them (it decodes in a group)."""
        need = len(call.live)
        taken = [sum(r is not None for r in rows) for rows in self._lanes]
        order = sorted(range(len(self._lanes)), key=lambda i: taken[i])
        for i in order:
            if len(self._lanes[i]) - taken[i] >= need:
                return i
        sizes = self.spec.batch_sizes
        for i in order:
            size = bucket(max(taken[i] + need, target if not taken[i] else 0), sizes)
            if size >= taken[i] + need:
                rows = self._lanes[i]
                if not taken[i]:
                    rows.clear()      # NOTE: an empty lane starts anew at its new size
                rows.extend([None] * (size - len(rows)))
                return i
        return None

    def _group(self, part: list[tuple[Call, Session]]) -> DecodeGroup:
        """One decode group: each session's uncached tokens (its last), a bucket of rows; queued
        when every call of it picks plain greedy tokens (``Sampling.plain``: the argmax a queued
        step reads on the workers), its next step too unless this is a call's last."""
        calls = [c for c, _ in part]
        queued = self.spec.lookahead and all(c.sampling.plain and not c.cancelled for c in calls)
        more = queued and all(c.produced + 1 < c.max_new for c in calls)
        steps = min(min(c.max_new - c.produced for c in calls), self.spec.loop_steps) if queued else 1
        rows = tuple(Chunk(s.sid, s.cached, tuple(s.tokens[s.cached:]), 1) for _, s in part)
        return DecodeGroup(rows, bucket(len(rows), self.spec.batch_sizes), queued, more, steps)

    # --- prompts ---------------------------------------------------------------------------
    def chunking(self, n: int, together: int = 1) -> list[tuple[int, int]]:
        """(tokens, program length) of the chunks ``n`` tokens are prefilled in when ``together``
        prompts are prefilled at once: a prompt alone on a runner that pipelines its chunks is cut
        for the stages they flow through; prompts prefilled together fill the stages already."""
        _, stages = self.flow()
        return chunking(n, self.spec.prefill_sizes, max(1, stages // max(1, together)))

    def prefill(self, sid: int, start: int, tokens: Sequence[int], together: int = 1,
                limit: int = 0) -> Prefill:
        """Session ``sid``'s ``tokens``, cached from slot ``start`` on, as prefill chunks; with a
        ``limit``, chunks of at most that many tokens, one by one (no chunks sent at once)."""
        if not tokens:
            return Prefill(sid, ())
        if limit:
            return Prefill(sid, _chunks(sid, start, tokens, chunking(len(tokens), self.sizes(limit))))
        pipelined, _ = self.flow()
        cut = self.chunking(len(tokens), together)
        ahead = _chunks(sid, start, tokens, sorted(cut)) if pipelined and len(cut) > 1 else ()
        return Prefill(sid, _chunks(sid, start, tokens, cut), ahead)

    def replay(self, sid: int, upto: int, together: int = 1) -> Prefill:
        """The chunks that rebuild running session ``sid``'s cache up to slot ``upto`` (its worker
        was lost): its tokens from the first, cut as a prompt is (slots still cached are read)."""
        s = next(s for c in [*self.running, *self.prefilling] for s in c.sessions if s.sid == sid)
        return self.prefill(sid, 0, s.tokens[:upto], together)

    def shapes(self, lengths: Sequence[int] | None = None, batches: Sequence[int] | None = None,
               max_sessions: int = 1) -> list[tuple[int, int]]:
        """(rows, tokens) of the step programs generation asks for: a prefill program per bucket
        length (only those prompts of ``lengths`` are cut in, alone or among others), then a
        decode program per batch size up to ``max_sessions`` (only ``batches``)."""
        sizes = self.spec.prefill_sizes if lengths is None else sorted(
            {size for n in lengths for together in (1, self.spec.pipeline)
             for _, size in self.chunking(int(n), together)})
        if batches is None:
            batches = [b for b in self.spec.batch_sizes if b <= max(1, max_sessions)]
        return [(1, n) for n in sizes] + [(int(b), 1) for b in batches]


def _lane_row(call: Call, s: Session) -> LaneRow | None:
    """A lane's row of session ``s`` of ``call``: its last token at its first uncached slot, and
    the steps left to its call (None for a row that ended: its loop empties it)."""
    if s.done or len(s.tokens) - s.cached != 1:
        return None
    i = call.sessions.index(s)
    pick = call.sampling.row_pick(i, s.tokens, call.base[i] if call.base else len(s.tokens), call.eos)
    return LaneRow(Chunk(s.sid, s.cached, (s.tokens[-1],), 1), call.max_new - call.produced, pick)


def twins_of(sessions: Sequence[Session]) -> dict[int, int]:
    """Sessions of one call with the same tokens as an earlier one of it, cached up to the same slot,
    with ``TWIN_TOKENS`` or more still to prefill (``n`` answers to one prompt), each -> that earlier
    session: they prefill nothing and start from a copy of its cache. NOTE: the whole prompt is
    compared, not only what is left to prefill: two prompts that started from different kept caches
    (``prefix``) may share their tails."""
    first: dict[tuple[int, tuple[int, ...]], int] = {}
    out = {}
    for s in sessions:
        key = (s.cached, tuple(s.tokens))
        if len(s.tokens) - s.cached < TWIN_TOKENS:
            continue
        if key in first:
            out[s.sid] = first[key]
        else:
            first[key] = s.sid
    return out


def _chunks(sid: int, start: int, tokens: Sequence[int], cut: Sequence[tuple[int, int]]) -> tuple[Chunk, ...]:
    """``tokens`` cached from slot ``start`` on, as chunks of ``cut`` ((tokens, length), in order)."""
    out, at = [], 0
    for n, length in cut:
        out.append(Chunk(sid, start + at, tuple(tokens[at:at + n]), length))
        at += n
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def chunking(n: int, sizes: tuple[int, ...], stages: int = 1) -> list[tuple[int, int]]:
    """(tokens, program length) of the chunks ``n`` tokens are prefilled in, programs of
    ``sizes`` tokens: the fewest tokens computed, padding included, plus ``STEP_TOKENS`` a
    chunk (so 145 tokens go in one chunk of 160, not in 128 and 17 padded to 32). Full chunks
    come first.

    ``stages``: the workers a prompt's chunks flow through at once (a pipelined prefill, each
    chunk following the one before): a chunk then runs on one stage while the one before runs
    on the next, and the prompt takes about ``work / stages + (stages - 1) / stages`` of its
    largest chunk's work, which this minimises over the largest chunk allowed (SmolLM2 on 2
    workers: 200 tokens as 112 + 88 first token 7% sooner than as one chunk, 250 as 128 + 122
    12%, 400 as 152 + 152 + 96 4% sooner than as 256 + 144; one stage is the sum alone)."""
    stages = max(1, int(stages))
    best: tuple[float, int, list[tuple[int, int]]] | None = None
    for top in sorted(sizes, reverse=True) if stages > 1 else [max(sizes)]:
        out = _fewest(n, tuple(s for s in sizes if s <= top))
        work = sum(STEP_TOKENS + size for _, size in out)
        largest = max(size for _, size in out)
        took = work / stages + (stages - 1) / stages * (STEP_TOKENS + largest)
        if best is None or (took, len(out)) < best[:2]:
            best = (took, len(out), out)
    assert best is not None
    return sorted(best[2], key=lambda c: -c[0])


def _fewest(n: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """The chunks of ``n`` tokens in programs of ``sizes`` that compute the fewest tokens, a step's
    fixed cost included: full chunks of the largest size, then the best cut of the last few."""
    top = max(sizes)
    full = max(0, (n - 2 * top) // top)        # NOTE: the largest chunk costs least a token
    rest = n - full * top
    cost = [(0, 0)] * (rest + 1)               # tokens left -> (cost, size of the next chunk)
    for left in range(1, rest + 1):
        cost[left] = min((STEP_TOKENS + s + cost[max(0, left - s)][0], -s) for s in sizes)
    out = [(top, top)] * full
    while rest > 0:
        size = -cost[rest][1]
        out.append((min(rest, size), size))
        rest -= size
    return out
