"""``seabiscuit serve``: an OpenAI-compatible HTTP server over deployed models.

``api`` reads and checks request bodies and writes OpenAI's answers and errors; ``models``
turns a checked request into a deployment's calls; ``app`` is the ASGI app (Starlette);
``connections`` bounds uvicorn's connections and their headers; ``server`` loads and deploys
models and runs the app on uvicorn. The server owns no model logic.

>>> from seabiscuit_dask.serve import Server, ServedModel, make_app     # doctest: +SKIP
>>> app = make_app(Server([ServedModel("smol", dm, tok, "generate", context=1024)]))  # doctest: +SKIP
"""

from .app import Server, make_app
from .models import ServedModel

__all__ = ["ServedModel", "Server", "make_app"]
