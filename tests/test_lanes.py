"""Lanes: decode loops on the workers whose rows change as they run.

A call joins an empty row of a running loop and leaves it between steps, with no
restart: the worker applies the caller's edits to the next step it builds
(``dataplane.Lane``), each row stops by itself after its call's last token, and each
step tells its caller the sessions it ran. The scheduler's placement is a plain record
(``LaneStep``); in this process (``LocalRunner(lanes=True)``) and on a cluster the
answers are Hugging Face's greedy ones for calls that join and leave at any time.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.errors import BadInput
from seabiscuit_dask.runtime.dataplane import Lane, Loop
from seabiscuit_dask.runtime.generation import (
    Engine,
    GenerateArgs,
    LocalRunner,
    Sampling,
    Scheduler,
    SchedulerSpec,
    SessionTable,
    generate_tokens,
    stream_tokens,
)
from seabiscuit_dask.runtime.generation.executor import EngineStats, Executor
from seabiscuit_dask.runtime.generation.inputs import lane_inputs, step_inputs
from seabiscuit_dask.runtime.generation.output import Chunk, LaneRow, LaneStep, SchedulerOutput

from .clusters import seabiscuit_cluster
from .test_generate import decoder, padded_batch
from .test_generation_scheduler import call

LANES = SchedulerSpec(prefill_sizes=(16, 32), batch_sizes=(1, 2, 4, 8), pipeline=2, loop_steps=32,
                      lookahead=True, lanes=2, lane_steps=64)


def answered(scheduler: Scheduler, out: Any, token: int = 7) -> None:
    """What the engine does once a step ran: each admitted call's prompts cached and its first
    token out; each lane's rows cached their token and took the next."""
    calls = {}
    for a in out.admitted:
        c = calls[a.call] = scheduler.call(a.call)
        for s, p in zip(c.sessions, a.prefills):
            s.cached = p.chunks[-1].stop
    for ls in out.lanes:
        for sid in ls.sessions:
            c = next(c for c in scheduler.running if sid in {s.sid for s in c.sessions})
            calls[c.cid] = c
            next(s for s in c.sessions if s.sid == sid).cached += 1
    for c in calls.values():
        for s in c.live:
            s.tokens.append(token)
        c.produced += 1


# --- the worker's side ------------------------------------------------------------------------
def logits_for(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    """(rows, 1, vocab) logits whose greedy tokens are ``tokens``."""
    out = torch.zeros((len(tokens), 1, vocab))
    for i, t in enumerate(tokens):
        out[i, 0, t] = 1.0
    return out


def test_a_lane_takes_joins_and_leaves_between_steps_and_stops_each_row_after_its_steps() -> None:
    feed = lane_inputs([(5, 3, (7,)), None], 2)
    # NOTE: row 0 takes 3 steps, the one fed from the caller first (as ``decode_loop`` reads them)
    loop = Loop([11, 12, 13, 14], [], "logits", feed, lane=Lane(1, [2, 0]))
    # step 11: row 0 goes on at slot 4 with its greedy token
    x, loop = loop.following(logits_for([2, 0]))
    assert x["sb_sessions"].tolist() == [5, -1] and x["position_ids"].flatten().tolist() == [4, 0]
    # step 12: the join takes row 1 at slot 4 for 2 steps
    assert loop.lane is not None and loop.lane.edit([(1, 9, 4, 8, 2)])
    x, loop = loop.following(logits_for([2, 0]))
    assert x["sb_sessions"].tolist() == [5, 9]
    assert x["position_ids"].flatten().tolist() == [5, 4] and x["sb_start"].tolist() == [5, 4]
    assert x["input_ids"].flatten().tolist() == [2, 8] and x["sb_valid"].flatten().tolist() == [True, True]
    # step 13: row 0 ran its 3 steps and empties itself; row 1 goes on, fed its greedy token
    x, loop = loop.following(logits_for([3, 6]))
    assert x["sb_sessions"].tolist() == [-1, 9] and x["input_ids"].flatten().tolist() == [0, 6]
    assert x["sb_valid"].flatten().tolist() == [False, True]
    assert x["position_ids"].flatten().tolist() == [0, 5]
    # a leave empties a row at once; built twice for one request, a step is the same
    assert loop.lane is not None and loop.lane.edit([(1, -1, 0, 0, 0)])
    same = loop.lane.apply(14, x)
    assert loop.lane.apply(14, x) is same and same["sb_sessions"].tolist() == [-1, -1]
    assert x["sb_sessions"].tolist() == [-1, 9]          # NOTE: the step before's inputs are never written
    # the lane's last step closes it: edits are refused from then on (the caller starts anew)
    _, last = loop.following(logits_for([3, 6]))
    assert not last.requests and loop.lane is not None and not loop.lane.open
    assert not loop.lane.edit([(0, 4, 0, 1, 1)])
    with pytest.raises(ValueError, match="row 2 of a lane of 2 rows"):
        Lane(2, [1, 1]).edit([(2, 4, 0, 1, 1)])


def test_a_stranger_cannot_edit_a_lane_with_bad_numbers() -> None:
    from seabiscuit_dask.plugins.worker import SeaBiscuitWorkerPlugin

    plugin = SeaBiscuitWorkerPlugin.__new__(SeaBiscuitWorkerPlugin)
    import asyncio

    for edits in ([("a", 1, 2, 3, 4)], [(0, 1, -2, 3, 4)], [(0, 1, 2)], "junk"):
        with pytest.raises(BadInput, match=r"\[row, session, slot, token, steps\]"):
            asyncio.run(plugin.seabiscuit_dp_lane(model="m", ticket="t", lane=1, edits=edits))


def test_a_row_picks_on_the_worker_exactly_as_the_caller_would() -> None:
    """A sampled row with logit rules and log-probabilities, carried to a lane as plain data and
    followed there step by step (``RowPicker``), picks the caller's tokens and log-probabilities
    (``Sampling.pick`` with the row's draws) at every step; greedy rows stay the argmax."""
    from seabiscuit_dask.runtime.dataplane.loops import logprob_of_row, pick_rows
    from seabiscuit_dask.runtime.generation import LogitRules
    from seabiscuit_dask.runtime.generation.sampling import History, RowPick, logprobs_of

    rules = LogitRules(min_new=3, bias=((4, 2.5),), repetition=1.3, frequency=0.4, presence=0.2)
    sampling = Sampling(True, 0.8, 12, 0.9, torch.Generator().manual_seed(3), rules, logprobs=3)
    eos = frozenset({5})
    prompts = [[1, 2, 3, 2], [7, 7], [9, 4, 1]]
    tokens = [[*p, 11] for p in prompts]        # NOTE: each row's first token, from its prompt's logits
    base = [len(p) for p in prompts]
    pickers = {i: RowPick.from_message(sampling.row_pick(i, tokens[i], base[i], eos).message()).picker()
               for i in (0, 2)}                       # row 1 is greedy in the lane: its argmax
    gen = torch.Generator().manual_seed(9)
    drew = set()
    for _ in range(8):
        logits = torch.randn((3, 1, 40), generator=gen) * 3
        want = sampling.pick(logits[[0, 2], 0], [History(tokens[i], base[i]) for i in (0, 2)], eos,
                             draws=[(i, len(tokens[i]) - base[i]) for i in (0, 2)]).tolist()
        want_lp = logprobs_of(logits[[0, 2], 0], want, 3)
        got, extra = pick_rows(logits, pickers)
        assert [int(got[0]), int(got[2])] == want and int(got[1]) == int(logits[1, 0].argmax())
        assert logprob_of_row(extra, 1) is None
        for row, w in zip((0, 2), want_lp):
            lp = logprob_of_row(extra, row)
            assert lp is not None and lp.logprob == pytest.approx(w.logprob) and len(lp.top) == 3
            assert [t for t, _ in lp.top] == [t for t, _ in w.top]
        for i, t in zip((0, 2), want):
            tokens[i].append(t)
            drew.add(t)
    assert len(drew) > 2                              # it samples: not one token over and over
    assert all(t != 5 for t in tokens[0][base[0]:base[0] + 3])     # no end before min_new tokens


def test_a_lane_refuses_a_malformed_pick() -> None:
    from seabiscuit_dask.errors import WorkerLost
    from seabiscuit_dask.runtime.dataplane import decode_loop

    lane = Lane(1, [2])
    for pick, match in (({"t": float("nan")}, "finite"), ({"zz": 1}, "unknown fields"),
                        ({"h": [1, 2], "at": 3}, "'at'"), ({"lp": 21}, "'lp'"), ("hot", "mapping"),
                        ({"bias": [[1, "x"]]}, "bias"), ({"bias": [[-1, 2.0]]}, "bias"),
                        ({"t": 1.0, "p": 0.0}, "top_p"), ({"t": 10 ** 400}, "out of range"),
                        ({"g": "start: x", "gk": "k" * 32, "gv": 10}, "not known in this process")):
        with pytest.raises(ValueError, match=match):
            lane.edit([(0, 3, 4, 5, 2, pick)])
    assert lane.taken == 0
    msg = {"requests": [2], "route": [], "logits": "l", "lane": 1, "left": [3], "picks": [{"t": -1.0}],
           "inputs": {k: v for k, v in lane_inputs([(0, 4, (5,))], 1).items()}}
    with pytest.raises(WorkerLost, match="temperature"):
        decode_loop(msg)


# --- the scheduler's records ------------------------------------------------------------------
def test_calls_take_empty_rows_of_the_lane_with_fewest_and_leave_them() -> None:
    table, scheduler = SessionTable(16, "m"), Scheduler(LANES)
    a = call(table, [1] * 5, max_new=4)
    scheduler.add(a)
    answered(scheduler, scheduler.schedule())              # admitted: its first token is out
    out = scheduler.schedule()
    assert [str(ls) for ls in out.lanes] == [f"lane 0 of 1 rows: s{a.sessions[0].sid}@5 x3, join rows [0]"]
    assert not out.decodes
    answered(scheduler, out)
    b, c = call(table, [2] * 3, [3] * 3, max_new=6), call(table, [4] * 9, max_new=2)
    scheduler.add(b)
    scheduler.add(c)
    answered(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    # b's two rows go to the empty lane 1 (sized for its share of the 4 rows decoding), c's grows lane 0
    lanes = {ls.lane: ls for ls in out.lanes}
    assert (lanes[0].batch, lanes[0].joins, lanes[1].batch, lanes[1].joins) == (2, (1,), 2, (0, 1))
    assert lanes[0].sessions == (a.sessions[0].sid, c.sessions[0].sid)
    answered(scheduler, out)
    # a ends: its row leaves lane 0; the next call of one row takes it without growing the lane
    scheduler.finish(a)
    d = call(table, [5] * 4, max_new=3)
    scheduler.add(d)
    answered(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    lanes = {ls.lane: ls for ls in out.lanes}
    assert lanes[0].leaves == ((0, a.sessions[0].sid),) and lanes[0].joins == (0,)
    assert lanes[0].batch == 2 and lanes[0].sessions == (d.sessions[0].sid, c.sessions[0].sid)
    assert lanes[1].joins == () and lanes[1].leaves == ()
    # a lane left empty steps once more with no rows (its loop stops), then not at all
    for x in (b, c, d):
        scheduler.finish(x)
    assert scheduler.has_calls and scheduler.lanes_leaving
    out = scheduler.schedule()
    assert all(ls.sessions == () for ls in out.lanes) and len(out.lanes) == 2
    assert not scheduler.has_calls and scheduler.schedule().lanes == ()


def test_sampled_calls_decode_in_lanes_and_kept_sessions_in_groups_beside_them() -> None:
    table, scheduler = SessionTable(16, "m"), Scheduler(LANES)
    greedy, sampled = call(table, [1] * 5), call(table, [2] * 5, sample=True)
    kept = call(table, [3] * 5)
    kept.keep = True
    for x in (greedy, sampled, kept):
        scheduler.add(x)
    answered(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    rows = {r.chunk.session: r for ls in out.lanes for r in ls.rows if r is not None}
    assert sorted(rows) == [greedy.sessions[0].sid, sampled.sessions[0].sid]
    # the greedy row needs nothing but its logits; the sampled one carries its pick, at its answer's
    # next token (its first was picked from its prompt's logits)
    assert rows[greedy.sessions[0].sid].pick is None
    pick = rows[sampled.sessions[0].sid].pick
    assert pick is not None and pick.temperature == 1.0 and pick.produced == 1
    assert pick.seed == sampled.sampling.seed
    assert [r.session for g in out.decodes for r in g.rows] == [kept.sessions[0].sid]


def test_a_lane_record_prints_its_rows() -> None:
    table, scheduler = SessionTable(16, "m"), Scheduler(LANES)
    a = call(table, [1] * 5, [2] * 7, max_new=3)
    scheduler.add(a)
    answered(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    s0, s1 = (s.sid for s in a.sessions)
    assert str(out).splitlines() == [f"step {out.step}: step 2 row(s) in 1 lane(s)",
                                     f"  lane 0 of 2 rows: s{s0}@5 x2 s{s1}@7 x2, join rows [0, 1]"]
    assert isinstance(out.lanes[0], LaneStep)


# --- an engine in this process -----------------------------------------------------------------
def test_calls_joining_and_leaving_lanes_in_this_process_answer_as_hugging_face() -> None:
    """Calls of many prompt lengths and lengths of answer join while others decode (each starts as
    the one before has streamed 2 tokens): every answer is Hugging Face's greedy one."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB", lanes=True), max_sessions=8, context=64, max_chunk=32)
    lengths, news = (5, 9, 13, 7, 11, 3), (12, 5, 9, 6, 3, 8)
    prompts = [padded_batch((n,), seed=i)[0] for i, n in enumerate(lengths)]
    got: dict[int, Any] = {}
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        ids = prompts[i]
        args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=news[i],
                                 pad_token_id=0, eos_token_id=[])
        rows = []
        for n, row in enumerate(stream_tokens(engine, ids, args, torch.ones_like(ids))):
            rows.append(row)
            if n == 1 and i + 1 < len(started):
                started[i + 1].set()
        got[i] = torch.cat([ids, torch.stack(rows, dim=1)], dim=1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    threads[0].start()
    for i, t in enumerate(threads[1:], 1):
        started[i].wait()
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(prompts):
        want = hf_no_eos(model, ids, news[i])
        assert torch.equal(got[i], want), i
    assert engine.stats.lane_starts >= 1 and engine.stats.decode_steps > 0
    engine.close()


def test_sampled_rules_and_logprob_calls_decode_in_lanes_as_they_would_from_here() -> None:
    """Calls that sample, shape their logits or ask for log-probabilities decode in lanes (picked
    where the lane's logits are made) and answer exactly as when every token is picked here:
    the same tokens, the same log-probabilities, whatever the batch they ran in."""
    model = decoder("llama")
    prompts = [padded_batch((n,), seed=20 + n)[0] for n in (5, 9, 7)]
    asks: list[dict[str, Any]] = [
        {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95},
        {"logprobs": 3},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5, "min_new_tokens": 6, "logit_bias": {3: 1.5}},
    ]

    def answers(lanes: bool) -> tuple[list[torch.Tensor], list[Any], EngineStats]:
        engine = Engine(LocalRunner(model, "64KiB", lanes=lanes), max_sessions=4, context=64, max_chunk=32)
        out, lps = [], []
        for ids, ask in zip(prompts, asks):
            args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=10, pad_token_id=0,
                                     eos_token_id=[2], generator=torch.Generator().manual_seed(4), **ask)
            stream = stream_tokens(engine, ids, args, torch.ones_like(ids))
            rows, seen = [], []
            for row in stream:
                rows.append(row)
                seen.append(stream.logprobs)
            out.append(torch.stack(rows, dim=1))
            lps.append(seen)
        engine.close()
        return out, lps, engine.stats

    here, here_lp, here_stats = answers(False)
    lane, lane_lp, lane_stats = answers(True)
    assert here_stats.lane_starts == 0 and lane_stats.lane_starts >= len(prompts)
    for a, b in zip(here, lane):
        assert torch.equal(a, b)
    assert here_lp[0] == [None] * 10 and here_lp[2] == [None] * 10
    for a, b in zip(here_lp[1], lane_lp[1]):
        (x,), (y,) = a, b
        assert x.token == y.token and x.logprob == pytest.approx(y.logprob)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.top[0][0] == x.token           # NOTE: greedy: the likeliest
    assert len(lane[2][0]) == 10 and 2 not in lane[2][0, :5].tolist()     # min_new_tokens held its end off


def hf_no_eos(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0, eos_token_id=None)


def test_a_lane_whose_rows_all_ended_starts_anew_for_a_row_that_joins_late() -> None:
    """A lane's loop stops once every row ran its steps; a row that joins after that (its edit too
    late) is read from a loop started anew, and its token is Hugging Face's."""
    model = decoder("llama")
    runner = LocalRunner(model, "64KiB", lanes=True)
    stats = EngineStats()
    executor = Executor(runner, lambda *a: None, stats, pipeline=2, lane_steps=8)  # type: ignore[arg-type,return-value]
    a, b = padded_batch((6,), seed=1)[0], padded_batch((9,), seed=2)[0]
    first = {}
    for sid, ids in ((0, a), (1, b)):
        n = ids.shape[1]
        logits = runner.run_step(1, n, step_inputs([(sid, 0, ids[0].tolist())], 1, n))
        first[sid] = int(logits.argmax(-1))
    one = LaneStep(0, 1, (LaneRow(Chunk(0, 6, (first[0],), 1), 1),), joins=(0,))
    tokens, rows, gone, _ = executor.lanes(SchedulerOutput(0, lanes=(one,)))[0]    # type: ignore[misc]
    assert rows.tolist() == [0] and int(tokens[0]) == int(hf_no_eos(model, a, 2)[0, -1]) and not gone
    late = LaneStep(0, 1, (LaneRow(Chunk(1, 9, (first[1],), 1), 3),), joins=(0,), leaves=((0, 0),))
    tokens, rows, gone, _ = executor.lanes(SchedulerOutput(1, lanes=(late,)))[0]   # type: ignore[misc]
    assert rows.tolist() == [1] and int(tokens[0]) == int(hf_no_eos(model, b, 2)[0, -1])
    assert gone == {0}          # NOTE: the loop it left was let go: no step of it runs session 0
    assert (stats.lane_starts, stats.lane_edits) == (2, 1)
    executor.close()


def test_a_row_joins_a_running_loop_by_an_edit_and_leaves_it_for_good() -> None:
    """A lane of 2 rows runs one session; a second joins its empty row by an edit (no new loop): the
    step built before the edit came runs without it, the next with it, each token Hugging Face's;
    a leave is told gone once a step was built after it."""
    model = decoder("llama")
    runner = LocalRunner(model, "64KiB", lanes=True)
    stats = EngineStats()
    executor = Executor(runner, lambda *a: None, stats, pipeline=2, lane_steps=16)  # type: ignore[arg-type,return-value]
    a, b = padded_batch((6,), seed=1)[0], padded_batch((9,), seed=2)[0]
    want_a, want_b = hf_no_eos(model, a, 6)[0, 6:].tolist(), hf_no_eos(model, b, 4)[0, 9:].tolist()
    for sid, ids in ((0, a), (1, b)):
        n = ids.shape[1]
        runner.run_step(1, n, step_inputs([(sid, 0, ids[0].tolist())], 1, n))
    a_row = LaneRow(Chunk(0, 6, (want_a[0],), 1), 5)

    def step(n: int, rows: tuple[LaneRow | None, ...], joins: tuple[int, ...] = (),
             leaves: tuple[tuple[int, int], ...] = ()) -> tuple[list[int], list[int], set[int]]:
        out = SchedulerOutput(n, lanes=(LaneStep(0, 2, rows, joins, leaves),))
        tokens, ran, gone, _ = executor.lanes(out)[0]      # type: ignore[misc]
        return tokens.tolist(), ran.tolist(), gone

    tokens, ran, _ = step(0, (a_row, None), joins=(0,))
    assert ran == [0, -1] and tokens[0] == want_a[1]
    b_row = LaneRow(Chunk(1, 9, (want_b[0],), 1), 3)
    tokens, ran, _ = step(1, (a_row, b_row), joins=(1,))
    assert ran == [0, -1] and tokens[0] == want_a[2]        # NOTE: built before the edit came
    tokens, ran, _ = step(2, (a_row, b_row))
    assert ran == [0, 1] and tokens == [want_a[3], want_b[1]]
    tokens, ran, gone = step(3, (None, b_row), leaves=((0, 0),))
    assert ran == [0, 1] and tokens == [want_a[4], want_b[2]] and not gone
    tokens, ran, gone = step(4, (None, b_row))
    assert ran == [-1, 1] and gone == {0}
    assert (stats.lane_starts, stats.lane_edits) == (1, 2)
    executor.close()


def test_a_call_that_ends_at_its_eos_frees_its_cache_once_its_row_left_the_lane() -> None:
    """A call of two rows in one lane, one of which meets its EOS while the other decodes on to the
    last token, then a call that ends at its EOS alone: each answers as Hugging Face, and by the
    time its caller hears of its end its caches are freed (the second's once a step of its lane
    was built without its row)."""
    model = decoder("llama")
    runner = LocalRunner(model, "64KiB", lanes=True)
    engine = Engine(runner, max_sessions=4, context=64, max_chunk=32)
    a, b = padded_batch((7,), seed=4)[0], padded_batch((5,), seed=6)[0]
    long = hf_no_eos(model, a, 12)
    eos = int(long[0, a.shape[1] + 2])                  # NOTE: its third new token ends it
    want_b = hf_no_eos(model, b, 14)
    assert eos not in want_b[0, b.shape[1]:].tolist()
    call = engine.submit([a[0].tolist(), b[0].tolist()], 12, Sampling(), [eos], 0)
    rows = list(engine.results(call))
    assert [int(r[0]) for r in rows[:3]] == long[0, a.shape[1]:a.shape[1] + 3].tolist()
    assert all(int(r[0]) == 0 for r in rows[3:])       # NOTE: padded once it ended
    assert [int(r[1]) for r in rows] == want_b[0, b.shape[1]:b.shape[1] + 12].tolist()
    assert not any(key[1] in {s.sid for s in call.sessions} for key in runner.store.caches)
    solo = engine.submit([a[0].tolist()], 12, Sampling(), [eos], 0)
    got = [int(r[0]) for r in engine.results(solo)]
    assert got == long[0, a.shape[1]:a.shape[1] + 3].tolist()
    assert not any(key[1] == solo.sessions[0].sid for key in runner.store.caches)
    engine.close()


def local_call(engine: Engine, model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    args = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=new, pad_token_id=0,
                             eos_token_id=[])
    return generate_tokens(engine, ids, args, torch.ones_like(ids))


# --- on a cluster ------------------------------------------------------------------------------
def test_calls_arriving_at_random_times_join_lanes_on_the_workers_and_answer_as_hugging_face() -> None:
    """Two workers, the data plane: 8 calls of many lengths, 4 at once and each other one as the call
    4 before it has streamed up to two tokens, join and leave the running loops; every answer is
    Hugging Face's greedy one, and lane steps ran rows of several calls."""
    model = decoder("llama")
    lengths, news = (5, 9, 13, 7, 11, 3, 6, 8), (12, 15, 9, 14, 18, 11, 16, 13)
    prompts = [padded_batch((n,), seed=i)[0] for i, n in enumerate(lengths)]
    want = [hf_no_eos(model, p, n) for p, n in zip(prompts, news)]
    gen = torch.Generator().manual_seed(5)
    after = [int(x) for x in torch.randint(0, 3, (len(prompts),), generator=gen)]
    got, _, stats = staggered(model, prompts, news, after, lambda i: {"pad_token_id": 0, "eos_token_id": []},
                              together=True)
    for i in range(len(prompts)):
        assert torch.equal(got[i], want[i]), i
    assert stats["lane_starts"] >= 1 and stats["rows"] > stats["decode_steps"]


def test_sampled_and_logprob_calls_joining_lanes_on_the_workers_answer_as_picked_in_the_caller() -> None:
    """Two workers, the data plane: greedy, sampled and log-probability calls join and leave the
    running loops at random times, each picked on the worker that makes its logits; every answer
    is the one picked in the caller, step by step, with no lane (``LocalRunner``)."""
    model = decoder("llama")
    lengths, news = (5, 9, 13, 7, 11, 3, 6, 8), (12, 15, 9, 14, 18, 11, 16, 13)
    prompts = [padded_batch((n,), seed=30 + i)[0] for i, n in enumerate(lengths)]
    asks: list[dict[str, Any]] = [
        {}, {"do_sample": True, "temperature": 0.8, "top_k": 30}, {"logprobs": 2},
        {"do_sample": True, "temperature": 1.1, "top_p": 0.9, "repetition_penalty": 1.2}] * 2

    def args(i: int) -> dict[str, Any]:
        return {"pad_token_id": 0, "eos_token_id": [], "generator": torch.Generator().manual_seed(i),
                **asks[i]}

    here = Engine(LocalRunner(model, "64KiB"), max_sessions=4, context=64, max_chunk=32)
    want, want_lp = [], []
    for i, ids in enumerate(prompts):
        a = GenerateArgs.make(model.generation_config, ids.shape[1], max_new_tokens=news[i], **args(i))
        stream = stream_tokens(here, ids, a, torch.ones_like(ids))
        rows = []
        for row in stream:
            rows.append(row)
            want_lp.append((i, stream.logprobs))
        want.append(torch.cat([ids, torch.stack(rows, dim=1)], dim=1))
    here.close()
    gen = torch.Generator().manual_seed(6)
    after = [int(x) for x in torch.randint(0, 3, (len(prompts),), generator=gen)]
    got, got_lp, stats = staggered(model, prompts, news, after, args)
    for i in range(len(prompts)):
        assert torch.equal(got[i], want[i]), i
    for i, lps in [(i, [lp for j, lp in want_lp if j == i]) for i in (2, 6)]:
        for a, b in zip(lps, got_lp[i]):
            (x,), (y,) = a, b
            assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-5)
    assert stats["lane_starts"] >= 1 and stats["rows"] > stats["decode_steps"]


Answers = tuple[dict[int, Any], dict[int, list[Any]], dict[str, Any]]


def staggered(model: torch.nn.Module, prompts: list[torch.Tensor], news: tuple[int, ...], after: list[int],
              args: Any, together: bool = False) -> Answers:
    """On two workers (the data plane): 4 calls at once (``together``: started by a barrier), then
    each other one as the call 4 before it has streamed ``after[i]`` tokens; each call's prompt and
    tokens, its log-probabilities per step, and the deployment's generation stats."""
    with seabiscuit_cluster(2, 450_000) as client:
        with sb.distribute(model, client, torch.zeros(1, 16, dtype=torch.long), budget="64KiB", sessions=4,
                           context=48) as dm:
            got: dict[int, Any] = {}
            got_lp: dict[int, list[Any]] = {}
            started = [threading.Event() for _ in prompts]
            barrier = threading.Barrier(4)

            def run(i: int) -> None:
                if together and i < 4:
                    barrier.wait()
                rows, lps = [], []
                stream = dm.stream(prompts[i], news[i], **args(i))
                for n, row in enumerate(stream):
                    rows.append(row)
                    lps.append(stream.logprobs)
                    if n == after[i] and i + 4 < len(started):
                        started[i + 4].set()
                if i + 4 < len(started):
                    started[i + 4].set()
                got[i] = torch.cat([prompts[i], torch.stack(rows, dim=1)], dim=1)
                got_lp[i] = lps

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads[:4]:
                t.start()
            for i, t in enumerate(threads[4:], 4):
                started[i].wait()
                t.start()
            for t in threads:
                t.join()
            return got, got_lp, dm.generation_stats()


class SlowFrees(LocalRunner):
    """A runner whose first free of caches waits to be let go (a scheduler round trip on a busy
    machine)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.held = threading.Event()
        self.freeing = threading.Event()

    def end_sessions(self, sessions: Any, renamed: Any = (), forked: Any = ()) -> None:
        if sessions and not self.freeing.is_set():
            self.freeing.set()
            self.held.wait()
        super().end_sessions(sessions, renamed, forked)


def test_a_slow_free_holds_its_calls_end_not_the_other_calls_tokens() -> None:
    """A call's caches are freed off the engine's thread: while the first free hangs, another call
    still gets every token; the first call's caller hears of its end only once its free is done."""
    model = decoder("llama")
    runner = SlowFrees(model, "64KiB", lanes=True)
    engine = Engine(runner, max_sessions=4, context=64, max_chunk=32)
    a, b = padded_batch((6,), seed=1)[0], padded_batch((9,), seed=2)[0]
    first = engine.submit([a[0].tolist()], 2, Sampling(), [], 0)
    rows = engine.results(first)
    assert [int(next(rows)[0]) for _ in range(2)] == hf_no_eos(model, a, 2)[0, 6:].tolist()
    assert runner.freeing.wait(60)                       # NOTE: its free is on its way, and hangs
    second = engine.submit([b[0].tolist()], 8, Sampling(), [], 0)
    got = engine.results(second)
    assert [int(next(got)[0]) for _ in range(8)] == hf_no_eos(model, b, 8)[0, 9:].tolist()
    assert not first.ended.is_set()
    runner.held.set()
    assert list(rows) == [] and first.ended.wait(60)
    assert list(got) == [] and second.ended.wait(60)
    assert not runner.store.caches
    engine.close()


def test_a_fault_in_the_engines_bookkeeping_fails_its_calls_and_the_engine_goes_on(monkeypatch: Any) -> None:
    """A step whose bookkeeping raises (a fault of the engine, not of a step) fails the calls it held
    with the error, none left waiting; the next call answers as Hugging Face."""
    model = decoder("llama")
    engine = Engine(LocalRunner(model, "64KiB", lanes=True), max_sessions=4, context=64, max_chunk=32)
    a = padded_batch((6,), seed=1)[0]
    real = engine.executor.lanes
    faults = [1]

    def lanes(out: Any, wake: Any = None) -> Any:
        if faults[0]:
            faults[0] -= 1
            raise TypeError("a fault of the engine's own")
        return real(out, wake)

    monkeypatch.setattr(engine.executor, "lanes", lanes)
    with pytest.raises(TypeError, match="a fault of the engine's own"):
        local_call(engine, model, a, 5)
    assert torch.equal(local_call(engine, model, a, 5), hf_no_eos(model, a, 5))
    engine.close()
