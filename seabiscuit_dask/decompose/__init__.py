"""Hierarchical decomposition: split ops until every working set fits a budget.

An op whose working set (params + inputs + outputs) exceeds the budget is cut by
the rule that makes its pieces fit in the fewest pieces, and the pieces are cut
again if they still do not (``up_proj.linear_4.c1.r0``: column tile 1, reduction
tile 0). Rules are a table keyed by op kind (``rules.RULES``), one function each:

=============  ==================================================================
linear/matmul  output columns (concat, exact) | rows of the input (concat, exact)
               | reduction dim (partial sums; bias on the first tile)
conv           output channels | input channels (partial sums) | whole groups | batch
embedding      vocabulary rows (masked lookups, summed) | embedding columns (concat)
attention      heads (GQA-aware) | query rows
elementwise,   strips along a dim the op does not reduce over (concat, exact)
norm, pool,
reduction
=============  ==================================================================

Each tile's weight is a ``ParamSpec`` slice of the original weight; activations
are cut by ``aten.slice.Tensor`` ops. The pass returns a new graph and never
edits its input.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import config
from ..errors import BudgetTooSmall
from ..ir import Op, OpGraph, fmt_bytes
from .decomposer import Decomposer
from .report import Oversize, describe, fmt_bytes_up
from .rules import RULES, register
from .split import Split, bounds_for, min_pieces

__all__ = ["RULES", "Decomposer", "Split", "bounds_for", "decompose", "largest_working_set",
           "min_pieces", "register", "smallest_budget"]


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
        ``meta["oversize"]``) instead of raising ``BudgetTooSmall``, whose
        message names those ops and the smallest budget that would fit them.

    Examples
    --------
    >>> g = sb.decompose(sb.trace(model, x), budget="64KiB")   # doctest: +SKIP
    >>> print(g.summary())                                       # doctest: +SKIP
    """
    from ..templates import cached_decompose

    budget_bytes = config.to_bytes(budget if budget is not None else config.get("budget"))
    return cached_decompose(graph, budget_bytes, allow_oversize, _decompose)


def _decompose(graph: OpGraph, budget_bytes: int, allow_oversize: bool) -> OpGraph:
    d = Decomposer(graph, budget_bytes)
    result = d.run()
    if not d.oversize:
        return result
    if not allow_oversize:
        raise budget_error(graph, budget_bytes, d.oversize)
    listed = sorted(d.oversize, key=lambda o: -o.ws)
    return result.with_meta(oversize=[[o.op.name, o.ws] for o in listed])


def budget_error(graph: OpGraph, budget: int, oversize: Sequence[Oversize]) -> BudgetTooSmall:
    """The error for ``oversize``: the ops at fault, why, and the budget that would do."""
    listed = sorted(oversize, key=lambda o: -o.ws)
    head = "; ".join(describe(o) for o in listed[:3])
    more = f"; and {len(listed) - 3} more" if len(listed) > 3 else ""
    need = smallest_budget(graph, budget, oversize)
    return BudgetTooSmall(
        f"{len(listed)} op(s) cannot be cut to fit the budget of {fmt_bytes(budget)}: {head}{more}. "
        f"Use a budget of at least {fmt_bytes_up(need)} ({need} bytes), or "
        "allow_oversize=True to keep such ops whole.")


def smallest_budget(graph: OpGraph, budget: int, oversize: Sequence[Oversize]) -> int:
    """The least budget (bytes) at which ``graph`` decomposes with every op within it.

    Searches above ``budget`` for the ops whose pieces did not fit there, then
    decomposes the whole graph at the answer to confirm it, searching on if it fails.
    """
    while oversize:
        roots = list({o.root.name: o.root for o in oversize}.values())
        budget = _search(graph, budget, roots)
        d = Decomposer(graph, budget)
        d.run()
        oversize = d.oversize
    return budget


def _search(graph: OpGraph, lo: int, roots: list[Op]) -> int:
    """Least ``hi > lo`` at which every op of ``roots`` fits, given that some fail at ``lo``."""
    hi = max(Decomposer(graph, lo).ws(op) for op in roots)   # NOTE: an op that fits stays whole
    while hi - lo > 1:
        mid = (lo + hi) // 2
        d = Decomposer(graph, mid)
        if all(d.fits(op) for op in roots):
            hi = mid
        else:
            lo = mid
    return hi


def largest_working_set(graph: OpGraph) -> tuple[str, int]:
    """Name and working set (bytes) of the op of ``graph`` holding the most memory."""
    ws, name = max(((graph.working_set(op), op.name) for op in graph.ops), default=(0, "-"))
    return name, ws
