"""Tiles of one device fused into one kernel: the linear tiles of a block that read the same input.

Decomposition cuts a linear layer into output-column tiles (and a block often holds
the query, key and value projections of one input side by side). On a GPU each tile
is a kernel launch, so a block runs them as one ``linear`` over the tiles' weights
laid end to end, and splits its output back into the tiles' outputs: the same
numbers, one launch. The weights are concatenated at load, not per run:
``pack_rows`` reads a group's tiles into one buffer and keeps each tile as a view of
it (no byte is held twice), and ``span`` finds the buffer again from the views.

Graphs are unchanged: this is how a worker runs the ops a graph names, not a new op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ir import Op

LINEAR = "aten.linear.default"


@dataclass(frozen=True)
class LinearGroup:
    """Linear ops of one block over the same input, runnable as one: op positions, their
    weight and bias parameters (in order), and each op's output features."""

    ops: tuple[int, ...]
    weights: tuple[str, ...]
    biases: tuple[str, ...]           # empty: no op of the group has a bias
    sizes: tuple[int, ...]


def _input_key(ref: Any) -> tuple[Any, ...] | None:
    """A hashable form of a tensor operand (``{"t": name}``, or a view of one), else None."""
    if not isinstance(ref, Mapping) or "t" not in ref or set(ref) - {"t", "view"}:
        return None
    view = tuple(tuple(int(v) for v in b) for b in ref.get("view", ()))
    return (str(ref["t"]), view)


def _param(ref: Any) -> str | None:
    return str(ref["p"]) if isinstance(ref, Mapping) and set(ref) == {"p"} else None


def linear_groups(ops: Sequence[Op], shapes: Mapping[str, tuple[int, ...]]) -> list[LinearGroup]:
    """Groups of two or more linear ops of ``ops`` reading the same input, with 2-D weights
    of the same input width (``shapes``: parameter name -> shape) and all or no biases."""
    found: dict[tuple[Any, ...], list[tuple[int, str, str | None]]] = {}
    for i, op in enumerate(ops):
        if op.target != LINEAR or op.attrs.get("kwargs") or op.attrs.get("multi"):
            continue
        args = list(op.attrs.get("args", ()))
        if len(args) not in (2, 3) or len(op.outputs) != 1:
            continue
        x, w = _input_key(args[0]), _param(args[1])
        b = _param(args[2]) if len(args) == 3 and args[2] is not None else None
        if x is None or w is None or (len(args) == 3 and args[2] is not None and b is None):
            continue
        shape = tuple(shapes.get(w, ()))
        if len(shape) != 2:
            continue
        found.setdefault((x, shape[1], b is None), []).append((i, w, b))
    return [LinearGroup(tuple(i for i, _, _ in g), tuple(w for _, w, _ in g),
                        tuple(b for _, _, b in g if b is not None), tuple(shapes[w][0] for _, w, _ in g))
            for g in found.values() if len(g) > 1]


def span(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor ``parts`` are consecutive row blocks of (one buffer, in order), as a view; else None."""
    first = parts[0]
    if not first.is_contiguous() or first.dim() == 0:
        return None
    rest = tuple(first.shape[1:])
    step = first.element_size()
    end = first.data_ptr() + first.numel() * step
    for p in parts[1:]:
        if (p.dtype != first.dtype or p.device != first.device or tuple(p.shape[1:]) != rest
                or not p.is_contiguous() or p.data_ptr() != end
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        end += p.numel() * step
    rows = sum(int(p.shape[0]) for p in parts)
    return first.as_strided((rows, *rest), first.stride(), first.storage_offset())


def pack_rows(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` copied end to end into one new buffer on their device; each returned as a view of it."""
    buf = torch.cat(list(parts), dim=0)
    out, row = [], 0
    for p in parts:
        out.append(buf[row:row + int(p.shape[0])])
        row += int(p.shape[0])
    return out


LinearGroupKernel = Callable[[torch.Tensor], list[torch.Tensor]]     # a group's input -> its tiles' outputs


def fused_linear(weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> LinearGroupKernel:
    """One kernel for a group: ``linear(x, weight, bias)`` split into the tiles' outputs."""
    cuts = [int(s) for s in sizes]

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        y = torch.nn.functional.linear(x, weight, bias)
        # NOTE: contiguous, as each tile's own linear gave it (an export travels as its own bytes)
        return [t.contiguous() for t in y.split(cuts, dim=-1)]
    return run


def should_fuse(device: torch.device, setting: Any) -> bool:
    """A fusion setting (``seabiscuit.lower.fuse-tiles``, ``fuse-ops``): ``auto`` (on a GPU, where
    launches cost most), or a bool, given as one or as text (``false``, ``0``, ``off`` from an
    environment variable)."""
    if isinstance(setting, str) and setting.lower() == "auto":
        return device.type == "cuda"
    if isinstance(setting, str):
        return setting.lower() in ("1", "true", "yes", "on")
    return bool(setting)
