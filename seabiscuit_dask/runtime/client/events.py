"""One subscription per client to the scheduler plugin's ``seabiscuit`` topic, shared by its models."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

TOPIC = "seabiscuit"

Handler = Callable[[Mapping[str, Any]], None]

# NOTE: a model's handler is held weakly (a bound method, by ``weakref.WeakMethod``): a model its
# caller drops is not kept alive by its subscription
_handlers: dict[str, dict[str, Callable[[], Handler | None]]] = {}      # client id -> model id -> handler
_lock = threading.Lock()


def listen(client: Any, model: str, handler: Handler) -> None:
    """Call ``handler(message)`` for every message about ``model`` on ``client``'s topic."""
    with _lock:
        models = _handlers.setdefault(client.id, {})
        first = not models
        models[model] = weakref.WeakMethod(handler) if hasattr(handler, "__self__") else (lambda: handler)
    if not first:
        return

    def dispatch(event: Any) -> None:
        msg = event[1]
        if isinstance(msg, Mapping):
            ref = _handlers.get(client.id, {}).get(str(msg.get("model")))
            target = ref() if ref is not None else None
            if target is not None:
                target(msg)

    client.subscribe_topic(TOPIC, dispatch)


def unlisten(client: Any, model: str) -> None:
    with _lock:
        models = _handlers.get(client.id, {})
        models.pop(model, None)
        last = not models
        if last:
            _handlers.pop(client.id, None)
    if last and client.status == "running":
        client.unsubscribe_topic(TOPIC)
