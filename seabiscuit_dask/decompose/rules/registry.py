"""The rule table: op kind -> rules, tried in the order they were registered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ...ir import Op, ParamSpec, TensorSpec
from ..split import Pieces, Split

R = TypeVar("R")


class Decomposing(Protocol):
    """What a rule reads of the decomposer that runs it (``decomposer.Decomposer``): sizes,
    where weights were cut, and ``cut`` to make a piece's operands; the rules never import it."""

    budget: int
    tensors: dict[str, TensorSpec]
    params: dict[str, ParamSpec]
    param_edges: dict[tuple[str, int], set[int]]      # NOTE: (param, dim) -> where it was cut

    def shape(self, ref: Any) -> tuple[int, ...]: ...

    def nbytes(self, ref: Any) -> int: ...

    def read(self, op: Op, reader: Callable[[Decomposing, Op], R]) -> R: ...

    def cut(self, ref: Any, dim: int, a: int, b: int, scope: str = "",
            pieces: Pieces | None = None) -> Any: ...


RuleFn = Callable[[Decomposing, Op], "Split | None"]
"""``rule(d, op)``: one way to cut ``op`` (sizes and cuts come from ``d``), or None."""

RULES: dict[str, list[RuleFn]] = {}


def register(*kinds: str) -> Callable[[RuleFn], RuleFn]:
    """Add the decorated rule to the rules of each op kind in ``kinds``.

    Examples
    --------
    >>> @register("elementwise")                      # doctest: +SKIP
    ... def strips(d: Decomposing, op: Op) -> Split | None:
    ...     ...
    """
    def add(rule: RuleFn) -> RuleFn:
        for kind in kinds:
            RULES.setdefault(kind, []).append(rule)
        return rule
    return add
