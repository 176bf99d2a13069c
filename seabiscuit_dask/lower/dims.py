"""Step programs of any row count and chunk length: sizes read at run time.

A generation step traced at two shapes gives the same micro-ops, the same weight tiles and
the same blocks at both (the decomposition cuts weights, and a step's activations are far
under the budget); only some literals differ, the sizes a ``view`` or ``reshape`` bakes in
((rows, tokens, -1, 64)) and the tensors' shapes. ``generalize`` turns two such programs
into one whose differing literals are ``{"sb_dim": [c, i, j]}``: ``c * rows**i * length**j``,
with ``(rows, length)`` read at run time from the shape of the step's ``sb_valid`` input
(which every op holding such a literal reads, so every block that runs it imports it). One
program then serves every shape of its kind: nothing is traced, decomposed or placed when
a step of a new shape comes.

``coverage`` finds the shapes it serves within the memory budget: every micro-op's working
set is checked at the corners of those shapes (a size grows with rows, tokens or both).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SeaBiscuitError
from ..ir import Op, OpGraph, TensorSpec, freeze, thaw

DIM = "sb_dim"
VALID = "sb_valid"      # NOTE: the step input whose shape is (rows, length): ``trace.decoder``
TERMS = ((1, 0), (0, 1), (1, 1))    # NOTE: what a size is made of: rows, length, or both


class NotGeneral(SeaBiscuitError):
    """Two traces of a step differ in more than sizes: the program is built per shape."""


@dataclass(frozen=True)
class Dims:
    """The shapes a general step program serves: rows up to ``rows``, tokens a row up to
    ``length``, ``tokens`` in all (rows x length) at most; ``decode``: one token a row."""

    rows: int
    length: int
    tokens: int

    @property
    def decode(self) -> bool:
        return self.length == 1

    def covers(self, rows: int, length: int) -> bool:
        if (length == 1) != self.decode:
            return False
        return 1 <= rows <= self.rows and 1 <= length <= self.length and rows * length <= self.tokens

    def corners(self) -> list[tuple[int, int]]:
        """The shapes where each size it serves is largest (a size grows with rows, length or
        their product, so its largest value over the shapes served is at one of these)."""
        length = min(self.length, self.tokens)
        wide = (max(1, min(self.rows, self.tokens // length)), length)
        rows = min(self.rows, self.tokens)
        tall = (rows, max(1, min(self.length, self.tokens // rows)))
        return sorted({wide, tall})


def value(sym: Any, rows: int, length: int) -> int:
    """The size ``{"sb_dim": [c, i, j]}`` stands for at (rows, length)."""
    c, i, j = sym[DIM]
    return int(c) * int(rows) ** int(i) * int(length) ** int(j)


def is_dim(x: Any) -> bool:
    return isinstance(x, Mapping) and len(x) == 1 and DIM in x


def _fit(a: int, b: int, at: tuple[int, int], bt: tuple[int, int], where: str) -> dict[str, list[int]]:
    """The one ``c * rows**i * length**j`` that is ``a`` at shape ``at`` and ``b`` at ``bt``."""
    fits, seen = [], set()
    for i, j in TERMS:
        da, db = at[0] ** i * at[1] ** j, bt[0] ** i * bt[1] ** j
        if da == db or (da, db) in seen or a % da:
            continue        # NOTE: rows and rows x length are one at length 1 (a decode step): rows
        seen.add((da, db))
        c = a // da
        if c * db == b:
            fits.append([c, i, j])
    if len(fits) != 1:
        raise NotGeneral(f"{where}: size {a} at {at[0]}x{at[1]} and {b} at {bt[0]}x{bt[1]} is "
                         f"{'no' if not fits else 'more than one'} product of rows and length")
    return {DIM: fits[0]}


def _merge(a: Any, b: Any, at: tuple[int, int], bt: tuple[int, int], where: str) -> Any:
    """``a`` with each int that differs from ``b``'s as the size both are (``_fit``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        if a != b:
            raise NotGeneral(f"{where}: {a!r} against {b!r}")
        return a
    if isinstance(a, int) and isinstance(b, int):
        return a if a == b else _fit(a, b, at, bt, where)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            raise NotGeneral(f"{where}: keys {sorted(a)} against {sorted(b)}")
        return {k: _merge(a[k], b[k], at, bt, where) for k in a}
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise NotGeneral(f"{where}: {len(a)} items against {len(b)}")
        return [_merge(x, y, at, bt, where) for x, y in zip(a, b)]
    if a != b:
        raise NotGeneral(f"{where}: {a!r} against {b!r}")
    return a


def has_dim(value: Any) -> bool:
    if is_dim(value):
        return True
    if isinstance(value, Mapping):
        return any(has_dim(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_dim(v) for v in value)
    return False


def generalize(a: OpGraph, at: tuple[int, int], b: OpGraph, bt: tuple[int, int], dims: Dims) -> OpGraph:
    """One program of ``a`` (traced at ``at`` = (rows, length)) and ``b`` (at ``bt``) that runs at
    any shape ``dims`` covers (see module doc); its tensors' shapes are those of the corner whose
    tensors take the most bytes (what placement keeps room for). Raises ``NotGeneral`` where the
    two differ in anything but sizes."""
    if at[1] == bt[1] and not dims.decode:
        raise NotGeneral("two traces of a prefill program must differ in length")
    if (len(a.ops), a.inputs, a.outputs, set(a.tensors), set(a.params)) != \
            (len(b.ops), b.inputs, b.outputs, set(b.tensors), set(b.params)):
        raise NotGeneral(f"the step's traces at {at} and {bt} have other ops, inputs or tensors")
    if VALID not in a.inputs:
        raise NotGeneral(f"a step program reads its shape from {VALID!r}, which this graph lacks")
    if dict(a.tilings) != dict(b.tilings):
        raise NotGeneral("the step's traces tile their inputs or outputs differently")
    for name, p in a.params.items():
        if p != b.params[name]:
            raise NotGeneral(f"weight tile {name!r} differs between the step's traces")
    ops = []
    top = _largest(dims)
    for x, y in zip(a.ops, b.ops):
        if (x.name, x.kind, x.target, x.inputs, x.outputs, x.params) != \
                (y.name, y.kind, y.target, y.inputs, y.outputs, y.params):
            raise NotGeneral(f"op {x.name!r} against {y.name!r}: the traces cut the step differently")
        attrs = _merge(thaw(x.attrs), thaw(y.attrs), at, bt, f"op {x.name!r}")
        inputs = x.inputs if not has_dim(attrs) or VALID in x.inputs else (*x.inputs, VALID)
        # NOTE: flops as at the largest step served, in proportion to its tokens (attention's
        # grow faster: what the cost model reads is an estimate, not a size anything runs with)
        flops = y.flops if x.flops == y.flops else y.flops * top[0] * top[1] // (bt[0] * bt[1])
        ops.append(Op(x.name, x.kind, x.target, inputs, x.outputs, x.params, freeze(attrs), x.scope, flops))
    shapes = {name: [_merge(m, n, at, bt, f"tensor {name!r}")
                     for m, n in zip(s.shape, b.tensors[name].shape)]
              for name, s in a.tensors.items() if len(s.shape) == len(b.tensors[name].shape)}
    if len(shapes) != len(a.tensors):
        raise NotGeneral("a tensor of the step has another rank at another shape")
    corner = max(dims.corners(), key=lambda c: sum(
        TensorSpec(tuple(d if isinstance(d, int) else value(d, *c) for d in s), a.tensors[n].dtype).nbytes
        for n, s in shapes.items()))
    tensors = {n: TensorSpec(tuple(d if isinstance(d, int) else value(d, *corner) for d in s),
                             a.tensors[n].dtype) for n, s in shapes.items()}
    sizes = {n: s for n, s in shapes.items() if any(not isinstance(d, int) for d in s)}
    meta = dict(a.meta)
    meta.update(step={"batch": corner[0], "length": corner[1]},
                dims={"rows": dims.rows, "length": dims.length, "tokens": dims.tokens, "shapes": sizes})
    return OpGraph(tuple(ops), tensors, a.params, a.inputs, a.outputs, meta, a.tilings)


def _largest(dims: Dims) -> tuple[int, int]:
    return max(dims.corners(), key=lambda c: c[0] * c[1])


def resolved(attrs: Any, rows: int, length: int) -> Any:
    """``attrs`` with each size (``{"sb_dim": ...}``) as its value at (rows, length)."""
    if is_dim(attrs):
        return value(attrs, rows, length)
    if isinstance(attrs, Mapping):
        return {k: resolved(v, rows, length) for k, v in attrs.items()}
    if isinstance(attrs, (list, tuple)):
        return [resolved(v, rows, length) for v in attrs]
    return attrs


def at_shape(graph: OpGraph, rows: int, length: int) -> OpGraph:
    """``graph`` (a general program) as the program of shape (rows, length) alone: its sizes and
    its tensors' shapes there (what a check of its working sets reads)."""
    sizes = dict(graph.meta.get("dims", {}).get("shapes") or {})
    tensors = {n: TensorSpec(tuple(d if isinstance(d, int) else value(d, rows, length) for d in sizes[n]),
                             s.dtype) if n in sizes else s for n, s in graph.tensors.items()}
    ops = tuple(Op(op.name, op.kind, op.target, op.inputs, op.outputs, op.params,
                   freeze(resolved(thaw(op.attrs), rows, length)), op.scope, op.flops)
                if has_dim(op.attrs) else op for op in graph.ops)
    return OpGraph(ops, tensors, graph.params, graph.inputs, graph.outputs, graph.meta, graph.tilings)


def over_budget(graph: OpGraph, traced: OpGraph, budget: int, dims: Dims) -> list[tuple[str, int, int, int]]:
    """The micro-ops of general program ``graph`` whose working set passes ``budget`` at some
    shape ``dims`` covers (at one of its corners) while it fits at a shape it was ``traced`` at
    (an op no cut brings under the budget is the decomposition's to refuse): (name, bytes, rows,
    length) each."""
    fit = {op.name for op in traced.ops if traced.working_set(op) <= budget}
    out = []
    for rows, length in dims.corners():
        shaped = at_shape(graph, rows, length)
        for op in shaped.ops:
            ws = shaped.working_set(op)
            if ws > budget and op.name in fit:
                out.append((op.name, ws, rows, length))
    return out


def input_shapes(graph: OpGraph, feed: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape each input of general program ``graph`` takes for the step ``feed`` is (its rows
    and length read from ``sb_valid``); raises ``NotGeneral`` for a shape it does not serve."""
    d = graph.meta["dims"]
    rows, length = (int(n) for n in feed[VALID].shape)
    if not Dims(int(d["rows"]), int(d["length"]), int(d["tokens"])).covers(rows, length):
        raise NotGeneral(f"a step of {rows} row(s) x {length} token(s) is past what this program serves "
                         f"({d['rows']} rows, {d['length']} tokens a row, {d['tokens']} in all)")
    sizes = d.get("shapes") or {}
    return {n: tuple(x if isinstance(x, int) else value(x, rows, length) for x in sizes[n]) if n in sizes
            else graph.tensors[n].shape for n in graph.inputs}
