"""One subscription per client to the scheduler plugin's ``seabiscuit`` topic, shared by its models."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

TOPIC = "seabiscuit"

Handler = Callable[[Mapping[str, Any]], None]

_handlers: dict[str, dict[str, Handler]] = {}      # client id -> model id -> handler
_lock = threading.Lock()


def listen(client: Any, model: str, handler: Handler) -> None:
    """Call ``handler(message)`` for every message about ``model`` on ``client``'s topic."""
    with _lock:
        models = _handlers.setdefault(client.id, {})
        first = not models
        models[model] = handler
    if not first:
        return

    def dispatch(event: Any) -> None:
        msg = event[1]
        if isinstance(msg, Mapping):
            target = _handlers.get(client.id, {}).get(str(msg.get("model")))
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
