"""Flow control of one data-plane stream (``streams.Link``), as plain Python: what to write next.

``FlowState`` is the sending half of one worker's stream to a peer. Messages queue in two
lanes: *urgent* (at most ``priority_bytes``: a decode step's activation, a failure) and
*bulk*. What goes next:

- urgent messages first, whole, in order, past the pipe limit below: a small message waits
  behind at most the bulk bytes already on the wire, never behind a queue of them;
- bulk messages go in chunks of ``chunk_bytes`` (or of the pipe below, where that is larger:
  the same time on the wire), the *streams* (one per request: model and request id) taking
  turns chunk by chunk (round robin), so two requests sharing a link get half of it each and a
  large prefill does not hold a small one back;
- a message may start only while the messages started and not yet taken by the peer stay
  within ``window_bytes`` in its lane (one larger message alone): the receiver never
  buffers more (*credits*, returned by its acknowledgements);
- bulk chunks are written only while the bytes on the wire and not yet acknowledged stay
  within the *pipe*: ``pipe_delay_s`` of the link's measured bandwidth, at least one chunk
  (*adaptive*: a link measured slower keeps fewer bytes queued, so an urgent message
  behind them waits about ``pipe_delay_s`` whatever the link).

The peer acknowledges every unit it reads (a whole message, or a chunk of one) with how long
it held it before acknowledging, and how long its bytes took to come in. The sender times
bulk *busy periods* (from the write that made the wire busy to the acknowledgement that left
it idle, or every ``SAMPLE_CHUNKS`` chunks of a long one) and urgent messages one by one:
bytes and seconds, less the peer's holds, are a sample of the link, which goes to the
scheduler (``placement.links``); a bandwidth-bound one also sets the pipe here, unless it is a
stall (late, though its bytes came in at the link's pace once read: ``placement.links.stall``).
The peer puts off most acknowledgements and sends them together (``streams.Acks``), counting
the wait as held.

>>> f = FlowState(chunk_bytes=4, window_bytes=64, priority_bytes=2, pipe_delay_s=0.0)
>>> _ = f.add("big", 10, stream=("m", 1)); _ = f.add("dot", 1, stream=("m", 2))
>>> [(u.item.token, u.offset, u.length) for u in f.take(now=0.0)][:2]
[('dot', 0, 1), ('big', 0, 4)]
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ...placement.cluster import DEFAULT_LINKS
from ...placement.links import stall

HEADER_BYTES = 17          # NOTE: a unit's header on the wire (``streams.UNIT``)
SAMPLE_CHUNKS = 16         # NOTE: a busy period this many chunks long is a sample, and goes on
URGENT, BULK = 0, 1


@dataclass(eq=False)
class Outgoing:
    """One message queued on a link: its bytes go out as units (``token`` is the caller's)."""

    token: Any
    nbytes: int
    stream: Hashable
    lane: int
    msg_id: int = 0
    sent: int = 0             # bytes handed out as units so far
    acked: int = 0            # bytes the peer acknowledged
    written_at: float = 0.0   # when its first unit was written

    @property
    def started(self) -> bool:
        return self.sent > 0

    @property
    def done(self) -> bool:
        return self.sent >= self.nbytes


@dataclass(frozen=True)
class Unit:
    """``length`` bytes of ``item`` from ``offset``: what one unit header announces."""

    item: Outgoing
    offset: int
    length: int

    @property
    def last(self) -> bool:
        return self.offset + self.length >= self.item.nbytes


@dataclass
class FlowState:
    """The sending half of one stream (see module doc); ``take`` and ``acked`` drive it."""

    chunk_bytes: float
    window_bytes: float
    priority_bytes: float
    pipe_delay_s: float
    whole: bool = False                  # NOTE: units are whole messages (a comm without a raw stream)
    # NOTE: as this end measures it; until it has, the topology's figure between racks
    bandwidth_bytes_per_s: float = DEFAULT_LINKS["network"].bandwidth_bytes_per_s
    urgent: deque[Outgoing] = field(default_factory=deque)
    streams: OrderedDict[Hashable, deque[Outgoing]] = field(default_factory=OrderedDict)
    by_id: dict[int, Outgoing] = field(default_factory=dict)
    open_bytes: list[int] = field(default_factory=lambda: [0, 0])    # per lane: started, not all acked
    pipe_bytes: int = 0                  # bulk bytes written, not yet acknowledged
    urgent_bytes: int = 0                # urgent bytes written, not yet acknowledged
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)   # bytes, s, when, read s
    counters: dict[str, float] = field(default_factory=lambda: {"messages": 0, "bytes": 0, "units": 0,
                                                                 "urgent": 0})
    _next_id: int = 0
    _busy_since: float = 0.0
    _busy_bytes: float = 0.0
    _busy_hold_s: float = 0.0
    _busy_read_s: float = 0.0
    _busy_chunks: int = 0
    _slower: bool = False                # NOTE: the last sample was under half the figure before it
    _pipe_limit: float = 0.0

    def __post_init__(self) -> None:
        self._pipe_limit = self._pipe()

    # --- queueing -------------------------------------------------------------------------------
    def add(self, token: Any, nbytes: int, stream: Hashable) -> Outgoing:
        """Queue a message of ``nbytes`` of ``stream`` (its lane by its size)."""
        self._next_id = (self._next_id + 1) % (1 << 32)
        lane = URGENT if nbytes <= self.priority_bytes else BULK
        item = Outgoing(token, int(nbytes), stream, lane, self._next_id)
        self.by_id[item.msg_id] = item
        if lane == URGENT:
            self.urgent.append(item)
        else:
            self.streams.setdefault(stream, deque()).append(item)
        return item

    @property
    def queued(self) -> int:
        """Messages not yet fully handed out."""
        return len(self.urgent) + sum(len(q) for q in self.streams.values())

    def _may_start(self, item: Outgoing) -> bool:
        held = self.open_bytes[item.lane]
        return held == 0 or held + item.nbytes <= self.window_bytes

    # --- what goes next -----------------------------------------------------------------------
    def take(self, now: float, max_bytes: float | None = None) -> list[Unit]:
        """The units that may be written now, in order (at most about ``max_bytes``, default two
        chunks): urgent messages first, then bulk chunks by turns, within window and pipe."""
        limit = 2 * self.chunk_bytes if max_bytes is None else max_bytes
        if len(self.urgent) == 1 and not self.streams:     # NOTE: the common hop: one small message
            if not self._may_start(self.urgent[0]):
                return []
            item = self.urgent.popleft()
            only = self._unit(item, item.nbytes)
            self._written(only, now)
            return [only]
        out: list[Unit] = []
        size = 0
        while size < limit:
            unit = self._urgent_unit() or self._bulk_unit()
            if unit is None:
                break
            out.append(unit)
            size += unit.length
            self._written(unit, now)
        return out

    def _urgent_unit(self) -> Unit | None:
        if not self.urgent or not self._may_start(self.urgent[0]):
            return None
        item = self.urgent.popleft()
        return self._unit(item, item.nbytes)

    def _bulk_unit(self) -> Unit | None:
        if self.pipe_bytes and self.pipe_bytes + self.chunk_bytes > self._pipe_limit:
            return None
        blocked = False       # NOTE: a stream whose next message may not start yet keeps others from starting
        for key, q in self.streams.items():
            item = q[0]
            if item.started or (not blocked and self._may_start(item)):
                left = item.nbytes - item.sent
                unit = self._unit(item, left if self.whole else int(min(self._chunk, left)))
                if item.done:
                    q.popleft()
                self.streams.move_to_end(key)      # NOTE: the next chunk is another stream's turn
                if not q:
                    del self.streams[key]
                return unit
            blocked = True
        return None

    def _unit(self, item: Outgoing, length: int) -> Unit:
        if not item.started:
            self.open_bytes[item.lane] += item.nbytes
            self.counters["messages"] += 1
            self.counters["urgent"] += item.lane == URGENT
        unit = Unit(item, item.sent, max(length, 0))
        item.sent += unit.length
        return unit

    def _written(self, unit: Unit, now: float) -> None:
        nbytes = unit.length + HEADER_BYTES
        self.counters["bytes"] += nbytes
        self.counters["units"] += 1
        if unit.item.lane == URGENT:
            unit.item.written_at = now
            self.urgent_bytes += nbytes
            return
        if not self.pipe_bytes:
            self._busy_since, self._busy_bytes, self._busy_chunks = now, 0.0, 0
            self._busy_hold_s = self._busy_read_s = 0.0
        self.pipe_bytes += nbytes
        self._busy_bytes += nbytes

    # --- acknowledgements -----------------------------------------------------------------------
    def acked(self, msg_id: int, length: int, hold_s: float, now: float, when: float = 0.0,
              read_s: float = 0.0) -> Outgoing | None:
        """The peer took ``length`` bytes of message ``msg_id`` after holding them ``hold_s`` (and
        reading them in for ``read_s``); returns the message once all of it is taken (its credit
        returns), else None."""
        item = self.by_id.get(msg_id)
        if item is None:
            return None
        nbytes = length + HEADER_BYTES
        item.acked += length
        if item.lane == URGENT:
            self.urgent_bytes = max(0, self.urgent_bytes - nbytes)
            if now - item.written_at - hold_s > 0:
                self.samples.append((float(nbytes), now - item.written_at - hold_s, when, max(read_s, 0.0)))
        else:
            self.pipe_bytes = max(0, self.pipe_bytes - nbytes)
            self._busy_hold_s += max(0.0, hold_s)
            self._busy_read_s += max(0.0, read_s)
            self._busy_chunks += 1
            if not self.pipe_bytes or self._busy_chunks >= SAMPLE_CHUNKS:
                self._sample(now, when)
        if item.acked < item.nbytes:
            return None
        del self.by_id[msg_id]
        self.open_bytes[item.lane] -= item.nbytes
        return item

    def _sample(self, now: float, when: float) -> None:
        """The busy period so far is a sample of the link; a long one goes on from here."""
        acked = self._busy_bytes - self.pipe_bytes
        seconds = now - self._busy_since - self._busy_hold_s
        if acked > 0 and seconds > 0:
            self.samples.append((acked, seconds, when, self._busy_read_s))
            if acked >= self.chunk_bytes / 4 and not self._stalled(acked, seconds):
                self._measured(acked / seconds)     # NOTE: a bandwidth-bound sample sets the pipe
        self._busy_since, self._busy_bytes = now, float(self.pipe_bytes)
        self._busy_hold_s, self._busy_read_s, self._busy_chunks = 0.0, 0.0, 0

    def _stalled(self, nbytes: float, seconds: float) -> bool:
        """Whether the busy period's ``nbytes`` took twice what the measured bandwidth says though the
        receiver read them in at that pace (``placement.links.stall``): an end that did not run (a
        block's compute on a shared core), no slower link."""
        expected = nbytes / self.bandwidth_bytes_per_s
        return seconds > 2 * expected and stall(seconds, self._busy_read_s, expected, expected)

    def _measured(self, bytes_per_s: float) -> None:
        """A bandwidth-bound sample (its bytes over its time, latency and all: on the low side, as a
        pipe should be): a step up of 2x or more is taken at once; a step down of 2x or more when
        the sample before stepped down too (one stalled sample, its receiver computing on a shared
        core or in a collector's pause, is no slower link: the pipe would split the next messages
        and each piece wait for an acknowledgement; stalls the receiver's read times tell never
        come here, see ``_sample``); a smaller step halfway (in log). Cheap, as the sender's own
        view must be; the scheduler fits the link properly (``placement.links``)."""
        old = self.bandwidth_bytes_per_s
        ratio = bytes_per_s / old
        slower = ratio <= 0.5
        if ratio >= 2 or (slower and self._slower):
            self.bandwidth_bytes_per_s = bytes_per_s
        elif not slower:
            self.bandwidth_bytes_per_s = math.sqrt(old * bytes_per_s)
        self._slower = slower
        self._pipe_limit = self._pipe()

    def _pipe(self) -> float:
        """Bytes the wire may hold unacknowledged: ``pipe_delay_s`` of the measured bandwidth, one chunk
        at least."""
        return max(self.chunk_bytes, self.bandwidth_bytes_per_s * self.pipe_delay_s)

    @property
    def _chunk(self) -> float:
        """A bulk unit: ``chunk_bytes``, or the pipe where that is larger (a fast link takes turns
        every ``pipe_delay_s`` as a slow one does, in fewer, larger units)."""
        return self._pipe_limit

    def take_samples(self) -> list[tuple[float, float, float, float]]:
        out, self.samples = self.samples, []
        return out

    def failed(self) -> list[Outgoing]:
        """Every message not yet all taken by the peer (the stream broke): their senders hear of it."""
        out = list(self.by_id.values())
        self.by_id.clear()
        self.urgent.clear()
        self.streams.clear()
        self.open_bytes, self.pipe_bytes, self.urgent_bytes = [0, 0], 0, 0
        return out
