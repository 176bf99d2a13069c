"""One persistent connection per pipeline edge: a worker's one-way data-plane messages to
a peer (block outputs, decode-loop feeds, failures) go down one comm, with no reply. A
request/reply RPC per activation would cost two messages and a connection taken from the
pool each hop.

``Links`` keeps a ``Link`` per peer. ``Link.send`` queues a message and returns once it
is written (or raises when it cannot be: the caller fails the run). What is written next
is ``flow.FlowState``'s to say: small messages first, large ones in chunks with the
requests taking turns, within the peer's credit and the link's measured pipe. The peer
acknowledges every unit it reads (``serve``); the acknowledgements return credit and
time the link, and the samples go to the scheduler (``Links.take_samples``). The peer's
refusals (a stale plan, a failed run) come back as messages of their own
(``DataPlane.receive``), not as replies.

A link may be *relayed* (``Links.routes``, from the scheduler: ``placement.reroute``):
its messages go to the relay with a ``to`` field, and the relay's data plane forwards
them, directly, down its own link to ``to``.

The connection is one of distributed's comms, opened with the cluster's connection
arguments (so TLS and ``Security`` apply). Before any unit is read the receiver admits the
stream (``admit``): it sends a fresh nonce, and the opener answers with its proof (an HMAC of
the nonce, both addresses and the key the scheduler plugin gives only its workers,
``access.peer_proof``); a peer without the key is dropped there. What a stream holds of
messages not yet complete is bounded by the sender's credit window (``Receiving``): a buffer
fills as its bytes arrive, never from what a header declares alone. Over TCP and TLS units go down the comm's
stream as raw frames: a 17-byte header (``UNIT``: kind, message id, length, the
message's total) and that many bytes of the message (``wire.pack_message``); an
acknowledgement says which (``ACK``: kind, message id, length, seconds held, seconds its bytes
took to come in after the header).
Over any other comm (UCX, in-process) whole messages go through ``comm.write`` and
acknowledgements come back the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import struct
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed.comm import CommClosedError, connect
from distributed.protocol import to_serialize
from tornado.iostream import IOStream, StreamClosedError

from ... import config
from ...errors import AccessDenied, BadMessage, RunFailed, SeaBiscuitError
from ..watch import seconds
from .flow import FlowState, Unit
from .wire import MAX_FRAME_BYTES, Frame, Tensors, nbytes, pack_message, unpack_message

logger = logging.getLogger(__name__)

HANDLER = "seabiscuit_dp_stream"
Connect = Callable[[str], Awaitable[tuple[Any, bool]]]   # address -> (a comm its handler reads, raw frames)
Receive = Callable[[Any], Awaitable[None]]
Prove = Callable[[str, str], Awaitable[str]]   # (nonce, receiver address) -> the opener's proof
Verify = Callable[[str, str, Any], bool]   # (nonce, sender address, proof) -> whether it holds
Writable = bytearray | memoryview          # a message's buffer, filled as its units arrive

UNIT = struct.Struct("<BIIQ")      # kind, message id, bytes of this unit, bytes of the whole message
ACK = struct.Struct("<BIIdd")      # kind, message id, bytes taken, seconds held, seconds its bytes came in
DATA, ACKED = 1, 2
JOIN_BYTES = 1 << 16               # NOTE: units smaller than this are joined into one write
READ_BYTES = 1 << 16               # NOTE: what one read of a raw stream takes at most
IOV_MAX = 1024                     # NOTE: the pieces one sendmsg takes at most (Linux's)
ACK_DELAY_S = 0.01                 # NOTE: how long a small message's acknowledgement may be put off
LAZY_BYTES = 1 << 20               # NOTE: a message larger than this fills pages that take memory as written


@dataclass(frozen=True)
class FlowSettings:
    """``seabiscuit.routing.*``: how a stream shares its link (``flow.FlowState``)."""

    chunk_bytes: int
    window_bytes: int
    priority_bytes: int
    pipe_delay_s: float

    @classmethod
    def from_config(cls) -> FlowSettings:
        def size(key: str) -> int:
            return config.to_bytes(config.get(f"routing.{key}"), f"seabiscuit.routing.{key}")

        return cls(size("chunk-bytes"), size("window-bytes"), size("priority-bytes"),
                   seconds("routing.pipe-delay"))

    def state(self, whole: bool = False) -> FlowState:
        return FlowState(self.chunk_bytes, self.window_bytes, self.priority_bytes, self.pipe_delay_s,
                         whole=whole)


def opener(connection_args: Callable[[], dict[str, Any]], sender: str, prove: Prove) -> Connect:
    """How worker ``sender`` opens a stream to a peer: a comm to its ``HANDLER`` (with the worker's
    ``connection_args()``), raw frames where the comm has a stream, admitted once it answers the
    peer's nonce with ``prove(nonce, peer)`` (``admit``)."""
    async def open_stream(address: str) -> tuple[Any, bool]:
        comm = await connect(address, **connection_args())
        comm.name = "seabiscuit data plane"
        raw = getattr(comm, "stream", None) is not None
        try:
            await comm.write({"op": HANDLER, "reply": False, "raw": raw, "sender": sender})
            asked = await asyncio.wait_for(comm.read(), seconds("runtime.probe-timeout"))
            nonce = asked.get("nonce") if isinstance(asked, dict) else None
            if not isinstance(nonce, str):
                raise CommClosedError(f"worker {address} did not ask the data-plane stream for its proof")
            await comm.write({"proof": await prove(nonce, address)})
        except BaseException:
            comm.abort()
            raise
        return comm, raw
    return open_stream


async def admit(comm: Any, sender: Any, verify: Verify, timeout_s: float) -> str:
    """The address of the worker that opened ``comm``, once it proved it is one of the cluster's:
    its answer to a fresh nonce, within ``timeout_s``, holds for ``verify``. Else ``AccessDenied``
    (the caller drops the stream before reading any unit)."""
    if not isinstance(sender, str) or not sender:
        raise AccessDenied(f"a data-plane stream from {comm.peer_address} names no sending worker")
    nonce = secrets.token_hex(16)
    try:
        await comm.write({"nonce": nonce})
        answer = await asyncio.wait_for(comm.read(), timeout_s)
    except asyncio.TimeoutError:
        raise AccessDenied(f"a data-plane stream from {comm.peer_address} (as {sender}) gave no proof "
                           f"within {timeout_s:g} s") from None
    except (CommClosedError, OSError, StreamClosedError):
        raise
    except Exception as e:  # noqa: BLE001 - the bytes of a stranger, read as a message: no proof
        raise AccessDenied(f"a data-plane stream from {comm.peer_address} (as {sender}) gave no valid proof: "
                           f"it sent what is no message ({type(e).__name__})") from None
    proof = answer.get("proof") if isinstance(answer, dict) else None
    if not verify(nonce, sender, proof):
        raise AccessDenied(f"a data-plane stream from {comm.peer_address} (as {sender}) gave no valid proof "
                           "that it is a worker of this cluster")
    return sender


def stream_of(msg: dict[str, Any]) -> Hashable:
    """The stream a message belongs to, for taking turns: its request."""
    return (msg.get("model"), msg.get("request"))


def message_bytes(msg: dict[str, Any]) -> int:
    """About the bytes ``msg`` takes on the wire (its tensors, and a header's worth)."""
    n = 256
    if isinstance(msg.get("tensors"), dict):
        n += nbytes(msg["tensors"])
    for _, ts in msg.get("inputs") or ():
        n += nbytes(ts)
    return n


def _serialized(msg: dict[str, Any]) -> dict[str, Any]:
    msg = dict(msg)
    if isinstance(msg.get("tensors"), Tensors):
        msg["tensors"] = to_serialize(msg["tensors"])
    if "inputs" in msg:
        msg["inputs"] = [[b, to_serialize(ts)] for b, ts in msg["inputs"]]
    return msg


def _settle(sent: list[asyncio.Future[None]], flushed: Any = None) -> None:
    """The messages whose last bytes were flushed (or failed to be: the link breaks, and they hear)."""
    error = flushed.exception() if flushed is not None and not flushed.cancelled() else None
    for fut in sent:
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(RunFailed(f"a data-plane message was not written: {type(error).__name__}: "
                                            f"{error}"))


def _pieces(frames: Sequence[Frame], offset: int, length: int) -> list[memoryview]:
    """The bytes ``offset`` to ``offset + length`` of ``frames`` laid end to end, as views."""
    out, pos, end = [], 0, offset + length
    for f in frames:
        mv = memoryview(f).cast("B")
        lo, hi = max(offset - pos, 0), min(end - pos, mv.nbytes)
        if lo < hi:
            out.append(mv[lo:hi])
        pos += mv.nbytes
        if pos >= end:
            break
    return out


def write(stream: Any, pieces: Sequence[Frame]) -> Any:
    """Write ``pieces`` (bytes-like, in order) to a tornado stream: None where its socket took every
    byte at once, else the future of their flush. Over plain TCP, with nothing of the stream's
    own waiting to go out, they go in one ``sendmsg`` of the socket, not through the stream's
    buffer: the same system call without the buffer's copy and future (a cold 60 us of a decode
    step's 150 us write, after its block run left the caches cold); what the socket does not
    take (or past ``IOV_MAX`` pieces) then goes through the stream, behind them. Over TLS each
    goes through the stream, small pieces joined into one write."""
    if type(stream) is IOStream and not stream.writing() and not stream.closed():
        try:
            n = stream.socket.sendmsg(pieces[:IOV_MAX])     # NOTE: more in one call is refused
        except BlockingIOError:
            n = 0
        except OSError as e:
            stream.close(exc_info=e)
            raise CommClosedError(f"a data-plane write failed: {type(e).__name__}: {e}") from e
        total = sum(memoryview(p).nbytes for p in pieces)
        if n == total:
            return None
        pieces = _pieces(pieces, n, total - n)
    small: list[Frame] = []     # NOTE: headers and small frames go in one write with their neighbours
    done = None
    for p in pieces:
        if memoryview(p).nbytes < JOIN_BYTES:
            small.append(p)
            continue
        if small:
            stream.write(b"".join(small))
            small = []
        done = stream.write(p)
    return stream.write(b"".join(small)) if small else done


class Link:
    """The stream to one peer: a ``FlowState``, the task that writes it and the one that reads acks."""

    def __init__(self, address: str, connect: Connect, settings: FlowSettings) -> None:
        self.address = address
        self.broken: BaseException | None = None
        self.settings = settings
        self.flow: FlowState | None = None          # NOTE: made once connected (raw or whole messages)
        self._pending: list[tuple[Any, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._comm: Any = None
        self._raw = False
        self._task = asyncio.ensure_future(self._write(connect))
        self._reader: asyncio.Future[None] | None = None

    def send(self, msg: Any) -> asyncio.Future[None]:
        """Queue ``msg``, written now where the stream is idle; the future of its being on the wire.
        Raises ``RunFailed`` when the link is broken."""
        if self.broken is not None:
            raise self._error(self.broken)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((msg, fut))
        if self._raw and self.flow is not None and len(self._pending) == 1 and not self.flow.queued:
            # NOTE: an idle stream: written now, not one loop turn later by the writer task (a
            # decode step's hop waits on it; the writer only waits for its wake-up between writes)
            try:
                self._flush_now()
            except BaseException as e:  # noqa: BLE001 - every sender waiting hears of it
                self._break(e)
                self._task.cancel()
        else:
            self._wake.set()
        return fut

    def _flush_now(self) -> None:
        """What the writer task does on a wake-up, here: queue, take and write what the flow lets out
        (the rest goes when acknowledgements make room, from the writer task)."""
        assert self.flow is not None
        self._queue()
        units = self.flow.take(time.perf_counter(), math.inf)
        if units:
            self._written(units, self._write_raw(units))
        if self.flow.queued:
            self._wake.set()

    @staticmethod
    def _written(units: list[Unit], flushed: Any) -> None:
        """The senders of the messages whose last units these are hear once their bytes are flushed:
        now, where the socket took them all (``flushed`` None), else when ``flushed`` resolves."""
        sent = [u.item.token[1] for u in units if u.last]
        if flushed is None:
            _settle(sent)
        else:
            flushed.add_done_callback(lambda f: _settle(sent, f))

    async def _write(self, connect: Connect) -> None:
        try:
            self._comm, self._raw = await connect(self.address)
            self.flow = self.settings.state(whole=not self._raw)
            self._reader = asyncio.ensure_future(self._read_acks())
            self._reader.add_done_callback(self._reader_ended)
            while True:
                self._queue()
                units = self.flow.take(time.perf_counter(), math.inf)
                if not units:
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                if not self._raw:
                    await self._write_whole(units)
                    _settle([u.item.token[1] for u in units if u.last])
                    continue
                # NOTE: not awaited: what the flow lets out goes at once (the pipe bounds it), and a
                # message's sender hears when its last bytes are flushed
                self._written(units, self._write_raw(units))
        except BaseException as e:  # noqa: BLE001 - every sender waiting hears of it
            self._break(e)
        finally:
            if self._reader is not None:
                self._reader.cancel()
            if self._comm is not None and not self._comm.closed():
                self._comm.abort()

    def _queue(self) -> None:
        """Messages sent since the last look go to the flow (as their bytes, over a raw stream)."""
        assert self.flow is not None
        pending, self._pending = self._pending, []
        for msg, fut in pending:
            if self._raw:
                frames, total = pack_message([msg])
                self.flow.add((frames, fut), total, stream_of(msg))
            else:
                self.flow.add((msg, fut), message_bytes(msg), stream_of(msg))

    def _write_raw(self, units: list[Unit]) -> Any:
        """Write ``units`` to the stream: None where the socket took every byte at once, else the
        future of their flush."""
        pieces: list[Frame] = []
        for u in units:
            pieces.append(UNIT.pack(DATA, u.item.msg_id, u.length, u.item.nbytes))
            whole = u.length == u.item.nbytes       # NOTE: most messages go as one unit
            pieces += u.item.token[0] if whole else _pieces(u.item.token[0], u.offset, u.length)
        stream = self._comm.stream
        if stream is None:
            raise CommClosedError(f"the data-plane stream to {self.address} is closed")
        return write(stream, pieces)

    async def _write_whole(self, units: list[Unit]) -> None:
        await self._comm.write([{"unit": u.item.msg_id, "n": u.length, "msg": _serialized(u.item.token[0])}
                                for u in units])

    async def _read_acks(self) -> None:
        """The peer's acknowledgements: credit and pipe back, a sample of the link where one ends."""
        while True:
            for msg_id, length, hold_s, read_s in await self._acks():
                assert self.flow is not None
                self.flow.acked(msg_id, length, hold_s, time.perf_counter(), time.time(), read_s)
            if self.flow is not None and self.flow.queued:     # NOTE: credit or pipe back for what waits
                self._wake.set()

    async def _acks(self) -> list[tuple[int, int, float, float]]:
        if not self._raw:
            msg = await self._comm.read()
            return [(int(i), int(n), float(h), 0.0) for i, n, h in (msg or {}).get("acks", ())]
        stream = self._comm.stream
        if stream is None:
            raise CommClosedError(f"the data-plane stream to {self.address} is closed")
        try:
            kind, msg_id, length, hold_s, read_s = ACK.unpack(await stream.read_bytes(ACK.size))
        except (OSError, StreamClosedError) as e:
            raise CommClosedError(f"the data-plane stream to {self.address} closed: {e}") from e
        if kind != ACKED:
            raise BadMessage(f"worker {self.address} sent a data-plane unit of kind {kind} back")
        return [(msg_id, length, hold_s, read_s)]

    def _reader_ended(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._break(task.exception())  # type: ignore[arg-type]
            self._task.cancel()

    def _break(self, e: BaseException) -> None:
        if self.broken is not None:
            return
        self.broken = e
        lost = [t for t in (self.flow.failed() if self.flow is not None else ())]
        futs = [item.token[1] for item in lost] + [f for _, f in self._pending]
        self._pending = []
        for fut in futs:
            if not fut.done():
                fut.set_exception(self._error(e))
        if not isinstance(e, asyncio.CancelledError):
            logger.info("seabiscuit: data-plane stream to %s broke: %s: %s", self.address,
                        type(e).__name__, e)

    def _error(self, e: BaseException) -> RunFailed:
        return RunFailed(f"the data-plane stream to {self.address} is broken ({type(e).__name__}: {e})")

    def close(self) -> None:
        self._task.cancel()


class Links:
    """A ``Link`` per peer, made on first use and made again after it broke; ``routes`` (peer ->
    relay) from the scheduler say which peers are reached through another worker."""

    def __init__(self, connect: Connect, settings: FlowSettings | None = None) -> None:
        self.connect = connect
        self.settings = settings or FlowSettings.from_config()
        self.routes: dict[str, str] = {}
        self.watch: set[str] = set()           # NOTE: peers whose links a repair left: probed when idle
        self._links: dict[str, Link] = {}
        self._sent_at: dict[str, float] = {}   # NOTE: peer -> when a message last went down its link
        self.relayed = 0

    def send(self, address: str, msg: Any, direct: bool = False) -> asyncio.Future[None]:
        """Send ``msg`` to ``address``, through its relay unless ``direct`` (a relay's own forward):
        ``Link.send``."""
        via = None if direct else self.routes.get(address)
        if via is not None:
            msg, address = {**msg, "to": address}, via
            self.relayed += 1
        link = self._links.get(address)
        if link is None or link.broken is not None:
            link = self._links[address] = Link(address, self.connect, self.settings)
        self._sent_at[address] = time.monotonic()
        return link.send(msg)

    def idle(self, now: float, after_s: float) -> list[str]:
        """Watched peers whose links carried nothing for ``after_s`` (monotonic ``now``): to probe,
        so a link the plans left is still measured and its recovery seen."""
        return sorted(a for a in self.watch if now - self._sent_at.get(a, -math.inf) >= after_s)

    def take_samples(self) -> dict[str, list[tuple[float, float, float, float]]]:
        """Per peer: the link samples (bytes, seconds, when, read seconds) taken since the last call."""
        out = {}
        for addr, link in self._links.items():
            if link.flow is not None and link.flow.samples:
                out[addr] = link.flow.take_samples()
        return out

    def counters(self) -> dict[str, dict[str, float]]:
        """Per peer: messages, bytes and units written directly to it, and how many went urgent."""
        return {addr: dict(link.flow.counters) for addr, link in self._links.items() if link.flow is not None}

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


class Overrun(SeaBiscuitError):
    """A stream sent more than its credit window lets a sender have open: it is dropped."""


@dataclass
class Receiving:
    """What the receiving end of one stream holds: bytes of messages read and not yet handed on.

    ``partial``: per message begun and not complete, its buffer, the bytes in it so far and its
    declared total. A message sent in more than one unit may begin only while the totals of those
    already begun stay within ``window_bytes``, or alone: the sender's own rule (``flow``), so a
    stream that breaks it is no SeaBiscuit worker's (``Overrun``). ``held_bytes`` counts bytes
    as they arrive, not as declared."""

    held_bytes: int = 0
    peak_bytes: int = 0
    messages: int = 0
    window_bytes: float = math.inf
    partial: dict[int, tuple[Writable, int, int]] = field(default_factory=dict)

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def begin(self, msg_id: int, total: int, length: int) -> Writable:
        """A buffer for a new message of ``total`` bytes whose first unit brings ``length``."""
        if length < total and self.partial:
            open_bytes = sum(t for _, _, t in self.partial.values())
            if open_bytes + total > self.window_bytes:
                raise Overrun(f"a data-plane stream began a message of {total} bytes with "
                              f"{len(self.partial)} others of {open_bytes} bytes open: past the credit "
                              f"window of {int(self.window_bytes)} bytes a SeaBiscuit worker keeps to")
        return buffer(total)


def buffer(nbytes: int) -> Writable:
    """A writable buffer of ``nbytes``, not written to: its pages take memory only as bytes are
    written into them (fresh ones from the system; ones the heap reused hold memory already), so
    what a header declares costs nothing until it comes."""
    if nbytes <= LAZY_BYTES:
        return bytearray(nbytes)
    try:
        return np.empty(nbytes, dtype=np.uint8).data     # a memoryview of the array, typed as one
    except (MemoryError, ValueError) as e:
        raise Overrun(f"a data-plane message of {nbytes} bytes has no room here: {e}") from e


class Acks:
    """The acknowledgements of one stream's receiving end, written in batches: a large message's
    units' on the loop's next turn (the sender's pipe waits on them), small messages' put off up to
    ``ACK_DELAY_S`` or till the next prompt one, so a hop of small messages costs one write in many.
    A small message's acknowledgement counts the time it was put off as held: it still times the
    link. When it falls due it goes after the work already queued on the loop: a block run on the
    loop that outlasted the delay queues its sends as it ends, and they go first (before, a decode
    step's activation waited 0.1 ms behind this write in 38 of 61 steps)."""

    def __init__(self, comm: Any, raw: bool, small_bytes: int) -> None:
        self.comm, self.raw, self.small_bytes = comm, raw, small_bytes
        self.pending: list[tuple[int, int, float, float, float]] = []   # id, length, held, read, since
        self._soon = False
        self._later: asyncio.TimerHandle | None = None
        self._writing: set[Any] = set()

    def add(self, msg_id: int, length: int, hold_s: float, read_s: float, total: int) -> None:
        loop = asyncio.get_running_loop()
        small = total <= self.small_bytes
        self.pending.append((msg_id, length, hold_s, read_s, time.perf_counter() if small else math.nan))
        if small:
            if not self._soon and self._later is None:
                self._later = loop.call_later(ACK_DELAY_S, self._due)
        elif not self._soon:
            self._soon = True
            loop.call_soon(self.flush)

    def _due(self) -> None:
        self._later, self._soon = None, True
        asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        if self._later is not None:
            self._later.cancel()
        self._soon, self._later = False, None
        batch, self.pending = self.pending, []
        if not batch:
            return
        now = time.perf_counter()
        acks = [(i, n, h + (now - t if t == t else 0.0), r) for i, n, h, r, t in batch]
        try:
            if self.raw:
                write(self.comm.stream, [b"".join(ACK.pack(ACKED, *a) for a in acks)])
            else:
                task = asyncio.ensure_future(self.comm.write({"acks": [list(a[:3]) for a in acks]}))
                self._writing.add(task)
                task.add_done_callback(self._writing.discard)
        except (OSError, StreamClosedError, CommClosedError, AttributeError):
            pass      # NOTE: the reader hears of a closed stream on its next read


async def serve(comm: Any, raw: bool, receive: Receive, held: Receiving | None = None,
                small_bytes: int = 0) -> None:
    """Read a peer's stream until it closes: each message to ``receive``, each unit acknowledged
    (``Acks``; after ``receive`` for a message's last one, with the seconds it took). Messages of
    at most ``small_bytes`` are the urgent ones (``FlowSettings.priority_bytes``). A stream that
    sends what no SeaBiscuit worker does raises ``Overrun`` (its caller drops it); what it held
    of messages not yet complete is let go either way."""
    held = held if held is not None else Receiving()
    acks = Acks(comm, raw, small_bytes)
    got = bytearray()               # NOTE: bytes read off a raw stream and not yet cut into units
    try:
        while True:
            if raw:
                if await _read_unit(comm, held, receive, acks.add, got):
                    # NOTE: a message handled (maybe a block run on the loop): the loop's other work
                    # (a step's tokens to the caller, replies) goes before the next one already read
                    # in; a read of buffered bytes does not yield, and a pipeline's pushes kept
                    # coming 0.6 s while every caller waited
                    await asyncio.sleep(0)
            else:
                units = await comm.read()
                if not isinstance(units, (list, tuple)):
                    raise Overrun(f"a data-plane stream sent a {type(units).__name__} where a worker sends "
                                  "a list of units")
                for unit in units:
                    t = time.perf_counter()
                    await receive(unit["msg"])
                    held.messages += 1
                    acks.add(int(unit["unit"]), int(unit["n"]), time.perf_counter() - t, 0.0, int(unit["n"]))
                await asyncio.sleep(0)
    except (CommClosedError, OSError, StreamClosedError):
        return
    finally:
        acks.flush()
        held.partial.clear()        # NOTE: what is left held is of messages begun: let go with the stream
        held.held_bytes = 0


async def _read_unit(comm: Any, held: Receiving, receive: Receive,
                     ack: Callable[[int, int, float, float, int], None], got: bytearray) -> bool:
    """One unit of a raw stream to its message; a message's last one to ``receive`` (True then).
    ``got``: the bytes read and not yet cut into units. A read takes whatever has come in
    (``READ_BYTES`` at most): a small message comes with its header in one read, not two (each a
    loop turn, a cold 50 us at a decode step's hop); the rest of a large unit is read straight
    into its message."""
    stream = comm.stream
    if stream is None:
        raise CommClosedError("the data-plane stream is closed")
    while len(got) < UNIT.size:
        got += await stream.read_bytes(READ_BYTES, partial=True)
    kind, msg_id, length, total = UNIT.unpack_from(got)
    started = time.perf_counter()
    if kind != DATA or not 0 < total <= MAX_FRAME_BYTES or length > total:
        raise Overrun(f"a data-plane unit of kind {kind}, {length} of {total} bytes: not one a SeaBiscuit "
                      "worker sends")
    have = min(length, len(got) - UNIT.size)
    buf, filled, declared = held.partial.pop(msg_id, (None, 0, total))
    if buf is None:
        buf = held.begin(msg_id, total, length)
    if declared != total or filled + length > total:
        raise Overrun(f"a data-plane message of {declared} bytes sent {filled + length} (a unit said "
                      f"{total})")
    held.partial[msg_id] = (buf, filled, total)      # NOTE: let go with the stream, if it ends midway
    if have:
        buf[filled:filled + have] = got[UNIT.size:UNIT.size + have]
        held.hold(have)
    del got[:UNIT.size + have]
    at, end = filled + have, filled + length
    while at < end:                  # NOTE: counted as it comes in
        n = await stream.read_into(memoryview(buf)[at:end], partial=True)
        held.hold(n)
        at += n
    filled += length
    t = time.perf_counter()
    if filled < total:
        held.partial[msg_id] = (buf, filled, total)
        ack(msg_id, length, 0.0, t - started, total)
        return False
    del held.partial[msg_id]
    try:
        try:
            msgs = unpack_message(buf)
        except BadMessage as e:
            raise Overrun(f"a malformed data-plane message ({e})") from e
        for m in msgs:
            await receive(m)
    finally:
        held.held_bytes -= total     # NOTE: the data plane holds it now (its runs are bounded)
    held.messages += 1
    ack(msg_id, length, time.perf_counter() - t, t - started, total)
    return True
