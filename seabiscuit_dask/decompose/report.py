"""Ops that do not fit the budget, and why, in words."""

from __future__ import annotations

import math
from typing import NamedTuple

from .. import ops as O
from ..ir import Op, OpGraph, TensorSpec, fmt_bytes
from .split import Split


class Oversize(NamedTuple):
    """An op kept whole although its working set exceeds the budget, and why.

    ``root`` is the op of the input graph it was cut from (``op`` itself if not cut).
    """

    op: Op
    ws: int
    why: str
    root: Op
    outputs: tuple[TensorSpec, ...]


def describe(o: Oversize, graph: OpGraph | None = None) -> str:
    """``op 'name' (target, output (8, 64) float32, working set 20.0 KiB): why``; for a piece
    of an op of ``graph``, that op, then the piece."""
    if graph is None or o.root is o.op or o.root.name not in graph.op_by_name:
        outs = ", ".join(f"{tuple(s.shape)} {s.dtype}" for s in o.outputs)
        return f"op {o.op.name!r} ({o.op.target}, output {outs}, working set {fmt_bytes(o.ws)}): {o.why}"
    root = o.root
    outs = ", ".join(f"{tuple(graph.tensors[t].shape)} {graph.tensors[t].dtype}" for t in root.outputs)
    return (f"op {root.name!r} ({root.target}, output {outs}, working set "
            f"{fmt_bytes(graph.working_set(root))}): its piece {o.op.name!r} needs {fmt_bytes(o.ws)}: "
            f"{o.why}")


def why_unsplit(op: Op, splits: list[Split], budget: int, depth: int, max_depth: int) -> str:
    """Why none of ``splits`` cuts ``op`` (at cut ``depth``) into pieces within ``budget``."""
    if depth >= max_depth:
        return f"it is still too big after {max_depth} levels of cuts"
    if op.target in O.INDIVISIBLE:
        return f"{op.target} is not cut: {O.INDIVISIBLE[op.target]}"
    if len(op.outputs) != 1:
        return f"rules cut ops with one output, and it has {len(op.outputs)}"
    if not splits:
        return f"no rule splits {op.target}"
    usable = [s for s in splits if s.n >= 2 and s.glue <= budget]
    if usable:
        least = min(s.ws(s.n) for s in usable)
        return f"cutting {either(usable)} still leaves {fmt_bytes_up(least)} in the largest piece"
    cuttable = [s for s in splits if s.n >= 2]
    if cuttable:
        glue = min(s.glue for s in cuttable)
        return f"joining the pieces after cutting {either(cuttable)} needs {fmt_bytes_up(glue)}"
    each = "" if len({s.about for s in splits}) == 1 else " of each"
    return f"{either(splits)} cannot be cut: there is only one{each}"


def either(splits: list[Split]) -> str:
    """``"a"``, ``"a or b"``, ``"a, b or c"``: what the splits cut."""
    abouts = list(dict.fromkeys(s.about for s in splits))
    return abouts[0] if len(abouts) == 1 else ", ".join(abouts[:-1]) + " or " + abouts[-1]


def fmt_bytes_up(n: float) -> str:
    """Like ``fmt_bytes``, rounded up, so that the text parses back to at least ``n``."""
    for i, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        scaled = n / 1024 ** i
        if scaled < 1024 or unit == "GiB":
            return f"{math.ceil(n)} B" if i == 0 else f"{math.ceil(scaled * 10) / 10:.1f} {unit}"
    return f"{n} B"  # pragma: no cover
