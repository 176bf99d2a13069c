"""Hierarchical decomposition: split ops until every working set fits a budget.

An op whose working set (params + inputs + outputs) exceeds the budget is cut by
the first rule that makes its pieces fit, and the pieces are cut again if they
still do not (``up_proj.linear_4.c1.r0``: column tile 1, reduction tile 0):

=============  ==================================================================
linear/mm      output columns (concat, exact) | rows of the input (concat, exact)
               | reduction dim (partial sums; bias on the first tile)
conv           output channels | input channels (partial sums) | whole groups | batch
embedding      vocabulary rows (masked lookups, summed) | embedding columns (concat)
attention      heads (GQA-aware) | query rows | batch
elementwise,   strips along a dim the op does not reduce over (concat, exact)
norm, pool
=============  ==================================================================

Each tile's weight is a ``ParamSpec`` slice of the original weight; activations
are cut by ``aten.slice.Tensor`` ops. The pass returns a new graph and never
edits its input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import config
from . import ops as O
from .cost import op_flops
from .errors import BudgetTooSmall
from .ir import Op, OpGraph, ParamSpec, TensorSpec, fmt_bytes, iter_refs, operand_names

MAX_DEPTH = 8

# piece(i, lo, hi, pieces) -> (args, kwargs, target, output spec) of tile i over [lo, hi)
PieceFn = Callable[[int, int, int, "list[tuple[Op, bool]]"],
                   "tuple[list[Any], dict[str, Any], str, TensorSpec]"]


@dataclass(frozen=True)
class Split:
    """One way to cut an op: ``tag`` names it, ``n`` units along the cut, ``ws(k)``
    the largest piece's working set for ``k`` pieces, ``glue`` the bytes the
    joining (and slicing) ops need, ``build(bounds)`` makes the pieces."""

    tag: str
    n: int
    ws: Callable[[int], float]
    glue: float
    build: Callable[[list[int]], list[tuple[Op, bool]]]


def _frac(n: int, k: int) -> float:
    """Share of ``n`` units held by the largest of ``k`` balanced pieces."""
    return math.ceil(n / k) / n


def bounds_for(n: int, k: int) -> list[int]:
    return [round(i * n / k) for i in range(k + 1)]


def min_pieces(split: Split, limit: float) -> int | None:
    """Fewest pieces whose largest working set is at most ``limit``, or None."""
    if split.n < 2 or split.ws(split.n) > limit:
        return None
    lo, hi = 2, split.n
    while lo < hi:  # ws(k) is non-increasing in k
        mid = (lo + hi) // 2
        if split.ws(mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Decomposer:
    def __init__(self, graph: OpGraph, budget: int) -> None:
        self.graph = graph
        self.budget = budget
        self.tensors: dict[str, TensorSpec] = dict(graph.tensors)
        self.params: dict[str, ParamSpec] = dict(graph.params)
        self.ops: list[Op] = []
        self.oversize: list[tuple[Op, int, str]] = []
        self.slices: dict[tuple[str, int, int, int], str] = {}

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

    # --- building pieces ---------------------------------------------------------------------
    def make(self, name: str, target: str, args: list[Any], kwargs: dict[str, Any],
             out: str, spec: TensorSpec, scope: str, kind: str | None = None) -> Op:
        self.tensors[out] = spec
        inputs, params = operand_names(args, kwargs)
        flops = op_flops(target, args, [spec.shape], self.shape)
        return Op(name, kind or O.kind_of(target), target, inputs, (out,), params,
                  {"args": args, "kwargs": kwargs}, scope, flops)

    def cut(self, ref: Any, dim: int, a: int, b: int, scope: str,
            pieces: list[tuple[Op, bool]]) -> Any:
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

    def join(self, op: Op, parts: list[str], how: str, dim: int) -> Op | list[Op]:
        out = op.outputs[0]
        spec = self.tensors[out]
        if how == "concat":
            return self.make(f"{op.name}.cat", "aten.cat.default", [[{"t": p} for p in parts], dim],
                             {}, out, spec, op.scope, "concat")
        chain: list[Op] = []
        acc = parts[0]
        for i, p in enumerate(parts[1:], 1):
            dst = out if i == len(parts) - 1 else f"{out}.sum{i}"
            chain.append(self.make(f"{op.name}.sum{i}", "aten.add.Tensor",
                                   [{"t": acc}, {"t": p}], {}, dst, spec, op.scope, "sum"))
            acc = dst
        return chain

    def tiles(self, op: Op, tag: str, bounds: list[int], join: str, join_dim: int,
              piece: PieceFn) -> list[tuple[Op, bool]]:
        """Make one tile per ``[bounds[i], bounds[i+1])`` with ``piece`` and join them."""
        pieces: list[tuple[Op, bool]] = []
        parts: list[str] = []
        for i in range(len(bounds) - 1):
            scope = f"{op.scope}.{tag}{i}" if op.scope else f"{tag}{i}"
            args, kwargs, target, spec = piece(i, bounds[i], bounds[i + 1], pieces)
            out = f"{op.outputs[0]}.{tag}{i}"
            pieces.append((self.make(f"{op.name}.{tag}{i}", target, args, kwargs, out, spec,
                                     scope, op.kind), True))
            parts.append(out)
        joined = self.join(op, parts, join, join_dim)
        pieces.extend((j, False) for j in (joined if isinstance(joined, list) else [joined]))
        return pieces

    # --- the recursion -----------------------------------------------------------------------
    def emit(self, op: Op, depth: int = 0) -> None:
        ws = self.ws(op)
        if ws <= self.budget:
            self.ops.append(op)
            return
        splits = self.splits(op) if depth < MAX_DEPTH and len(op.outputs) == 1 else []
        choice = self.choose(splits)
        if choice is None:
            why = (f"no rule splits {op.target}" if not splits else
                   "no split of " + ", ".join(s.tag for s in splits) + " fits")
            self.oversize.append((op, ws, why))
            self.ops.append(op)
            return
        split, k = choice
        for piece, is_tile in split.build(bounds_for(split.n, k)):
            if is_tile and self.ws(piece) < ws:
                self.emit(piece, depth + 1)
            else:
                self.emit_glue(piece)

    def emit_glue(self, op: Op) -> None:
        ws = self.ws(op)
        if ws > self.budget:
            self.oversize.append((op, ws, "joining or slicing op"))
        self.ops.append(op)

    def choose(self, splits: list[Split]) -> tuple[Split, int] | None:
        """The split needing the fewest pieces to fit; rule order breaks ties."""
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

    def splits(self, op: Op) -> list[Split]:
        t = op.target
        if t in O.LINEAR or t in O.MATMUL:
            return self.matmul_splits(op)
        if t in O.CONV:
            return self.conv_splits(op)
        if t in O.EMBEDDING:
            return self.embedding_splits(op)
        if t in O.ATTENTION:
            return self.attention_splits(op)
        return self.strip_splits(op)

    # --- matmul family -----------------------------------------------------------------------
    def matmul_splits(self, op: Op) -> list[Split]:
        args = list(op.attrs["args"])
        t = op.target
        bias_i: int | None
        if t == "aten.linear.default":
            a_i, b_i, bias_i, b_nk = 0, 1, 2, True
        elif t == "aten.addmm.default":
            if O.operand(args, 3, 1) != 1 or O.operand(args, 4, 1) != 1:
                return []
            a_i, b_i, bias_i, b_nk = 1, 2, 0, False
        else:
            a_i, b_i, bias_i, b_nk = 0, 1, None, False
        A, B = args[a_i], args[b_i]
        bias = O.operand(args, bias_i) if bias_i is not None else None
        sa, sb = self.shape(A), self.shape(B)
        if len(sa) < 2 or len(sb) < 2:
            return []
        a, b, y = self.nbytes(A), self.nbytes(B), self.tensors[op.outputs[0]].nbytes
        bb = self.nbytes(bias)
        out = self.tensors[op.outputs[0]]
        n_dim, k_dim = (0, 1) if b_nk else (len(sb) - 1, len(sb) - 2)
        N, K, M = sb[n_dim], sa[-1], sa[-2]
        a_ref = O.ref_name(A)
        a_cut = a if a_ref is not None and a_ref[0] == "t" else 0

        def cols(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = list(args)
                new[b_i] = self.cut(B, n_dim, lo, hi, op.scope, pieces)
                if bias is not None and bias_i is not None:
                    new[bias_i] = self.cut(bias, -1, lo, hi, op.scope, pieces)
                return new, dict(op.attrs["kwargs"]), t, TensorSpec((*out.shape[:-1], hi - lo), out.dtype)
            return self.tiles(op, "c", bounds, "concat", -1, piece)

        def rows(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = list(args)
                new[a_i] = self.cut(A, len(sa) - 2, lo, hi, op.scope, pieces)
                if bias is not None and bias_i is not None and len(self.shape(bias)) >= 2 \
                        and self.shape(bias)[-2] == M:
                    new[bias_i] = self.cut(bias, -2, lo, hi, op.scope, pieces)
                shape = (*out.shape[:-2], hi - lo, out.shape[-1])
                return new, dict(op.attrs["kwargs"]), t, TensorSpec(shape, out.dtype)
            return self.tiles(op, "m", bounds, "concat", -2, piece)

        def reduction(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = list(args)
                new[a_i] = self.cut(A, -1, lo, hi, op.scope, pieces)
                new[b_i] = self.cut(B, k_dim, lo, hi, op.scope, pieces)
                target = t
                if bias is not None and bias_i is not None and i > 0:
                    if t == "aten.addmm.default":   # NOTE: no bias left: a plain mm
                        new, target = [new[1], new[2]], "aten.mm.default"
                    else:
                        new[bias_i] = None
                return new, dict(op.attrs["kwargs"]), target, out
            return self.tiles(op, "r", bounds, "sum", -1, piece)

        out_splits = [
            Split("c", N, lambda k: a + (b + bb) * _frac(N, k) + y * _frac(N, k), 2 * y, cols),
            Split("m", M, lambda k: a * _frac(M, k) + b + bb + y * _frac(M, k),
                  max(2 * y, a_cut * 1.5), rows),
            Split("r", K, lambda k: (a + b) * _frac(K, k) + bb + y, max(3 * y, a_cut * 1.5), reduction),
        ]
        if op.target == "aten.matmul.default" and len(sa) != len(sb):
            out_splits = out_splits[:2]   # broadcasting matmul: keep to exact concat splits
        return out_splits

    # --- conv --------------------------------------------------------------------------------
    def conv_splits(self, op: Op) -> list[Split]:
        args = list(op.attrs["args"])
        X, W = args[0], args[1]
        bias = O.operand(args, 2)
        groups = int(O.operand(args, 6, 1))
        sx, sw = self.shape(X), self.shape(W)
        out = self.tensors[op.outputs[0]]
        x, w, y, bb = self.nbytes(X), self.nbytes(W), out.nbytes, self.nbytes(bias)
        if len(sx) != len(sw):   # unbatched input: leave alone
            return []
        O_, I_ = sw[0], sw[1]

        def with_args(**changes: Any) -> list[Any]:
            new = list(args) + [None] * (7 - len(args))
            nd = len(sx) - 2
            defaults = {3: [1] * nd, 4: [0] * nd, 5: [1] * nd, 6: 1}
            for pos, d in defaults.items():
                if new[pos] is None:
                    new[pos] = d
            for name, v in changes.items():
                new[int(name[1:])] = v
            return new

        def out_channels(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = with_args(a1=self.cut(W, 0, lo, hi, op.scope, pieces),
                                a2=self.cut(bias, 0, lo, hi, op.scope, pieces) if bias else None)
                shape = (*out.shape[:1], hi - lo, *out.shape[2:])
                return new, {}, op.target, TensorSpec(shape, out.dtype)
            return self.tiles(op, "c", bounds, "concat", 1, piece)

        def in_channels(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = with_args(a0=self.cut(X, 1, lo, hi, op.scope, pieces),
                                a1=self.cut(W, 1, lo, hi, op.scope, pieces),
                                a2=bias if i == 0 else None)
                return new, {}, op.target, out
            return self.tiles(op, "i", bounds, "sum", 1, piece)

        def by_groups(bounds: list[int]) -> list[tuple[Op, bool]]:
            opg, ipg = O_ // groups, I_

            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = with_args(a0=self.cut(X, 1, lo * ipg, hi * ipg, op.scope, pieces),
                                a1=self.cut(W, 0, lo * opg, hi * opg, op.scope, pieces),
                                a2=self.cut(bias, 0, lo * opg, hi * opg, op.scope, pieces) if bias else None,
                                a6=hi - lo)
                shape = (*out.shape[:1], (hi - lo) * opg, *out.shape[2:])
                return new, {}, op.target, TensorSpec(shape, out.dtype)
            return self.tiles(op, "g", bounds, "concat", 1, piece)

        def batch(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = with_args(a0=self.cut(X, 0, lo, hi, op.scope, pieces))
                return new, {}, op.target, TensorSpec((hi - lo, *out.shape[1:]), out.dtype)
            return self.tiles(op, "n", bounds, "concat", 0, piece)

        N = sx[0]
        result = []
        if groups == 1:
            result += [
                Split("c", O_, lambda k: x + (w + bb + y) * _frac(O_, k), 2 * y, out_channels),
                Split("i", I_, lambda k: (x + w) * _frac(I_, k) + bb + y, max(3 * y, 1.5 * x), in_channels),
            ]
        else:
            result.append(Split("g", groups, lambda k: (x + w + bb + y) * _frac(groups, k),
                                max(2 * y, 1.5 * x), by_groups))
        result.append(Split("n", N, lambda k: (x + y) * _frac(N, k) + w + bb, max(2 * y, 1.5 * x), batch))
        return result

    # --- embedding ---------------------------------------------------------------------------
    def embedding_splits(self, op: Op) -> list[Split]:
        args = list(op.attrs["args"])
        W, idx = args[0], args[1]
        V, D = self.shape(W)
        out = self.tensors[op.outputs[0]]
        w, i_b, y = self.nbytes(W), self.nbytes(idx), out.nbytes
        rows_target = op.target == "sb.embedding_rows"

        def vocab(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                base = int(args[2]) if rows_target else 0
                return ([self.cut(W, 0, lo, hi, op.scope, pieces), idx, base + lo], {},
                        "sb.embedding_rows", out)
            return self.tiles(op, "v", bounds, "sum", -1, piece)

        def columns(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = list(args)
                new[0] = self.cut(W, 1, lo, hi, op.scope, pieces)
                return new, {}, op.target, TensorSpec((*out.shape[:-1], hi - lo), out.dtype)
            return self.tiles(op, "d", bounds, "concat", -1, piece)

        v = Split("v", V, lambda k: w * _frac(V, k) + i_b + y, 3 * y, vocab)
        d = Split("d", D, lambda k: (w + y) * _frac(D, k) + i_b, 2 * y, columns)
        if rows_target:
            return [d]
        return [v, d] if V >= 4 * D else [d, v]

    # --- attention ---------------------------------------------------------------------------
    def attention_splits(self, op: Op) -> list[Split]:
        args = list(op.attrs["args"])
        kwargs = dict(op.attrs["kwargs"])
        Q, K_, V_ = args[:3]
        mask = O.operand(args, 3)
        causal = bool(O.operand(args, 5, False))
        sq, sk = self.shape(Q), self.shape(K_)
        if len(sq) != 4 or len(sk) != 4:
            return []
        B, H, L, _ = sq
        Hk = sk[1]
        if H % Hk:
            return []
        g = H // Hk
        out = self.tensors[op.outputs[0]]
        q, kv, y = self.nbytes(Q), self.nbytes(K_) + self.nbytes(V_), out.nbytes
        m = self.nbytes(mask)
        ms = self.shape(mask) if mask is not None else ()
        mask4 = (1,) * (4 - len(ms)) + tuple(ms) if mask is not None else ()
        biggest = max(q, self.nbytes(K_), self.nbytes(V_), m)

        def cut_mask(dim: int, lo: int, hi: int, size: int, pieces: list[tuple[Op, bool]]) -> Any:
            if mask is None or mask4[dim] != size:
                return mask
            return self.cut(mask, dim - (4 - len(ms)), lo, hi, op.scope, pieces)

        def heads(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = list(args)
                new[0] = self.cut(Q, 1, lo * g, hi * g, op.scope, pieces)
                new[1] = self.cut(K_, 1, lo, hi, op.scope, pieces)
                new[2] = self.cut(V_, 1, lo, hi, op.scope, pieces)
                if len(new) > 3:
                    new[3] = cut_mask(1, lo * g, hi * g, H, pieces)
                shape = (B, (hi - lo) * g, *out.shape[2:])
                return new, kwargs, op.target, TensorSpec(shape, out.dtype)
            # NOTE: pieces are whole KV groups, so grouped-query heads stay with their KV head.
            return self.tiles(op, "h", bounds, "concat", 1, piece)

        def queries(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                new = list(args)
                new[0] = self.cut(Q, 2, lo, hi, op.scope, pieces)
                if len(new) > 3:
                    new[3] = cut_mask(2, lo, hi, L, pieces)
                shape = (*out.shape[:2], hi - lo, *out.shape[3:])
                return new, kwargs, op.target, TensorSpec(shape, out.dtype)
            return self.tiles(op, "q", bounds, "concat", 2, piece)

        result = [Split("h", Hk, lambda k: (q + kv + y + m) * _frac(Hk, k), max(2 * y, 1.5 * biggest), heads)]
        if not causal:
            result.append(Split("q", L, lambda k: (q + y + m) * _frac(L, k) + kv,
                                max(2 * y, 1.5 * biggest), queries))
        return result

    # --- strips ------------------------------------------------------------------------------
    def strip_splits(self, op: Op) -> list[Split]:
        args = list(op.attrs.get("args", ()))
        kwargs = dict(op.attrs.get("kwargs", {}))
        out = self.tensors[op.outputs[0]]
        r = len(out.shape)
        forbidden = O.row_split_forbidden_dims(op.target, args, r)
        if forbidden is None or r == 0:
            return []
        allowed = [d for d in range(r) if d not in forbidden and out.shape[d] > 1]
        if not allowed:
            return []
        d = max(allowed, key=lambda i: (out.shape[i], -i))
        n = out.shape[d]
        slice_params = op.target in O.ELEMENTWISE

        def aligned(ref: Any) -> int | None:
            rr = O.ref_name(ref)
            if rr is None or (rr[0] == "p" and not slice_params):
                return None
            s = self.shape(ref)
            di = d - (r - len(s))
            return di if di >= 0 and s[di] == n else None

        refs = list(iter_refs(args))
        cut_bytes = sum(self.nbytes(a) for a in refs if aligned(a) is not None)
        whole = sum(self.nbytes(a) for a in refs if aligned(a) is None)
        biggest = max([self.nbytes(a) for a in refs if aligned(a) is not None] + [0])

        def build(bounds: list[int]) -> list[tuple[Op, bool]]:
            def piece(i: int, lo: int, hi: int, pieces: list[tuple[Op, bool]]):  # type: ignore[no-untyped-def]
                def sub(v: Any) -> Any:
                    if O.ref_name(v) is not None:
                        di = aligned(v)
                        return v if di is None else self.cut(v, di, lo, hi, op.scope, pieces)
                    if isinstance(v, (list, tuple)):
                        return [sub(x) for x in v]
                    return v
                shape = (*out.shape[:d], hi - lo, *out.shape[d + 1:])
                return [sub(a) for a in args], kwargs, op.target, TensorSpec(shape, out.dtype)
            return self.tiles(op, "s", bounds, "concat", d, piece)

        return [Split("s", n, lambda k: (cut_bytes + out.nbytes) * _frac(n, k) + whole,
                      max(2 * out.nbytes, 1.5 * biggest), build)]

    # --- result ------------------------------------------------------------------------------
    def run(self) -> OpGraph:
        for op in self.graph.ops:
            self.emit(op)
        used = {p for op in self.ops for p in op.params} | set(self.graph.outputs)
        params = {k: v for k, v in self.params.items() if k in used}
        live = set(self.graph.inputs) | {t for op in self.ops for t in op.outputs}
        tensors = {k: v for k, v in self.tensors.items() if k in live}
        meta = {**dict(self.graph.meta), "budget_bytes": self.budget}
        return OpGraph(tuple(self.ops), tensors, params, self.graph.inputs,
                       self.graph.outputs, meta)


def decompose(graph: OpGraph, budget: int | str | None = None, *,
              allow_oversize: bool = False) -> OpGraph:
    """Split every op whose working set exceeds ``budget`` into micro-ops that fit.

    Parameters
    ----------
    graph : OpGraph
        A traced graph (left unchanged).
    budget : int or str, default config ``seabiscuit.budget`` ("16MiB")
        Per-op memory budget: params + inputs + outputs of every micro-op.
    allow_oversize : bool
        Keep ops that no rule can shrink below the budget (listed in
        ``meta["oversize"]``) instead of raising ``BudgetTooSmall``.

    Examples
    --------
    >>> g = sb.decompose(sb.trace(model, x), budget="64KiB")   # doctest: +SKIP
    >>> print(g.summary())                                       # doctest: +SKIP
    """
    from .templates import cached_decompose

    budget_bytes = config.to_bytes(budget if budget is not None else config.get("budget"))
    return cached_decompose(graph, budget_bytes, allow_oversize, _decompose)


def _decompose(graph: OpGraph, budget_bytes: int, allow_oversize: bool) -> OpGraph:
    d = _Decomposer(graph, budget_bytes)
    result = d.run()
    if d.oversize:
        listed = sorted(d.oversize, key=lambda x: -x[1])
        if not allow_oversize:
            head = "; ".join(f"op {op.name!r} ({op.target}) needs {fmt_bytes(ws)} ({why})"
                             for op, ws, why in listed[:3])
            more = f" and {len(listed) - 3} more" if len(listed) > 3 else ""
            raise BudgetTooSmall(f"{len(listed)} op(s) cannot be split below the budget of "
                                 f"{fmt_bytes(budget_bytes)}: {head}{more}")
        result = result.with_meta(oversize=[[op.name, ws] for op, ws, _ in listed])
    return result


def largest_working_set(graph: OpGraph) -> tuple[str, int]:
    ws, name = max(((graph.working_set(op), op.name) for op in graph.ops), default=(0, "-"))
    return name, ws

