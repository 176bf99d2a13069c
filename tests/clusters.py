"""Local Dask clusters for tests, and one way to wait for an event with a timeout."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import seabiscuit_dask as sb

TIMEOUT_S = 60.0


@contextlib.contextmanager
def seabiscuit_cluster(n_workers: int, budget_bytes: int, *, processes: bool = True,
                       plugin: bool = True, **kwargs: Any) -> Iterator[Any]:
    """A Client of a LocalCluster whose workers each have ``budget_bytes`` (resource MEM).

    ``client.cluster`` is the LocalCluster; with ``processes=False`` its workers share
    this process, so a test can reach their plugins.
    """
    from distributed import Client, LocalCluster

    security = kwargs.get("security")
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=processes,
                      dashboard_address=None, resources={"MEM": budget_bytes}, **kwargs) as cluster, \
            Client(cluster, security=security) as client:
        if plugin:
            client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        yield client


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = TIMEOUT_S) -> Any:
    """Wait until ``condition()`` is truthy and return it; fail naming ``what`` after ``timeout_s``.

    The condition is re-checked every few milliseconds: this waits for an event the
    test cannot subscribe to, it does not stand in for one.
    """
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        tick.wait(0.005)


def serve_until(dm, x, stop: threading.Event, callers: int = 3, after: int = 2):
    """Callers send requests until ``stop`` is set, then ``after`` more each; (results, errors, threads)."""
    results: list = []
    errors: list = []

    def body() -> None:
        try:
            while not stop.is_set():
                results.append(dm(x).logits)
            for _ in range(after):
                results.append(dm(x).logits)
        except BaseException as e:  # noqa: BLE001 - collected and asserted on
            errors.append(e)

    threads = [threading.Thread(target=body) for _ in range(callers)]
    for t in threads:
        t.start()
    return results, errors, threads


def running_on(client, dm, address: str) -> bool:
    """Whether a block of ``dm`` runs on ``address`` (a task processing there, or a run of the
    data plane seen running within ``WATCH_S``)."""
    if not dm.p2p:
        keys = client.processing(workers=[address]).get(address, ())
        return any(f"sb-{dm.model_id}" in str(k) for k in keys)
    return bool(client.run(_running, dm.model_id, workers=[address]).get(address))


WATCH_S = 0.2


async def _running(model: str, dask_worker=None) -> bool:
    """Watched from a thread of its own while the worker's event loop goes on: a block that runs
    on that loop (a small one, or the worker's only work) is never seen running by a call the
    same loop answers, and a worker under load may run nothing else."""
    import asyncio

    runs = dask_worker.plugins["seabiscuit"].dataplane.runs
    tick = threading.Event()

    def watch() -> bool:
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            if any(b.state == "running" for (m, _), run in list(runs.items()) if m == model
                   for b in list(run.blocks.values())):
                return True
            tick.wait(0.0002)
        return False

    return await asyncio.get_running_loop().run_in_executor(None, watch)


def stop(procs: list[Any]) -> None:
    """Terminate subprocesses (last started first), killing any that do not end in 20 s."""
    import subprocess

    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
