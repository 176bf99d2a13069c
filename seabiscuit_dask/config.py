"""Defaults live in ``seabiscuit.yaml`` and are read through ``dask.config``."""

from __future__ import annotations

import operator
import os
import re
from pathlib import Path
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

from .errors import BadConfig, BadInput

_fn = Path(__file__).with_name("seabiscuit.yaml")
with _fn.open() as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


def get(key: str, default: Any = None) -> Any:
    """Read ``seabiscuit.<key>`` from the Dask configuration."""
    return dask.config.get(f"seabiscuit.{key}", default=default)


MAX_BYTES = 2**48
"""Largest byte count a budget or a device's memory may be: 256 TiB, above any one machine's."""
MAX_BYTES_TEXT = f"{MAX_BYTES // 2**40} TiB ({MAX_BYTES} bytes)"


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is a Python or numpy int; a bool is not one."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _whole(value: Any) -> int | None:
    """``_integer``, or a float that is a whole number."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else None     # NOTE: False for inf and nan
    return _integer(value)


def _byte_count(value: Any) -> int | None:
    """``value`` as bytes: a number (``_whole``) or a string ``parse_bytes`` reads; else None."""
    if not isinstance(value, str):
        return _whole(value)
    try:
        return parse_bytes(value)
    except (ValueError, OverflowError):      # NOTE: "1e400" parses to inf, which int() refuses
        return None


def to_bytes(value: int | str, what: str = "budget") -> int:
    """Parse a byte count such as ``"16MiB"`` once, at the API boundary: positive, at most
    ``MAX_BYTES``."""
    n = _byte_count(value)
    if n is None:
        raise BadConfig(f"{what} must be a byte count like '16MiB', got {value!r}")
    if n > MAX_BYTES:
        raise BadConfig(f"{what} must be a byte count like '16MiB' of at most {MAX_BYTES_TEXT}, "
                        f"got {value!r} ({n:.3g} bytes)")
    if n <= 0:
        raise BadConfig(f"{what} must be positive, got {value!r} ({n} bytes)")
    return n


DIGITS = re.compile(r"\s*[+-]?[0-9]+\s*")


def to_count(value: Any, what: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` (an int, or a string of digits such as ``"8"``) as an int from ``minimum`` to
    ``maximum``, read once at the API boundary; ``BadInput`` naming ``what`` for anything else
    (``"abc"``, ``2.5``, ``True``, a number out of range).

    >>> to_count("8", "sessions", minimum=1)
    8
    """
    n = _integer(value)
    if isinstance(value, str) and DIGITS.fullmatch(value):
        try:
            n = int(value)
        except ValueError:              # NOTE: more digits than Python converts
            n = None
    if n is None or n < minimum or (maximum is not None and n > maximum):
        bounds = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise BadInput(f"{what} must be a whole number {bounds} (an int, or digits such as '8'), "
                       f"got {value!r}")
    return n


DEVICES = ("auto", "cuda", "cpu")


def device_choice(value: str | None = None) -> str:
    """Where models run: ``value``, else config ``seabiscuit.device``; one of ``DEVICES``.

    ``"auto"``: on a worker's GPU where it has one, else on its CPU; ``"cuda"``: on GPU
    workers only; ``"cpu"``: on CPUs and host memory, GPU workers included.
    """
    choice = value if value is not None else get("device")
    if not isinstance(choice, str) or choice.lower() not in DEVICES:
        raise BadConfig(f"device must be one of {', '.join(map(repr, DEVICES))}, got {choice!r}")
    return choice.lower()


def data_plane() -> str:
    """How activations travel (config ``seabiscuit.runtime.data-plane``): ``p2p`` or ``tasks``."""
    mode = get("runtime.data-plane")
    if mode not in ("p2p", "tasks"):
        raise BadConfig(f"seabiscuit.runtime.data-plane is {mode!r}: it must be p2p or tasks")
    return str(mode)


def cache_dir() -> Path:
    """Folder for on-disk templates (config ``seabiscuit.cache.directory``)."""
    d = get("cache.directory")
    if d:
        return Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "seabiscuit"
