"""How long a request may go without an answer before its workers are probed.

A hung worker (stopped, deadlocked, swapping to death) answers nothing, while Dask
keeps it for minutes. ``Deadline`` gives each request or generation step a bound
from the usual time of its program (the median of its last runs, times
``seabiscuit.runtime.hang-factor``, at least ``hang-floor``); past it the client asks
the scheduler plugin to probe the workers involved (``seabiscuit_stalled``). Only a
worker that does not answer a probe within ``probe-timeout`` is fenced; one that
answers is merely slow, and the wait goes on with the bound doubled, so a loaded
machine raises no false alarm.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Hashable

from dask.utils import parse_timedelta

from .. import config


def seconds(key: str) -> float:
    """A duration setting (``"5s"``, ``"200ms"`` or a number of seconds) in seconds."""
    return float(parse_timedelta(config.get(key), default="seconds"))


class Deadline:
    """Usual run times per program, and the bound a run of it may take before a probe."""

    def __init__(self, keep: int = 32) -> None:
        self._times: dict[Hashable, deque[float]] = {}
        self._keep = keep
        self._lock = threading.Lock()

    def observe(self, program: Hashable, duration_s: float) -> None:
        with self._lock:
            self._times.setdefault(program, deque(maxlen=self._keep)).append(float(duration_s))

    def bound_s(self, program: Hashable) -> float:
        """Seconds a run of ``program`` may take before its workers are probed."""
        floor = seconds("runtime.hang-floor")
        with self._lock:
            seen = list(self._times.get(program, ()))
        if not seen:
            return floor
        return max(floor, float(config.get("runtime.hang-factor")) * statistics.median(seen))
