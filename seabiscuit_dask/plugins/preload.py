"""Preload for real deployments: ``dask scheduler --preload seabiscuit_dask.plugins.preload``.

On a scheduler it adds ``SeaBiscuitSchedulerPlugin`` (which installs the worker
plugin on every worker that joins) and the dashboard page. On a worker (``dask worker --preload
seabiscuit_dask.plugins.preload``) it installs ``SeaBiscuitWorkerPlugin`` at
once, so the agent reports before the first heartbeat; both ways agree.
"""

from __future__ import annotations

from typing import Any

from .. import config  # noqa: F401 - registers SeaBiscuit's defaults with dask.config
from ..dashboard import register_pages

# NOTE: a preload is imported before the scheduler builds its dashboard: the page and its panes
# join distributed's own Bokeh application, where dask-labextension finds the panes.
register_pages()


async def dask_setup(server: Any) -> None:
    from distributed import Scheduler, Worker

    if isinstance(server, Scheduler):
        from .scheduler import SeaBiscuitSchedulerPlugin

        # NOTE: preloads run before the scheduler starts its plugins, so start() runs once, there.
        server.add_plugin(SeaBiscuitSchedulerPlugin(), idempotent=True)
    elif isinstance(server, Worker):
        from .worker import SeaBiscuitWorkerPlugin

        await server.plugin_add(SeaBiscuitWorkerPlugin(), name=SeaBiscuitWorkerPlugin.name)
