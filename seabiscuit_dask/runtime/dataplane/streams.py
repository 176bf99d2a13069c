"""One persistent connection per pipeline edge: a worker's one-way data-plane messages to
a peer (block outputs, decode-loop feeds, failures) go down one comm, in order, with no
reply. A request/reply RPC per activation would cost two messages and a connection
taken from the pool each hop.

``Links`` keeps a ``Link`` per peer. ``Link.send`` queues a message and returns once it
is written (or raises when it cannot be: the caller fails the run); a writer task
writes what queued meanwhile as one batch, so a burst of small activations costs one
write. The peer's refusals (a stale plan, a failed run) come back as messages of their
own (``DataPlane.receive``), not as replies.

The connection is one of distributed's comms, opened with the cluster's connection
arguments (so TLS and ``Security`` apply). Over TCP and TLS a batch goes down the
comm's stream as ``wire.pack`` frames: a hop is a few hundred microseconds of Python,
and distributed's general message framing and serializer dispatch were most of it.
Over any other comm (UCX, in-process) batches go through ``comm.write``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from distributed.comm import CommClosedError, connect
from distributed.protocol import to_serialize
from tornado.iostream import StreamClosedError

from ...errors import RunFailed
from .wire import Tensors, pack, read_packed

logger = logging.getLogger(__name__)

HANDLER = "seabiscuit_dp_stream"
Connect = Callable[[str], Awaitable[tuple[Any, bool]]]   # address -> (a comm its handler reads, raw frames)


def opener(connection_args: Callable[[], dict[str, Any]]) -> Connect:
    """How a worker opens a stream to a peer: a comm to its ``HANDLER`` (with the worker's
    ``connection_args()``), raw frames where the comm has a stream."""
    async def open_stream(address: str) -> tuple[Any, bool]:
        comm = await connect(address, **connection_args())
        comm.name = "seabiscuit data plane"
        raw = getattr(comm, "stream", None) is not None
        await comm.write({"op": HANDLER, "reply": False, "raw": raw})
        return comm, raw
    return open_stream


async def read_batch(comm: Any, raw: bool) -> list[Any]:
    """The next batch of messages a ``Link`` wrote; ``CommClosedError`` once the peer is gone."""
    if not raw:
        msgs = await comm.read()
        return list(msgs) if isinstance(msgs, (list, tuple)) else [msgs]
    stream = getattr(comm, "stream", None)
    if stream is None:
        raise CommClosedError(f"the data-plane stream from {comm.peer_address} is closed")
    try:
        return await read_packed(stream)
    except (OSError, StreamClosedError) as e:
        raise CommClosedError(f"the data-plane stream from {comm.peer_address} closed: {e}") from e


async def write_batch(comm: Any, raw: bool, msgs: list[Any]) -> None:
    if not raw:
        await comm.write([_serialized(m) for m in msgs])
        return
    frames = pack(msgs)
    if sum(memoryview(f).nbytes for f in frames) < 1 << 16:
        frames = [b"".join(frames)]
    for f in frames:
        done = comm.stream.write(f)
    await done


def _serialized(msg: dict[str, Any]) -> dict[str, Any]:
    msg = dict(msg)
    if isinstance(msg.get("tensors"), Tensors):
        msg["tensors"] = to_serialize(msg["tensors"])
    if "inputs" in msg:
        msg["inputs"] = [[b, to_serialize(ts)] for b, ts in msg["inputs"]]
    return msg


class Link:
    """The stream to one peer: a queue and the task that writes it."""

    def __init__(self, address: str, connect: Connect) -> None:
        self.address = address
        self.broken: BaseException | None = None
        self._queue: list[tuple[Any, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._comm: Any = None
        self._writing: list[tuple[Any, asyncio.Future[None]]] = []
        self._task = asyncio.ensure_future(self._write(connect))

    async def send(self, msg: Any) -> None:
        """Queue ``msg``; returns once it is on the wire. Raises ``RunFailed`` when the link is broken."""
        if self.broken is not None:
            raise self._error(self.broken)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((msg, fut))
        self._wake.set()
        await fut

    async def _write(self, connect: Connect) -> None:
        try:
            self._comm, raw = await connect(self.address)
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._writing, self._queue = self._queue, []
                if not self._writing:
                    continue
                await write_batch(self._comm, raw, [m for m, _ in self._writing])
                for _, fut in self._writing:
                    if not fut.done():
                        fut.set_result(None)
                self._writing = []
        except BaseException as e:  # noqa: BLE001 - every sender waiting hears of it
            self.broken = e
            lost, self._writing, self._queue = self._writing + self._queue, [], []
            for _, fut in lost:
                if not fut.done():
                    fut.set_exception(self._error(e))
            if not isinstance(e, asyncio.CancelledError):
                logger.info("seabiscuit: data-plane stream to %s broke: %s: %s", self.address,
                            type(e).__name__, e)
        finally:
            if self._comm is not None and not self._comm.closed():
                self._comm.abort()

    def _error(self, e: BaseException) -> RunFailed:
        return RunFailed(f"the data-plane stream to {self.address} is broken ({type(e).__name__}: {e})")

    def close(self) -> None:
        self._task.cancel()


class Links:
    """A ``Link`` per peer, made on first use and made again after it broke."""

    def __init__(self, connect: Connect) -> None:
        self.connect = connect
        self._links: dict[str, Link] = {}

    async def send(self, address: str, msg: Any) -> None:
        link = self._links.get(address)
        if link is None or link.broken is not None:
            link = self._links[address] = Link(address, self.connect)
        await link.send(msg)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
