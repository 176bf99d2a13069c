"""Who may open a data-plane stream to a worker, what a stream may make it hold, and how its
messages share the worker's event loop.

A stream is admitted only from a peer that proves it is a worker of the cluster, before any unit
is read; a message's buffer fills as its bytes arrive, never from what a header declares; what a
stream holds of messages begun is bounded by the credit window; messages naming made-up models
cost the scheduler nothing; messages read in together are handled a loop turn apart.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import dask.config
import psutil
import pytest
import torch
from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize

import seabiscuit_dask as sb
from seabiscuit_dask.runtime import access
from seabiscuit_dask.runtime.dataplane import Tensors
from seabiscuit_dask.runtime.dataplane.streams import DATA, UNIT, Overrun, Receiving, admit, opener, serve
from seabiscuit_dask.runtime.dataplane.wire import pack_message

from .clusters import seabiscuit_cluster

MiB = 1 << 20
SLACK_BYTES = 64 * MiB          # NOTE: what a process's memory may move by on its own meanwhile
X = torch.zeros(1, 8)


def rss() -> int:
    return psutil.Process().memory_info().rss


async def bomb(address: str, sender: str, headers: list[tuple[int, int, int]], body_bytes: int = 0) -> str:
    """A stranger's stream: the hello a worker sends, then raw unit headers (message id, unit
    bytes, message bytes) and ``body_bytes`` of the first unit; returns how it ended."""
    comm = await connect(address)
    await comm.write({"op": "seabiscuit_dp_stream", "reply": False, "raw": True, "sender": sender})
    for msg_id, length, total in headers:
        comm.stream.write(UNIT.pack(DATA, msg_id, length, total))
    if body_bytes:
        comm.stream.write(bytes(body_bytes))
    try:
        for _ in range(1000):       # NOTE: the nonce, then nothing: the worker ends the stream
            await asyncio.wait_for(comm.read(), 60)
    except CommClosedError:
        return "closed"
    finally:
        comm.abort()
    return "open"


def test_a_stranger_on_a_workers_port_is_dropped_before_any_unit_and_takes_no_memory(caplog) -> None:
    """Four headers declaring 256 MiB each and one declaring 3 GiB grew a worker by 1 GiB (and had
    the nanny kill it) when streams were served unasked; now the stranger is asked for a proof,
    gives none, and is dropped, logged once however often it comes back."""
    headers = [(i, 256 * MiB, 256 * MiB) for i in range(1, 5)] + [(9, 3 << 30, 3 << 30)]
    with dask.config.set({"seabiscuit.runtime.probe-timeout": "0.5s"}), \
            seabiscuit_cluster(1, 64 * MiB, processes=False, protocol="tcp") as client, \
            caplog.at_level(logging.INFO, logger="seabiscuit_dask"):
        model = torch.nn.Linear(8, 4)
        dm = sb.distribute(model, client, X)
        (address,) = client.scheduler_info()["workers"]
        before = rss()
        ended = [asyncio.run(bomb(address, "tcp://10.9.9.9:1", headers, body_bytes=MiB)) for _ in range(3)]
        grown = rss() - before
        torch.testing.assert_close(dm(X), model(X))      # NOTE: the worker serves on
        dm.close()
    assert ended == ["closed"] * 3
    assert grown < SLACK_BYTES, f"the worker grew by {grown / MiB:.0f} MiB"
    dropped = [r for r in caplog.records if "dropped a data-plane stream from tcp://10.9.9.9:1" in r.message]
    assert len(dropped) == 1 and "no valid proof" in dropped[0].message


def test_the_workers_of_a_cluster_prove_themselves_and_a_proof_holds_once() -> None:
    """A worker's opener answers the receiver's nonce with the key both hold; a peer with another
    key, one replaying a proof made for another nonce or receiver, are refused before any unit is
    read."""
    key, me_as = secrets.token_hex(32), "tcp://127.0.0.1:7"

    async def run(prove):
        admitted, refused, got, decided = [], [], asyncio.Event(), asyncio.Event()

        async def receive(msg) -> None:
            got.set()

        async def handler(comm) -> None:
            hello = await comm.read()
            try:
                admitted.append(await admit(comm, hello.get("sender"), verify, 5.0))
            except sb.AccessDenied as e:
                refused.append(str(e))
                comm.abort()
                return
            finally:
                decided.set()
            await serve(comm, bool(hello["raw"]), receive)

        listener = listen("tcp://127.0.0.1:0", handler)
        await listener.start()
        here = listener.contact_address

        def verify(nonce, sender, proof):
            return access.same_token(access.peer_proof(key, nonce, sender, here), proof)

        try:
            comm, _ = await opener(dict, me_as, prove)(here)
            frames, total = pack_message([{"op": "probe", "tensors": Tensors(x=torch.ones(2))}])
            comm.stream.write(b"".join([UNIT.pack(DATA, 1, total, total), *map(bytes, frames)]))
            await asyncio.wait_for(decided.wait(), 60)
            if admitted:
                await asyncio.wait_for(got.wait(), 60)
            comm.abort()
        except CommClosedError:
            pass
        listener.stop()
        return admitted, refused, got.is_set()

    async def honest(nonce, receiver):
        return access.peer_proof(key, nonce, me_as, receiver)

    async def other_key(nonce, receiver):
        return access.peer_proof(secrets.token_hex(32), nonce, me_as, receiver)

    async def replayed(nonce, receiver):
        return access.peer_proof(key, "0" * 32, me_as, receiver)

    async def elsewhere(nonce, receiver):
        return access.peer_proof(key, nonce, me_as, "tcp://127.0.0.1:8")

    assert asyncio.run(run(honest)) == (["tcp://127.0.0.1:7"], [], True)
    for liar in (other_key, replayed, elsewhere):
        admitted, refused, got = asyncio.run(run(liar))
        assert not admitted and not got and len(refused) == 1 and "no valid proof" in refused[0]


async def raw_stream(handler):
    """A listener served by ``handler`` and a comm to it that has said it sends raw units."""
    listener = listen("tcp://127.0.0.1:0", handler)
    await listener.start()
    comm = await connect(listener.contact_address)
    await comm.write({"raw": True})
    return listener, comm


async def served(units: list[tuple[int, int, int, int]], window_bytes: int):
    """A proven peer's raw units (message id, unit bytes, message bytes, body bytes sent) to ``serve``
    over TCP; returns the receiver's ``Receiving`` mid-stream and at the end, how the stream ended,
    and the process's growth in memory while the stream was open."""
    held = Receiving(window_bytes=window_bytes)
    ended: list[BaseException | None] = []
    reading = asyncio.Event()

    async def receive(msg) -> None:
        pass

    async def handler(comm) -> None:
        await comm.read()
        reading.set()
        try:
            await serve(comm, True, receive, held)
            ended.append(None)
        except Overrun as e:
            ended.append(e)
        finally:
            comm.abort()

    listener, comm = await raw_stream(handler)
    await reading.wait()
    before = rss()
    sent = 0
    for msg_id, length, total, body in units:
        comm.stream.write(UNIT.pack(DATA, msg_id, length, total) + bytes(body))
        sent += body
    for _ in range(100_000):       # NOTE: every byte read in, or the stream dropped
        if ended or held.held_bytes >= sent:
            break
        await asyncio.sleep(0.001)
    mid = (held.held_bytes, len(held.partial), rss() - before)
    comm.abort()
    for _ in range(100_000):
        if ended:
            break
        await asyncio.sleep(0.001)
    listener.stop()
    return mid, held, ended


def test_a_declared_size_takes_no_memory_until_its_bytes_come() -> None:
    """A unit declaring a 3 GiB message and bringing 1 MiB holds 1 MiB, in counted bytes and in the
    process's memory; when the stream ends the partial message is let go."""
    (held_bytes, partial, grown), held, ended = asyncio.run(served([(1, 3 << 30, 3 << 30, MiB)], 64 * MiB))
    assert held_bytes == MiB and partial == 1 and grown < SLACK_BYTES
    assert ended == [None] and held.held_bytes == 0 and not held.partial


def test_a_stream_past_its_credit_window_is_dropped() -> None:
    """A message begun alone may be larger than the window (a sender starts one so); a second one
    begun beside it past the window is none a SeaBiscuit worker sends: the stream is dropped."""
    chunk = 256 * 1024
    (_, partial, _), held, ended = asyncio.run(served(
        [(1, chunk, 256 * MiB, chunk), (2, chunk, 256 * MiB, chunk)], 64 * MiB))
    assert len(ended) == 1 and isinstance(ended[0], Overrun) and "credit window" in str(ended[0])
    assert held.held_bytes == 0 and not held.partial
    # NOTE: within the window, messages begun together are read whole
    (held_bytes, partial, _), held, ended = asyncio.run(served(
        [(1, chunk, 2 * chunk, chunk), (2, chunk, 2 * chunk, chunk)], 64 * MiB))
    assert partial == 2 and held_bytes == 2 * chunk and ended == [None]


def test_messages_naming_made_up_models_cost_the_scheduler_nothing(caplog) -> None:
    """The worker tells a made-up model id from one the scheduler issued without asking it; an issued
    model that is gone is asked about once, and refused without asking for a while after."""
    with seabiscuit_cluster(1, 64 * MiB, processes=False) as client:
        model = torch.nn.Linear(8, 4)
        dm = sb.distribute(model, client, X)
        gone = sb.distribute(torch.nn.Linear(8, 3), client, X)
        gone_id = gone.model_id
        gone.close()
        (address,) = client.scheduler_info()["workers"]
        worker = client.cluster.workers[0]
        plugin = worker.plugins["seabiscuit"]
        torch.testing.assert_close(dm(X), model(X))
        asked = plugin.ticket_questions
        rpc = client.rpc(address)
        empty = to_serialize(Tensors({}))
        made_up = [secrets.token_hex(8) for _ in range(200)]
        for named in [*made_up, *[gone_id] * 50]:
            with pytest.raises(sb.AccessDenied):
                client.sync(rpc.seabiscuit_dp_push, model=named, ticket="0" * 64, version=0, request=1,
                            block=0, tensors=empty)
        torch.testing.assert_close(dm(X), model(X))
        questions = plugin.ticket_questions - asked
        dm.close()
    assert questions == 1
    assert access.issued(dm.model_id, plugin.peer_key) and not any(access.issued(m, plugin.peer_key)
                                                                  for m in made_up)


def test_the_loops_other_work_runs_between_messages_already_read_in() -> None:
    """Messages that came in together are handled one loop turn apart: work a message's handling
    woke (a step's tokens for its caller) goes before the next message, whose handling may run a
    block on the loop for tens of milliseconds. Reads of bytes already buffered do not yield, and
    a pipeline's pushes once kept a worker's loop busy 0.6 s while every caller waited."""
    order: list[str] = []

    async def run() -> None:
        done = asyncio.Event()

        async def receive(msg) -> None:
            n = int(msg["request"])
            order.append(f"message {n}")
            asyncio.get_running_loop().call_soon(order.append, f"woken by {n}")
            if n == 3:
                done.set()

        async def handler(comm) -> None:
            await comm.read()
            try:
                await serve(comm, True, receive, Receiving(window_bytes=64 * MiB))
            finally:
                comm.abort()

        listener, comm = await raw_stream(handler)
        wire = b""
        for n in (1, 2, 3):         # NOTE: one write: every message is buffered by the first read
            frames, total = pack_message([{"op": "push", "request": n, "tensors": Tensors(x=torch.ones(2))}])
            wire += UNIT.pack(DATA, n, total, total) + b"".join(bytes(f) for f in frames)
        comm.stream.write(wire)
        await asyncio.wait_for(done.wait(), 60)
        comm.abort()
        listener.stop()

    asyncio.run(run())
    assert order[:5] == ["message 1", "woken by 1", "message 2", "woken by 2", "message 3"]
