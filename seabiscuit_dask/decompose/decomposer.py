"""The recursion: cut an op by the best rule, cut its pieces again until they fit.

Tensors stay tiled between ops: a split op's output is recorded as the grid of its
tiles (``tiling.Entry``), and a consumer's tile reads only the tiles it overlaps.
Ops that slice or join tiles are emitted only where a micro-op reads a region that
no single tile holds; partial sums are added as a tree of (tiled) adds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .. import ops as O
from ..cost import op_flops
from ..ir import (
    Op,
    OpGraph,
    ParamSpec,
    Region,
    TensorSpec,
    input_bytes,
    operand_names,
    scratch_bytes,
    spec_of,
)
from . import tiling as T
from .report import Oversize, why_unsplit
from .rules import RULES, RuleFn
from .rules.strips import strips_along
from .rules.views import view_strips_along
from .split import Pieces, Split, bounds_for, min_pieces

MAX_DEPTH = 8
R = TypeVar("R")
REGION = "sb.region"       # x[region]: a multi-dim slice
ASSEMBLE = "sb.assemble"   # tiles placed at their regions of a new tensor
SAMPLE_K = 16       # pieces a split is judged at when none fits in one level
FOLLOW_MAX = 8      # most tiles an op that fits whole is run over tile by tile (more: one join)
FOLLOW_SHARE = 32   # nor when a tile is under 1/32 of the budget: its ops would cost more than the join
FOLLOW: dict[str, Callable[[Decomposer, Op, int], Split | None]] = {     # kind -> its rule along a dim
    "elementwise": strips_along, "view": view_strips_along}
WINDOWS = {"aten.slice.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"}


class Decomposer:
    """Cuts the ops of ``graph`` until each fits ``budget``; ``run()`` gives the new graph.

    ``rules`` maps an op kind to the rules tried on ops of that kind (default ``RULES``).
    """

    def __init__(self, graph: OpGraph, budget: int,
                 rules: Mapping[str, Sequence[RuleFn]] = RULES,
                 weight_cuts: Mapping[tuple[str, int], set[int]] | None = None, held: bool = False) -> None:
        self.graph = graph
        self.budget = budget
        self.rules = rules
        self.tensors: dict[str, TensorSpec] = dict(graph.tensors)
        self.params: dict[str, ParamSpec] = dict(graph.params)
        self.ops: list[Op] = []
        self.oversize: list[Oversize] = []
        self.virtual: dict[str, tuple[T.Entry, ...]] = {}   # tensors that exist as tiles only
        self.views: dict[tuple[str, int, int, int], str] = {}
        self.made: dict[str, dict[str, Any]] = {}            # virtual tensor -> its reference
        self.sliced: set[str] = set()                        # leaf regions made into tensors
        # NOTE: where params were cut; ``weight_cuts`` seeds it with the cuts of a weight that
        # several ops share, so the first of them cuts it as the largest one will.
        seeds = weight_cuts or {}
        self.param_edges: dict[tuple[str, int], set[int]] = {k: set(v) for k, v in seeds.items()}
        self.seeded = {name: dim for name, dim in seeds}
        # NOTE: ``held``: the seeded tiles are held already (another program's, ``decompose(like=)``):
        # they are read whole, cut along another dim where they pass the budget (``reused``)
        self.held = held
        self.edge_ws: dict[tuple[str, int], int] = {}            # largest op that cut each
        self.root_ws = 0
        self.sampling = False
        self.root: Op | None = None
        self.last_read: tuple[Op, Callable[..., Any], Any] | None = None
        self.input_tilings = self.tile_inputs()

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
        """Working set of ``op``: params, inputs (a view counts its region), outputs, scratch."""
        return (sum(self.params[p].nbytes for p in op.params) + input_bytes(op, self.tensors)
                + sum(self.tensors[t].nbytes for t in op.outputs)
                + scratch_bytes(op, self.tensors))

    def glue_ws(self, op: Op) -> int:
        """The largest working set among the ops that would gather ``op``'s tiled inputs."""
        return max((self.gather_ws(t) for t in op.inputs if t in self.virtual), default=0)

    def gather_ws(self, name: str) -> int:
        """What reading tensor ``name`` takes beyond the op: joining its tiles (views are free)."""
        if name in self.made or len(self.virtual[name]) == 1:
            return 0
        return 2 * self.tensors[name].nbytes

    def read(self, op: Op, reader: Callable[[Decomposer, Op], R]) -> R:
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

    def cut(self, ref: Any, dim: int, a: int, b: int, scope: str = "", pieces: Pieces | None = None) -> Any:
        """``ref[..., a:b, ...]`` along ``dim``: a param tile, or a tensor that is a window of
        ``ref``'s tiles (nothing is emitted until a micro-op reads it)."""
        tag, name = O.ref_name(ref) or ("", "")
        shape = self.shape(ref)
        dim %= len(shape)
        if a == 0 and b == shape[dim]:
            return ref
        new_shape = (*shape[:dim], b - a, *shape[dim + 1:])
        if tag == "p":
            p = self.params[name]
            if not self.sampling:   # NOTE: a trial cut while choosing a split is no cut
                self.param_edges.setdefault((name, dim), {0, shape[dim]}).update((a, b))
                if self.root is not None:
                    self.edge_ws[(name, dim)] = max(self.edge_ws.get((name, dim), 0), self.root_ws)
            tile = f"{name}@{dim}[{a}:{b}]"
            if tile not in self.params:
                self.params[tile] = ParamSpec(tile, new_shape, p.dtype,
                                              p.source.sliced(dim, a, b, p.shape))
            return {"p": tile}
        key = (name, dim, a, b)
        if key not in self.views:
            view = f"{name}@{dim}[{a}:{b}]"
            self.tensors[view] = TensorSpec(new_shape, self.tensors[name].dtype)
            self.virtual[view] = T.window(self.entries(name), dim, a, b)
            self.views[key] = view
        return {"t": self.views[key]}

    def entries(self, name: str) -> tuple[T.Entry, ...]:
        """Where the parts of tensor ``name`` live: its tiles, or itself."""
        if name in self.virtual:
            return self.virtual[name]
        whole = T.full(self.tensors[name].shape)
        return ((whole, name, whole),)

    def gather(self, name: str, scope: str) -> dict[str, Any]:
        """A reference equal to tensor ``name``: a produced tensor, a view of one (read in
        place), or the join of the views of several tiles."""
        if name not in self.virtual:
            return {"t": name}
        if name not in self.made:
            entries = self.virtual[name]
            if len(entries) == 1:
                self.made[name] = self.view_of(entries[0][1], entries[0][2])
            else:
                parts = [(region, self.view_of(leaf, src)) for region, leaf, src in entries]
                self.made[name] = {"t": self.join_parts(name, parts, scope)}
        return self.made[name]

    def produced(self, name: str, scope: str) -> str:
        """A tensor some op produces (or the caller feeds) equal to tensor ``name``."""
        ref = self.gather(name, scope)
        view = ref.get("view")
        return ref["t"] if view is None else self.region_of(ref["t"], tuple((a, b) for a, b in view), scope)

    def view_of(self, leaf: str, src: Region) -> dict[str, Any]:
        """``{"t": leaf}``, or ``{"t": leaf, "view": src}`` for a part of it."""
        if src == T.full(self.tensors[leaf].shape):
            return {"t": leaf}
        return {"t": leaf, "view": [list(r) for r in src]}

    def region_of(self, leaf: str, src: Region, scope: str) -> str:
        """``leaf[src]`` as a produced tensor (a slice op unless ``src`` is all of it)."""
        spec = self.tensors[leaf]
        if src == T.full(spec.shape):
            return leaf
        out = f"{leaf}{T.tag(src)}"
        if out not in self.sliced:
            new = TensorSpec(T.extent(src), spec.dtype)
            op = self.make(f"{scope}.slice:{out}", REGION, [{"t": leaf}, [list(r) for r in src]],
                           {}, out, new, scope, "slice")
            self.append_glue(op)
            self.sliced.add(out)
        return out

    def join_parts(self, name: str, parts: list[tuple[Region, dict[str, Any]]], scope: str) -> str:
        """One op joining ``parts`` (references placed at their regions) into tensor ``name``."""
        spec = self.tensors[name]
        regions = [r for r, _ in parts]
        dim = T.concat_dim(regions)
        out = f"{name}.joined"
        if dim is not None:
            ordered = [ref for _, ref in sorted(parts, key=lambda x: x[0][dim])]
            op = self.make(f"{scope}.cat:{out}", "aten.cat.default", [ordered, dim], {},
                           out, spec, scope, "concat")
        else:
            op = self.make(f"{scope}.assemble:{out}", ASSEMBLE,
                           [[ref for _, ref in parts], [[list(a) for a in r] for r in regions],
                            list(spec.shape)], {}, out, spec, scope, "concat")
        self.append_glue(op)
        return out

    def bind(self, op: Op) -> Op:
        """``op`` reading produced tensors: its tiled inputs gathered first."""
        refs = {t: self.gather(t, op.scope) for t in op.inputs if t in self.virtual}
        if not refs:
            return op
        if "args" not in op.attrs:   # NOTE: an op without operands to rename reads whole tensors
            names = {t: self.produced(t, op.scope) for t in refs}
            return Op(op.name, op.kind, op.target, tuple(names.get(t, t) for t in op.inputs),
                      op.outputs, op.params, op.attrs, op.scope, op.flops)
        args = _rename(op.attrs["args"], refs)
        kwargs = _rename(op.attrs.get("kwargs", {}), refs)
        inputs, params = operand_names(args, kwargs)
        attrs = {**dict(op.attrs), "args": args, "kwargs": kwargs}
        return Op(op.name, op.kind, op.target, inputs, op.outputs, params, attrs, op.scope, op.flops)

    # --- the recursion -----------------------------------------------------------------------
    def splits(self, op: Op) -> list[Split]:
        """Every way the rules for ``op.kind`` can cut ``op``, in order of preference."""
        if "args" not in op.attrs:   # NOTE: rules read operands; synthetic ops have none
            return []
        found = [s for rule in self.rules.get(op.kind, ()) if (s := rule(self, op)) is not None]
        return sorted(found, key=lambda s: s.tiebreak)

    def emit(self, op: Op, depth: int = 0) -> None:
        """Append ``op`` if it fits, else its tiles by the best split, cut again as needed."""
        if self.as_windows(op):
            return
        own = self.ws(op)
        ws = max(own, self.glue_ws(op))
        if ws <= self.budget:
            followed = self.follow(op) or self.read_seeded_tiles(op)
            if followed is None:
                self.ops.append(self.widened(self.bind(op)))
                return
            split, bounds = followed
        else:
            splits = self.splits(op) if depth < MAX_DEPTH and len(op.outputs) == 1 else []
            choice = self.choose(op, splits)
            if choice is None:
                self.keep_oversize(op, ws, why_unsplit(op, splits, self.budget, depth, MAX_DEPTH))
                return
            split, k = choice
            bounds = self.aligned(split, k) or split.bounds(k)
        parts: list[str] = []
        for i in range(len(bounds) - 1):
            name = f"{split.tag}{i}"
            scope = f"{op.scope}.{name}" if op.scope else name
            args, kwargs, target, spec = split.piece(i, bounds[i], bounds[i + 1], [])
            if spec is None:   # NOTE: a tile that contributes nothing (fully masked)
                continue
            out = f"{op.outputs[0]}.{name}"
            kind = split.kind or op.kind
            tile = self.make(f"{op.name}.{name}", target, args, kwargs, out, spec, scope, kind)
            if ws <= self.budget or self.ws(tile) < self.ws(op):   # NOTE: a followed op's tiles fit
                self.emit(tile, depth + 1)
            else:
                self.keep_oversize(tile, self.ws(tile), why_unsplit(tile, [], self.budget, depth, MAX_DEPTH))
            parts.append(out)
        self.join(op, split, parts)

    def read_seeded_tiles(self, op: Op) -> tuple[Split, list[int]] | None:
        """``op`` (one that fits whole) cut where ``weight_cuts`` cut a weight it reads, so that it
        reads those tiles and not the whole weight a second time: a generation step of one token
        reads the column tiles its deployment cut for longer inputs and holds (a worker held
        both, 100 KiB over its plan). None when no rule cuts ``op`` along that dim."""
        seeded = [p for p in op.params if p in self.seeded]
        if not seeded or len(op.outputs) != 1:
            return None
        for split in self.splits(op):
            if split.along is None:
                continue
            ref, dim, ratio = split.along
            r = O.ref_name(ref)
            if r is None or r[0] != "p" or r[1] not in seeded:
                continue
            want = self.seeded[r[1]]
            if dim % len(self.shape(ref)) != want:
                continue
            edges = sorted(self.param_edges.get((r[1], want), ()))
            if len(edges) > 2 and not any(e % ratio for e in edges) and edges[-1] // ratio == split.n:
                return split, [e // ratio for e in edges]
        return None

    def follow(self, op: Op) -> tuple[Split, list[int]] | None:
        """``op`` (an elementwise op or a view that fits whole) cut along the tiles of its largest
        tiled input, when that has at most ``FOLLOW_MAX`` tiles side by side along one dim, none
        under ``1 / FOLLOW_SHARE`` of the budget: no join is made, and the next op reads the tiles
        (an MLP's activation stays in the column tiles of its first linear, so the second one sums
        partial products over them). Small tiles (a decode step's one row, the heads of a short
        prompt before their rotary embedding) are joined once instead: per-tile ops there cost
        more in overhead than the join does, and they serve no placement."""
        along = FOLLOW.get(op.kind)
        if along is None or len(op.outputs) != 1 or "args" not in op.attrs \
                or not self.tensors[op.outputs[0]].numel:
            return None
        tiled = [t for t in op.inputs if 1 < len(self.virtual.get(t, ())) <= FOLLOW_MAX]
        if not tiled:
            return None
        name = max(tiled, key=lambda t: self.tensors[t].nbytes)
        entries = self.virtual[name]
        j = T.concat_dim([region for region, _, _ in entries])
        spec = self.tensors[name]
        smallest = min(math.prod(T.extent(region)) for region, _, _ in entries) * spec.nbytes // spec.numel
        if j is None or smallest * FOLLOW_SHARE < self.budget:
            return None
        edges = sorted({e for region, _, _ in entries for e in region[j]})
        for dim in range(len(self.tensors[op.outputs[0]].shape)):
            split = along(self, op, dim)
            if split is None or split.along is None or split.join != "concat":
                continue
            ref, cut_dim, ratio = split.along
            r = O.ref_name(ref)
            if r is None or r != ("t", name) or cut_dim % len(self.shape(ref)) != j:
                continue
            if any(e % ratio for e in edges) or edges[-1] // ratio != split.n:
                return None
            return split, [e // ratio for e in edges]
        return None

    def widened(self, op: Op) -> Op:
        """An ``sb.qlinear`` whose slab takes the budget its working set leaves (fewer, larger
        dequantizing steps); any other op as it is."""
        # NOTE: not one that may multiply in bf16 (a quantized graph's own): its slab would depend on
        # the rows, so step programs of other shapes could not be derived from one (``lower.dims``)
        args = op.attrs["args"]
        slab = O.qlinear_slab(args, [self.tensors[op.outputs[0]].shape], spec_of(self.tensors)) \
            if op.target == O.QLINEAR and not (len(args) > 6 and args[6]) else None
        if slab is None:
            return op
        room = max(0, self.budget - self.ws(op) + slab.scratch())   # NOTE: shared by the slab and its step
        share = room * slab.k // (slab.k + max(1, slab.rows))
        wider = O.qlinear_columns(slab.n, slab.k, slab.itemsize, share)
        if wider <= slab.columns:
            return op
        args = list(op.attrs["args"]) + [None] * (6 - len(op.attrs["args"]))
        args[5] = wider
        new = Op(op.name, op.kind, op.target, op.inputs, op.outputs, op.params,
                 {**dict(op.attrs), "args": args}, op.scope, op.flops)
        return new if self.ws(new) <= self.budget else op

    def aligned(self, split: Split, k: int) -> list[int] | None:
        """Bounds of at least ``k`` pieces, none larger than ``n / k``, that never cross a tile
        boundary of the operand the split cuts (None when it is not tiled along that dim)."""
        if split.along is None:
            return None
        ref, dim, ratio = split.along
        r = O.ref_name(ref)
        if r is None:
            return None
        dim %= len(self.shape(ref))
        if r[0] == "p":
            edges = self.param_edges.get((r[1], dim), set())
            return self.reused(split, k, sorted(e // ratio for e in edges if e % ratio == 0),
                               self.held and self.seeded.get(r[1]) == dim)
        if r[1] not in self.virtual:
            return None
        edges = {e for region, _, _ in self.virtual[r[1]] for e in region[dim]}
        cuts = sorted(e // ratio for e in edges if e % ratio == 0)
        if len(cuts) <= 2 or cuts[0] != 0 or cuts[-1] != split.n:
            return None
        most = -(-split.n // k)
        # NOTE: tiles much smaller than a piece merge (a join per piece beats many tiny ops)
        # while gathering them (twice the window) fits; a larger tile is cut evenly.
        unit = self.nbytes(ref) / split.n
        merge = max(1, min(most, int(self.budget / (2 * unit)) if unit else most))
        tiny = max(b - a for a, b in zip(cuts, cuts[1:])) * 4 <= most
        bounds = [0]
        for a, b in zip(cuts, cuts[1:]):
            if tiny and b - bounds[-1] <= merge and bounds[-1] >= a - merge:
                if b == split.n or b - bounds[-1] == merge:
                    bounds.append(b)
                continue
            if a > bounds[-1]:
                bounds.append(a)
            m = -(-(b - a) // most)
            bounds.extend(a + round(i * (b - a) / m) for i in range(1, m + 1))
        if bounds[-1] != split.n:
            bounds.append(split.n)
        return bounds

    def reused(self, split: Split, k: int, cuts: list[int], seeded: bool = False) -> list[int] | None:
        """The bounds a weight was cut at before, if they serve ``split`` as well as ``k`` pieces
        would (so a weight is not held twice in tiles that overlap). ``seeded``: the cuts of a
        weight another program holds (``weight_cuts``), kept even where their pieces pass the
        budget: each piece is then cut along another dim (``cuts_seeded_tile``), its tile
        whole (a 32-row step program reads its deployment's LM head tiles in two halves of
        the rows, and holds no tiles of its own)."""
        if len(cuts) <= 2 or cuts[0] != 0 or cuts[-1] != split.n:
            return None
        most = max(b - a for a, b in zip(cuts, cuts[1:]))
        if most > -(-split.n // k) and split.ws(max(1, split.n // most)) > self.budget and not seeded:
            return None
        return cuts

    def as_windows(self, op: Op) -> bool:
        """Record a slice or split of a tiled tensor as windows of its tiles, emitting nothing."""
        args = op.attrs.get("args", ())
        src = O.ref_name(args[0]) if args else None
        if op.target not in WINDOWS or src is None or src[0] != "t" or src[1] not in self.virtual:
            return False
        shape = self.tensors[src[1]].shape
        kwargs = op.attrs.get("kwargs", {})
        if op.target == "aten.slice.Tensor":
            dim = int(O.operand(args, 1, kwargs.get("dim", 0))) % len(shape)
            if O.operand(args, 4, kwargs.get("step", 1)) != 1:
                return False
            lo, hi = O.operand(args, 2, kwargs.get("start")), O.operand(args, 3, kwargs.get("end"))
            lo = 0 if lo is None else max(0, min(shape[dim], lo + shape[dim] if lo < 0 else lo))
            hi = shape[dim] if hi is None else max(lo, min(shape[dim], hi + shape[dim] if hi < 0 else hi))
            spans = [(lo, hi)]
        else:
            dim = int(O.operand(args, 2, kwargs.get("dim", 0))) % len(shape)
            size = args[1] if op.target != "aten.chunk.default" else -(-shape[dim] // max(int(args[1]), 1))
            sizes = [int(n) for n in size] if isinstance(size, (list, tuple)) else \
                [min(int(size), shape[dim] - a) for a in range(0, shape[dim], max(int(size), 1))]
            if sum(sizes) != shape[dim]:
                return False
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            spans = [(a, a + n) for a, n in zip(starts, sizes)]
        if len(spans) != len(op.outputs) or any(hi <= lo for lo, hi in spans):
            return False   # NOTE: an empty piece is left to the op itself
        for out, (lo, hi) in zip(op.outputs, spans):
            self.virtual[out] = T.window(self.virtual[src[1]], dim, lo, hi)
        return True

    def join(self, op: Op, split: Split, parts: list[str]) -> None:
        """Make ``op``'s output from its tiles: a tiling, or a tree of adds or merges."""
        out = op.outputs[0]
        if split.join == "concat":
            dim = split.dim % len(self.tensors[out].shape)
            starts = [0]
            for p in parts:
                starts.append(starts[-1] + self.tensors[p].shape[dim])
            self.virtual[out] = tuple(e for p, lo in zip(parts, starts) for e in
                                      T.shifted(self.entries(p), dim, lo))
            return
        target, kind = ("aten.add.Tensor", "sum") if split.join == "sum" else (split.join, "merge")
        level, depth = parts, 0
        while len(level) > 1:
            depth += 1
            nxt = []
            for j in range(0, len(level) - 1, 2):
                last = len(level) == 2 and split.finish is None
                dst = out if last else f"{out}.{kind}{depth}.{j // 2}"
                spec = self.tensors[out] if split.join == "sum" else self.tensors[level[j]]
                self.emit(self.make(f"{op.name}.{kind}{depth}.{j // 2}", target, [{"t": level[j]},
                                    {"t": level[j + 1]}], {}, dst, spec, op.scope, kind))
                nxt.append(dst)
            if len(level) % 2:
                nxt.append(level[-1])
            level = nxt
        if split.finish is not None:
            spec = self.tensors[out]
            self.emit(self.make(f"{op.name}.finish", split.finish, [{"t": level[0]}, {"dtype": spec.dtype}],
                                {}, out, spec, op.scope, "merge"))
        elif level[0] != out:   # NOTE: one part only: it is the output
            self.virtual[out] = self.entries(level[0])

    def append_glue(self, op: Op) -> None:
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
        self.ops.append(self.bind(op))

    def choose(self, op: Op, splits: list[Split]) -> tuple[Split, int] | None:
        """The split needing the fewest pieces to fit, reading their tiled inputs included
        (ties: ``tiebreak``, then rule order)."""
        usable = [s for s in splits if s.n >= 2 and s.glue <= self.budget]
        best: tuple[int, int, int, int, Split] | None = None
        for rank, s in enumerate(usable):
            k = min_pieces(s, self.budget)
            k = self.fitting_k(op, s, k) if k is not None else None
            if k is None:
                continue
            # NOTE: of as many pieces, those that read tiles as they lie (no join) first
            key = (self.crosses_seeded_cut(s) or self.cuts_seeded_tile(op, s, k), k,
                   int(self.piece_ws(op, s, k) > 0), rank)
            if best is None or key < best[:4]:
                best = (*key, s)
        if best is not None:
            return best[4], best[1]
        # Nothing fits in one level: cut along the dim that shrinks the op most, reading
        # included, until what is left of it takes at most half the budget; the pieces are
        # then cut along another dim.
        shrinking = [s for s in usable if s.ws(s.n) < s.ws(1)]
        if not shrinking:
            return None
        # NOTE: cutting along the tiles of a tiled input first costs no joins, and its pieces
        # then need no partial sums: rows x columns before any reduction.
        tiled = [s for s in shrinking if s.join == "concat" and self.aligned(s, 2) is not None]
        if tiled:
            s = min(tiled, key=lambda s: s.ws(s.n))
            bounds = self.aligned(s, 2) or []
            return s, len(bounds) - 1
        least = {id(s): max(s.ws(s.n), self.piece_ws(op, s, min(s.n, SAMPLE_K)))
                 for s in shrinking}
        s = min(shrinking, key=lambda s: least[id(s)])
        k = min_pieces(s, least[id(s)] + self.budget / 2) or s.n
        return s, k

    def crosses_seeded_cut(self, split: Split) -> int:
        """1 when ``split`` cuts a shared weight along another dim than its seeded cut."""
        r = O.ref_name(split.along[0]) if split.along is not None else None
        if r is None or r[0] != "p" or r[1] not in self.seeded or split.along is None:
            return 0
        return int(split.along[1] % len(self.params[r[1]].shape) != self.seeded[r[1]])

    def cuts_seeded_tile(self, op: Op, split: Split, k: int) -> int:
        """1 when ``split``'s pieces of ``op`` would cut a tile of a seeded weight that is held whole
        elsewhere (``held``), so its pieces would be held beside it."""
        tiles = [p for p in op.params if "@" in p and p.split("@", 1)[0] in self.seeded]
        if not tiles or not self.held:
            return 0
        bounds = split.bounds(k)
        self.sampling = True
        try:
            args, kwargs, _, _ = split.piece(0, bounds[0], bounds[1], [])
        finally:
            self.sampling = False
        _, params = operand_names(args, kwargs)
        return int(any(p not in params for p in tiles))

    def fitting_k(self, op: Op, split: Split, k: int) -> int | None:
        """The fewest pieces from ``k`` on whose tiles, and what they read, fit the budget."""
        tried = 0
        while k <= split.n and tried < 12:
            if self.piece_ws(op, split, k) <= self.budget:
                return k
            k = k + 1 if tried < 4 else min(2 * k, split.n) if k < split.n else split.n + 1
            tried += 1
        return None

    def piece_ws(self, op: Op, split: Split, k: int) -> int:
        """The most that gathering the inputs of sampled tiles of ``k`` pieces takes."""
        bounds = split.bounds(k)
        k = len(bounds) - 1
        picks = range(k) if k <= 4 else sorted({0, k // 3, (2 * k) // 3, k - 1})
        worst = 0
        self.sampling = True
        try:
            for i in picks:
                args, kwargs, _, spec = split.piece(i, bounds[i], bounds[i + 1], [])
                if spec is None:
                    continue
                inputs, _ = operand_names(args, kwargs)
                worst = max(worst, max((self.gather_ws(t) for t in inputs if t in self.virtual), default=0))
        finally:
            self.sampling = False
        return worst

    # --- result ------------------------------------------------------------------------------
    def tile_inputs(self) -> dict[str, tuple[tuple[Region, str], ...]]:
        """Cut each graph input over a quarter of the budget into row chunks the caller feeds."""
        tilings = {}
        for name in self.graph.inputs:
            spec = self.tensors[name]
            region, grid = T.full(spec.shape), [T.full(spec.shape)]
            itemsize = spec.nbytes // max(spec.numel, 1)
            for dim in range(len(spec.shape)):
                row = math.prod(T.extent(region)[dim + 1:]) * itemsize
                if max(math.prod(T.extent(r)) for r in grid) * itemsize <= self.budget // 4:
                    break
                k = -(-spec.shape[dim] * row // max(self.budget // 4, 1))
                bounds = bounds_for(spec.shape[dim], min(k, spec.shape[dim]))
                grid = [T.replace(r, dim, a, b) for r in grid for a, b in zip(bounds, bounds[1:])]
            if len(grid) > 1:
                tiles = tuple((r, f"{name}{T.tag(r)}") for r in grid)
                for r, tile in tiles:
                    self.tensors[tile] = TensorSpec(T.extent(r), spec.dtype)
                self.virtual[name] = tuple((r, tile, T.full(T.extent(r))) for r, tile in tiles)
                tilings[name] = tiles
        return tilings

    def run(self) -> OpGraph:
        for op in self.graph.ops:
            self.root = op
            self.root_ws = self.ws(op)
            self.emit(op)
        self.root = None
        outputs, tilings = self.deliver()
        tilings.update(self.input_tilings)
        used = {p for op in self.ops for p in op.params} | set(outputs)
        params = {k: v for k, v in self.params.items() if k in used}
        tiles = {t for tiling in tilings.values() for _, t in tiling}
        live = set(self.graph.inputs) | {t for op in self.ops for t in op.outputs} | set(tilings) | tiles
        tensors = {k: v for k, v in self.tensors.items() if k in live}
        meta = {**dict(self.graph.meta), "budget_bytes": self.budget}
        return OpGraph(tuple(self.ops), tensors, params, self.graph.inputs, outputs, meta, tilings)

    def deliver(self) -> tuple[tuple[str, ...], dict[str, tuple[tuple[Region, str], ...]]]:
        """Graph outputs: gathered into one tensor where that fits, else left as tiles."""
        outputs: list[str] = []
        tilings: dict[str, tuple[tuple[Region, str], ...]] = {}
        for t in self.graph.outputs:
            if t not in self.virtual:
                outputs.append(t)
            elif self.gather_ws(t) <= self.budget:
                outputs.append(self.produced(t, "output"))
            else:
                tilings[t] = tuple((r, self.region_of(leaf, src, "output"))
                                   for r, leaf, src in self.virtual[t])
                outputs.append(t)
        return tuple(outputs), tilings

    def succeeds(self) -> bool:
        """Whether every op of the graph can be cut into pieces that fit (stops at the first not)."""
        for op in self.graph.ops:
            self.root = op
            self.root_ws = self.ws(op)
            self.emit(op)
            if self.oversize:
                return False
        self.root = None
        self.deliver()
        return not self.oversize


def _rename(value: Any, refs: Mapping[str, dict[str, Any]]) -> Any:
    """``value`` with references to the tensors in ``refs`` replaced by their references."""
    if isinstance(value, Mapping):
        ref = O.ref_name(value)
        if ref is not None:
            return dict(refs.get(ref[1], value)) if ref[0] == "t" and "view" not in value else dict(value)
        return {k: _rename(v, refs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rename(v, refs) for v in value]
    return value
