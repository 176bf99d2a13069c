"""The recursion: cut an op by the best rule, cut its pieces again until they fit."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .. import ops as O
from ..cost import op_flops
from ..ir import Op, OpGraph, ParamSpec, TensorSpec, operand_names
from .report import Oversize, why_unsplit
from .rules import RULES, RuleFn
from .split import Pieces, Split, bounds_for, min_pieces

MAX_DEPTH = 8
T = TypeVar("T")


class Decomposer:
    """Cuts the ops of ``graph`` until each fits ``budget``; ``run()`` gives the new graph.

    ``rules`` maps an op kind to the rules tried on ops of that kind (default ``RULES``).
    """

    def __init__(self, graph: OpGraph, budget: int,
                 rules: Mapping[str, Sequence[RuleFn]] = RULES) -> None:
        self.graph = graph
        self.budget = budget
        self.rules = rules
        self.tensors: dict[str, TensorSpec] = dict(graph.tensors)
        self.params: dict[str, ParamSpec] = dict(graph.params)
        self.ops: list[Op] = []
        self.oversize: list[Oversize] = []
        self.slices: dict[tuple[str, int, int, int], str] = {}
        self.root: Op | None = None
        self.last_read: tuple[Op, Callable[..., Any], Any] | None = None

    # --- sizes -------------------------------------------------------------------------------
    def shape(self, ref: Any) -> tuple[int, ...]:
        tag, name = O.ref_name(ref) or ("", "")
        return self.tensors[name].shape if tag == "t" else self.params[name].shape

    def nbytes(self, ref: Any) -> int:
        r = O.ref_name(ref)
        if r is None:
            return 0
        tag, name = r
        return self.tensors[name].nbytes if tag == "t" else self.params[name].nbytes

    def ws(self, op: Op) -> int:
        return (sum(self.params[p].nbytes for p in op.params)
                + sum(self.tensors[t].nbytes for t in op.inputs)
                + sum(self.tensors[t].nbytes for t in op.outputs))

    def read(self, op: Op, reader: Callable[[Decomposer, Op], T]) -> T:
        """``reader(self, op)``, computed once for the rules of a family trying one op."""
        last = self.last_read
        if last is None or last[0] is not op or last[1] is not reader:
            last = self.last_read = (op, reader, reader(self, op))
        return last[2]

    # --- building pieces ---------------------------------------------------------------------
    def make(self, name: str, target: str, args: list[Any], kwargs: dict[str, Any],
             out: str, spec: TensorSpec, scope: str, kind: str | None = None) -> Op:
        self.tensors[out] = spec
        inputs, params = operand_names(args, kwargs)
        flops = op_flops(target, args, [spec.shape], self.shape)
        return Op(name, kind or O.kind_of(target), target, inputs, (out,), params,
                  {"args": args, "kwargs": kwargs}, scope, flops)

    def cut(self, ref: Any, dim: int, a: int, b: int, scope: str, pieces: Pieces) -> Any:
        """``ref[..., a:b, ...]`` along ``dim``: a param tile, or a slice op on an activation."""
        tag, name = O.ref_name(ref) or ("", "")
        shape = self.shape(ref)
        dim %= len(shape)
        if a == 0 and b == shape[dim]:
            return ref
        new_shape = (*shape[:dim], b - a, *shape[dim + 1:])
        if tag == "p":
            p = self.params[name]
            tile = f"{name}@{dim}[{a}:{b}]"
            if tile not in self.params:
                self.params[tile] = ParamSpec(tile, new_shape, p.dtype,
                                              p.source.sliced(dim, a, b, p.shape))
            return {"p": tile}
        key = (name, dim, a, b)
        if key not in self.slices:
            out = f"{name}@{dim}[{a}:{b}]"
            spec = TensorSpec(new_shape, self.tensors[name].dtype)
            op = self.make(f"{scope}.slice:{out}" if scope else f"slice:{out}",
                           "aten.slice.Tensor", [{"t": name}, dim, a, b, 1], {}, out, spec,
                           scope, "slice")
            pieces.append((op, False))
            self.slices[key] = out
        return {"t": self.slices[key]}

    def join(self, op: Op, parts: list[str], how: str, dim: int) -> list[Op]:
        """Ops joining tile outputs ``parts`` into ``op``'s output: one concat, or a sum chain."""
        out = op.outputs[0]
        spec = self.tensors[out]
        if how == "concat":
            return [self.make(f"{op.name}.cat", "aten.cat.default", [[{"t": p} for p in parts], dim],
                              {}, out, spec, op.scope, "concat")]
        chain: list[Op] = []
        acc = parts[0]
        for i, p in enumerate(parts[1:], 1):
            dst = out if i == len(parts) - 1 else f"{out}.sum{i}"
            chain.append(self.make(f"{op.name}.sum{i}", "aten.add.Tensor",
                                   [{"t": acc}, {"t": p}], {}, dst, spec, op.scope, "sum"))
            acc = dst
        return chain

    def tiles(self, op: Op, split: Split, bounds: list[int]) -> Pieces:
        """One tile of ``op`` per ``[bounds[i], bounds[i+1])``, the slices they read, the join."""
        pieces: Pieces = []
        parts: list[str] = []
        for i in range(len(bounds) - 1):
            name = f"{split.tag}{i}"
            scope = f"{op.scope}.{name}" if op.scope else name
            args, kwargs, target, spec = split.piece(i, bounds[i], bounds[i + 1], pieces)
            out = f"{op.outputs[0]}.{name}"
            pieces.append((self.make(f"{op.name}.{name}", target, args, kwargs, out, spec,
                                     scope, op.kind), True))
            parts.append(out)
        pieces.extend((j, False) for j in self.join(op, parts, split.join, split.dim))
        return pieces

    # --- the recursion -----------------------------------------------------------------------
    def splits(self, op: Op) -> list[Split]:
        """Every way the rules for ``op.kind`` can cut ``op``, in order of preference."""
        if "args" not in op.attrs:   # NOTE: rules read operands; synthetic ops have none
            return []
        found = [s for rule in self.rules.get(op.kind, ()) if (s := rule(self, op)) is not None]
        return sorted(found, key=lambda s: s.tiebreak)

    def emit(self, op: Op, depth: int = 0) -> None:
        """Append ``op`` if it fits, else its pieces by the best split, cut again as needed."""
        ws = self.ws(op)
        if ws <= self.budget:
            self.ops.append(op)
            return
        splits = self.splits(op) if depth < MAX_DEPTH and len(op.outputs) == 1 else []
        choice = self.choose(splits)
        if choice is None:
            self.keep_oversize(op, ws, why_unsplit(op, splits, self.budget, depth, MAX_DEPTH))
            return
        split, k = choice
        for piece, is_tile in self.tiles(op, split, bounds_for(split.n, k)):
            if is_tile and self.ws(piece) < ws:
                self.emit(piece, depth + 1)
            else:
                self.emit_glue(piece)

    def emit_glue(self, op: Op) -> None:
        """Append a slicing or joining op, which is never cut."""
        ws = self.ws(op)
        if ws > self.budget:
            root = self.root.name if self.root is not None else "?"
            self.keep_oversize(op, ws, f"it joins or slices the tiles of {root!r}")
        else:
            self.ops.append(op)

    def keep_oversize(self, op: Op, ws: int, why: str) -> None:
        """Append ``op`` whole although it does not fit, noting why."""
        outputs = tuple(self.tensors[t] for t in op.outputs)
        self.oversize.append(Oversize(op, ws, why, self.root or op, outputs))
        self.ops.append(op)

    def choose(self, splits: list[Split]) -> tuple[Split, int] | None:
        """The split needing the fewest pieces to fit (ties: ``tiebreak``, then rule order)."""
        usable = [s for s in splits if s.n >= 2 and s.glue <= self.budget]
        best: tuple[int, int, Split] | None = None
        for rank, s in enumerate(usable):
            k = min_pieces(s, self.budget)
            if k is not None and (best is None or (k, rank) < best[:2]):
                best = (k, rank, s)
        if best is not None:
            return best[2], best[0]
        # Nothing fits in one level: cut along the most reducible dim until what is left
        # of it takes at most half the budget; the pieces are then cut along another dim.
        shrinking = [s for s in usable if s.ws(s.n) < s.ws(1)]
        if not shrinking:
            return None
        s = min(shrinking, key=lambda s: s.ws(s.n))
        k = min_pieces(s, s.ws(s.n) + self.budget / 2) or s.n
        return s, k

    # --- result ------------------------------------------------------------------------------
    def run(self) -> OpGraph:
        for op in self.graph.ops:
            self.root = op
            self.emit(op)
        used = {p for op in self.ops for p in op.params} | set(self.graph.outputs)
        params = {k: v for k, v in self.params.items() if k in used}
        live = set(self.graph.inputs) | {t for op in self.ops for t in op.outputs}
        tensors = {k: v for k, v in self.tensors.items() if k in live}
        meta = {**dict(self.graph.meta), "budget_bytes": self.budget}
        return OpGraph(tuple(self.ops), tensors, params, self.graph.inputs,
                       self.graph.outputs, meta)

    def fits(self, op: Op) -> bool:
        """Whether ``op`` (an op of the graph) can be cut into pieces that all fit."""
        self.root = op
        self.emit(op)
        return not self.oversize

