"""What tests of ``DataPlane`` s in one event loop share: a worker made of plain functions
(``FunctionHost``), peers that talk through the streams' wire format, and blocks that report
taking long enough not to run on the event loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from seabiscuit_dask.errors import AccessDenied
from seabiscuit_dask.runtime.dataplane import DataPlane
from seabiscuit_dask.runtime.dataplane.wire import pack, unpack

TICKET = "t" * 64


def _nothing_known(model: str, version: int, block: int) -> None:
    return None


def _at_plan_zero(model: str) -> int:
    return 0


def _cached(model: str, version: int, block: int, imports: Any) -> bool:
    return True


async def _no_relay(address: str, msg: dict[str, Any]) -> None:
    raise AccessDenied(f"this worker relays nothing to {address}")


@dataclass
class FunctionHost:
    """A ``runtime.dataplane.host.Host`` of plain functions (each replaceable in a test); with no
    ``describe``, a block is described by loading it."""

    address: str
    executor: Any
    compute: Callable[..., Any]
    send: Callable[..., Any]
    check: Callable[..., Any]
    load_spec: Callable[..., Any]
    spec_of: Callable[..., Any] = _nothing_known
    describe: Callable[..., Any] | None = None
    version_of: Callable[[str], int] = _at_plan_zero
    ready: Callable[..., bool] = _cached
    forward: Callable[..., Any] = _no_relay

    def __post_init__(self) -> None:
        if self.describe is None:
            self.describe = self.load_spec


class Planes:
    """``planes``: address -> ``DataPlane``; a message to one goes through ``wire.pack``."""

    planes: dict[str, DataPlane]

    @staticmethod
    def _slow(compute: Any, seconds: float = 1.0) -> Any:
        """Blocks reported as taking ``seconds``: at 1 s none runs on the event loop (``INLINE_S``, nor
        as a worker's only work, ``ALONE_S``)."""
        def run(*args: Any) -> Any:
            out, record = compute(*args)
            return out, {**record, "compute_s": seconds}
        return run

    @staticmethod
    async def check(model: str, ticket: Any) -> str:
        return TICKET

    def _sender(self, sender: str) -> Any:
        async def send(address: str, op: str, **msg: Any) -> None:
            _, head, *frames = pack([{"op": op.removeprefix("seabiscuit_dp_"), "sender": sender, **msg}])
            for m in unpack(bytes(head), [bytearray(f) for f in frames]):
                await self.planes[address].receive(m)
        return send
