"""The data plane's run manager and its runs (``runtime.dataplane``), driven without a
cluster: the workers of a real plan as ``DataPlane`` s in one event loop, each over a
``FunctionHost``, messages between them passed through the streams' wire format
(``wire.pack``) to ``DataPlane.receive``, blocks run from ``ResidentBlocks``."""

from __future__ import annotations

import asyncio
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import msgpack
import pytest
import torch
from distributed.protocol import deserialize, serialize

import seabiscuit_dask as sb
from seabiscuit_dask.errors import (
    AccessDenied,
    BadMessage,
    ClusterTooSmall,
    SeaBiscuitError,
    UnsupportedModel,
)
from seabiscuit_dask.lower.blocks import BlockSpec, block_specs
from seabiscuit_dask.lower.kvcache import CacheLost
from seabiscuit_dask.runtime.dataplane import DataPlane, RunFailed, StaleRun, Tensors, timed
from seabiscuit_dask.runtime.dataplane.client import route
from seabiscuit_dask.runtime.dataplane.loops import Loop, greedy
from seabiscuit_dask.runtime.dataplane.ordered import OrderedExecutor
from seabiscuit_dask.runtime.dataplane.runs import KINDS
from seabiscuit_dask.runtime.dataplane.wire import (
    DTYPES,
    as_bytes,
    from_bytes,
    from_inline,
    inline,
    nbytes,
    pack,
    pack_message,
    unpack,
    unpack_message,
)
from seabiscuit_dask.runtime.worker.resident import ResidentBlocks

from .planes import TICKET, FunctionHost
from .test_runtime_resident import MODEL, blocks  # noqa: F401 - its module-scoped fixture


@pytest.fixture(scope="module")
def planned(blocks):  # noqa: F811 - the imported fixture
    """A GPT-2's graph and its blocks on three workers (``test_runtime_resident``'s plan)."""
    graph, plan, x, expected, owner = blocks
    return graph, block_specs(plan, MODEL, 0), x, expected, owner


class Mesh:
    """One ``DataPlane`` per worker of a plan; a message to a worker goes through the wire format."""

    def __init__(self, specs: list, fail_on: int | None = None, gone: str = "", max_runs: int = 256,
                 unloadable: int | None = None, fail_with: Exception | None = None,
                 ordered: bool = False) -> None:
        self.fail_with = fail_with
        self.specs = {s.index: s for s in specs}
        self.pool = ThreadPoolExecutor(1)
        self.resident: dict[str, ResidentBlocks] = {}
        self.planes: dict[str, DataPlane] = {}
        self.gone = gone
        for addr in sorted({s.address for s in specs}):
            r = self.resident[addr] = ResidentBlocks(64 * 2**20, "cpu", addr)
            # NOTE: ``ordered``: each worker its own compute thread, oldest run first, as the plugin runs
            pool = OrderedExecutor(1, f"mesh-{addr}") if ordered else self.pool
            host = FunctionHost(addr, pool, timed(self._compute(r, fail_on), addr), self._sender(addr),
                                self.check, self._loader(r, unloadable),
                                describe=lambda m, v, b: BlockSpec.from_dict(self.fetch(m, v, b)),
                                version_of=lambda m, r=r: r.versions.get(m, -1))
            self.planes[addr] = DataPlane(host, max_runs=max_runs)

    def _loader(self, r: ResidentBlocks, unloadable: int | None) -> Any:
        def load(m, v, b):
            if b == unloadable:
                raise ClusterTooSmall(f"block {b} does not fit")
            return r.program(m, v, b, self.fetch).spec
        return load

    def _compute(self, r: ResidentBlocks, fail_on: int | None) -> Any:
        def run(model, version, request, block, imports):
            if block == fail_on:
                raise self.fail_with or RuntimeError(f"block {block} broke")
            return r.run(model, version, request, block, imports, (), self.fetch)
        return run

    def fetch(self, model: str, version: int, block: int) -> dict:
        return self.specs[block].to_dict()

    @staticmethod
    async def check(model: str, ticket: Any) -> str:
        if ticket != TICKET:
            raise AccessDenied("wrong ticket")
        return TICKET

    def _sender(self, sender: str) -> Any:
        """How ``sender`` sends: down a stream (``wire.pack`` frames) that the peer's ``receive`` reads."""
        async def send(address: str, op: str, **msg: Any) -> None:
            if address == self.gone:
                raise OSError(f"no route to {address}")
            _, head, *frames = pack([{"op": op.removeprefix("seabiscuit_dp_"), "sender": sender, **msg}])
            for m in unpack(bytes(head), [bytearray(f) for f in frames]):
                await self.planes[address].receive(m)
        return send

    async def call(self, graph, x: torch.Tensor, request: int = 1, version: int = 0, repeat: int = 1) -> Any:
        wanted = sorted({s.index for s in self.specs.values() if graph.outputs[0] in s.outputs})
        plan = route(list(self.specs.values()), wanted)
        inputs = {graph.inputs[0]: x}
        calls = [self.planes[a].feed(MODEL, TICKET, version, request,
                                     {b: {t: inputs[t] for t in names} for b, names in feeds}, collects)
                 for a, (feeds, collects) in plan.items() for _ in range(repeat)]
        replies = await asyncio.wait_for(asyncio.gather(*calls), 60)
        out = graph.outputs[0]
        return next(ts[out] for reply in replies for ts in reply.values() if out in ts)

    def runs(self) -> int:
        return sum(len(p.records) for p in self.planes.values())


def test_a_request_crosses_the_workers_and_equals_the_model(planned) -> None:
    graph, specs, x, expected, _ = planned
    assert len({s.address for s in specs}) >= 2 and any(s.sends for s in specs)
    mesh = Mesh(specs)
    got = asyncio.run(mesh.call(graph, x))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert mesh.runs() == len(specs)                          # every block ran once
    assert not any(p.runs for p in mesh.planes.values())      # and nothing of it is held


def test_compute_threads_take_the_oldest_runs_work_first() -> None:
    pool = OrderedExecutor(1, "test")
    gate, started, order = threading.Event(), threading.Event(), []

    def hold() -> None:
        started.set()
        gate.wait()

    first = pool.submit(hold)
    started.wait()                          # the one thread is busy: what follows queues
    done = [pool.submit_ordered(3.0, order.append, "newest"),
            pool.submit_ordered(1.0, order.append, "oldest"),
            pool.submit_ordered(2.0, order.append, "middle"),
            pool.submit(order.append, "a spec to load")]
    failing = pool.submit_ordered(0.5, lambda: 1 / 0)
    gate.set()
    for f in (first, *done):
        f.result()
    assert order == ["a spec to load", "oldest", "middle", "newest"]
    with pytest.raises(ZeroDivisionError):
        failing.result()
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(order.append, "late")


def test_requests_in_flight_together_each_equal_the_model(planned) -> None:
    graph, specs, x, expected, _ = planned
    mesh = Mesh(specs, ordered=True)

    async def together() -> list[Any]:
        return await asyncio.gather(*(mesh.call(graph, x, request=r) for r in range(1, 5)))

    for got in asyncio.run(together()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert mesh.runs() == 4 * len(specs)


def test_repeated_messages_change_nothing(planned) -> None:
    graph, specs, x, expected, _ = planned
    mesh = Mesh(specs)

    async def twice() -> Any:
        first = await mesh.call(graph, x, request=7)
        plane = next(iter(mesh.planes.values()))
        # NOTE: the same inputs again, after the run finished: refused as a repeat
        s = next(s for s in specs if s.address == plane.address)
        again = await plane.push(MODEL, TICKET, 0, 7, s.index,
                                 {t: torch.zeros(1) for t in list(s.imports)[:1]})
        return first, again

    got, again = asyncio.run(twice())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert again is False and mesh.runs() == len(specs)
    assert sum(p.counters["repeats"] for p in mesh.planes.values()) >= 1


def test_a_decode_loop_caller_collects_greedy_tokens_in_place_of_logits(planned) -> None:
    graph, specs, x, expected, _ = planned
    mesh = Mesh(specs)
    out = graph.outputs[0]
    (maker,) = [s for s in specs if out in s.outputs]

    async def run() -> Any:
        plan = route(specs, [maker.index])
        inputs = {graph.inputs[0]: x}
        await asyncio.gather(*(mesh.planes[a].feed(MODEL, TICKET, 0, 3, {b: {t: inputs[t] for t in names}
                                                                          for b, names in feeds})
                               for a, (feeds, _) in plan.items()))
        plane = mesh.planes[maker.address]
        got = await asyncio.wait_for(plane.collect(MODEL, TICKET, 0, 3, [maker.index], tokens=out), 60)
        return got, plane

    got, plane = asyncio.run(run())
    tokens = got[maker.index][out]
    assert tokens.dtype == torch.long and tuple(tokens.shape) == (x.shape[0],)
    assert torch.equal(tokens, expected[:, -1].argmax(dim=-1))
    assert not plane.runs                                      # the run ended with its collect
    with pytest.raises(SeaBiscuitError, match="greedy tokens need"):
        greedy(torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("prepared", [False, True])
def test_a_decode_loops_next_step_reads_the_greedy_tokens_and_positions_one_on(dtype, prepared) -> None:
    """``Loop.following``: each live row's argmax (the first of equal maxima) at its position one on,
    a pad row as it was, whether or not the worker worked out the positions before (``prepare``)."""
    logits = torch.randn(3, 2, 11).to(dtype)
    logits[0, -1, 4] = logits[0, -1, 7] = 9.0               # NOTE: a tie: the first is taken
    x = {"input_ids": torch.tensor([[1], [2], [0]]), "position_ids": torch.tensor([[5], [9], [0]]),
         "sb_sessions": torch.tensor([0, 1, -1]), "sb_start": torch.tensor([5, 9, 0]),
         "sb_valid": torch.ones(3, 1, dtype=torch.bool)}
    loop = Loop([7, 8], [], "logits", x)
    if prepared:
        loop.prepare()
    nxt, after = loop.following(logits)
    tokens = logits[:, -1].float().argmax(dim=-1)
    assert tokens[0] == 4
    assert torch.equal(nxt["input_ids"], torch.stack([tokens[0], tokens[1], torch.tensor(0)]).reshape(3, 1))
    assert torch.equal(nxt["position_ids"], torch.tensor([[6], [10], [0]]))
    assert torch.equal(nxt["sb_start"], torch.tensor([6, 10, 0]))
    assert nxt["sb_sessions"] is x["sb_sessions"] and nxt["sb_valid"] is x["sb_valid"]
    assert after.requests == [8] and after.inputs is nxt and after.ahead is None
    assert torch.equal(greedy(logits), tokens) and greedy(logits).dtype == torch.long
    with pytest.raises(SeaBiscuitError, match="greedy tokens need"):
        greedy(torch.zeros(2, 5))


def test_a_message_of_an_older_plan_or_without_the_ticket_is_refused(planned) -> None:
    graph, specs, x, _, _ = planned
    mesh = Mesh(specs)
    addr = specs[0].address
    mesh.resident[addr].versions[MODEL] = 3          # NOTE: this worker holds plan v3 now
    with pytest.raises(StaleRun, match="names plan v0"):
        asyncio.run(mesh.call(graph, x))
    plane = mesh.planes[addr]
    with pytest.raises(AccessDenied):
        asyncio.run(plane.push(MODEL, "forged", 3, 1, specs[0].index, {}))
    assert plane.counters["stale"] >= 1 and not plane.runs


@pytest.mark.parametrize("peer_is", ["gone", "on a newer plan"])
def test_a_push_that_cannot_land_fails_the_run_at_its_sender(planned, peer_is: str) -> None:
    """A peer that cannot be reached fails the run as ``RunFailed``; one that refuses the push
    (it holds a newer plan) sends the sender a fail of the run, which fails it the same way."""
    _, specs, x, _, _ = planned
    first = next(s for s in specs if not any(src >= 0 for src in s.sources)
                 and any(a != s.address for _, a, _ in s.sends))
    peer = next(a for _, a, _ in first.sends if a != first.address)
    mesh = Mesh(specs, gone=peer if peer_is == "gone" else "")
    if peer_is != "gone":
        mesh.resident[peer].versions[MODEL] = 3          # NOTE: the consumer's worker holds plan v3 now
    plane = mesh.planes[first.address]

    async def feed_then_ask() -> Any:
        await plane.feed(MODEL, TICKET, 0, 1, {first.index: {t: x for t in first.imports}})
        return await asyncio.wait_for(plane.collect(MODEL, TICKET, 0, 1, [first.index]), 60)

    why = f"could not send the inputs of block .* to {peer}" if peer_is == "gone" else \
        f"names plan v0; worker {peer} holds v3"
    with pytest.raises(RunFailed, match=why) as failed:
        asyncio.run(feed_then_ask())
    assert isinstance(failed.value, StaleRun) == (peer_is != "gone")   # NOTE: the caller resends it at once
    assert plane.counters["runs_failed"] == 1 and not plane.runs
    assert peer_is == "gone" or mesh.planes[peer].counters["stale"] >= 1


def test_a_stream_message_that_is_not_a_push_feed_or_fail_is_dropped(planned) -> None:
    _, specs, _, _, _ = planned
    plane = Mesh(specs).planes[specs[0].address]

    async def junk() -> None:
        await plane.receive({"op": "collect", "model": MODEL, "ticket": TICKET, "version": 0, "request": 1,
                             "blocks": [0]})
        await plane.receive({"op": "push", "model": MODEL})                         # fields missing
        await plane.receive({"op": "push", "model": MODEL, "ticket": "forged", "version": 0, "request": 1,
                             "block": 0, "tensors": {}})
        await plane.receive(["not", "a", "message"])

    asyncio.run(junk())
    assert not plane.runs and plane.counters["messages"] == 0


def test_a_failed_block_fails_the_run_downstream_at_once(planned) -> None:
    graph, specs, x, _, _ = planned
    first = next(s for s in specs if s.sends)         # a block others wait on
    mesh = Mesh(specs, fail_on=first.index)
    with pytest.raises(SeaBiscuitError, match=f"block {first.index} broke"):
        asyncio.run(mesh.call(graph, x))
    assert not any(p.runs for p in mesh.planes.values())


def test_the_status_of_a_run_whose_blocks_ran_shows_none_running(planned) -> None:
    """Every block here loads its spec on its first message (``resolving``); once they ran, a
    caller past its bound must hear that nothing of the run still moves: else a run that lost a
    message elsewhere looks busy to ``_lost`` and its caller waits forever."""
    graph, specs, x, _, _ = planned
    mesh = Mesh(specs)
    last = next(s for s in specs if graph.outputs[0] in s.outputs)
    plan = route(list(mesh.specs.values()), [last.index])

    async def fed_not_collected() -> list[list[int]]:
        await asyncio.gather(*(mesh.planes[a].feed(MODEL, TICKET, 0, 1, {b: {t: x for t in names}
                                                                          for b, names in feeds})
                               for a, (feeds, _) in plan.items()))
        run = mesh.planes[last.address].runs[(MODEL, 1)]
        while last.index not in run.outputs and run.error is None:
            await run.changed.wait()
        return [await p.status(MODEL, TICKET, 1) for p in mesh.planes.values()]

    status = asyncio.run(fed_not_collected())
    assert all(s[0] == 0 for s in status), status              # no block runs, none loads its spec
    assert [1, 1] in [[s[1], s[3]] for s in status]            # the last block ran; its output waits


def test_a_failure_that_comes_back_to_a_worker_goes_on_past_it(blocks) -> None:  # noqa: F811
    """Stages on h0, h1, h0 again, then h2. The first block fails: h0 ends the run, having heard of
    no later block of its own, and tells h1, which tells h0's second stage. h0 must pass that on to
    h2 (a run it ended already): else h2's last block, and the caller collecting it, wait forever."""
    import numpy as np

    graph, plan, x, _, _ = blocks
    spec = sb.ClusterSpec(tuple(replace(d, memory_bytes=256 * 2**20) for d in plan.spec.devices[:3]),
                          plan.spec.links)
    order = np.arange(len(graph.ops)) * 4 // len(graph.ops)           # four contiguous stages
    bounce = sb.Plan(graph, spec, np.array([0, 1, 0, 2])[order], info={"fused": True})
    specs = block_specs(bounce, MODEL, 0)
    where = [s.address[-1] for s in specs]
    assert [w for i, w in enumerate(where) if not i or where[i - 1] != w] == ["0", "1", "0", "2"]
    mesh = Mesh(specs, fail_on=specs[0].index)
    with pytest.raises(SeaBiscuitError, match=f"block {specs[0].index} broke"):
        asyncio.run(mesh.call(graph, x))
    assert not any(p.runs for p in mesh.planes.values())


def test_a_failure_passes_a_worker_on_a_newer_plan_that_never_held_the_run(blocks) -> None:  # noqa: F811
    """Stages on h0, h1, h2; h1 took plan v1 before the request (of v0) came. It refuses h0's push,
    and the fail that h0 then sends past its block finds no run on h1: h1 passes it on to h2,
    else h2's last block, and the caller collecting it, wait forever."""
    import numpy as np

    graph, plan, x, _, _ = blocks
    spec = sb.ClusterSpec(tuple(replace(d, memory_bytes=256 * 2**20) for d in plan.spec.devices[:3]),
                          plan.spec.links)
    order = np.arange(len(graph.ops)) * 3 // len(graph.ops)           # three contiguous stages
    specs = block_specs(sb.Plan(graph, spec, order, info={"fused": True}), MODEL, 0)
    first = next(s for s in specs if graph.inputs[0] in s.imports)
    last = next(s for s in specs if graph.outputs[0] in s.outputs)
    middle = next(s.address for s in specs if s.address not in (first.address, last.address))
    mesh = Mesh(specs)
    assert mesh.planes[middle].retire(MODEL, 1) == 0                 # NOTE: it holds no run: only refuses

    async def call() -> Any:
        waiting = asyncio.ensure_future(mesh.planes[last.address].collect(MODEL, TICKET, 0, 1, [last.index]))
        await mesh.planes[first.address].feed(MODEL, TICKET, 0, 1, {first.index: {graph.inputs[0]: x}})
        return await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 30)

    (error,) = asyncio.run(call())
    assert isinstance(error, RunFailed) and f"worker {middle} holds v1" in str(error)
    assert not any(p.runs for p in mesh.planes.values())


def test_a_block_that_cannot_load_fails_the_run_downstream(planned) -> None:
    """Its spec is not loaded, yet the blocks after it hear of the failure (they would wait forever)."""
    graph, specs, x, _, _ = planned
    first = next(s for s in specs if any(a != s.address for _, a, _ in s.sends))   # read on another worker
    mesh = Mesh(specs, unloadable=first.index)
    with pytest.raises(ClusterTooSmall, match=f"block {first.index} does not fit"):
        asyncio.run(mesh.call(graph, x))
    assert not any(p.runs for p in mesh.planes.values())


def test_a_lost_cache_reaches_the_caller_as_such(planned) -> None:
    """Not as a plain RunFailed, which has the caller wait for a newer plan: a session's cache lost
    with a worker is cured by replaying the session on the plan the caller holds."""
    graph, specs, x, _, _ = planned
    first = next(s for s in specs if any(a != s.address for _, a, _ in s.sends))   # read on another worker
    lost = CacheLost("session 3 of model m: layer 0 holds 0 cached token(s) here", "m", 3, 0)
    mesh = Mesh(specs, fail_on=first.index, fail_with=lost)
    with pytest.raises(CacheLost, match="session 3 of model m") as e:
        asyncio.run(mesh.call(graph, x))
    assert not isinstance(e.value, RunFailed)


def test_a_block_that_fails_after_its_run_was_forgotten_leaves_no_unread_error(planned) -> None:
    """A run forgotten before its block's task started (the caller stopped a decode loop) while the
    block still ran on a compute thread: its failure is nobody's, and asyncio must not log it as
    an exception never retrieved."""
    import gc

    _, specs, x, _, _ = planned
    first = next(s for s in specs if s.imports and all(src < 0 for src in s.sources))
    lost = CacheLost("session 3 of model m: layer 0 holds 0 cached token(s) here", "m", 3, 0)
    mesh = Mesh(specs, fail_on=first.index, fail_with=lost)
    plane = mesh.planes[first.address]
    resident = mesh.resident[first.address]
    plane.host.spec_of = lambda m, v, b: resident.program(m, v, b, mesh.fetch).spec    # NOTE: loaded, as held

    async def forgotten() -> list[dict]:
        unread: list[dict] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: unread.append(context))
        await plane.feed(MODEL, TICKET, 0, 7, {first.index: {t: x for t in first.imports}})
        assert await plane.forget(MODEL, TICKET, [7]) == 1     # before its task took a step
        # NOTE: the block failed on the thread before this, and its result reached the loop first
        await loop.run_in_executor(mesh.pool, lambda: None)
        gc.collect()
        return unread

    assert asyncio.run(forgotten()) == []


def test_runs_in_flight_are_bounded_and_forgotten_runs_are_dropped(planned) -> None:
    _, specs, _, _, _ = planned
    waiting = next(s for s in specs if any(src >= 0 for src in s.sources))    # it waits for a producer
    mesh = Mesh(specs, max_runs=2)
    plane = mesh.planes[waiting.address]

    async def flood() -> Any:
        waits = [asyncio.ensure_future(plane.collect(MODEL, TICKET, 0, r, [waiting.index])) for r in range(3)]
        await asyncio.wait(waits, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        first = waits[0].exception() if waits[0].done() else None
        dropped = await plane.forget(MODEL, TICKET, [1, 2])
        rest = await asyncio.gather(*waits[1:], return_exceptions=True)
        return first, dropped, rest

    first, dropped, rest = asyncio.run(flood())
    assert isinstance(first, RunFailed) and "more than 2 runs in flight" in str(first)
    assert dropped == 2 and all(isinstance(e, RunFailed) for e in rest)
    assert not plane.runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64,
                                   torch.complex64])
def test_tensors_of_every_dtype_cross_the_wire(dtype) -> None:
    x = (torch.randn(3, 5, 2) * 10).to(dtype)
    view = x[:, 1:4].transpose(0, 1)                # NOTE: not contiguous
    got = deserialize(*serialize(Tensors(a=x, b=view, c=x[0, 0, 0], d=x[:0])))
    _, head, *frames = pack([{"op": "push", "tensors": Tensors(a=x, b=view)},
                             {"op": "feed", "inputs": [[3, Tensors(c=x[0, 0, 0], d=x[:0])]]}])
    push, feed = unpack(bytes(head), [bytearray(f) for f in frames])
    assert isinstance(got, Tensors) and push["op"] == "push" and feed["inputs"][0][0] == 3
    streamed = {**push["tensors"], **feed["inputs"][0][1]}
    for k, want in dict(a=x, b=view, c=x[0, 0, 0], d=x[:0]).items():
        assert got[k].dtype == dtype and got[k].shape == want.shape and torch.equal(got[k], want)
        assert streamed[k].dtype == dtype and torch.equal(streamed[k], want)


def test_views_of_one_tensor_cross_the_wire_once_and_arrive_apart() -> None:
    # A decode step sends each layer's view of one rotary table: its bytes go once, and each name
    # still gets a tensor of its own (a block writing one would not change the others).
    cos = torch.randn(1, 1, 64)
    layers = {f"cos{i}": cos.unsqueeze(1) for i in range(15)}
    other = cos[:, :, :32].unsqueeze(1)                     # NOTE: the same memory, another shape
    msgs = [{"op": "push", "tensors": Tensors(h=torch.randn(1, 1, 576), **layers)},
            {"op": "feed", "inputs": [[3, Tensors(c=cos.unsqueeze(1), half=other)]]}]
    frames, total = pack_message(msgs)
    assert len(pack(msgs)) == 2 + 3                      # prefix, header; h, one cos, half
    push, feed = unpack_message(bytearray(b"".join(bytes(f) for f in frames)))
    got = {**push["tensors"], **feed["inputs"][0][1]}
    assert all(torch.equal(got[n], cos.unsqueeze(1)) for n in [*layers, "c"])
    assert torch.equal(got["half"], other)
    got["cos0"].zero_()
    assert torch.equal(got["cos1"], cos.unsqueeze(1))
    assert total < 64 * 16 + 4 * 64 * 15                 # NOTE: far less than fifteen copies of the table
    # what a worker counts as received is what crossed: each frame once, not once per name
    assert nbytes(push["tensors"]) == 4 * (576 + 64) and nbytes(feed["inputs"][0][1]) == 4 * 32
    assert nbytes(Tensors(layers)) == 4 * 64 * 15          # NOTE: not read off a stream: every name
    _, _, *data = pack([{"op": "push", "tensors": Tensors(a=cos, b=cos)}])
    bad = msgpack.packb({"msgs": [{"op": "push", "tensors": 0}],
                         "tensors": [[["a", "float32", [1, 1, 64]], ["b", "float32", [1, 1, 64], 1]]]})
    with pytest.raises(SeaBiscuitError, match="names frame"):
        unpack(bad, [bytearray(f) for f in data])
    bad = msgpack.packb({"msgs": [{"op": "push", "tensors": 0}],
                         "tensors": [[["a", "float32", [1, 1, 64]], ["b", "float32", [64], 0]]]})
    with pytest.raises(SeaBiscuitError, match="names frame"):
        unpack(bad, [bytearray(f) for f in data])


def test_views_that_leave_a_block_as_copies_still_cross_the_wire_once() -> None:
    # A block's exports leave its inference mode as copies: one copy for views of one tensor (each
    # layer's rotary table), so the wire still sends its bytes once.
    from seabiscuit_dask.lower.blocks import _exported

    with torch.inference_mode():
        cos = torch.randn(1, 1, 64)
        env = {"h": torch.randn(1, 1, 576), **{f"cos{i}": cos.unsqueeze(1) for i in range(15)},
               "half": cos[:, :, :32]}
    out = _exported(env, list(env), cpu=False)
    assert not any(t.is_inference() for t in out.values())
    assert len({out[f"cos{i}"].data_ptr() for i in range(15)}) == 1
    assert torch.equal(out["cos3"], cos.unsqueeze(1)) and torch.equal(out["half"], cos[:, :, :32])
    assert len(pack([{"op": "push", "tensors": Tensors(out)}])) == 2 + 3     # h, one cos, half


def test_the_wire_refuses_an_unknown_dtype_or_a_short_buffer() -> None:
    with pytest.raises(SeaBiscuitError, match="dtype 'object'"):
        from_bytes(b"\0" * 8, "object", [1])
    with pytest.raises(SeaBiscuitError, match="arrived with 4 bytes"):
        from_bytes(b"\0" * 4, "float32", [2])
    _, head, *frames = pack([{"op": "push", "tensors": Tensors(a=torch.ones(2), b=torch.ones(3))}])
    with pytest.raises(SeaBiscuitError, match="names more tensors than its 1 frames"):
        unpack(bytes(head), [bytearray(frames[0])])
    with pytest.raises(SeaBiscuitError, match="has 3 frames and names 2 tensors"):
        unpack(bytes(head), [bytearray(f) for f in frames] + [bytearray(4)])
    for bad in ({"msgs": [{"op": "push", "tensors": 0}], "tensors": [[["a", "float32", 5]]]},
                {"msgs": [{"op": "push", "tensors": 3}], "tensors": [[["a", "float32", [2]]]]},
                {"msgs": 7, "tensors": [[["a", "float32", [2]]]]}, {"tensors": []}, [1, 2]):
        with pytest.raises(SeaBiscuitError, match="header is malformed"):
            unpack(msgpack.packb(bad), [bytearray(8)] if bad != {"tensors": []} else [])
    # NOTE: a dtype no activation may have is refused where it would be sent, not at the peer
    with pytest.raises(UnsupportedModel, match="dtype uint16 cannot be sent"):
        pack([{"op": "push", "tensors": Tensors(a=torch.zeros(2, dtype=torch.uint16))}])


def test_a_malformed_frame_from_a_peer_is_a_bad_message() -> None:
    # Every way a peer's bytes can fail to be a data-plane message is a BadMessage. Peers downstream
    # hear of it as RunFailed, as of any failure the caller does not act on by class.
    frames, _ = pack_message([{"op": "push", "tensors": Tensors(a=torch.ones(2))}])
    good = b"".join(bytes(f) for f in frames)
    for buf, why in ((good[:4], "needs 8 at least"), (struct.pack("<Q", 0) + good[8:], "names 0 frames"),
                     (good[:-1], "whose frames take"), (good + bytes(64), "whose frames take")):
        with pytest.raises(BadMessage, match=why):
            unpack_message(bytearray(buf))
    head = msgpack.packb({"msgs": [{"op": "push", "tensors": 0}], "tensors": [[["a", "float32", 2]]]})
    with pytest.raises(BadMessage, match="header is malformed"):
        unpack(head, [bytearray(8)])
    with pytest.raises(BadMessage, match="inline are malformed"):
        from_inline([["a", "float32", [2]]])
    with pytest.raises(BadMessage, match="arrived with 4 bytes"):
        from_inline([["a", "float32", [2], b"\0" * 4]])
    header, wire_frames = serialize(Tensors(a=torch.ones(2)))
    with pytest.raises(BadMessage, match="names 1 tensors and has 2 frames"):
        deserialize(header, [*wire_frames, b""])
    assert not issubclass(BadMessage, RunFailed) and BadMessage.__name__ not in KINDS


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_crosses_the_wire_as_it_was(dtype: str) -> None:
    kind = DTYPES[dtype]
    base = torch.randn(3, 4, 2) * 50
    t = base > 0 if kind is torch.bool else base.to(kind)
    strided = t[:, ::2]                                     # NOTE: not contiguous: sent as if it were
    empty = t[:0]
    frames, _ = pack_message([{"op": "push", "tensors": Tensors(t=t, strided=strided, empty=empty)}])
    (msg,) = unpack_message(bytearray(b"".join(bytes(f) for f in frames)))
    for name, want in (("t", t), ("strided", strided), ("empty", empty)):
        got = msg["tensors"][name]
        assert got.dtype == kind and got.shape == want.shape and torch.equal(got, want), name
    if kind.is_complex:
        lazy = t.conj()                                     # NOTE: a view with its conjugate bit set
        assert torch.equal(from_bytes(bytes(as_bytes(lazy)), dtype, list(t.shape)), lazy.resolve_conj())
    back = from_inline(msgpack.unpackb(msgpack.packb(inline(Tensors(t=t, strided=strided, empty=empty)))))
    for name, want in (("t", t), ("strided", strided), ("empty", empty)):
        assert back[name].dtype == kind and torch.equal(back[name], want), name      # NOTE: a follow's way


def test_tensors_sent_inline_that_do_not_fit_are_refused() -> None:
    ok = inline(Tensors(t=torch.arange(3)))
    for bad in ([["t", "object", [3], ok[0][3]]], [["t", "int64", [4], ok[0][3]]], [["t", "int64", [3]]], 7):
        with pytest.raises(SeaBiscuitError, match="dtype 'object'|arrived with 24 bytes|malformed"):
            from_inline(bad)


def test_a_block_left_with_no_ops_is_never_started(planned) -> None:
    """A block whose views its readers all make again is left empty (``block_specs``): no run
    feeds it, and the request's answer and every other block are as before."""
    from dataclasses import replace

    _, specs, _, _, _ = planned
    empty = replace(specs[0], index=len(specs), ops=(), params={}, imports={}, exports=(), sources=(),
                     sends=(), outputs=())
    wanted = [s.index for s in specs if s.outputs]
    with_empty = route([*specs, empty], wanted)
    assert with_empty == route(specs, wanted)
    assert all(empty.index not in [b for b, _ in feeds] for feeds, _ in with_empty.values())
    reads_nothing = replace(empty, ops=specs[0].ops[:1])    # NOTE: ops that read nothing still start
    assert any(reads_nothing.index in [b for b, _ in feeds]
               for feeds, _ in route([*specs, reads_nothing], wanted).values())


def test_a_run_a_sync_retires_fails_downstream_and_older_runs_are_refused(planned) -> None:
    """A worker's sync to a new plan fails its older runs there and at each worker downstream of
    their blocks: one whose own blocks did not move (it holds the old plan still) would wait for
    them until its caller's progress bound. From then on that worker refuses a run of an older
    plan, though its resident blocks are still the old plan's while the new ones load."""
    _, specs, _, _, _ = planned
    mid = next(s for s in specs if len(s.imports) >= 2 and any(a != s.address for _, a, _ in s.sends))
    consumer, peer = next((c, a) for c, a, _ in mid.sends if a != mid.address)
    mesh = Mesh(specs)
    up, down = mesh.planes[mid.address], mesh.planes[peer]
    up.host.spec_of = lambda m, v, b: mesh.specs[b] if v == 0 else None       # NOTE: resident, as they are
    one = {next(iter(mid.imports)): torch.zeros(1)}                      # one of the block's inputs

    async def retire_a_waiting_run() -> Any:
        waiting = asyncio.ensure_future(down.collect(MODEL, TICKET, 0, 7, [consumer]))
        await up.push(MODEL, TICKET, 0, 7, mid.index, one)
        assert up.runs[(MODEL, 7)].blocks[mid.index].state == "waiting"
        assert up.retire(MODEL, 1) == 1
        return await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 30)

    (error,) = asyncio.run(retire_a_waiting_run())
    assert isinstance(error, StaleRun) and "moved to plan v1" in str(error)
    assert not down.runs and not up.runs
    assert mesh.resident[mid.address].versions.get(MODEL, -1) < 1          # the old blocks still resident
    with pytest.raises(StaleRun, match="names plan v0"):
        asyncio.run(up.push(MODEL, TICKET, 0, 8, mid.index, one))


def test_a_push_that_comes_after_its_run_was_retired_fails_the_blocks_after_it(planned) -> None:
    """A run a sync retired before any of its blocks here was named: a push that comes for one
    later is dropped, and the blocks after that block hear the run failed."""
    _, specs, _, _, _ = planned
    mid = next(s for s in specs if any(a != s.address for _, a, _ in s.sends))
    consumer, peer = next((c, a) for c, a, _ in mid.sends if a != mid.address)
    mesh = Mesh(specs)
    up, down = mesh.planes[mid.address], mesh.planes[peer]

    async def push_after_retiring() -> Any:
        waiting = asyncio.ensure_future(down.collect(MODEL, TICKET, 0, 9, [consumer]))
        await up.feed(MODEL, TICKET, 0, 9, {})          # NOTE: the run is known here, none of its blocks
        assert up.retire(MODEL, 1) == 1
        assert not await up.push(MODEL, TICKET, 0, 9, mid.index, {next(iter(mid.imports)): torch.zeros(1)})
        return await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 30)

    (error,) = asyncio.run(push_after_retiring())
    assert isinstance(error, StaleRun) and "moved to plan v1" in str(error)
    assert not down.runs and not up.runs
