"""Compute threads that take the oldest request's work first.

A worker's blocks of several requests in flight wait for its compute threads. In
the order they became ready (a FIFO pool), a stage runs its first block for every
request that arrived before it runs its second block for the first request: with
8 requests on a 2-stage pipeline, the second stage sits idle until the first has
taken all 8, and the pipeline runs no faster than one worker. Taken by age
(``OrderedExecutor.submit_ordered``: the run's first arrival here), the first
request goes on down the pipeline while the next one starts: each stage stays busy.
Work with no key (a spec to load) goes before any block.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any


class OrderedExecutor(concurrent.futures.Executor):
    """``threads`` threads that run submitted calls lowest key first (ties: in submission order)."""

    def __init__(self, threads: int, name: str = "seabiscuit-dp") -> None:
        self._heap: list[tuple[tuple[float, ...], int, concurrent.futures.Future[Any], Any, Any, Any]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._running = 0
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, int(threads)))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        return self._put((0.0,), fn, args, kwargs)

    def submit_ordered(self, key: float, fn: Callable[..., Any], /, *args: Any,
                       **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` before any call of a larger ``key`` not yet started."""
        return self._put((1.0, float(key)), fn, args, kwargs)

    def pending(self) -> int:
        """Calls submitted and not yet started."""
        return len(self._heap)

    def idle(self) -> bool:
        """No call waits and none runs."""
        return not self._heap and not self._running

    def _put(self, key: tuple[float, ...], fn: Any, args: Any, kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            heapq.heappush(self._heap, (key, next(self._seq), future, fn, args, kwargs))
            self._cv.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, future, fn, args, kwargs = heapq.heappop(self._heap)
                self._running += 1
            outcome = _outcome(future, fn, args, kwargs)
            with self._cv:
                self._running -= 1      # NOTE: before its caller hears of it, who may ask ``idle``
            if outcome is None:
                continue
            if outcome[0]:
                future.set_result(outcome[1])
            else:
                future.set_exception(outcome[1])

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._closed = True
            if cancel_futures:
                for _, _, future, _, _, _ in self._heap:
                    future.cancel()
                self._heap.clear()
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


def _outcome(future: concurrent.futures.Future[Any], fn: Any, args: Any,
             kwargs: Any) -> tuple[bool, Any] | None:
    """(True, result) or (False, the exception) of ``fn(*args, **kwargs)``; None when cancelled."""
    if not future.set_running_or_notify_cancel():
        return None
    try:
        return True, fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        return False, e
