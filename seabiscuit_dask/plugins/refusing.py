"""RPC handlers whose expected refusals log one line, not a traceback."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from distributed.core import error_message

from ..errors import SeaBiscuitError

logger = logging.getLogger("seabiscuit_dask.plugins")


def refusing(handler: Any) -> Any:
    """``handler`` as an RPC whose expected refusals (``SeaBiscuitError``) log one line, not a
    traceback; the caller still gets the exception."""
    @functools.wraps(handler)
    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            out = handler(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except SeaBiscuitError as e:
            logger.info("seabiscuit: refused %s: %s: %s", handler.__name__, type(e).__name__, e)
            return error_message(e, status="uncaught-error")
    return run
