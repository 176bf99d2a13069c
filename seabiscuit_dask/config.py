"""Defaults live in ``seabiscuit.yaml`` and are read through ``dask.config``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

from .errors import SeaBiscuitError

_fn = Path(__file__).with_name("seabiscuit.yaml")
with _fn.open() as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


def get(key: str, default: Any = None) -> Any:
    """Read ``seabiscuit.<key>`` from the Dask configuration."""
    return dask.config.get(f"seabiscuit.{key}", default=default)


def to_bytes(value: int | str, what: str = "budget") -> int:
    """Parse a byte count such as ``"16MiB"`` once, at the API boundary."""
    if isinstance(value, bool):
        raise SeaBiscuitError(f"{what} must be a byte count like '16MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        try:
            n = parse_bytes(value)
        except (ValueError, TypeError) as e:
            raise SeaBiscuitError(f"{what} must be a byte count like '16MiB', got {value!r}") from e
    if n <= 0:
        raise SeaBiscuitError(f"{what} must be positive, got {value!r} ({n} bytes)")
    return n


DEVICES = ("auto", "cuda", "cpu")


def device_choice(value: str | None = None) -> str:
    """Where models run: ``value``, else config ``seabiscuit.device``; one of ``DEVICES``.

    ``"auto"``: on a worker's GPU where it has one, else on its CPU; ``"cuda"``: on GPU
    workers only; ``"cpu"``: on CPUs and host memory, GPU workers included.
    """
    choice = value if value is not None else get("device", "auto")
    if not isinstance(choice, str) or choice.lower() not in DEVICES:
        raise SeaBiscuitError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {choice!r}")
    return choice.lower()


def cache_dir() -> Path:
    """Folder for on-disk templates (config ``seabiscuit.cache.directory``)."""
    d = get("cache.directory")
    if d:
        return Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "seabiscuit"
