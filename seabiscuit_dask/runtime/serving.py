"""What the command-line tools share on the client's side: reach a cluster or start one, size its
workers, and say what they do.

``seabiscuit demo``, ``seabiscuit generate`` (``demo.py``), ``seabiscuit serve``
(``serve/server.py``) and ``seabiscuit plan --cluster tcp://...`` (``cli.py``) join a scheduler
with ``connect`` or start an embedded one with ``local_cluster``. The scheduler plugin they
install is theirs to pass: the runtime never imports ``plugins/``.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import SeaBiscuitError
from ..ir import fmt_bytes

# NOTE: long enough for a scheduler across a data centre, short enough that a typo fails fast.
CONNECT_TIMEOUT_S = 5


class SchedulerUnreachable(SeaBiscuitError):
    """Nothing answered at the ``--scheduler`` address."""


def say(msg: str) -> None:
    """Print a line of progress at once (a command's output reaches its reader as it happens)."""
    print(msg, flush=True)


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """A ``Client`` of the scheduler at ``address``, or ``SchedulerUnreachable`` within ``timeout_s``."""
    from distributed import Client

    try:
        return Client(address, timeout=f"{timeout_s}s")
    except ValueError as e:
        raise SchedulerUnreachable(f"--scheduler {address!r} is not a scheduler address ({e})") from e
    except (OSError, TimeoutError) as e:
        raise SchedulerUnreachable(
            f"no Dask scheduler answered at {address} within {timeout_s:g} s: start one with "
            "`dask scheduler --preload seabiscuit_dask.plugins.preload`, or drop --scheduler to use "
            "an embedded cluster") from e


@contextlib.contextmanager
def sigint_ignored_by_children() -> Iterator[None]:
    """Start processes here that ignore SIGINT: Ctrl-C stops only this one, which closes them cleanly."""
    if threading.current_thread() is not threading.main_thread():
        yield                          # NOTE: only the main thread may change signal handlers
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)   # NOTE: an ignored signal survives exec
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def local_cluster(workers: int, budget_bytes: int, scheduler_plugin: Any) -> Iterator[Any]:
    """A Client of an embedded LocalCluster of ``workers`` processes of ``budget_bytes`` each, with
    ``scheduler_plugin`` (``SeaBiscuitSchedulerPlugin()``) registered."""
    from distributed import Client, LocalCluster

    say(f"starting a LocalCluster: {workers} worker processes x 1 thread, "
        f"{fmt_bytes(budget_bytes)} of budget each ...")
    with sigint_ignored_by_children():
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               resources={"MEM": budget_bytes}, dashboard_address=":8787")
    with cluster, Client(cluster) as client:
        client.register_plugin(scheduler_plugin)
        yield client


def worker_budget_bytes(weight_bytes: int, workers: int) -> int:
    """Room for a share of the model with some slack, never all of it."""
    per_worker = int(weight_bytes * 1.6 / workers) + 16 * 2**20
    return per_worker if per_worker < weight_bytes else int(weight_bytes * 0.75)


def page_link(dashboard_link: str) -> str:
    """The SeaBiscuit page of the dashboard at ``dashboard_link`` (which ends in ``/status``)."""
    return dashboard_link.rsplit("/", 1)[0] + "/seabiscuit"


def accepts(model: Any, name: str) -> bool:
    """Whether ``model``'s ``forward`` takes an argument ``name`` (``logits_to_keep``, say)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return False
