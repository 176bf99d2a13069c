"""A prompt's chunks sent at once (``DataPlane.feed(after=...)``): each worker holds a chunk's
blocks until the chunk before has cached what they read. Two ``DataPlane`` s in one event
loop run a two-block prefill (worker A: b0, worker B: b1, each caching 4 tokens of its
layer); a block that starts before its slots' history is cached fails as a real one does
(``CacheLost``), so a chunk run out of order cannot pass unseen."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from seabiscuit_dask.ir import Op, TensorSpec
from seabiscuit_dask.lower.blocks import BlockSpec
from seabiscuit_dask.lower.kvcache import CacheLost, KVStore, kv_layers
from seabiscuit_dask.runtime.dataplane import DataPlane, RunFailed, timed
from seabiscuit_dask.runtime.dataplane.ordered import OrderedExecutor

from .planes import TICKET, FunctionHost, Planes

MODEL, CHUNK = "m", 4
A, B = "tcp://a:1", "tcp://b:1"
STEP = {"sb_sessions": -1, "sb_start": -1}


Sends = tuple[tuple[int, str, tuple[str, ...]], ...]


def spec(index: int, address: str, imports: dict[str, int], exports: tuple[str, ...], sends: Sends = (),
         outputs: tuple[str, ...] = ()) -> BlockSpec:
    return BlockSpec(MODEL, 0, index, "cpu", (), {}, {t: TensorSpec((1, 1), "float32") for t in imports},
                     exports, tuple(imports.values()), address, sends=sends, outputs=outputs)


SPECS = {0: spec(0, A, {"x": -1, **STEP}, ("h",), sends=((1, B, ("h",)),)),
         1: spec(1, B, {"h": 0, **STEP}, ("y",), outputs=("y",))}


class Pair(Planes):
    """Workers A and B, each with the slots its layer has cached of session 0."""

    def __init__(self) -> None:
        self.cached = {A: 0, B: 0}
        self.ran: list[tuple[str, int, int]] = []         # (worker, block, request)
        self.pools = {a: OrderedExecutor(1, f"follow-{a}") for a in (A, B)}
        self.planes = {a: DataPlane(self._host(a)) for a in (A, B)}

    def _host(self, address: str) -> FunctionHost:
        return FunctionHost(address, self.pools[address], self._slow(timed(self._compute(address), address)),
                            self._sender(address), self.check, lambda m, v, b: SPECS[b],
                            spec_of=lambda m, v, b: SPECS[b] if SPECS[b].address == address else None,
                            ready=self._ready(address))

    def _ready(self, address: str) -> Any:
        return lambda m, v, b, imports: self.cached[address] >= int(imports["sb_start"])

    def _compute(self, address: str) -> Any:
        def run(model, version, request, b, imports):
            start = int(imports["sb_start"])
            if start > self.cached[address]:
                raise CacheLost(f"session 0: {self.cached[address]} slots cached, a step starts at {start}",
                                MODEL, 0, self.cached[address])
            self.cached[address] = max(self.cached[address], start + CHUNK)
            self.ran.append((address, b, request))
            return ({"h": imports["x"] + 1} if b == 0 else {"y": imports["h"] * 2}), "computed"
        return run

    async def feed(self, address: str, request: int, chunk: int, collect: bool = False,
                   after: int = -1) -> Any:
        step = {"sb_sessions": torch.tensor(0), "sb_start": torch.tensor(chunk * CHUNK)}
        inputs = {0: {"x": torch.tensor(float(chunk)), **step}} if address == A else {1: step}
        out = await self.planes[address].feed(MODEL, TICKET, 0, request, inputs, [1] if collect else [],
                                              after=after)
        return out[1]["y"] if collect else None

    def run(self, main: Any) -> None:
        try:
            asyncio.run(main)
        finally:
            for p in self.pools.values():
                p.shutdown(wait=True)


def test_a_chunk_sent_before_the_one_it_follows_waits_for_its_cache_writes() -> None:
    pair = Pair()

    async def main() -> None:
        # the second chunk reaches both workers first: on its own it would run first, and fail
        await pair.feed(A, 2, 1, after=1)
        held = pair.planes[A].runs[(MODEL, 2)]
        assert held.blocks[0].deferred and held.progress()[0] == 1 and not pair.ran
        second = asyncio.ensure_future(pair.feed(B, 2, 1, collect=True, after=1))
        first = asyncio.ensure_future(pair.feed(B, 1, 0, collect=True))
        await pair.feed(A, 1, 0)
        got = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert [float(y) for y in got] == [2.0, 4.0]

    pair.run(main())
    assert [r for r in pair.ran if r[0] == A] == [(A, 0, 1), (A, 0, 2)]
    assert [r for r in pair.ran if r[0] == B] == [(B, 1, 1), (B, 1, 2)]
    assert pair.cached == {A: 2 * CHUNK, B: 2 * CHUNK}
    assert not pair.planes[A].held and not pair.planes[B].held and not pair.planes[A].runs


def test_a_chunk_whose_predecessor_ended_first_fails_on_every_worker() -> None:
    pair = Pair()

    async def main() -> None:
        await pair.feed(A, 2, 1, after=1)
        second = asyncio.ensure_future(pair.feed(B, 2, 1, collect=True, after=1))
        await pair.planes[A].forget(MODEL, TICKET, [1])      # the caller let the first chunk go
        with pytest.raises(RunFailed, match="follows request 1"):
            await asyncio.wait_for(second, 30)

    pair.run(main())
    assert not pair.ran and pair.cached == {A: 0, B: 0}
    assert not pair.planes[A].held and (MODEL, 2) not in pair.planes[A].runs


def test_a_block_is_ready_once_every_live_row_is_cached_up_to_its_start_in_its_layers() -> None:
    def attention(layer: int) -> Op:
        names = ("q", "k", "v", "sb_sessions", "sb_start", "sb_valid")
        args = [*({"t": n} for n in names), layer, None, None]
        return Op(f"attn{layer}", "kv_attention", "sb.kv_attention", names, (f"o{layer}",), (),
                  {"args": args, "kwargs": {}})

    block = BlockSpec(MODEL, 0, 0, "cpu", (attention(3), attention(5)), {}, {}, (), ())
    assert kv_layers(block) == (3, 5) and kv_layers(SPECS[0]) == ()
    store = KVStore()
    kv = torch.zeros(1, 6, 2)
    store.write(MODEL, 7, 3, 0, kv, kv)
    step = {"sb_sessions": torch.tensor([7, -1]), "sb_start": torch.tensor([6, 99])}
    assert not store.ready(MODEL, block, step)               # layer 5 has none of session 7 yet
    store.write(MODEL, 7, 5, 0, kv[:, :4], kv[:, :4])
    assert not store.ready(MODEL, block, step)               # 4 slots of 6
    store.write(MODEL, 7, 5, 4, kv[:, :2], kv[:, :2])
    assert store.ready(MODEL, block, step)                   # the empty row (-1) waits for nothing
    assert store.ready(MODEL, SPECS[0], step) and store.ready(MODEL, block, {})


def test_a_chunk_whose_predecessor_finished_without_caching_its_slots_fails_instead_of_waiting() -> None:
    pair = Pair()

    async def main() -> None:
        await pair.feed(A, 2, 2, after=1)                  # slots 8.. after request 1, which caches 0..3
        second = asyncio.ensure_future(pair.feed(B, 2, 2, collect=True, after=1))
        first = asyncio.ensure_future(pair.feed(B, 1, 0, collect=True))
        await pair.feed(A, 1, 0)
        assert float(await asyncio.wait_for(first, 30)) == 2.0
        with pytest.raises(RunFailed, match="follows request 1, which ended"):
            await asyncio.wait_for(second, 30)

    pair.run(main())
    assert pair.ran == [(A, 0, 1), (B, 1, 1)] and not pair.planes[A].held and not pair.planes[B].held
