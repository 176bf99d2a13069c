"""The op registry: the only operations a graph may make a worker run.

Graphs are data, never code. A graph, a template cache file or a deploy RPC names
its operations by string (``"aten.linear.default"``); a string is turned into a
callable only by looking it up in ``KERNELS``, a table built from the explicit list
of names below plus SeaBiscuit's own tile kernels (``sb.*``, registered in
``kernels.py``). Anything else, ``aten.from_file.default`` or ``os.system``
alike, is refused with ``UnsupportedOp`` before any op of the graph runs.

Tagged values in op arguments (``{"dtype": "float32"}``) are decoded through the
same kind of tables, never by ``getattr`` on a module.

Adding a kernel is one entry: an ATen overload is one more entry of the op
table (``ops.py``); any other callable is one ``register_kernel`` call:

>>> @register_kernel("sb.my_tile_op")                        # doctest: +SKIP
... def my_tile_op(x, n): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from .. import ops as O
from ..errors import BadInput, UnsupportedOp
from ..ir import DTYPE_BYTES, Op, OpGraph

F = TypeVar("F", bound=Callable[..., Any])

# NOTE: every ATen overload SeaBiscuit runs: the ATen entries of the op table (ops.OPS), what
# tracing the supported model families emits and what decomposition adds. Pure tensor
# computations only: nothing there reads or writes files, sockets or other processes.
ATEN_TARGETS: tuple[str, ...] = tuple(t for t in O.OPS if t.startswith("aten."))

# NOTE: dtype names are the IR's vocabulary (ir.DTYPE_BYTES); layouts and memory formats are
# the few that tracing records.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({n: getattr(torch, n) for n in DTYPE_BYTES})
LAYOUTS: Mapping[str, torch.layout] = MappingProxyType({"strided": torch.strided})
MEMORY_FORMATS: Mapping[str, torch.memory_format] = MappingProxyType({
    "contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d,
})
TAGGED: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS,
})

_kernels: dict[str, Callable[..., Any]] = {}
KERNELS: Mapping[str, Callable[..., Any]] = MappingProxyType(_kernels)
SUPPORTED = KERNELS.keys()     # a live view: names registered later are in it too


def register_kernel(target: str, fn: F | None = None, *, replace: bool = False) -> Any:
    """Make ``target`` runnable by ``fn``; with no ``fn``, a decorator that registers.

    A target is registered once; ``replace=True`` swaps its kernel on purpose.
    Register in a module every worker imports too: each process has its own registry.

    Examples
    --------
    >>> register_kernel("aten.erfinv.default", torch.ops.aten.erfinv.default)   # doctest: +SKIP
    """
    if fn is None:
        return lambda f: register_kernel(target, f, replace=replace)
    if not isinstance(target, str) or target.count(".") not in (1, 2) or not callable(fn):
        raise BadInput(f"register_kernel: expected a target 'ns.op[.overload]' and a callable, "
                       f"got {target!r} and {type(fn).__name__}")
    if target in _kernels and not replace and _kernels[target] is not fn:
        raise BadInput(f"register_kernel: {target} already has a kernel; pass replace=True")
    _kernels[target] = fn
    O.declare(target)       # NOTE: an op of the table, so tracing knows it too
    return fn


def _aten(target: str) -> Callable[..., Any]:
    _ns, name, overload = target.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)  # NOTE: names from ATEN_TARGETS only


for _t in ATEN_TARGETS:
    register_kernel(_t, _aten(_t))


registry_hint = O.registry_hint


def resolve_target(target: str, op: Op | None = None) -> Callable[..., Any]:
    """The registered kernel of ``target``; ``UnsupportedOp`` for anything else.

    ``op``, when given, is named in the error.
    """
    fn = _kernels.get(target) if isinstance(target, str) else None
    if fn is None:
        what = (f"op {op.name!r} ({op.scope or 'no scope'}) names {target!r}, which is" if op is not None
                else f"target {target!r} is")
        raise UnsupportedOp(f"{what} not in SeaBiscuit's op registry. {registry_hint()}")
    return fn


def require_registered(ops: OpGraph | Iterable[Op], where: str = "") -> None:
    """Refuse ``ops`` (a graph or its ops) if any names a target outside the registry.

    Run it before anything of a graph runs. The error lists every unregistered
    target once, with the first op that names it; ``where`` says whose ops they
    are (default: the graph's name).

    >>> require_registered(graph, where="template cache file t-1.json")   # doctest: +SKIP
    """
    if isinstance(ops, OpGraph):
        where = where or f"graph {ops.meta.get('name', '')!r}"
        ops = ops.ops
    unknown: dict[str, str] = {}
    for op in ops:
        target = op.target if isinstance(op.target, str) else repr(op.target)
        if target not in _kernels and target not in unknown:
            unknown[target] = op.name
    if unknown:
        listed = ", ".join(f"{t!r} (op {name!r})" for t, name in unknown.items())
        raise UnsupportedOp(f"{where or 'ops'}: {len(unknown)} target(s) not in SeaBiscuit's op registry: "
                            f"{listed}. {registry_hint()}")


def tagged_value(tag: str, name: Any) -> Any:
    """``("dtype", "float32")`` -> ``torch.float32``, through ``TAGGED`` only."""
    table = TAGGED[tag]
    value = table.get(name) if isinstance(name, str) else None
    if value is None:
        raise UnsupportedOp(f"{tag} {name!r} is not one SeaBiscuit knows; known {tag}s: "
                            f"{', '.join(table)}")
    return value


def torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype of an IR dtype name; ``UnsupportedOp`` for any other string."""
    dtype: torch.dtype = tagged_value("dtype", name)
    return dtype
