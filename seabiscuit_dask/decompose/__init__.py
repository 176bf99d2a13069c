"""Hierarchical decomposition on tiled tensors: split ops until every working set fits.

An op whose working set (params + inputs + outputs, and an attention's scores)
exceeds the budget is cut by the rule that makes its pieces fit in the fewest
pieces, counting what gathering their inputs takes, and the pieces are cut again
if they still do not (``up_proj.linear_4.m1.c0``: row tile 1, column tile 0).
Rules are a table keyed by op kind (``rules.RULES``), one function each:

=============  ==================================================================
linear/matmul  output columns | rows of the input | reduction dim (partial sums
               added as a tree; bias on the first tile)
conv           output channels | input channels (partial sums) | whole groups | batch
               | spatial strips, each reading its input rows and a halo
pool           spatial strips with halos (max; average where exact)
embedding      token rows | vocabulary rows (masked lookups, summed) | columns
attention      heads (GQA-aware) | query chunks (causal: only the keys they see)
               | key chunks (parts merged exactly by log-sum-exp)
elementwise,   strips along a dim the op does not reduce over
norm, pool,
reduction
view, concat   strips that map to strips of the input (reshape, permute, expand, cat)
=============  ==================================================================

Tiles are the output (``tiling``): a split op's output is recorded as the grid of
its tiles, and a consumer's piece reads only the tiles it overlaps; slices and
joins are emitted only where a piece straddles tiles, and pieces are aligned with
the tiles of the input they cut. Each tile's weight is a ``ParamSpec`` slice of
the original weight. The pass returns a new graph and never edits its input.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .. import config
from ..errors import BudgetTooSmall, InvalidGraph
from ..ir import OpGraph, fmt_bytes, iter_refs
from ..pauses import no_gc
from .decomposer import Decomposer
from .report import Oversize, describe, fmt_bytes_up
from .rules import RULES, register
from .split import Split, bounds_for, min_pieces

__all__ = ["RULES", "Decomposer", "Split", "bounds_for", "decompose", "largest_working_set",
           "min_pieces", "register", "smallest_budget"]


def decompose(graph: OpGraph, budget: int | str | None = None, *,
              allow_oversize: bool = False, like: OpGraph | None = None) -> OpGraph:
    """Split every op whose working set exceeds ``budget`` into micro-ops that fit.

    Parameters
    ----------
    graph : OpGraph
        A traced graph (left unchanged).
    budget : int or str, default config ``seabiscuit.budget`` ("16MiB")
        Per-op memory budget: params + inputs + outputs of every micro-op.
    allow_oversize : bool
        Keep ops that no rule can shrink below the budget (listed in
        ``meta["oversize"]``) instead of raising ``BudgetTooSmall``, whose
        message names those ops and the smallest budget that would fit them.

    like : OpGraph, optional
        A decomposed graph of the same model (another input shape): weights are cut
        where it cut them, and quantized as it quantized them (``quantize.py``), so both
        read the same tiles (a generation step program shares its deployment's resident
        weights).

    Examples
    --------
    >>> g = sb.decompose(sb.trace(model, x), budget="64KiB")   # doctest: +SKIP
    >>> print(g.summary())                                       # doctest: +SKIP
    """
    from ..templates import cached_decompose

    budget_bytes = config.to_bytes(budget if budget is not None else config.get("budget"))
    if graph.tilings or any("view" in r for op in graph.ops for r in iter_refs(op.attrs.get("args", ()))):
        raise InvalidGraph(f"{graph.meta.get('name', 'the graph')} is already decomposed into tiles; "
                           "decompose the traced graph with the new budget instead")
    if like is not None and like.meta.get("quantize") is not None:
        from ..quantize import quantize  # NOTE: its weights as the deployment holds them

        graph = quantize(graph, like.meta["quantize"])
    if like is None:
        return cached_decompose(graph, budget_bytes, allow_oversize, _decompose)
    cuts = weight_cuts_of(like, graph)
    key = repr(sorted((k, sorted(v)) for k, v in cuts.items()))
    return cached_decompose(graph, budget_bytes, allow_oversize,
                            lambda g, b, a: _decompose(g, b, a, cuts), extra=key)


def weight_cuts_of(decomposed: OpGraph, graph: OpGraph) -> dict[tuple[str, int], set[int]]:
    """Where ``decomposed`` cut each weight of ``graph`` (tiles are named ``param@dim[a:b]``):
    (param, dim) -> edges."""
    cuts: dict[tuple[str, int], set[int]] = {}
    for tile, p in decomposed.params.items():
        name = tile.split("@")[0]
        if name not in graph.params or p.source.slices is None \
                or len(p.source.slices) != len(graph.params[name].shape):
            continue
        full = graph.params[name].shape
        for dim, (a, b) in enumerate(p.source.slices):
            if (a, b) != (0, full[dim]):
                cuts.setdefault((name, dim), {0, full[dim]}).update((a, b))
    return cuts


def shared_weight_cuts(graph: OpGraph, budget: int) -> dict[tuple[str, int], set[int]] | None:
    """How to cut each weight several ops read (tied embeddings): as the op with the largest
    working set among them cuts it on its own, so the weight is held in one set of tiles."""
    users = Counter(p for op in graph.ops for p in dict.fromkeys(op.params))
    shared = {p for p, n in users.items() if n > 1}
    if not shared:
        return None
    first = Decomposer(graph, budget)
    with no_gc():
        first.run()
    best: dict[str, tuple[int, int]] = {}
    for (name, dim), ws in first.edge_ws.items():
        if name in shared and ws > best.get(name, (-1, 0))[0]:
            best[name] = (ws, dim)
    return {(name, dim): first.param_edges[(name, dim)] for name, (_, dim) in best.items()}


def _decompose(graph: OpGraph, budget_bytes: int, allow_oversize: bool,
               cuts: dict[tuple[str, int], set[int]] | None = None) -> OpGraph:
    d = Decomposer(graph, budget_bytes, weight_cuts=cuts or shared_weight_cuts(graph, budget_bytes),
                   held=bool(cuts))
    with no_gc():
        result = d.run()
    if not d.oversize:
        return result
    if not allow_oversize:
        raise budget_error(graph, budget_bytes, d.oversize)
    listed = sorted(d.oversize, key=lambda o: -o.ws)
    return result.with_meta(oversize=[[o.op.name, o.ws] for o in listed])


def budget_error(graph: OpGraph, budget: int, oversize: Sequence[Oversize]) -> BudgetTooSmall:
    """The error for ``oversize``: the ops at fault, why, and the budget that would do."""
    worst: dict[str, Oversize] = {}
    for o in sorted(oversize, key=lambda o: -o.ws):
        worst.setdefault(o.root.name, o)
    listed = list(worst.values())
    head = "; ".join(describe(o, graph) for o in listed[:3])
    more = f"; and {len(listed) - 3} more" if len(listed) > 3 else ""
    need = smallest_budget(graph, budget, oversize)
    return BudgetTooSmall(
        f"{len(listed)} op(s) cannot be cut to fit the budget of {fmt_bytes(budget)}: {head}{more}. "
        f"Use a budget of at least {fmt_bytes_up(need)} ({need} bytes), or "
        "allow_oversize=True to keep such ops whole.")


def smallest_budget(graph: OpGraph, budget: int, oversize: Sequence[Oversize]) -> int:
    """The least budget (bytes) at which ``graph`` decomposes with every op within it.

    Above ``budget`` (which fails), doubles from the largest oversize op until the
    whole graph decomposes, then bisects; each try stops at its first op that cannot fit.
    """
    lo, hi = budget, max(budget + 1, max(o.ws for o in oversize))
    while not Decomposer(graph, hi).succeeds():
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if Decomposer(graph, mid).succeeds():
            hi = mid
        else:
            lo = mid
    return hi


def largest_working_set(graph: OpGraph) -> tuple[str, int]:
    """Name and working set (bytes) of the op of ``graph`` holding the most memory."""
    ws, name = max(((graph.working_set(op), op.name) for op in graph.ops), default=(0, "-"))
    return name, ws
