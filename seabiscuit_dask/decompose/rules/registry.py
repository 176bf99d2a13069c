"""The rule table: op kind -> rules, tried in the order they were registered."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...ir import Op
from ..split import Split

if TYPE_CHECKING:
    from ..decomposer import Decomposer

RuleFn = Callable[["Decomposer", Op], "Split | None"]
"""``rule(d, op)``: one way to cut ``op`` (sizes and cuts come from ``d``), or None."""

RULES: dict[str, list[RuleFn]] = {}


def register(*kinds: str) -> Callable[[RuleFn], RuleFn]:
    """Add the decorated rule to the rules of each op kind in ``kinds``.

    Examples
    --------
    >>> @register("elementwise")                      # doctest: +SKIP
    ... def strips(d: Decomposer, op: Op) -> Split | None:
    ...     ...
    """
    def add(rule: RuleFn) -> RuleFn:
        for kind in kinds:
            RULES.setdefault(kind, []).append(rule)
        return rule
    return add
