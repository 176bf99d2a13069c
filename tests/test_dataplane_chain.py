"""A decode loop's logits block and the next step's first blocks on one compute thread
(``runtime.dataplane.chain``): two ``DataPlane`` s in one event loop (each over a
``FunctionHost``), a three-block step
(worker A: b0 reads the step's inputs, b2 makes the logits; worker B: b1 between them)
whose blocks are plain functions, so each next token is known in advance."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import dask.config
import pytest
import torch

from seabiscuit_dask.ir import TensorSpec
from seabiscuit_dask.lower.blocks import BlockSpec
from seabiscuit_dask.runtime.dataplane import DataPlane, Loop, StaleRun, timed
from seabiscuit_dask.runtime.dataplane.ordered import OrderedExecutor
from seabiscuit_dask.runtime.dataplane.runs import Run

from .planes import TICKET, FunctionHost, Planes

MODEL, VOCAB = "m", 11
A, B = "tcp://a:1", "tcp://b:1"


Sends = tuple[tuple[int, str, tuple[str, ...]], ...]


def spec(index: int, address: str, imports: dict[str, int], exports: tuple[str, ...], sends: Sends = (),
         outputs: tuple[str, ...] = ()) -> BlockSpec:
    return BlockSpec(MODEL, 0, index, "cpu", (), {}, {t: TensorSpec((1, 1), "float32") for t in imports},
                     exports, tuple(imports.values()), address, sends=sends, outputs=outputs)


SPECS = {0: spec(0, A, {"input_ids": -1, "position_ids": -1}, ("h",), sends=((1, B, ("h",)),)),
         1: spec(1, B, {"h": 0}, ("h2",), sends=((2, A, ("h2",)),)),
         2: spec(2, A, {"h2": 1}, ("logits",), outputs=("logits",))}
# NOTE: as a decoder's step is: the block on B reads the step's positions too (its cache slots)
FED = {**SPECS, 1: spec(1, B, {"h": 0, "position_ids": -1}, ("h2",), sends=((2, A, ("h2",)),))}
# NOTE: B's fed block b3 reads no output of A's b0: its step inputs cannot go with b0's push
APART = {**FED, 1: spec(1, B, {"h": 0, "p": 3}, ("h2",), sends=((2, A, ("h2",)),)),
         3: spec(3, B, {"position_ids": -1}, ("p",), sends=((1, B, ("p",)),))}
ROUTES = {id(SPECS): [(A, [(0, ("input_ids", "position_ids"))])],
          id(FED): [(A, [(0, ("input_ids", "position_ids"))]), (B, [(1, ("position_ids",))])],
          id(APART): [(A, [(0, ("input_ids", "position_ids"))]), (B, [(3, ("position_ids",))])]}


def block(b: int, imports: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next token is (3 * token + position + 1) % VOCAB."""
    if b == 0:
        return {"h": (imports["input_ids"] * 3 + imports["position_ids"]).float()}
    if b == 3:
        return {"p": imports["position_ids"].float() * 0}
    if b == 1:
        return {"h2": imports["h"] + 1 + imports.get("p", 0)}
    return {"logits": torch.nn.functional.one_hot(imports["h2"].long() % VOCAB, VOCAB).float()}


def expected(token: int, position: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = (3 * token + position + 1) % VOCAB
        out.append(token)
        position += 1
    return out


class Pair(Planes):
    """Workers A and B; ``hold``: (block, request) whose compute waits for ``gate``."""

    def __init__(self, hold: tuple[int, int] | None = None, specs: dict[int, BlockSpec] = SPECS,
                 token_delay: float = 0.0, seconds: float = 1.0) -> None:
        self.hold, self.entered, self.gate = hold, threading.Event(), threading.Event()
        self.specs, self.route = specs, ROUTES[id(specs)]
        self.ran: list[tuple[str, int, int, int]] = []        # (worker, block, request, thread)
        self.pools = {a: OrderedExecutor(1, f"chain-{a}") for a in (A, B)}
        self.planes = {a: DataPlane(self._host(a, seconds), token_delay=token_delay) for a in (A, B)}

    def _host(self, address: str, seconds: float) -> FunctionHost:
        compute = self._slow(timed(self._compute(address), address), seconds)
        return FunctionHost(address, self.pools[address], compute, self._sender(address), self.check,
                            lambda m, v, b: self.specs[b], spec_of=self._spec_of(address))

    def _spec_of(self, address: str) -> Any:
        return lambda m, v, b: self.specs[b] if self.specs[b].address == address else None

    def _compute(self, address: str) -> Any:
        def run(model, version, request, b, imports):
            if (b, request) == self.hold:
                self.entered.set()
                assert self.gate.wait(30)
            self.ran.append((address, b, request, threading.get_ident()))
            return block(b, imports), "computed"
        return run

    async def start(self, requests: list[int], token: int = 4, position: int = 7) -> None:
        """A decode loop of ``requests`` at ``A``, its first step fed from here."""
        inputs = {"input_ids": torch.tensor([[token]]), "position_ids": torch.tensor([[position]]),
                  "sb_sessions": torch.tensor([0]), "sb_start": torch.tensor([position]),
                  "sb_valid": torch.ones(1, 1, dtype=torch.bool)}
        loop = Loop(requests[1:], self.route, "logits", inputs)
        for address, feeds in self.route:
            await self.planes[address].feed(MODEL, TICKET, 0, requests[0],
                                            {b: {t: inputs[t] for t in names} for b, names in feeds},
                                            loop=loop if address == A else None)

    async def tokens(self, request: int) -> int:
        got = await asyncio.wait_for(self.planes[A].collect(MODEL, TICKET, 0, request, [2], tokens="logits"),
                                     30)
        return int(got[2]["logits"][0])

    def loop_tokens(self, requests: list[int],
                    before: Callable[[], Awaitable[None]] | None = None) -> list[int]:
        """The tokens of a decode loop of ``requests`` started at ``A`` (after ``before``, in the event
        loop); the pair is closed after."""
        async def run() -> list[int]:
            if before is not None:
                await before()
            await self.start(requests)
            return [await self.tokens(r) for r in requests]

        try:
            return asyncio.run(run())
        finally:
            self.close()

    def close(self) -> None:
        for p in self.pools.values():
            p.shutdown(wait=False)


# NOTE: with ``token_delay`` the caller hears of each step's tokens later, never fewer of them
@pytest.mark.parametrize("specs, token_delay", [(SPECS, 0.0), (FED, 0.02)], ids=["at-once", "fed-delayed"])
def test_the_next_step_runs_on_the_thread_that_made_the_logits(specs, token_delay) -> None:
    pair = Pair(specs=specs, token_delay=token_delay)
    assert pair.loop_tokens([10, 11, 12, 13]) == expected(4, 7, 4)
    plane = pair.planes[A]
    assert plane.counters["chained"] == 3 and plane.counters["loop_steps"] == 3
    at_a = [(b, r) for w, b, r, _ in pair.ran if w == A]
    assert at_a == [(0, 10), (2, 10), (0, 11), (2, 11), (0, 12), (2, 12), (0, 13), (2, 13)]
    assert len({t for w, _, _, t in pair.ran if w == A}) == 1
    # NOTE: a chained block is recorded as any block (the dashboard's timeline) and nothing is held
    assert sorted(r["request"] for r in plane.records if r["block"] == 0) == [10, 11, 12, 13]
    assert not plane.runs and not plane.loops and not pair.planes[B].runs       # NOTE: nor a chain of one


def test_a_lanes_own_picks_come_back_for_each_step_it_ran_chained_also_as_its_row_empties() -> None:
    """A lane of two rows: row 0 greedy, row 1 with its own pick (a bias that always wins, and its
    log-probability asked for) for three steps, then emptied by the lane. Each step is chained,
    so the next step's rows are built before the loop hears of the logits: the step's own picks
    are what come back, the last one too (its row's picker is gone by then)."""
    from seabiscuit_dask.runtime.dataplane import Lane
    from seabiscuit_dask.runtime.dataplane.loops import LOGPROBS
    from seabiscuit_dask.runtime.generation import LogitRules
    from seabiscuit_dask.runtime.generation.sampling import RowPick

    pair = Pair()
    requests = [20, 21, 22, 23]
    pick = RowPick(rules=LogitRules(bias=((5, 10.0),)), logprobs=0)

    async def run() -> list[tuple[list[int], Any]]:
        inputs = {"input_ids": torch.tensor([[4], [4]]), "position_ids": torch.tensor([[7], [7]]),
                  "sb_sessions": torch.tensor([0, 1]), "sb_start": torch.tensor([7, 7]),
                  "sb_valid": torch.ones(2, 1, dtype=torch.bool)}
        loop = Loop(requests[1:], pair.route, "logits", inputs, lane=Lane(requests[0], [-1, 2], [None, pick]))
        for address, feeds in pair.route:
            await pair.planes[address].feed(MODEL, TICKET, 0, requests[0],
                                            {b: {t: inputs[t] for t in names} for b, names in feeds},
                                            loop=loop if address == A else None)
        out = []
        for r in requests:
            got = await asyncio.wait_for(pair.planes[A].collect(MODEL, TICKET, 0, r, [2], "logits"), 30)
            out.append((got[2]["logits"].tolist(), got[2].get(LOGPROBS)))
        return out

    try:
        steps = asyncio.run(run())
    finally:
        pair.close()
    assert pair.planes[A].counters["chained"] == 3
    assert [t[0] for t, _ in steps] == expected(4, 7, 4)          # NOTE: row 0, greedy, as ever
    assert [t[1] for t, _ in steps[:3]] == [5, 5, 5]               # NOTE: row 1, its own pick each step
    for _, lp in steps[:3]:
        assert lp is not None and torch.isnan(lp[0, 0]) and torch.isfinite(lp[1, 0])
    assert steps[3][1] is None                                     # NOTE: its row emptied: no pick, none sent


@pytest.mark.parametrize("seconds", [1.0, 0.01], ids=["chained", "on-the-loop"])
def test_a_steps_inputs_of_the_next_workers_block_go_with_the_push_it_reads(seconds) -> None:
    """B's block reads the step's positions (a feed) and b0's output (a push): the positions go in
    b0's push, one message a step, whether b0 ran chained to the logits or on the event loop."""
    pair = Pair(specs=FED, seconds=seconds)
    sent: list[tuple[str, int, list[int]]] = []
    send = pair.planes[A].host.send

    async def logged(address: str, op: str, **msg: Any) -> None:
        if address == B:
            sent.append((op.removeprefix("seabiscuit_dp_"), int(msg["request"]),
                         [b for b, _ in msg.get("inputs") or ()]))
        await send(address, op, **msg)

    pair.planes[A].host.send = logged
    assert pair.loop_tokens([10, 11, 12, 13]) == expected(4, 7, 4)
    assert pair.planes[A].counters["chained"] == (3 if seconds >= 1 else 1)
    assert sent == [("push", 10, [])] + [("push", r, [1]) for r in (11, 12, 13)]
    assert not pair.planes[A].runs and not pair.planes[B].runs


def test_a_steps_inputs_of_a_block_that_reads_nothing_from_here_go_on_their_own_first() -> None:
    """B's fed block b3 reads no output of A: its positions go out as the step starts, not with b0's
    push, and ahead of it."""
    pair = Pair(specs=APART)
    sent: list[tuple[str, int]] = []
    send = pair.planes[A].host.send

    async def logged(address: str, op: str, **msg: Any) -> None:
        if address == B:
            assert not msg.get("inputs") or op.endswith("feed")
            sent.append((op.removeprefix("seabiscuit_dp_"), int(msg["request"])))
        await send(address, op, **msg)

    pair.planes[A].host.send = logged
    assert pair.loop_tokens([10, 11, 12, 13]) == expected(4, 7, 4)
    assert sent == [("push", 10)] + [m for r in (11, 12, 13) for m in (("feed", r), ("push", r))]
    assert not pair.planes[A].runs and not pair.planes[B].runs


def test_a_block_that_is_its_workers_only_work_runs_on_the_event_loop_tokens_after_the_next_step() -> None:
    """Blocks of 10 ms: each runs on a compute thread once (its time unknown), then on the event
    loop while it is its worker's only work; the caller hears of a step's tokens once the next
    step's first block sent its outputs on."""
    pair = Pair(specs=FED, seconds=0.01)
    heard: list[tuple[int, set[tuple[str, int, int]]]] = []

    async def run() -> list[int]:
        await pair.start([10, 11, 12, 13])
        out = []
        for r in (10, 11, 12, 13):
            out.append(await pair.tokens(r))
            heard.append((r, {(w, b, q) for w, b, q, _ in pair.ran}))
        return out

    try:
        tokens = asyncio.run(run())
    finally:
        pair.close()
    assert tokens == expected(4, 7, 4)
    main = threading.main_thread().ident
    on_loop = sorted((w, b, r) for w, b, r, t in pair.ran if t == main)
    # NOTE: step 10 and b0 of step 11 (chained to b2 of 10 on its thread) ran before their times were known
    assert on_loop == sorted((w, b, r) for w, b, r, _ in pair.ran if r >= 12 or (r == 11 and b != 0))
    for r, ran in heard[:-1]:
        if r >= 11:
            assert (A, 0, r + 1) in ran           # NOTE: b0 of the next step ran before its tokens came
    assert pair.planes[A].counters["chained"] == 1
    assert not pair.planes[A].runs and not pair.planes[B].runs


def test_a_block_that_runs_on_the_event_loop_has_run_when_its_last_input_is_delivered() -> None:
    """Not a loop turn later in a task of its own: a decode step's hop saves a wake-up of the loop."""
    pair = Pair(seconds=0.01)

    async def run() -> tuple[list[int], bool, int]:
        await pair.start([10, 11])
        out = [await pair.tokens(r) for r in (10, 11)]        # NOTE: the blocks' times are known now
        await pair.planes[A].feed(MODEL, TICKET, 0, 20, {0: {"input_ids": torch.tensor([[4]]),
                                                             "position_ids": torch.tensor([[7]])}})
        ran = (A, 0, 20) in {(w, b, r) for w, b, r, _ in pair.ran}
        return out, ran, await pair.tokens(20)

    try:
        tokens, ran, token = asyncio.run(run())
    finally:
        pair.close()
    assert tokens == expected(4, 7, 2) and token == expected(4, 7, 1)[0]
    assert ran
    assert not pair.planes[A].runs and not pair.planes[B].runs


def test_a_blocks_outputs_go_to_their_stream_before_anything_queued_on_the_loop_meanwhile() -> None:
    """A block on the event loop ends with work queued behind it (an acknowledgement, a reply):
    its outputs are handed to the stream first, not a loop turn later behind that work."""
    pair = Pair(specs=FED, seconds=0.01)
    events: list[Any] = []
    compute, send = pair.planes[B].host.compute, pair.planes[B].host.send
    loop: asyncio.AbstractEventLoop | None = None

    def queuing(*args: Any) -> Any:
        loop.call_soon_threadsafe(events.append, ("queued", args[2]))
        return compute(*args)

    def eager(address: str, op: str, **msg: Any) -> Any:          # NOTE: as a worker's stream is
        events.append((op.removeprefix("seabiscuit_dp_"), msg["request"]))
        return asyncio.ensure_future(send(address, op, **msg))

    async def before() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        pair.planes[B].host.compute, pair.planes[B].host.send = queuing, eager

    assert pair.loop_tokens([10, 11, 12, 13], before) == expected(4, 7, 4)
    for r in (11, 12, 13):            # NOTE: on the loop (10 ran on a thread: its time was unknown)
        assert events.index(("push", r)) < events.index(("queued", r))


def test_a_block_beside_other_work_of_its_worker_runs_on_a_compute_thread() -> None:
    """The same loop while another request's block waits at each worker: nothing on the loop."""
    pair = Pair(specs=FED, seconds=0.01)

    async def before() -> None:
        for address, b in ((A, 2), (B, 1)):       # NOTE: request 99 waits for h2 at A and for h at B
            await pair.planes[address].feed(MODEL, TICKET, 0, 99, {b: {}} if b == 2 else
                                            {b: {"position_ids": torch.tensor([[0]])}})

    assert pair.loop_tokens([10, 11, 12, 13], before) == expected(4, 7, 4)
    assert threading.main_thread().ident not in {t for _, _, _, t in pair.ran}


def test_a_step_forgotten_while_the_logits_are_made_does_not_run() -> None:
    pair = Pair(hold=(2, 11))

    async def run() -> list[int]:
        await pair.start([10, 11, 12, 13])
        first = await pair.tokens(10)
        await asyncio.get_running_loop().run_in_executor(None, pair.entered.wait, 30)
        assert await pair.planes[A].forget(MODEL, TICKET, [12, 13]) == 0     # NOTE: not started yet
        pair.gate.set()
        return [first, await pair.tokens(11)]

    try:
        assert asyncio.run(run()) == expected(4, 7, 2)
    finally:
        pair.close()
    assert (A, 0, 12) not in {(w, b, r) for w, b, r, _ in pair.ran}
    assert pair.planes[A].counters["chained"] == 1          # NOTE: 11 after 10 only
    assert not any(run.chain for run in pair.planes[A].runs.values())


def test_other_work_waiting_for_the_compute_thread_goes_first() -> None:
    pair = Pair(hold=(2, 11))

    async def run() -> list[int]:
        await pair.start([10, 11, 12, 13])
        await asyncio.get_running_loop().run_in_executor(None, pair.entered.wait, 30)
        other = pair.pools[A].submit(lambda: "other")       # NOTE: waits while the logits are made
        pair.gate.set()
        tokens = [await pair.tokens(r) for r in (10, 11, 12, 13)]
        assert other.result(30) == "other"
        return tokens

    try:
        assert asyncio.run(run()) == expected(4, 7, 4)
    finally:
        pair.close()
    assert pair.planes[A].counters["chained"] == 2          # NOTE: not step 12: it went through the queue


def test_a_chained_block_whose_plan_left_the_worker_meanwhile_fails_its_step_as_stale() -> None:
    pair = Pair(hold=(2, 11))
    held = pair.planes[A].host.spec_of

    async def run() -> tuple[list[int], BaseException]:
        await pair.start([10, 11, 12, 13])
        first = await pair.tokens(10)
        await asyncio.get_running_loop().run_in_executor(None, pair.entered.wait, 30)
        # NOTE: a newer plan took block 0 from this worker while step 12 was being chained
        pair.planes[A].host.spec_of = lambda m, v, b: None if b == 0 else held(m, v, b)
        pair.gate.set()
        second = await pair.tokens(11)
        try:
            await pair.tokens(12)
        except StaleRun as e:
            return [first, second], e
        raise AssertionError("step 12 answered without its block's plan")

    try:
        tokens, error = asyncio.run(run())
    finally:
        pair.close()
    assert tokens == expected(4, 7, 2) and "no longer held" in str(error)


def test_a_token_delay_that_is_no_duration_or_past_its_bound_is_refused_by_name() -> None:
    from seabiscuit_dask.errors import SeaBiscuitError
    from seabiscuit_dask.runtime.dataplane.manager import token_delay_s

    assert token_delay_s() == 0.002
    with dask.config.set({"seabiscuit.generate.token-delay": "1s"}), \
            pytest.raises(SeaBiscuitError, match=r"token-delay is 1000 ms: it must be from 0 to 100 ms"):
        token_delay_s()
    with dask.config.set({"seabiscuit.generate.token-delay": "soon"}), \
            pytest.raises(SeaBiscuitError, match=r"token-delay must be a duration such as '2ms'"):
        token_delay_s()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_greedy_pick_is_torchs_argmax_of_the_last_position_first_of_equal_maxima(dtype) -> None:
    from seabiscuit_dask.runtime.dataplane.loops import greedy

    logits = torch.randn(5, 3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, -1, 7] = logits[1, -1, 900] = 50.0          # NOTE: a tie: the first index wins
    got = greedy(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits[:, -1].argmax(dim=-1))
    assert int(got[1]) == 7
    inputs = {"input_ids": torch.zeros(2, 1, dtype=torch.long), "position_ids": torch.tensor([[5], [0]]),
              "sb_sessions": torch.tensor([0, -1]), "sb_start": torch.tensor([5, 0]),
              "sb_valid": torch.ones(2, 1, dtype=torch.bool)}
    step = Loop([1, 2], [], "logits", inputs)
    nxt, after = step.following(logits[:2])
    assert nxt["input_ids"].tolist() == [[int(got[0])], [0]]          # NOTE: a pad row stays 0
    assert nxt["position_ids"].tolist() == [[6], [0]] and nxt["sb_start"].tolist() == [6, 0]
    assert after.requests == [2] and after.inputs is nxt


def test_a_steps_tokens_are_told_as_the_next_step_leaves_on_idle_streams(monkeypatch) -> None:
    """On the loop, where the next step's first block's outputs went down an idle stream at once
    (its send is done as it returns), the caller is told of the step's tokens then, not after
    more loop turns, behind the next worker's handling of that push."""
    pair = Pair(specs=SPECS, seconds=0.01)
    events: list[tuple[str, int]] = []
    notify = Run.notify

    def told(self: Run) -> None:
        if self.keeper is pair.planes[A]:
            events.append(("told", self.request))
        notify(self)

    monkeypatch.setattr(Run, "notify", told)
    send = pair.planes[A].host.send

    def wire(address: str, op: str, **msg: Any) -> Any:      # NOTE: as an idle stream: on the wire now
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: asyncio.ensure_future(send(address, op, **msg)))
        sent = loop.create_future()
        sent.set_result(None)
        return sent

    compute = pair.planes[B].host.compute

    def logged(*args: Any) -> Any:
        events.append(("b1", args[2]))
        return compute(*args)

    async def before() -> None:
        pair.planes[A].host.send, pair.planes[B].host.compute = wire, logged

    assert pair.loop_tokens([10, 11, 12, 13], before) == expected(4, 7, 4)
    for r in (11, 12):          # NOTE: on the loop (10 ran on a thread: its time was unknown)
        assert events.index(("told", r)) < events.index(("b1", r + 1))


# NOTE: a model whose whole step is one block on one worker: the block reads the step's inputs and makes
# the logits (3 * token + position + 1, as the three-block step)
ONE = {0: spec(0, A, {"input_ids": -1, "position_ids": -1}, ("logits",), outputs=("logits",))}
ROUTES[id(ONE)] = [(A, [(0, ("input_ids", "position_ids"))])]


class One(Pair):
    """Worker A alone, its one block the whole step; ``wait(request)``: what its compute waits for."""

    def __init__(self, wait: Callable[[int], None]) -> None:
        self.wait = wait
        super().__init__(specs=ONE)

    def _compute(self, address: str) -> Any:
        def run(model, version, request, b, imports):
            self.wait(request)
            self.ran.append((address, b, request, threading.get_ident()))
            h = imports["input_ids"] * 3 + imports["position_ids"] + 1
            return {"logits": torch.nn.functional.one_hot(h.long() % VOCAB, VOCAB).float()}, "computed"
        return run

    async def tokens(self, request: int) -> int:
        got = await asyncio.wait_for(self.planes[A].collect(MODEL, TICKET, 0, request, [0], tokens="logits"),
                                     30)
        return int(got[0]["logits"][0])


def test_a_step_that_is_one_block_tells_its_tokens_as_the_next_step_computes(monkeypatch) -> None:
    """Where one block is the whole step (a model on one worker), the block is not chained to the next
    step's (itself: ``Run._chain``): each step's tokens are told while the next step computes, one
    step at a time, not two at once after it. Each step's compute here waits for the caller to be
    told of the step before; chained, it would wait in vain (its step's tokens come after it)."""
    requests = [10, 11, 12, 13]
    told = {r: threading.Event() for r in requests}
    waited: list[bool] = []

    def wait(request: int) -> None:
        if request - 1 in told:
            waited.append(told[request - 1].wait(10))

    pair = One(wait)
    notify = Run.notify

    def telling(self: Run) -> None:
        if self.keeper is pair.planes[A] and self.request in told:
            told[self.request].set()
        notify(self)

    monkeypatch.setattr(Run, "notify", telling)
    assert pair.loop_tokens(requests) == expected(4, 7, 4)
    assert waited == [True, True, True]
    assert [r for _, _, r, _ in pair.ran] == requests
