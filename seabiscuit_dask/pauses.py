"""``no_gc()``: pause Python's cyclic garbage collector around passes that build many objects.

Decomposing or placing a graph of 100k micro-ops allocates millions of small
objects that live as long as the graph; each automatic collection walks all of
them. The passes make no reference cycles worth collecting mid-way, so they run
with the collector paused and leave it as they found it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_gc() -> Iterator[None]:
    """Run the body with automatic garbage collection off (nested uses are fine)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
