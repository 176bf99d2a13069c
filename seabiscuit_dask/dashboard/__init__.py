"""SeaBiscuit on the scheduler's dashboard: the ``/seabiscuit`` page and ``/seabiscuit/api/*``.

``install(scheduler, plugin)`` is called by ``SeaBiscuitSchedulerPlugin.start``, so
the page is there wherever the plugin is (``client.register_plugin`` or
``dask scheduler --preload seabiscuit_dask.plugins.preload``), and it is listed in
the dashboard's menu. The preload also registers the page and its single figures
with distributed's own dashboard application before the scheduler starts
(``register_pages``), so dask-labextension lists the figures as panes. The page
and the routes read ``dashboard.data``.
"""

from __future__ import annotations

import logging
from typing import Any

from .data import Activity, Serving, record_serving, serving_data, snapshot

__all__ = ["PAGE", "Activity", "Serving", "install", "record_serving", "register_pages", "serving_data",
           "snapshot"]

logger = logging.getLogger(__name__)

PAGE = "seabiscuit"


def _dashboard(application: Any) -> Any:
    """The scheduler's Bokeh application (distributed's dashboard), or None."""
    try:
        from bokeh.server.tornado import BokehTornado
    except ImportError:
        return None
    return next((a for a in getattr(application, "applications", ()) if isinstance(a, BokehTornado)), None)


def register_pages() -> bool:
    """Add the page and its panes to distributed's dashboard, for schedulers started from now on."""
    try:
        from distributed.dashboard import scheduler as dashboard
    except ImportError:          # NOTE: no (compatible) bokeh: no dashboard at all
        return False
    from .page import applications

    dashboard.applications.update(applications())
    return True


def install(scheduler: Any, plugin: Any) -> bool:
    """Add the JSON routes and, where the scheduler has a Bokeh dashboard, the page; True if the page."""
    application = getattr(scheduler, "http_application", None)
    if application is None:
        return False
    from .routes import handlers

    dashboard = _dashboard(application)
    prefix = dashboard.prefix if dashboard is not None else ""
    application.add_handlers(r".*", handlers(plugin, prefix))
    if dashboard is None:          # NOTE: no dashboard (or no compatible bokeh): the routes only
        logger.info("seabiscuit: the scheduler has no Bokeh dashboard: JSON routes only, no page")
        return False
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    from .page import seabiscuit_doc

    variables = template_variables(scheduler)
    if PAGE not in variables["pages"]:
        variables["pages"].insert(len(variables["pages"]) - 1, PAGE)     # NOTE: before "info"
    if f"/{PAGE}" in dashboard.app_paths:
        return True                # NOTE: registered before the scheduler started (the preload)
    app = BokehApplication({f"/{PAGE}": seabiscuit_doc}, scheduler, prefix=prefix,
                           template_variables=variables)
    application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return True
