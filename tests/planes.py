"""What tests of ``DataPlane`` s in one event loop share: peers that talk through the streams'
wire format, and blocks that report taking long enough not to run on the event loop."""

from __future__ import annotations

from typing import Any

from seabiscuit_dask.runtime.dataplane import DataPlane
from seabiscuit_dask.runtime.dataplane.wire import pack, unpack

TICKET = "t" * 64


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
