"""The generation scheduler's decisions, with no cluster and no model: each step's record says
which calls are admitted and how their prompts are cut (chunks and cache ranges), which rows
decode in which group, and which calls end; the engine carries out exactly what it says."""

from __future__ import annotations

import dataclasses
from typing import Any

import dask.config
import pytest
import torch

from seabiscuit_dask.errors import BadInput, Busy
from seabiscuit_dask.runtime.generation import (
    Call,
    Chunk,
    DecodeGroup,
    Engine,
    GenerateArgs,
    LocalRunner,
    Sampling,
    Scheduler,
    SchedulerOutput,
    SchedulerSpec,
    SessionTable,
    generate_tokens,
)
from seabiscuit_dask.runtime.generation.scheduler import twins_of

from .test_generate import decoder, hf_greedy, padded_batch

SPEC = SchedulerSpec(prefill_sizes=(16, 32, 64), batch_sizes=(1, 2, 4, 8), pipeline=2, loop_steps=32,
                     lookahead=True)


def call(table: SessionTable, *prompts: list[int], max_new: int = 8, sample: bool = False) -> Call:
    table.reserve(len(prompts))
    return table.call(prompts, max_new, Sampling(do_sample=sample), eos=[], pad=0)


def answered(scheduler: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does once a step ran: its sessions cached what it wrote, each live row
    took its next token."""
    for a in out.admitted:
        for s, p in zip(scheduler.call(a.call).sessions, a.prefills):
            s.cached = p.chunks[-1].stop
    for g in out.decodes:
        for r in g.rows:
            next(s for c in scheduler.running for s in c.sessions if s.sid == r.session).cached = r.stop
    for c in scheduler.running:
        for s in c.live:
            s.tokens.append(token)
        c.produced += 1


def test_admission_takes_every_waiting_call_up_to_the_session_limit() -> None:
    table, scheduler = SessionTable(3, "m"), Scheduler(SPEC)
    a, b = call(table, [1] * 5, [2] * 20), call(table, [3] * 40)
    with pytest.raises(Busy, match="3 session\\(s\\) open and this call asks for 1 more; the limit is 3"):
        call(table, [4])
    with pytest.raises(BadInput,
                       match="asks for 4 sessions \\(rows\\) at once and the deployment serves at most 3"):
        table.check_rows(4)
    gone = call(SessionTable(1, "m"), [5] * 3)
    gone.cancelled = True                     # its caller stopped reading before it was admitted
    for c in (a, b, gone):
        scheduler.add(c)
    out = scheduler.schedule()
    assert out.ended == (gone.cid,) and [x.call for x in out.admitted] == [a.cid, b.cid]
    assert out.together == 2 and not out.decodes and scheduler.running == [a, b] and not scheduler.waiting
    # each session's uncached tokens, cut into bucketed chunks with the cache slots they fill
    first, second = (p.chunks for p in out.admitted[0].prefills)
    assert first == (Chunk(a.sessions[0].sid, 0, (1,) * 5, 16),)
    assert [(c.start, c.stop, c.length) for c in second] == [(0, 20, 32)]
    assert [(c.start, c.stop, c.length) for c in out.admitted[1].prefills[0].chunks] == [(0, 40, 64)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.together = 1          # type: ignore[misc]
    assert str(out).splitlines() == [
        f"step 0: end calls {gone.cid}; admit 2 call(s), 2 prompt(s) at once",
        f"  call {a.cid}: s{a.sessions[0].sid}[0:5)/16; s{a.sessions[1].sid}[0:20)/32",
        f"  call {b.cid}: s{b.sessions[0].sid}[0:40)/64"]


def test_a_step_after_an_admission_decodes_the_running_rows_before_admitting_more() -> None:
    table, scheduler = SessionTable(8, "m"), Scheduler(SPEC)
    first = call(table, [1] * 6)
    scheduler.add(first)
    answered(scheduler, scheduler.schedule())
    later = call(table, [2] * 3)
    scheduler.add(later)              # arrives while the first call's prompt was prefilled
    out = scheduler.schedule()
    assert not out.admitted and [g.key for g in out.decodes] == [(first.sessions[0].sid,)]
    answered(scheduler, out)
    out = scheduler.schedule()        # then the call that waited
    assert [a.call for a in out.admitted] == [later.cid] and out.together == 1
    answered(scheduler, out)
    out = scheduler.schedule()        # and both decode together, one a group (the pipeline's two stages)
    assert [g.key for g in out.decodes] == [(first.sessions[0].sid,), (later.sessions[0].sid,)]


def test_running_rows_decode_in_pipeline_groups_none_over_the_largest_batch() -> None:
    table, scheduler = SessionTable(32, "m"), Scheduler(SPEC)
    calls = [call(table, *[[i + 1] * 4] * n, max_new=5) for i, n in enumerate((2, 1, 17))]
    for c in calls:
        scheduler.add(c)
    answered(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    assert [len(g.rows) for g in out.decodes] == [7, 7, 6] and [g.batch for g in out.decodes] == [8, 8, 8]
    rows = [r for g in out.decodes for r in g.rows]
    assert [r.session for r in rows] == [s.sid for c in calls for s in c.sessions]      # in arrival order
    # each row writes its last token at the slot after its cached ones: one token, one slot
    assert {(r.start, r.stop, r.tokens, r.length) for r in rows} == {(4, 5, (7,), 1)}
    # greedy groups are queued: the next step behind this one, a decode loop of the tokens left
    assert all(g.queued and g.more and g.steps == 4 for g in out.decodes)
    assert str(out.decodes[2]).endswith("in 8 rows, queued, next queued, loop 4")
    few = Scheduler(SPEC)
    sampled = call(table, [1] * 4, [2] * 4, [3] * 4, sample=True)
    few.add(sampled)
    answered(few, few.schedule())
    out = few.schedule()
    assert [(len(g.rows), g.batch) for g in out.decodes] == [(2, 2), (1, 1)]
    assert out.decodes[1] == DecodeGroup((Chunk(sampled.sessions[2].sid, 4, (7,), 1),), 1)   # not queued


def test_a_groups_last_step_queues_none_behind_it_and_loops_no_further_than_its_tokens() -> None:
    table, scheduler = SessionTable(8, "m"), Scheduler(dataclasses.replace(SPEC, loop_steps=3))
    long, short = call(table, [1] * 4, max_new=20), call(table, [2] * 4, max_new=2)
    scheduler.add(long)
    scheduler.add(short)
    answered(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    assert [(g.more, g.steps) for g in out.decodes] == [(True, 3), (False, 1)]
    unchained = Scheduler(dataclasses.replace(SPEC, lookahead=False))
    c = call(table, [3] * 4)
    unchained.add(c)
    answered(unchained, unchained.schedule())
    assert unchained.schedule().decodes == (DecodeGroup((Chunk(c.sessions[0].sid, 4, (7,), 1),), 1),)


def test_a_call_that_ends_leaves_its_group_and_is_ended_before_the_step() -> None:
    table, scheduler = SessionTable(8, "m"), Scheduler(SPEC)
    calls = [call(table, [i + 1] * 4) for i in range(4)]
    for c in calls:
        scheduler.add(c)
    answered(scheduler, scheduler.schedule())
    before = scheduler.schedule()
    assert [g.key for g in before.decodes] == [(0, 1), (2, 3)]
    answered(scheduler, before)
    calls[1].cancelled = True                   # its caller stopped reading
    calls[3].closing = BadInput("closed")       # the deployment closes it
    out = scheduler.schedule()
    assert out.ended == (calls[1].cid, calls[3].cid) and scheduler.running == [calls[0], calls[2]]
    # the groups changed: each a session alone (a step queued for the old ones is let go)
    assert [g.key for g in out.decodes] == [(0,), (2,)]
    assert [g.starts for g in out.decodes] == [(5,), (5,)]


def test_a_long_prompt_is_cut_for_the_stages_its_chunks_flow_through_and_sent_smallest_first() -> None:
    flow = [(False, 1)]
    scheduler = Scheduler(dataclasses.replace(SPEC, prefill_sizes=(16, 24, 32, 40, 48, 56, 64)),
                          lambda: flow[0])
    prompt = list(range(3, 78))                 # 75 tokens
    one = scheduler.prefill(5, 0, prompt)
    assert [str(c) for c in one.chunks] == ["s5[0:64)/64", "s5[64:75)/16"] and not one.ahead
    assert sum((c.tokens for c in one.chunks), ()) == tuple(prompt)
    flow[0] = (True, 2)          # the runner sends a prompt's chunks at once, through two stages
    alone = scheduler.prefill(5, 10, prompt)
    assert [str(c) for c in alone.chunks] == ["s5[10:50)/40", "s5[50:85)/40"]
    assert [str(c) for c in alone.ahead] == ["s5[10:45)/40", "s5[45:85)/40"]      # the smallest first
    together = scheduler.prefill(5, 10, prompt, together=2)      # two prompts fill the stages already
    assert [str(c) for c in together.chunks] == ["s5[10:74)/64", "s5[74:85)/16"]
    assert [str(c) for c in together.ahead] == ["s5[10:21)/16", "s5[21:85)/64"]
    assert scheduler.prefill(5, 0, []) == type(one)(5, ())       # nothing to prefill: the step refuses it


def test_a_replay_rebuilds_a_running_sessions_cache_from_its_first_token() -> None:
    table, scheduler = SessionTable(8, "m"), Scheduler(SPEC)
    c = call(table, list(range(3, 43)))
    scheduler.add(c)
    answered(scheduler, scheduler.schedule())
    for _ in range(3):
        answered(scheduler, scheduler.schedule())
    s = c.sessions[0]
    replay = scheduler.replay(s.sid, upto=42)        # its worker was lost when the cache held 42 slots
    assert [str(x) for x in replay.chunks] == [f"s{s.sid}[0:42)/64"]
    assert replay.chunks[0].tokens == tuple(s.tokens[:42])
    chunked = Scheduler(dataclasses.replace(SPEC, prefill_sizes=(16,)), lambda: (True, 1))
    chunked.running = [c]
    replay = chunked.replay(s.sid, upto=42)
    assert [(x.start, x.stop) for x in replay.chunks] == [(0, 16), (16, 32), (32, 42)]
    assert [(x.start, x.stop) for x in replay.ahead] == [(0, 10), (10, 26), (26, 42)]


def test_the_spec_comes_from_the_configuration() -> None:
    spec = SchedulerSpec.from_config(max_chunk=64, chains_steps=True)
    assert spec.prefill_sizes == tuple(b for b in dask.config.get("seabiscuit.generate.prefill-buckets")
                                       if b <= 64)
    assert spec.batch_sizes == tuple(dask.config.get("seabiscuit.generate.batch-buckets"))
    assert spec.loop_steps == dask.config.get("seabiscuit.generate.loop-steps") > 1
    assert spec.lookahead and not SchedulerSpec.from_config().lookahead    # a runner that chains no step
    with dask.config.set({"seabiscuit.generate.batch-buckets": [4, 1], "seabiscuit.generate.loop-steps": 1}):
        spec = SchedulerSpec.from_config(max_chunk=10)
        assert spec.batch_sizes == (1, 4) and spec.loop_steps == 1 and spec.prefill_sizes == (10,)
    with dask.config.set({"seabiscuit.generate.prefill-buckets": []}), \
            pytest.raises(BadInput, match="prefill-buckets must list positive sizes"):
        SchedulerSpec.from_config()


class RecordingRunner(LocalRunner):
    """Logs each step it runs: (rows, tokens, sessions, first slots, real tokens per row)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, "64KiB")
        self.ran: list[tuple[int, int, list[int], list[int], list[int]]] = []

    def run_step(self, batch: int, length: int, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        self.ran.append((batch, length, feed["sb_sessions"].tolist(), feed["sb_start"].tolist(),
                         feed["sb_valid"].sum(dim=1).tolist()))
        return super().run_step(batch, length, feed)


def test_the_engine_runs_the_steps_its_records_say_and_no_other() -> None:
    model = decoder("llama")
    runner = RecordingRunner(model)
    engine = Engine(runner, max_chunk=16)
    records: list[SchedulerOutput] = []
    decide = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: records.append(decide()) or records[-1]     # type: ignore[method-assign]
    ids, mask = padded_batch((20, 5), seed=3)
    args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=4, pad_token_id=0,
                             eos_token_id=[])
    assert torch.equal(generate_tokens(engine, ids, args, mask), hf_greedy(model, ids, mask, 4))
    ran = iter(runner.ran)
    for out in records:
        said = [(1, c.length, [c.session], [c.start], [len(c.tokens)])
                for a in out.admitted for p in a.prefills for c in p.chunks]
        for g in out.decodes:
            pad = g.batch - len(g.rows)
            said.append((g.batch, 1, [*g.key, *[-1] * pad], [*g.starts, *[0] * pad],
                         [1] * len(g.rows) + [0] * pad))
        got = [next(ran) for _ in said]
        # NOTE: a step's groups run side by side, in any order; a prompt's chunks in order
        if out.decodes:
            got, said = sorted(got), sorted(said)
        assert got == said, out
    assert next(ran, None) is None
    assert [len(out.decodes) for out in records if out.decodes] == [2, 2, 2]     # a row a group, 3 steps


def test_prompts_that_fit_a_chunk_are_prefilled_together_within_the_step_tokens() -> None:
    """With a prefill program of any rows (``grouping``: 128 tokens a step), 6 prompts admitted
    at once go in 2 groups side by side (the pipeline), longest first, each padded to the bucket
    of its longest and within the step's tokens; a prompt longer than a chunk goes alone."""
    table = SessionTable(8, "m")
    scheduler = Scheduler(SPEC, grouping=lambda: (128, 8))
    lengths = [5, 30, 12, 20, 9, 3]
    calls = [call(table, [i + 1] * n) for i, n in enumerate(lengths)] + [call(table, [9] * 100)]
    for c in calls:
        scheduler.add(c)
    out = scheduler.schedule()
    assert [str(g) for g in out.prefill_groups] == [
        "prefill s1[0:30) s3[0:20) s2[0:12) in 3x32", "prefill s4[0:9) s0[0:5) s5[0:3) in 3x16"]
    assert all(g.tokens <= 128 for g in out.prefill_groups)
    by_session = {p.session: p for a in out.admitted for p in a.prefills}
    assert all(by_session[s].grouped for s in range(6)) and not by_session[6].grouped
    assert [c.length for c in by_session[6].chunks] == [64, 64]      # NOTE: 100 tokens alone, as before
    answered(scheduler, out)
    assert all(s.cached == len(s.tokens) - 1 for c in calls for s in c.sessions)


def test_more_prompts_than_a_step_holds_make_more_groups_and_one_alone_is_not_grouped() -> None:
    table = SessionTable(16, "m")
    scheduler = Scheduler(SPEC, grouping=lambda: (64, 8))
    for n in [16] * 10:
        scheduler.add(call(table, [1] * n))
    groups = scheduler.schedule().prefill_groups
    assert [len(g.rows) for g in groups] == [4, 4, 2] and all(g.tokens <= 64 for g in groups)
    alone = Scheduler(SPEC, grouping=lambda: (64, 8))
    alone.add(call(table, [1] * 10))
    assert alone.schedule().prefill_groups == ()
    none = Scheduler(SPEC)          # NOTE: a runner whose prefill programs are built per shape
    none.add(call(table, [1] * 10))
    none.add(call(table, [2] * 10))
    assert none.schedule().prefill_groups == ()


def test_an_admission_prefills_while_the_running_rows_decode_and_its_calls_join_once_out() -> None:
    """With ``overlap`` (a runner that chains steps): a step both admits the calls waiting and
    decodes the running rows; no second admission starts while one prefills, and its calls decode
    only once joined (their first tokens out)."""
    table, scheduler = SessionTable(8, "m"), Scheduler(dataclasses.replace(SPEC, overlap=True))
    first = call(table, [1] * 6)
    scheduler.add(first)
    out = scheduler.schedule()
    assert [a.call for a in out.admitted] == [first.cid] and not out.decodes
    assert not scheduler.schedule().admitted and scheduler.prefilling == [first]   # nothing to do meanwhile
    answered(scheduler, out)
    scheduler.joined(first)
    later, third = call(table, [2] * 3), call(table, [3] * 5)
    scheduler.add(later)
    out = scheduler.schedule()          # NOTE: the later call prefills as the first decodes
    assert [a.call for a in out.admitted] == [later.cid]
    assert [g.key for g in out.decodes] == [(first.sessions[0].sid,)]
    scheduler.add(third)
    out2 = scheduler.schedule()         # NOTE: one admission at a time: the third waits, the first decodes
    assert not out2.admitted and [g.key for g in out2.decodes] == [(first.sessions[0].sid,)]
    scheduler.joined(later)
    out3 = scheduler.schedule()
    assert [a.call for a in out3.admitted] == [third.cid]
    assert sorted(g.key for g in out3.decodes) == [(first.sessions[0].sid,), (later.sessions[0].sid,)]
    scheduler.finish(third)
    assert third not in scheduler.prefilling and not scheduler.waiting


def test_kv_room_is_counted_in_blocks_so_8_sessions_of_1024_hold_32_chats_of_200() -> None:
    """A deployment that kept room for 8 sessions of 1024 tokens counts that room in tokens: 32
    chats of 200 tokens (prompt and answer) are open at once, a 33rd waits, a kept session counts
    its whole context, and a call past the room or the rows is refused naming both."""
    table = SessionTable(8, "m", context=1024, max_rows=64)
    room = table.room([200])
    assert room == 224                                  # 7 blocks of 32
    for _ in range(32):
        table.reserve(1, room)
    assert table.open == 32 and table.tokens == 7168 and not table.fits(1, 1024 + 32)
    with pytest.raises(Busy, match="8192 KV tokens, 7168 counted"):
        table.reserve(5, table.room([200] * 5))
    table.keep()                                        # NOTE: 1024 more: the room is full
    assert table.tokens == 8192 and not table.fits(1, 32)
    table.release(1, table.kept_room)
    with pytest.raises(BadInput, match="fill 9216 KV tokens.*room for 8192"):
        table.check_rows(9, table.room([1024] * 9))
    with pytest.raises(BadInput, match="at most 64"):
        table.check_rows(65)
    odd = SessionTable(8, "m", context=92)              # NOTE: a block past the context counts the context
    assert odd.room([69, 92]) == 92 + 92 and all(odd.fits(1, odd.room([69])) for _ in range(8))
    plain = SessionTable(8, "m")                        # NOTE: no room kept: sessions are counted
    assert plain.room([200]) == 0 and plain.max_rows == 8


def test_calls_past_the_sessions_run_at_once_where_the_kv_room_holds_them() -> None:
    """An engine of 2 sessions of 64 tokens: 4 calls of at most 22 tokens each (prompt and answer,
    a block of 32) never wait for room, each answer Hugging Face's greedy one."""
    import threading

    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=2, context=64, max_chunk=16)
    had_room: list[bool] = []
    wait = engine.sessions.wait

    def seen(rows: int, *args: Any, **kwargs: Any) -> None:
        had_room.append(engine.sessions.fits(rows, args[3] if len(args) > 3 else kwargs.get("tokens", 0)))
        wait(rows, *args, **kwargs)

    engine.sessions.wait = seen     # type: ignore[method-assign]
    prompts = [padded_batch((k,), seed=k) for k in (8, 12, 16, 10)]
    got: dict[int, torch.Tensor] = {}
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        ids, mask = prompts[i]
        args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=6, pad_token_id=0)
        start.wait()
        got[i] = generate_tokens(engine, ids, args, mask)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (ids, mask) in enumerate(prompts):
        assert torch.equal(got[i], hf_greedy(model, ids, mask, 6))
    assert had_room == [True] * 4
    assert engine.max_sessions == 64 and engine.sessions.open == 0 and engine.sessions.tokens == 0
    engine.close()


def test_prompts_admitted_while_rows_decode_go_in_steps_of_the_bound_one_by_one() -> None:
    """``overlap_tokens`` 32: a prompt admitted while a row decodes is cut into chunks of 32 tokens
    at most, none sent ahead, and no group passes 32 tokens; with no row decoding, as before."""
    spec = dataclasses.replace(SPEC, overlap=True, overlap_tokens=32)
    table, scheduler = SessionTable(8, "m"), Scheduler(spec, grouping=lambda: (128, 8))
    first = call(table, [1] * 6)
    scheduler.add(first)
    out = scheduler.schedule()
    answered(scheduler, out)
    scheduler.joined(first)
    long, short = call(table, [2] * 70), call(table, [3] * 20)
    scheduler.add(long)
    scheduler.add(short)
    out = scheduler.schedule()
    prefills = {p.session: p for a in out.admitted for p in a.prefills}
    assert [c.length for c in prefills[long.sessions[0].sid].chunks] == [32, 32, 16]
    assert not prefills[long.sessions[0].sid].ahead and out.decodes
    assert all(g.tokens <= 32 for g in out.prefill_groups)
    unbounded = Scheduler(dataclasses.replace(SPEC, overlap=True, overlap_tokens=32),
                          grouping=lambda: (128, 8))
    unbounded.add(call(table, [4] * 70))
    assert [c.length for c in unbounded.schedule().admitted[0].prefills[0].chunks] == [64, 16]


def test_rows_of_one_call_with_the_same_prompt_are_prefilled_once() -> None:
    """``n`` answers to one prompt: of a call's rows with the same tokens to prefill (16 at least),
    the first is prefilled (grouped with the others' prompts) and the rest are its twins: nothing
    to prefill, a copy of its cache; a shorter shared prompt, or one row of another call, is
    prefilled as before."""
    table = SessionTable(16, "m")
    scheduler = Scheduler(SPEC, grouping=lambda: (128, 8))
    same = call(table, [5] * 20, [5] * 20, [6] * 20, [5] * 20)
    short = call(table, [7] * 10, [7] * 10)
    other = call(table, [5] * 20)
    for c in (same, short, other):
        scheduler.add(c)
    out = scheduler.schedule()
    prefills = {p.session: p for a in out.admitted for p in a.prefills}
    s = [x.sid for x in same.sessions]
    assert [prefills[x].twin for x in s] == [-1, s[0], -1, s[0]]
    assert str(prefills[s[1]]) == f"s{s[1]} as s{s[0]} (a copy of its cache)" and not prefills[s[1]].chunks
    grouped = {r.session for g in out.prefill_groups for r in g.rows}
    assert grouped == {s[0], s[2], *(x.sid for x in short.sessions), other.sessions[0].sid}
    assert all(prefills[x.sid].twin == -1 for x in (*short.sessions, *other.sessions))
    # NOTE: two prompts that started from different kept caches of one length share only their tails
    a, b = call(table, [1] * 20 + [8] * 20, [2] * 20 + [8] * 20).sessions
    a.cached = b.cached = 20
    assert twins_of([a, b]) == {}
    b.tokens[:20] = a.tokens[:20]
    assert twins_of([a, b]) == {b.sid: a.sid}


def test_twins_that_started_from_a_kept_cache_count_one_hit_each() -> None:
    """With prefix caching: a prompt answered, then 3 rows of it and a new turn: each row starts
    from the kept cache (a hit each), the 2 twins from the first row's cache after it prefilled
    the rest (no second hit, only the tokens past the kept ones counted); answers as HF's."""
    model = decoder("llama")
    with dask.config.set({"seabiscuit.generate.prefix-caching": True}):
        engine = Engine(LocalRunner(model, "64KiB"), max_sessions=4, context=96, max_chunk=32)
    first, _ = padded_batch((24,), seed=5)
    args = GenerateArgs.make(model.generation_config, first.shape[1], max_new_tokens=4, pad_token_id=0)
    answer = generate_tokens(engine, first, args, torch.ones_like(first))
    assert engine.load()["prefix_kept"] == 1
    turn = torch.cat([answer, torch.arange(100, 120).reshape(1, -1)], dim=1).repeat(3, 1)
    args = GenerateArgs.make(model.generation_config, turn.shape[1], max_new_tokens=4, pad_token_id=0)
    got = generate_tokens(engine, turn, args, torch.ones_like(turn))
    assert torch.equal(got, hf_greedy(model, turn, torch.ones_like(turn), 4))
    kept = answer.shape[1] - 1            # NOTE: the kept cache holds the answer but its last token
    assert engine.stats.prefix_hits == 3 and engine.stats.new_sessions == 4
    assert engine.stats.prefix_tokens == 3 * kept + 2 * (turn.shape[1] - kept)
    assert engine.load()["prefix_hit_rate"] == 0.75
    engine.close()


def test_n_answers_to_one_prompt_prefill_it_once_and_answer_as_hugging_face() -> None:
    """An engine in this process: 3 rows of one 20-token prompt and one of another prefill 2 rows;
    the twins start from a copy of the first row's cache, and every row's answer is Hugging Face's
    greedy one (the twins' steps read the copied slots)."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB"), max_sessions=4, context=64, max_chunk=32)
    ids, mask = padded_batch((20, 20), seed=3)
    ids = torch.cat([ids[:1], ids[:1], ids[1:], ids[:1]])
    mask = torch.ones_like(ids)
    args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=6, pad_token_id=0)
    got = generate_tokens(engine, ids, args, mask)
    assert torch.equal(got, hf_greedy(model, ids, mask, 6))
    stats = engine.stats
    assert (stats.prefix_hits, stats.prefix_tokens, stats.new_sessions) == (2, 40, 4)
    assert engine.load()["prefix_hit_rate"] == 0.5
    engine.close()
