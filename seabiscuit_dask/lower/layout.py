"""How a worker holds each matmul weight in memory: as traced, or transposed.

A weight ``W`` of a linear layer is one logical tensor, and the matmul kernel reads
it in either of two physical orders: rows of ``W`` or rows of ``W.T``. On CPUs the
faster one depends on the rows that multiply it and on the weight's shape. Measured
here on one core (MKL, fp32, weights read from memory as a model's are): a
``[1024, 4096]`` weight times 128 rows runs 1.37x faster held ``[out, in]`` than
``[in, out]``, while SmolLM2's ``[576, 1536]`` times 4 rows runs 1.15x faster held
``[in, out]``; neither is always the order the model was written in (``nn.Linear``
holds ``[out, in]``, GPT-2's ``Conv1D`` ``[in, out]``).

The order is chosen once per deployment, by measurement on one worker of the
plan (``measure``), for the rows the deployment will run (``matmul_cases``), and
recorded in ``graph.meta["weight_layouts"]`` (param name -> ``"t"``: held
transposed). Every block spec carries it, so every worker, every plan version
and every program of the model hold a tile the same way, and a replayed request
computes the same bits. Holding a tile transposed changes only its strides: the
graph, the kernels and every result's logical shape are the same.

A linear layer over a few rows (a decode step) has a second choice, of kernel: as
``linear(x, W)``, or in *columns*, ``(W @ x.T).T`` (``columns``), the rows of a
weight held ``[out, in]`` against the columns of ``x.T``, a single row padded to
two. Measured the same way on one core (SmolLM2's weights, read cold): one row
times its 49152-row lm head takes 9.2 ms as ``linear`` and 5.5 ms in columns, two
rows 21.5 and 5.5 ms, four 16.4 and 9.9 ms; its ``[1536, 576]`` MLP weights 0.29 and
0.19 ms at one row. The rows counts a deployment decodes with (``small_rows()``, up to
its decode batch) are timed both ways for each weight held as traced
(``time_columns``); those where columns run at least ``MARGIN`` times faster are
recorded in ``graph.meta["matmul_forms"]`` (param name -> those rows counts), and a
block runs the linear ops that read the weight in columns for them (``columns_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import config
from .. import ops as O
from ..errors import BadInput
from ..ir import OpGraph
from ..timing import median_s

TRANSPOSED = "t"
LAYOUTS = (TRANSPOSED,)
LINEAR = "aten.linear.default"
# NOTE: the matmuls a weight's order is chosen for, their operands where the op table says: 2-D
# weights in floats (bmm multiplies 3-D operands; sb.qlinear dequantizes its 1-byte weight itself)
MATMULS: Mapping[str, O.MatmulOperands] = {
    t: O.MATMUL_OPERANDS[t] for t in (LINEAR, "aten.addmm.default", "aten.mm.default", "aten.matmul.default")}
# NOTE: ops that read rows of a weight: any order serves them (a tied embedding beside its lm head)
GATHERS = O.GATHERS
MARGIN = 1.2        # NOTE: the other order is taken only when it runs at least this much faster
# NOTE: below this a matmul's time is mostly the call's own, and a timing would choose at random
MIN_BYTES = 1 << 20
MAX_ROWS = 512      # NOTE: more rows are timed as this many (the orders run alike there)
COLD_BYTES = 64 << 20
FLOATS = ("float32", "float16", "bfloat16", "float64")     # NOTE: the dtypes a weight is timed in


@dataclass(frozen=True)
class Case:
    """A matmul to time: ``rows`` x ``k`` input times a weight as traced (``out_in``: ``[n, k]``)."""

    rows: int
    k: int
    n: int
    dtype: str
    out_in: bool
    bias: bool

    def key(self) -> str:
        return f"{self.rows}x{self.k}x{self.n}:{self.dtype}:{'oi' if self.out_in else 'io'}:{int(self.bias)}"


def small_rows() -> tuple[int, ...]:
    """The rows counts a decode step's linear layers may run in columns: the decode batch sizes
    (config ``seabiscuit.generate.batch-buckets``)."""
    return tuple(sorted({int(r) for r in config.get("generate.batch-buckets")}))


def columns(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, w, b)`` computed as ``(w @ x.T).T`` (a single row padded to two: one column is a
    matrix-vector product, the slow kernel again)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    x2 = x.reshape(rows, k)
    if rows == 1:
        x2 = torch.cat([x2, x2])
    y = torch.mm(w, x2.t()) if b is None else torch.addmm(b.unsqueeze(1), w, x2.t())
    return y.t()[:rows].contiguous().reshape(*x.shape[:-1], w.shape[0])


def columns_kernel(rows: Iterable[int], linear: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``linear`` (the registered kernel), run in ``columns`` when its input has one of ``rows`` rows
    and its weight is a 2-D ``[out, in]`` tensor as traced (a CPU block's: ``BlockProgram``)."""
    counts = frozenset(int(r) for r in rows)

    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        k = x.shape[-1]
        if k and x.numel() // k in counts and w.dim() == 2 and w.stride(1) == 1:
            return columns(x, w, b)
        return linear(x, w) if b is None else linear(x, w, b)
    return run


def check_forms(forms: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """``forms`` (param -> rows counts run in columns) with every count one of ``small_rows()``, else
    ``BadInput``."""
    out = {}
    sizes = small_rows()
    for name, counts in dict(forms or {}).items():
        if not isinstance(counts, (list, tuple)) or not all(isinstance(r, int) and r in sizes
                                                            for r in counts):
            raise BadInput(f"{where}: matmul form rows {counts!r} for {name!r} are not among {list(sizes)}")
        out[str(name)] = tuple(sorted(set(counts)))
    return out


def check_layouts(layouts: Mapping[str, Any], where: str) -> dict[str, str]:
    """``layouts`` (param -> layout) with every value a known layout, else ``BadInput``."""
    out = {}
    for name, value in dict(layouts or {}).items():
        if value not in LAYOUTS:
            raise BadInput(f"{where}: weight layout {value!r} for {name!r} is not one of {list(LAYOUTS)}")
        out[str(name)] = str(value)
    return out


def _ref(x: Any) -> tuple[str, str] | None:
    """("t", name) or ("p", name) of a plain operand reference, else None."""
    if isinstance(x, Mapping) and len(x) == 1:
        (kind, name), = x.items()
        if kind in ("t", "p"):
            return str(kind), str(name)
    return None


def matmul_cases(graph: OpGraph, rows: int | None = None) -> dict[str, Case]:
    """Each 2-D weight a matmul of ``graph`` reads -> the case its kernel runs.

    ``rows``: the rows the deployment will multiply (a generation deployment's decode
    batch) instead of the traced ones. A weight read by matmuls of different cases,
    or by anything else but row gathers (``GATHERS``) as well, is left out: it is held
    as traced.
    """
    cases: dict[str, Case] = {}
    other: set[str] = set()
    for op in graph.ops:
        if op.target in GATHERS:
            continue
        where = MATMULS.get(op.target)
        args = list(op.attrs.get("args", ()))
        if where is None or op.attrs.get("kwargs") or len(args) <= max(where.a, where.b):
            other.update(op.params)
            continue
        out_in = where.b_out_in
        x, w = _ref(args[where.a]), _ref(args[where.b])
        if x is None or w is None or x[0] != "t" or w[0] != "p":
            other.update(op.params)
            continue
        p = graph.params[w[1]]
        shape = tuple(graph.tensors[x[1]].shape)
        if len(p.shape) != 2 or not shape or shape[-1] != p.shape[1 if out_in else 0]:
            other.update(op.params)
            continue
        m = min(MAX_ROWS, int(rows) if rows is not None else max(1, int(torch.Size(shape[:-1]).numel())))
        n, k = (p.shape[0], p.shape[1]) if out_in else (p.shape[1], p.shape[0])
        bias = where.bias is not None and O.operand(args, where.bias) is not None
        case = Case(m, int(k), int(n), p.dtype, out_in, bool(bias))
        if cases.setdefault(w[1], case) != case:
            other.add(w[1])
        other.update(q for q in op.params if q != w[1])
    return {name: c for name, c in cases.items() if name not in other}


def _operands(case: Case, cold_bytes: int) -> tuple[torch.dtype, torch.Generator, torch.Tensor,
                                                    torch.Tensor | None, int]:
    """A timing's dtype, seeded generator, input rows, bias (or None), and how many copies of the
    weight make ``cold_bytes`` (so none is still in the cache when it is read again)."""
    from .registry import DTYPES

    dt = DTYPES.get(case.dtype)
    if dt is None or not dt.is_floating_point:
        raise BadInput(f"cannot time a matmul of {case.dtype}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.rows, case.k, generator=gen).to(dt)
    b = torch.randn(case.n, generator=gen).to(dt) if case.bias else None
    return dt, gen, x, b, max(1, -(-int(cold_bytes) // max(1, case.k * case.n * x.element_size())))


def time_case(case: Case, reps: int = 5, cold_bytes: int = COLD_BYTES) -> tuple[float, float]:
    """Seconds of one run of ``case`` with its weight held as traced, and held transposed (here,
    on this process's CPU threads).

    A model's weights stream from memory at every step: each run reads the next of
    enough copies of the weight (``cold_bytes`` in all) that none is still in the
    cache. (A weight timed hot runs a 4-row matmul twice as fast held ``[in, out]``;
    read cold, 1.15x; and a step of a real model reads it cold.)
    """
    dt, gen, x, b, copies = _operands(case, cold_bytes)

    def weights(flip: bool) -> list[torch.Tensor]:
        out = []
        for _ in range(copies):
            w = torch.randn(case.n, case.k, generator=gen).to(dt)     # [out, in]
            w = w if case.out_in else w.t().contiguous()
            out.append(transposed(w) if flip else w)
        return out

    def run(ws: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        if case.out_in:
            return lambda: [torch.nn.functional.linear(x, w, b) for w in ws]
        if b is not None:
            return lambda: [torch.addmm(b, x, w) for w in ws]
        return lambda: [torch.mm(x, w) for w in ws]

    def timed(flip: bool) -> float:
        fn = run(weights(flip))
        fn()                                    # NOTE: warm: the first call pays for allocations
        return median_s(fn, reps) / copies

    with torch.inference_mode():
        return timed(False), timed(True)


def time_columns(case: Case, reps: int = 5, cold_bytes: int = COLD_BYTES) -> tuple[float, float]:
    """Seconds of one run of ``case`` (a linear layer's, its weight ``[out, in]``) as ``linear``, and
    in ``columns``, its weight read cold as in ``time_case``."""
    if not case.out_in:
        raise BadInput(f"cannot time the columns form of {case.key()}")
    dt, gen, x, b, copies = _operands(case, cold_bytes)
    ws = [torch.randn(case.n, case.k, generator=gen).to(dt) for _ in range(copies)]

    def timed(fn: Callable[..., torch.Tensor]) -> float:
        def run() -> None:
            for w in ws:
                fn(x, w, b)
        run()                                   # NOTE: warm: the first call pays for allocations
        return median_s(run, reps) / copies

    with torch.inference_mode():
        return timed(torch.nn.functional.linear), timed(columns)


def decide_forms(graph: OpGraph, timer: Callable[[list[Case]], Mapping[str, tuple[float, float]]],
                 rows: Iterable[int], only: Iterable[str] | None = None,
                 held: Mapping[str, str] | None = None, min_bytes: int | None = None,
                 margin: float = MARGIN) -> dict[str, list[int]]:
    """The rows counts (of ``rows``, among ``small_rows()``) in which each linear weight of ``graph`` of
    at least ``min_bytes`` (``only``: among these params; not one ``held`` transposed) runs in
    ``columns``: those where ``timer`` (``measure`` with ``columns`` on a worker) found it ``margin`` times
    faster. A weight that anything but linear layers reads is left out."""
    least = MIN_BYTES if min_bytes is None else int(min_bytes)
    keep = set(only) if only is not None else None
    linear_only: dict[str, bool] = {}
    for op in graph.ops:
        for q in op.params:
            linear_only[q] = linear_only.get(q, True) and op.target in (LINEAR, *GATHERS)
    asked: dict[tuple[str, int], Case] = {}
    for r in sorted({int(r) for r in rows} & set(small_rows())):
        for name, c in matmul_cases(graph, r).items():
            if c.out_in and linear_only.get(name) and (keep is None or name in keep) \
                    and name not in (held or {}) and graph.params[name].nbytes >= least \
                    and c.dtype in FLOATS:
                asked[(name, r)] = c
    if not asked:
        return {}
    timings = timer(list({c.key(): c for c in asked.values()}.values()))
    out: dict[str, list[int]] = {}
    for (name, r), c in sorted(asked.items()):
        t = timings.get(c.key())
        if t is not None and t[1] > 0 and t[0] >= margin * t[1]:
            out.setdefault(name, []).append(r)
    return out


def measure(cases: Sequence[Case], reps: int = 5, columns: bool = False) -> dict[str, tuple[float, float]]:
    """``time_case`` of each distinct case, by ``Case.key`` (``time_columns`` with ``columns``)."""
    timer = time_columns if columns else time_case
    out: dict[str, tuple[float, float]] = {}
    for c in cases:
        if c.key() not in out:
            out[c.key()] = timer(c, reps)
    return out


async def measure_off_loop(cases: Sequence[Case], reps: int = 5,
                           columns: bool = False) -> dict[str, tuple[float, float]]:
    """``measure`` on a thread of its own, so the worker's event loop (heartbeats, other
    models' requests) goes on meanwhile (for ``Client.run``)."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, measure, cases, reps, columns)


def choose(cases: Mapping[str, Case], timings: Mapping[str, tuple[float, float]],
           margin: float = MARGIN) -> dict[str, str]:
    """Params to hold transposed: those whose case ran at least ``margin`` times faster so."""
    out = {}
    for name, c in cases.items():
        t = timings.get(c.key())
        if t is not None and t[1] > 0 and t[0] >= margin * t[1]:
            out[name] = TRANSPOSED
    return out


def transposed(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with the same shape and values, its bytes in the other order."""
    return t.t().contiguous().t()


def held(t: torch.Tensor, layout: str | None) -> torch.Tensor:
    """A tile as a block holds it: transposed for ``"t"`` (2-D tiles only), else as read."""
    if layout == TRANSPOSED and t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) != 1:
        return transposed(t)
    return t


def decide(graph: OpGraph, timer: Callable[[list[Case]], Mapping[str, tuple[float, float]]],
           rows: int | None = None, only: Iterable[str] | None = None,
           min_bytes: int | None = None) -> dict[str, str]:
    """The layouts for ``graph``'s matmul weights of at least ``min_bytes`` (default ``MIN_BYTES``;
    ``only``: among these params), timing each distinct case once with ``timer`` (``measure`` on
    a worker)."""
    least = MIN_BYTES if min_bytes is None else int(min_bytes)
    cases = matmul_cases(graph, rows)
    keep = set(only) if only is not None else set(cases)
    cases = {n: c for n, c in cases.items() if n in keep and graph.params[n].nbytes >= least
             and c.dtype in FLOATS}
    if not cases:
        return {}
    distinct = list({c.key(): c for c in cases.values()}.values())
    chosen = choose(cases, timer(distinct))
    # NOTE: a worker shares one tile among the params that read the same bytes (a tied embedding and
    # lm head): it is held transposed when every matmul that reads it wants it so and nothing else
    # but row gathers reads it, and then under every name it has (whichever block loads it first)
    readers: dict[str, set[str]] = {}
    for op in graph.ops:
        for q in op.params:
            readers.setdefault(q, set()).add(op.target)
    tiles: dict[Any, list[str]] = {}
    for name, p in graph.params.items():
        tiles.setdefault((p.source.file, p.source.key, p.source.slices, p.source.quant), []).append(name)
    out = {}
    for names in tiles.values():
        gathered = [n for n in names if readers.get(n, set()) <= GATHERS]
        multiplied = [n for n in names if n not in gathered]
        if multiplied and all(chosen.get(n) == TRANSPOSED for n in multiplied):
            out.update({n: TRANSPOSED for n in names})
    return out
