"""Templates: a traced (and decomposed) architecture, reused across parameter sets.

Tracing and decomposition depend only on a model's architecture and the shapes
of its inputs, not on its weights. Both are cached under a key built from the
architecture (module tree, parameter shapes and dtypes, config, the source of
every module class) and the input shapes: in memory for this process, and as
JSON files under ``seabiscuit.cache.directory`` for the next one.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import tempfile
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import config
from .errors import SeaBiscuitError
from .ir import SCHEMA_VERSION, OpGraph
from .lower.registry import require_registered
from .version import __version__

MEMORY_ENTRIES = 32
_memory: OrderedDict[str, OpGraph] = OrderedDict()
stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0}


@cache
def _class_source_hash(cls: type) -> str:
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        src = f"{cls.__module__}.{cls.__qualname__}"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


@cache
def _code_hash(*parts: str) -> str:
    """A hash of these files and folders of the package: a template is reused only by the code
    that made it (a changed rule or op kind within one version makes new templates)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for part in parts:
        where = root / part
        for path in sorted(where.rglob("*.py")) if where.is_dir() else [where]:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _decomposer_hash() -> str:
    """A hash of the decomposition code: a cached decomposition is reused only by the same rules."""
    return _code_hash("decompose", "ir.py", "ops.py")


def _tracer_hash() -> str:
    """A hash of the tracing code: a cached trace is reused only by the same tracer and op kinds."""
    return _code_hash("trace", "ir.py", "ops.py", "lower/registry.py")


def _settings(module: torch.nn.Module, seen: dict[int, str]) -> list[tuple[str, str]]:
    """A module's own attributes, which its repr may omit and its forward may read: plain settings
    (``ceil_mode``...), and also a tensor or array that is no buffer (baked into the trace as a
    constant) by its values, a function by its code, a config by its JSON, anything else by its
    type. ``seen``: descriptions already made in this key, by object id (a shared config)."""
    return sorted((k, _describe(v, seen)) for k, v in vars(module).items() if not k.startswith("_"))


_PLAIN = (int, float, bool, str, bytes, type(None))


def _describe(v: Any, seen: dict[int, str], depth: int = 0) -> str:
    """What of ``v`` tracing may depend on, as text (``_settings``)."""
    if isinstance(v, _PLAIN):
        return repr(v)
    if depth > 3:
        return type(v).__qualname__
    if id(v) in seen:
        return seen[id(v)]
    if isinstance(v, (tuple, list, set, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        out = f"{type(v).__name__}[{', '.join(_describe(x, seen, depth + 1) for x in items)}]"
    elif isinstance(v, Mapping):
        out = "{" + ", ".join(f"{k!r}: {_describe(x, seen, depth + 1)}" for k, x in v.items()) + "}"
    elif isinstance(v, torch.nn.Module):
        out = "module"                   # NOTE: a submodule is keyed as one, by named_modules
    elif isinstance(v, torch.Tensor):
        out = f"tensor{tuple(v.shape)}{v.dtype}" + ("" if v.is_meta else ":" + _bytes_hash(
            v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
    elif type(v).__module__ == "numpy" and hasattr(v, "tobytes"):
        out = f"array{getattr(v, 'shape', ())}{v.dtype}:{_bytes_hash(v.tobytes())}"
    elif hasattr(v, "to_json_string"):
        out = str(v.to_json_string())
    elif isinstance(v, types.MethodType):
        out = f"method {type(v.__self__).__qualname__}.{_describe(v.__func__, seen, depth + 1)}"
    elif isinstance(v, functools.partial):
        out = f"partial {_describe((v.func, v.args, v.keywords), seen, depth + 1)}"
    elif isinstance(v, types.FunctionType):
        code = v.__code__
        cells = [c.cell_contents for c in v.__closure__ or () if c.cell_contents is not v]
        out = (f"function {v.__qualname__}:{_code_text(code)}:"
               f"{_describe(cells, seen, depth + 1)}:{_describe(v.__defaults__, seen, depth + 1)}")
    elif isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        out = f"op {v!r}"
    elif hasattr(v, "__qualname__"):              # NOTE: a builtin function (torch.relu), a class
        out = f"{getattr(v, '__module__', None)}.{v.__qualname__}"
    else:
        out = type(v).__qualname__
    seen[id(v)] = out
    return out


def _code_text(code: types.CodeType) -> str:
    """A function's code as text that is the same in every process (no addresses)."""
    consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return _bytes_hash(code.co_code + repr((code.co_names, consts)).encode())


def _bytes_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def architecture_key(model: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: Mapping[str, Any]) -> str:
    """A key that changes whenever tracing could produce a different graph."""
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    put(__version__, SCHEMA_VERSION, _tracer_hash(), torch.__version__, type(model).__module__,
        type(model).__qualname__, repr(model))
    seen: dict[int, str] = {}
    for name, m in model.named_modules():
        put(name, _settings(m, seen))
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        put(cls.__qualname__, _class_source_hash(cls))  # type: ignore[arg-type]
    for name, p in model.named_parameters(remove_duplicate=False):
        put(name, tuple(p.shape), p.dtype, p.is_meta)
    for name, b in model.named_buffers(remove_duplicate=False):
        put(name, tuple(b.shape), b.dtype, b.is_meta)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        put(cfg.to_json_string())
    for leaf in pytree.tree_leaves((args, dict(kwargs))):
        put(("T", tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else repr(leaf))
    return h.hexdigest()[:32]


def _enabled() -> bool:
    return bool(config.get("cache.enabled"))


def _path(key: str) -> str:
    return os.path.join(config.cache_dir(), "templates", f"{key}.json")


def lookup(key: str) -> OpGraph | None:
    """The template stored under ``key``, or ``None`` when there is none.

    A cache file that is missing or unreadable is ``None`` (it only costs a fresh
    trace); one that names an op outside the op registry raises ``UnsupportedOp``.
    """
    if not _enabled():
        return None
    if key in _memory:
        _memory.move_to_end(key)
        stats["memory_hits"] += 1
        return _memory[key]
    path = _path(key)
    try:
        with open(path) as f:
            graph = OpGraph.from_json(f.read())
    except (OSError, ValueError, KeyError, SeaBiscuitError):
        # NOTE: a missing, stale or damaged cache file only costs a fresh trace.
        return None
    # NOTE: a well-formed file naming an op outside the registry was not written by SeaBiscuit
    # (the key covers the versions): refuse it loudly rather than re-trace over the tampering.
    require_registered(graph, where=f"template cache file {path} (tampered with? delete it to re-trace)")
    stats["disk_hits"] += 1
    _remember(key, graph)
    return graph


def _remember(key: str, graph: OpGraph) -> None:
    _memory[key] = graph
    _memory.move_to_end(key)
    while len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)


def store(key: str, graph: OpGraph) -> None:
    if not _enabled():
        return
    _remember(key, graph)
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(graph.to_json())
        os.replace(tmp, path)
    except OSError:
        pass  # NOTE: a read-only cache folder disables the disk cache, nothing else.


def clear_memory() -> None:
    _memory.clear()


def cached_trace(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 trace_fn: Callable[[], OpGraph]) -> OpGraph:
    key = "t-" + architecture_key(model, args, kwargs)
    graph = lookup(key)
    if graph is None:
        stats["misses"] += 1
        graph = trace_fn().with_meta(template_key=key)
        store(key, graph)
    return graph


def cached_decompose(graph: OpGraph, budget: int, allow_oversize: bool,
                     fn: Callable[[OpGraph, int, bool], OpGraph], extra: str = "") -> OpGraph:
    base = graph.meta.get("template_key")
    if base is None:
        return fn(graph, budget, allow_oversize)
    parts = (base, budget, allow_oversize, graph.meta.get("budget_bytes"),
             graph.meta.get("checkpoint"), _decomposer_hash(), extra)
    key = "d-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
    result = lookup(key)
    if result is None:
        stats["misses"] += 1
        result = fn(graph, budget, allow_oversize).with_meta(template_key=key)
        store(key, result)
        return result
    # NOTE: what the caller's graph says of itself (its call signature, ...) wins over the template's
    own = {k: v for k, v in graph.meta.items() if k not in ("template_key", "budget_bytes")
           and result.meta.get(k) != v}
    return result.with_meta(**own) if own else result
