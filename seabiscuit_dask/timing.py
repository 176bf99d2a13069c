"""``median_s(fn, reps)``: the median wall time of a few calls, for the stages that measure.

The layout choice (``lower/layout.py``) times matmuls on a worker, and the resource agent and
cluster discovery (``runtime/``) time kernels and round trips: each reads this one helper, so a
lower stage never imports the runtime to time something.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_s(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
