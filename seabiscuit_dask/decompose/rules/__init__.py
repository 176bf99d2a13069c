"""Decomposition rules, a table keyed by op kind (``ops.kind_of``).

A rule is a function ``rule(d, op) -> Split | None``: one way to cut ``op``, with
sizes read from the decomposer ``d`` (what a rule sees of it: ``Decomposing``) and
activations cut by ``d.cut``. Adding a rule is writing that function and registering
it under the kinds it serves:

>>> @register("pool")                                   # doctest: +SKIP
... def pool_windows(d: Decomposing, op: Op) -> Split | None:
...     ...

The decomposer tries every rule of ``op.kind`` and takes the split needing the
fewest pieces (ties: ``Split.tiebreak``, then registration order).
"""

from . import (
    attention,
    conv,
    conv_transpose,
    creation,
    embedding,
    matmul,
    pool,
    q4linear,  # noqa: F401  (registers sb.q4linear's rules)
    reductions,
    scatter,
    strips,
    views,
)
from .registry import RULES, Decomposing, RuleFn, register

__all__ = ["RULES", "Decomposing", "RuleFn", "attention", "conv", "conv_transpose", "creation", "embedding",
           "matmul", "pool", "reductions", "register", "scatter", "strips", "views"]
