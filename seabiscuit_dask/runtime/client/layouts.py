"""How the workers hold a deployment's matmul weights on CPU devices, measured as it deploys.

A matmul weight tile may be held transposed, and a linear weight multiplied in columns for a
few rows, where its kernel runs faster so on a worker (``lower.layout``); the deployment's graph
names the choices (``weight_layouts``, ``matmul_forms``) and every program built later reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ... import config
from ...errors import BadInput
from ...lower import layout
from ...placement import Plan
from ..generation.scheduler import batch_buckets

Timer = Callable[[list[layout.Case]], Mapping[str, tuple[float, float]]]   # matmul cases -> times


def weight_layouts(client: Any, plan: Plan, graph: Any, rows: int | None = None) -> dict[str, str]:
    """How the workers hold ``graph``'s matmul weights on CPU devices of ``plan``
    (``lower.layout``): measured on the plan's first CPU worker, unless config
    ``seabiscuit.lower.weight-layout`` says ``traced`` (as the model holds them) or
    ``transposed`` (every one the other way, small ones too)."""
    setting = str(config.get("lower.weight-layout")).lower()
    if setting not in ("auto", "traced", "transposed"):
        raise BadInput(f"seabiscuit.lower.weight-layout is {setting!r}: use auto, traced or transposed")
    if setting == "traced" or graph.meta.get("weight_layouts"):
        return dict(graph.meta.get("weight_layouts") or {})
    on_cpu, timer = _cpu_timing(client, plan, graph)
    if not on_cpu:
        return {}
    if setting == "transposed":
        return layout.decide(graph, lambda cases: {c.key(): (2.0, 1.0) for c in cases}, rows, on_cpu, 0)
    return layout.decide(graph, timer, rows, on_cpu)


def matmul_forms(client: Any, plan: Plan, graph: Any, rows: int | None = None) -> dict[str, list[int]]:
    """The rows counts each linear weight of ``graph`` on a CPU device of ``plan`` runs in columns
    (``lower.layout.columns``): measured on the plan's first CPU worker for the decode batches up
    to ``rows`` (a forward deployment: its graph's rows, when that few), unless config
    ``seabiscuit.lower.matmul-form`` says ``linear`` (never) or the graph names them already."""
    setting = str(config.get("lower.matmul-form")).lower()
    if setting not in ("auto", "linear"):
        raise BadInput(f"seabiscuit.lower.matmul-form is {setting!r}: use auto or linear")
    if setting == "linear" or "matmul_forms" in graph.meta:
        return dict(graph.meta.get("matmul_forms") or {})
    on_cpu, timer = _cpu_timing(client, plan, graph, columns=True)
    if not on_cpu:
        return {}
    if rows is not None:
        counts = [b for b in batch_buckets() if b <= max(1, int(rows))]
    else:
        counts = sorted({c.rows for c in layout.matmul_cases(graph).values()})
    return layout.decide_forms(graph, timer, counts, on_cpu, graph.meta.get("weight_layouts") or {})


def _cpu_timing(client: Any, plan: Plan, graph: Any, columns: bool = False) -> tuple[set[str], Timer]:
    """The params of ``graph`` on CPU devices of ``plan``, and a timer of matmul cases on the plan's
    first CPU worker (``lower.layout.measure``; ``columns``: as linear and in columns)."""
    cpu = {i for i, d in enumerate(plan.spec.devices) if d.kind == "cpu"}
    on_cpu = {p for op, d in zip(graph.ops, plan.device_of.tolist()) if d in cpu for p in op.params}
    address = next((plan.spec.devices[i].address for i in sorted(cpu)), "")

    def timer(cases: list[layout.Case]) -> Mapping[str, tuple[float, float]]:
        return client.run(layout.measure_off_loop, cases, 5, columns, workers=[address])[address]
    return on_cpu, timer
