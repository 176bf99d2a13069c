"""The connections of ``seabiscuit serve``: uvicorn's HTTP/1.1 protocol (h11) with a deadline on
each request's headers and a bound on the connections open at once.

uvicorn closes an idle keep-alive connection but leaves one that has sent half a request line
open for ever, and accepts connections without limit: a few hundred sockets that send a byte
now and then would hold as many file descriptors. Here a connection gets
``seabiscuit.serve.header-timeout-s`` to send its request's headers, and when more than
``seabiscuit.serve.max-connections`` are open the oldest one whose request has not arrived in
full (headers or body) is closed. (A request's body has its own deadline in ``app``.)
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import config


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; a connection waiting for a request's headers is closed after
    ``head_timeout_s``, and one whose request has not arrived in full is closed, oldest first, to
    keep at most ``max_connections`` open. ``uvicorn_config`` makes the subclass that sets both."""

    head_timeout_s: float
    max_connections: int
    _order = itertools.count()          # NOTE: which connection began waiting first

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._await_head(after=None)
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._head_arrived()

    def on_response_complete(self) -> None:
        done = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head(after=done)     # NOTE: the next request on this connection ...
            self._head_arrived()             # NOTE: ... unless it was pipelined behind this one

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    # --- the deadline on a request's headers ------------------------------------------------------
    def _await_head(self, after: Any) -> None:
        """Give the request that follows the cycle ``after`` (None: the first) its deadline."""
        self._stop_head_timer()
        self._head_cycle = after
        self._head_since = next(self._order)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _head_arrived(self) -> None:
        """A new request cycle began: its headers are in."""
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    # --- the bound on open connections -------------------------------------------------------------
    @property
    def arriving(self) -> bool:
        """Its request's headers or body are still coming: nothing is being answered on it."""
        if self.transport.is_closing():
            return False
        cycle = self.cycle
        return self._head_timer is not None or (cycle is not None and cycle.more_body
                                                and not cycle.response_complete)

    def _make_room(self) -> None:
        """Over ``max_connections``: close the connection whose request has been arriving longest
        (this new one when every other is being answered)."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) <= self.max_connections:
            return
        arriving = [c for c in open_ if isinstance(c, GuardedH11Protocol) and c.arriving]
        oldest = min(arriving, key=lambda c: c._head_since, default=self)
        oldest.transport.close()


def uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for ``app`` from ``seabiscuit.serve.*``: the guarded h11 protocol, its
    header deadline and connection bound, the keep-alive timeout, the largest headers."""
    protocol = type("ServeH11Protocol", (GuardedH11Protocol,), {
        "head_timeout_s": float(config.get("serve.header-timeout-s")),
        "max_connections": int(config.get("serve.max-connections"))})
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", http=protocol,
                          ws="none", timeout_keep_alive=config.get("serve.keep-alive-timeout-s"),
                          h11_max_incomplete_event_size=config.to_bytes(config.get("serve.max-header-bytes"),
                                                                        "serve.max-header-bytes"))
