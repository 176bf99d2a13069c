"""Local Dask clusters for tests: worker processes x 1 thread, a budget each, SeaBiscuit installed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import seabiscuit_dask as sb


@contextlib.contextmanager
def seabiscuit_cluster(n_workers: int, budget_bytes: int, *, processes: bool = True,
                       plugin: bool = True, **kwargs: Any) -> Iterator[Any]:
    """A Client of a LocalCluster whose workers each have ``budget_bytes`` (resource MEM)."""
    from distributed import Client, LocalCluster

    security = kwargs.get("security")
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=processes,
                      dashboard_address=None, resources={"MEM": budget_bytes}, **kwargs) as cluster, \
            Client(cluster, security=security) as client:
        if plugin:
            client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        yield client
