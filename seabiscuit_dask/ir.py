"""The operator-graph IR: small, frozen, framework-neutral data.

Nothing here imports torch or dask. Ops refer to tensors and parameters by
name; a graph saves to JSON and loads back equal.

JSON schema (``OpGraph.to_json``, ``schema`` = 2; schema 1 documents, which have
no ``tilings``, still load)::

    {
      "schema": 2,
      "inputs":  ["input_ids", ...],            # graph input tensor names, in call order
      "outputs": ["logits", ...],               # graph output tensor names (flattened)
      "tilings": {"logits": [[[[0, 1], [0, 512], [0, 25000]], "logits.c0"],
                             [[[0, 1], [0, 512], [25000, 50257]], "logits.c1"]]},
      "meta":    {...},                         # free-form: name, in_spec/out_spec, budget, ...
      "tensors": {"<name>": {"shape": [1, 8, 32], "dtype": "float32"}, ...},
      "params":  {"<name>": {"shape": [64, 32], "dtype": "float32",
                             "source": {"kind": "model" | "safetensors" | "inline" | "raw",
                                        "key": "<state-dict key>",
                                        "slices": [[0, 64], [0, 32]] | null,
                                        "file": "<path>" | null,
                                        "data": [..flat values..] | null,
                                        "offset": 0 | null, "stored": [32, 64] | null,
                                        "transposed": false}}, ...},
      "ops": [{"name": "model.layers.0.mlp.up_proj.linear_4.c1",
               "kind": "linear", "target": "aten.linear.default",
               "inputs": [...tensor names...], "outputs": [...], "params": [...],
               "attrs": {"args": [...], "kwargs": {...}, ...},
               "scope": "model.layers.0.mlp.up_proj.c1", "flops": 65536}, ...]
    }

A tensor named in ``tilings`` exists only as its tiles: each entry is a region
(``[start, stop)`` per dim) and the produced tensor holding exactly that region;
the regions cover the tensor once. A graph input or output may be tiled (it is
larger than the budget): the caller cuts such an input into its tiles
(``split_inputs``) and assembles such an output from its tiles (``assemble_outputs``).

Ops are listed in topological order. In ``attrs["args"]`` a tensor operand is
``{"t": name}``, a parameter ``{"p": name}``; dtypes, devices, layouts and memory
formats are ``{"dtype": "float32"}``-style objects and non-finite floats are
``{"float": "inf"}``. ``slices`` are ``[start, stop)`` ranges into the stored
tensor named by ``key`` (``null``: the whole tensor), so a weight tile loads
only its own bytes.
"""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from . import ops as O
from .errors import InvalidGraph

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)

Region = tuple[tuple[int, int], ...]
"""``[start, stop)`` along each dim of a tensor."""
Tiling = tuple[tuple[Region, str], ...]
"""A tensor as tiles: (region of the tensor, name of the produced tensor holding it)."""

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# NOTE: what a param derived on load from a float weight is (``ParamSource.quant``, ``quantize.py``)
QUANT_KINDS = ("int8", "int8-scale", *(f"int4-g{g}{t}" for g in (32, 64, 128) for t in ("", "-sz")))

MAX_ELEMENTS = 2**48
"""Most elements a tensor or parameter may have (and most along any dim): ~2.8e14, far above any
model's, so that every size stays exact in the int64 and float64 arithmetic of the passes."""
MAX_ELEMENTS_TEXT = f"2**{MAX_ELEMENTS.bit_length() - 1} = {MAX_ELEMENTS}"
MAX_FLOPS = 2**63 - 1
"""Most flops one op may claim: the largest int64."""


MAPPINGS = (dict, MappingProxyType)
"""The mapping types op attributes hold (JSON objects, frozen): checked without the slow
``Mapping`` ABC, which the passes over 100k-op graphs would pay for millions of times."""
SEQUENCES = (list, tuple)


PLAIN = (str, int, float, bool, type(None), *SEQUENCES)


def is_mapping(value: Any) -> bool:
    if isinstance(value, MAPPINGS):
        return True
    return not isinstance(value, PLAIN) and isinstance(value, Mapping)


def freeze(value: Any) -> Any:
    """Recursively turn dicts into read-only mappings and lists into tuples."""
    if is_mapping(value):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, SEQUENCES):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of ``freeze`` for JSON output: mappings -> dicts, tuples -> lists."""
    if is_mapping(value):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, SEQUENCES):
        return [thaw(v) for v in value]
    return value


def fmt_bytes(n: float) -> str:
    """Human-readable byte count (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str = "a tensor") -> TensorSpec:
        """Read and check (``check_shape``) a spec; ``what`` names it in an error."""
        spec = cls(tuple(d["shape"]), str(d["dtype"]))
        check_shape(what, spec.shape, spec.dtype)
        return spec


@dataclass(frozen=True)
class ParamSource:
    """Where a parameter's bytes live.

    ``kind`` is ``"model"`` (a tensor of the model in memory, by state-dict key),
    ``"safetensors"`` (``key`` inside ``file``), ``"inline"`` (small constants
    stored in ``data``, flattened) or ``"raw"`` (a C-ordered array of shape ``stored``
    at byte ``offset`` of ``file``, as ONNX external data is; ``transposed``: the
    parameter is that 2-D array's transpose). ``slices`` select a tile of the stored
    tensor (of its transpose, when transposed), so a tile reads only its own bytes.
    """

    kind: str
    key: str
    slices: tuple[tuple[int, int], ...] | None = None
    file: str | None = None
    data: tuple[Any, ...] | None = None
    offset: int | None = None
    stored: tuple[int, ...] | None = None
    transposed: bool = False
    quant: str | None = None
    whole: tuple[int, ...] | None = None
    heads: int = 0          # NOTE: a "gguf" llama attention q or k: its heads' rows stored permuted

    def sliced(self, dim: int, start: int, stop: int, full_shape: tuple[int, ...]) -> ParamSource:
        """The source of ``self[..., start:stop, ...]`` along ``dim`` of the current view (an
        inline constant: its own values, sliced)."""
        base = self.slices or tuple((0, s) for s in full_shape)
        lo, _ = base[dim]
        new = list(base)
        new[dim] = (lo + start, lo + stop)
        out = replace(self, slices=tuple(new))
        if self.kind == "inline" and self.data is not None:     # NOTE: its data is the current view's
            shape = tuple(b - a for a, b in base)
            inner, n = math.prod(shape[dim + 1:]), shape[dim]
            out = replace(out, data=tuple(v for o in range(0, len(self.data), n * inner)
                                          for v in self.data[o + start * inner: o + stop * inner]))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "key": self.key,
            "slices": [list(s) for s in self.slices] if self.slices is not None else None,
            "file": self.file,
            "data": list(self.data) if self.data is not None else None,
        }
        if self.kind == "raw":
            out.update(offset=self.offset, stored=list(self.stored) if self.stored is not None else None,
                       transposed=self.transposed)
        if self.quant is not None:
            out.update(quant=self.quant, whole=list(self.whole) if self.whole is not None else None)
        if self.heads:
            out.update(heads=self.heads)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParamSource:
        slices = d.get("slices")
        data = d.get("data")
        stored = d.get("stored")
        return cls(
            kind=str(d["kind"]),
            key=str(d["key"]),
            slices=tuple((a, b) for a, b in slices) if slices is not None else None,
            file=d.get("file"),
            data=tuple(data) if data is not None else None,
            offset=d.get("offset"),
            stored=tuple(stored) if stored is not None else None,
            transposed=bool(d.get("transposed", False)),
            quant=str(d["quant"]) if d.get("quant") is not None else None,
            whole=tuple(d["whole"]) if d.get("whole") is not None else None,
            heads=int(d.get("heads") or 0),
        )


@dataclass(frozen=True)
class ParamSpec:
    """A weight (or weight tile): its shape, dtype and where its bytes live."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: ParamSource

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_tile(self) -> bool:
        return self.source.slices is not None

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "source": self.source.to_dict()}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> ParamSpec:
        """Read and check (``check_param``) a spec."""
        spec = cls(name, tuple(d["shape"]), str(d["dtype"]), ParamSource.from_dict(d["source"]))
        check_param(spec)
        return spec


@dataclass(frozen=True)
class Op:
    """One operation: ``outputs = target(*args)``, with operands named in ``attrs``."""

    name: str
    kind: str
    target: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    scope: str = ""
    flops: int = 0

    def __post_init__(self) -> None:
        # NOTE: attrs are frozen on construction so that an Op is immutable all the way down.
        object.__setattr__(self, "attrs", freeze(self.attrs))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "params", tuple(self.params))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "target": self.target,
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "params": list(self.params), "attrs": thaw(self.attrs),
            "scope": self.scope, "flops": self.flops,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Op:
        return cls(
            name=d["name"], kind=d["kind"], target=d["target"],
            inputs=tuple(d["inputs"]), outputs=tuple(d["outputs"]),
            params=tuple(d.get("params", ())), attrs=d.get("attrs", {}),
            scope=d.get("scope", ""), flops=check_flops(d["name"], d.get("flops", 0)),
        )


@dataclass(frozen=True)
class OpCost:
    """Sizes of one op: what it computes and what it must hold in memory."""

    flops: int
    param_bytes: int
    input_bytes: int
    output_bytes: int
    scratch_bytes: int = 0

    @property
    def working_set_bytes(self) -> int:
        return self.param_bytes + self.input_bytes + self.output_bytes + self.scratch_bytes


def input_bytes(op: Op, tensors: Mapping[str, TensorSpec]) -> int:
    """Bytes of the distinct tensors ``op`` reads (specs from ``tensors``); a view counts its region."""
    if "args" not in op.attrs:
        return sum(tensors[t].nbytes for t in dict.fromkeys(op.inputs))
    seen: dict[tuple[str, str], int] = {}
    for r in iter_refs((op.attrs["args"], op.attrs.get("kwargs", {}))):
        if "t" in r and (key := (r["t"], repr(r.get("view")))) not in seen:
            spec = tensors[r["t"]]
            seen[key] = math.prod(view_shape(r, spec.shape)) * DTYPE_BYTES.get(spec.dtype, 4)
    return sum(seen.values())


def scratch_bytes(op: Op, tensors: Mapping[str, TensorSpec]) -> int:
    """Memory an op needs beyond its operands (its entry of the op table, ``ops.scratch``): the
    score matrix of an attention op, the dequantized slab of an ``sb.qlinear``."""
    outs = [tensors[t].shape for t in op.outputs if t in tensors]
    return O.scratch(op.target, op.kind, op.attrs.get("args", ()), outs, spec_of(tensors))


def spec_of(tensors: Mapping[str, TensorSpec]) -> Callable[[Any], tuple[tuple[int, ...], str] | None]:
    """``(shape, dtype)`` of an operand reference (a view's shape for a view) among ``tensors``."""
    def spec(ref: Any) -> tuple[tuple[int, ...], str] | None:
        if not isinstance(ref, Mapping) or ref.get("t") not in tensors:
            return None
        t = tensors[ref["t"]]
        return view_shape(ref, t.shape), t.dtype
    return spec


# NOTE: what ``with_meta`` keeps of a graph's ``__dict__``: its fields, and the cached views that
# read no meta (``placement.workload`` keeps a view there that does)
_META_FREE = frozenset({"ops", "tensors", "params", "inputs", "outputs", "meta", "tilings", "op_by_name",
                        "producer", "consumers", "leaf_inputs", "leaf_outputs"})


@dataclass(frozen=True)
class OpGraph:
    """A frozen operator graph. Passes return new graphs; nothing edits one in place."""

    ops: tuple[Op, ...]
    tensors: Mapping[str, TensorSpec]
    params: Mapping[str, ParamSpec]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    tilings: Mapping[str, Tiling] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "tilings", MappingProxyType({
            k: tuple((tuple((int(a), int(b)) for a, b in r), str(t)) for r, t in v)
            for k, v in self.tilings.items()}))
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "meta", freeze(self.meta))

    def __repr__(self) -> str:
        name = self.meta.get("name", "graph")
        return (f"<OpGraph {name}: {len(self.ops)} ops, {len(self.params)} params "
                f"({fmt_bytes(self.param_bytes)}), inputs={list(self.inputs)}>")

    # --- derived views -------------------------------------------------------------
    @cached_property
    def op_by_name(self) -> Mapping[str, Op]:
        return MappingProxyType({op.name: op for op in self.ops})

    @cached_property
    def producer(self) -> Mapping[str, str]:
        """tensor name -> name of the op producing it."""
        return MappingProxyType({t: op.name for op in self.ops for t in op.outputs})

    @cached_property
    def consumers(self) -> Mapping[str, tuple[str, ...]]:
        """tensor name -> names of the ops reading it."""
        out: dict[str, list[str]] = {}
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                out.setdefault(t, []).append(op.name)
        return MappingProxyType({k: tuple(v) for k, v in out.items()})

    @cached_property
    def leaf_inputs(self) -> tuple[str, ...]:
        """The tensors a caller feeds: graph inputs, tiled ones replaced by their tiles."""
        return self.leaves(self.inputs)

    @cached_property
    def leaf_outputs(self) -> tuple[str, ...]:
        """The tensors a caller fetches: graph outputs, tiled ones replaced by their tiles."""
        return self.leaves(self.outputs)

    def leaves(self, names: Iterable[str]) -> tuple[str, ...]:
        """``names`` with each tiled tensor replaced by its tiles (each name once)."""
        out: list[str] = []
        for t in names:
            out.extend(n for _, n in self.tilings.get(t, ((None, t),)))
        return tuple(dict.fromkeys(out))

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    def with_meta(self, **updates: Any) -> OpGraph:
        """This graph with ``updates`` in its meta. Only they are frozen: the rest of it is already
        (a generation step's meta holds every tile's checksum and layout; freezing it all again took
        0.15 s a program as the engine registered its programs)."""
        graph = copy.copy(self)
        for key in set(graph.__dict__) - _META_FREE:     # NOTE: a view derived from the meta goes
            del graph.__dict__[key]
        object.__setattr__(graph, "meta", MappingProxyType(
            {**self.meta, **{k: freeze(v) for k, v in updates.items()}}))
        return graph

    def cost(self, op: Op) -> OpCost:
        """Flops and bytes of ``op``: params + distinct inputs (or the views it reads of them)
        + outputs."""
        return OpCost(
            flops=op.flops,
            param_bytes=sum(self.params[p].nbytes for p in dict.fromkeys(op.params)),
            input_bytes=self.input_bytes(op),
            output_bytes=sum(self.tensors[t].nbytes for t in op.outputs),
            scratch_bytes=scratch_bytes(op, self.tensors),
        )

    def input_bytes(self, op: Op) -> int:
        """Bytes of the distinct tensors ``op`` reads; a view counts its own region."""
        return input_bytes(op, self.tensors)

    def working_set(self, op: Op) -> int:
        return self.cost(op).working_set_bytes

    # --- presentation --------------------------------------------------------------
    def summary(self, budget: int | None = None) -> str:
        """A table: ops by kind, total params, largest op, count over budget."""
        budget = budget if budget is not None else self.meta.get("budget_bytes")
        by_kind: Counter[str] = Counter()
        flops_by_kind: Counter[str] = Counter()
        ws_by_kind: dict[str, int] = {}
        largest: tuple[int, str] = (0, "-")
        over = 0
        for op in self.ops:
            ws = self.working_set(op)
            by_kind[op.kind] += 1
            flops_by_kind[op.kind] += op.flops
            ws_by_kind[op.kind] = max(ws_by_kind.get(op.kind, 0), ws)
            largest = max(largest, (ws, op.name))
            if budget is not None and ws > budget:
                over += 1
        lines = [f"{'kind':<12} {'ops':>7} {'GFLOP':>10} {'max working set':>16}"]
        for kind, n in by_kind.most_common():
            lines.append(f"{kind:<12} {n:>7} {flops_by_kind[kind] / 1e9:>10.3f} "
                         f"{fmt_bytes(ws_by_kind[kind]):>16}")
        lines.append(f"{'total':<12} {len(self.ops):>7} "
                     f"{sum(flops_by_kind.values()) / 1e9:>10.3f}")
        tiles = sum(1 for p in self.params.values() if p.is_tile)
        lines.append(f"params: {len(self.params)} ({tiles} tiles), {fmt_bytes(self.param_bytes)}")
        lines.append(f"largest op: {largest[1]} ({fmt_bytes(largest[0])})")
        if budget is not None:
            lines.append(f"over budget ({fmt_bytes(budget)}): {over}")
        return "\n".join(lines)

    # --- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "tilings": {k: [[[list(a) for a in r], t] for r, t in v] for k, v in self.tilings.items()},
            "meta": thaw(self.meta),
            "tensors": {k: v.to_dict() for k, v in self.tensors.items()},
            "params": {k: v.to_dict() for k, v in self.params.items()},
            "ops": [op.to_dict() for op in self.ops],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpGraph:
        """Read a graph document, checking every spec as it is read (``check_shape``,
        ``check_param``, ``check_flops``); the graph's invariants are ``verify``'s."""
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidGraph(f"OpGraph document is malformed: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> OpGraph:
        if d.get("schema") not in READABLE_SCHEMAS:
            raise InvalidGraph(f"OpGraph schema {d.get('schema')!r} is not supported "
                               f"(this version reads schemas {list(READABLE_SCHEMAS)})")
        return cls(
            ops=tuple(Op.from_dict(o) for o in d["ops"]),
            tensors={k: TensorSpec.from_dict(v, f"tensor {k!r}") for k, v in d["tensors"].items()},
            params={k: ParamSpec.from_dict(k, v) for k, v in d["params"].items()},
            inputs=tuple(d["inputs"]),
            outputs=tuple(d["outputs"]),
            meta=d.get("meta", {}),
            tilings=_read_tilings(d.get("tilings", {})),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> OpGraph:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidGraph(f"not an OpGraph JSON document: {e}") from e
        return cls.from_dict(d)


# --- checks of what a document may hold ---------------------------------------------------
def is_count(n: Any) -> bool:
    """A non-negative Python int: neither a bool nor a float such as ``2.0`` is one."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_dims(what: str, shape: Any) -> None:
    """Refuse a shape that is not a tuple of non-negative ints, or that has more than
    ``MAX_ELEMENTS`` elements (or along one dim); ``what`` names the tensor or param."""
    if not isinstance(shape, tuple) or not all(is_count(n) for n in shape):
        raise InvalidGraph(f"{what} has shape {_listed(shape)!r}: a shape is a list of ints >= 0")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS or any(n > MAX_ELEMENTS for n in shape):
        raise InvalidGraph(f"{what} has shape {list(shape)} ({numel:.3g} elements): a tensor holds at most "
                           f"{MAX_ELEMENTS_TEXT} elements, along any dim too; is the document corrupt?")


def check_shape(what: str, shape: Any, dtype: Any) -> None:
    """``check_dims``, and a dtype the IR knows (``DTYPE_BYTES``): so ``nbytes`` is exact and bounded."""
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise InvalidGraph(f"{what} has dtype {dtype!r}, which the IR does not know; "
                           f"known: {', '.join(DTYPE_BYTES)}")
    check_dims(what, shape)


def check_param(spec: ParamSpec) -> None:
    """A param's shape and dtype (``check_shape``), and where its bytes lie: slices ``[start, stop)``
    of ints within ``MAX_ELEMENTS``, a raw weight's stored shape and a byte offset >= 0."""
    what = f"param {spec.name!r}"
    check_shape(what, spec.shape, spec.dtype)
    src = spec.source
    if src.slices is not None and not all(is_count(a) and is_count(b) and a <= b <= MAX_ELEMENTS
                                          for a, b in src.slices):
        raise InvalidGraph(f"{what} reads slices {[_listed(s) for s in src.slices]} of {src.key!r}: each is "
                           f"[start, stop) with 0 <= start <= stop <= {MAX_ELEMENTS}")
    if src.stored is not None:
        check_dims(f"{what} (stored as {src.key!r})", src.stored)
    if src.quant is not None:
        if src.quant not in QUANT_KINDS or src.whole is None or len(src.whole) != 2:
            raise InvalidGraph(f"{what} is {src.quant!r} of a float weight of shape {src.whole!r}: a derived "
                               f"weight is one of {', '.join(QUANT_KINDS)} of a 2-D weight")
        check_dims(f"{what} (quantized from {src.key!r})", src.whole)
        if src.quant.startswith("int4"):
            n, k = src.whole
            group = int(src.quant.split("-")[1][1:])
            want = ((k // group, n, 2), "bfloat16") if src.quant.endswith("-sz") \
                else ((n // 64, k, 32), "uint8")
            if n % 64 or k % group or spec.dtype != want[1] or len(spec.shape) != len(want[0]) \
                    or any(a > b for a, b in zip(spec.shape, want[0])) \
                    or spec.shape[-1] != want[0][-1]:
                raise InvalidGraph(f"{what} ({src.quant} of a {list(src.whole)} weight) is {spec.dtype} "
                                   f"{list(spec.shape)}: an int4 weight is whole blocks of 64 rows and of "
                                   f"{group} columns, held as {want[1]} within {list(want[0])}")
        elif (spec.dtype == "int8") != (ints := src.quant == "int8") or not spec.shape \
                or spec.shape[0] > src.whole[0] \
                or (ints and (len(spec.shape) != 2 or spec.shape[1] > src.whole[1])):
            raise InvalidGraph(f"{what} ({src.quant} of a {list(src.whole)} weight) is {spec.dtype} "
                               f"{list(spec.shape)}: its integers are int8 and within the weight, its "
                               "scales a float per row")
    if src.heads and (src.kind != "gguf" or not is_count(src.heads)):
        raise InvalidGraph(f"{what} reads rows permuted for {src.heads!r} heads from a {src.kind!r} source: "
                           "only a GGUF's attention weights are stored so, with a head count >= 1")
    if src.offset is not None and not is_count(src.offset):
        raise InvalidGraph(f"{what} lies at byte offset {src.offset!r} of {src.file!r}: "
                           "an offset is an int >= 0")


def quant_region(src: ParamSource) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows and columns of the float weight ``src.whole`` a derived param's tile covers
    (``ParamSource.quant``): an int8 tile's or a row scale's own rows (and columns); an int4 weight's
    blocks of 64 rows and reduction steps; an int4 scale and zero's rows and groups."""
    assert src.quant is not None and src.whole is not None
    n, k = src.whole
    sl = src.slices
    if src.quant.startswith("int4"):
        group = int(src.quant.split("-")[1][1:])
        if sl is None:
            return (0, n), (0, k)
        if src.quant.endswith("-sz"):
            return sl[1], (sl[0][0] * group, sl[0][1] * group)
        return (sl[0][0] * 64, sl[0][1] * 64), sl[1]
    rows = sl[0] if sl is not None else (0, n)
    cols = sl[1] if sl is not None and len(sl) > 1 and src.quant == "int8" else (0, k)
    return rows, cols


def check_flops(op: str, flops: Any) -> int:
    """``flops`` of op ``op``, an int from 0 to ``MAX_FLOPS``; returns it."""
    if not is_count(flops) or flops > MAX_FLOPS:
        raise InvalidGraph(f"op {op!r} claims {flops!r} flops: a flop count is an int from 0 to {MAX_FLOPS}")
    return flops


def check_specs(graph: OpGraph) -> None:
    """Every tensor's and param's shape and dtype, and every op's flops, within the IR's bounds
    (what ``from_json`` checks as it reads; here for a graph built in memory or received)."""
    for name, t in graph.tensors.items():
        check_shape(f"tensor {name!r}", t.shape, t.dtype)
    for p in graph.params.values():
        check_param(p)
    for op in graph.ops:
        check_flops(op.name, op.flops)


def _read_tilings(value: Any) -> dict[str, Tiling]:
    try:
        return {str(k): tuple((tuple((int(a), int(b)) for a, b in r), str(t)) for r, t in v)
                for k, v in value.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidGraph(f"graph 'tilings' must map a tensor name to [[region, tile], ...]: {e}") \
            from None


def check_tiling(graph: OpGraph, name: str, tiling: Tiling, available: set[str]) -> None:
    """The tiles of ``name`` are produced, match their regions and cover it exactly once."""
    spec = graph.tensors.get(name)
    if spec is None:
        raise InvalidGraph(f"tiled tensor {name!r} has no TensorSpec")
    covered = 0
    for region, tile in tiling:
        if tile not in available:
            raise InvalidGraph(f"tile {tile!r} of {name!r} is never produced")
        extent = tuple(b - a for a, b in region)
        if len(region) != len(spec.shape) or any(
                a < 0 or b > n or a >= b for (a, b), n in zip(region, spec.shape)):
            raise InvalidGraph(f"tile {tile!r} region {list(region)} lies outside {name!r} {spec.shape}")
        t = graph.tensors[tile]
        if t.shape != extent or t.dtype != spec.dtype:
            raise InvalidGraph(f"tile {tile!r} is {t.shape} {t.dtype} but its region of {name!r} "
                               f"is {extent} {spec.dtype}")
        covered += math.prod(extent)
    regions = sorted(r for r, _ in tiling)
    for i, r in enumerate(regions):
        for other in regions[i + 1:]:
            if other[0][0] >= r[0][1]:
                break
            if all(a < d and c < b for (a, b), (c, d) in zip(r, other)):
                raise InvalidGraph(f"tiles of {name!r} overlap at {list(r)} and {list(other)}")
    if covered != spec.numel:
        raise InvalidGraph(f"tiles of {name!r} cover {covered} of its {spec.numel} elements")


def is_ref(value: Mapping[str, Any]) -> bool:
    """``{"t": name}``, ``{"t": name, "view": region}`` or ``{"p": name}``."""
    keys = set(value)
    return keys in ({"t"}, {"p"}, {"t", "view"})


def view_shape(ref: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of what ``ref`` reads of a tensor of ``shape``: all of it, or its view."""
    view = ref.get("view")
    return shape if view is None else tuple(int(b) - int(a) for a, b in view)


def iter_refs(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every operand reference inside ``value``: ``{"t": name}`` or ``{"p": name}``, or
    ``{"t": name, "view": [[start, stop], ...]}`` (a region of a tensor, read in place)."""
    if isinstance(value, SEQUENCES):
        for v in value:
            if isinstance(v, (*MAPPINGS, *SEQUENCES)):
                yield from iter_refs(v)
    elif isinstance(value, MAPPINGS):
        if is_ref(value):
            yield value
        else:
            for v in value.values():
                if isinstance(v, (*MAPPINGS, *SEQUENCES)):
                    yield from iter_refs(v)


def _refs(value: Any, tag: str) -> Iterable[str]:
    return (r[tag] for r in iter_refs(value) if tag in r)


def operand_names(args: Any, kwargs: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Distinct tensor and param names referenced in args/kwargs, in order of appearance."""
    refs = list(iter_refs((args, kwargs)))
    return (tuple(dict.fromkeys(r["t"] for r in refs if "t" in r)),
            tuple(dict.fromkeys(r["p"] for r in refs if "p" in r)))


def _check_views(graph: OpGraph, op: Op) -> None:
    """Every view an op reads lies inside its tensor."""
    for r in iter_refs((op.attrs.get("args", ()), op.attrs.get("kwargs", {}))):
        view = r.get("view")
        if view is None:
            continue
        shape = graph.tensors[r["t"]].shape
        if len(view) != len(shape) or any(not (0 <= int(a) < int(b) <= n) for (a, b), n in zip(view, shape)):
            raise InvalidGraph(f"op {op.name!r} reads view {view} of {r['t']!r}, which is {shape}")


def _check_join_shapes(graph: OpGraph, op: Op) -> None:
    """Shapes of the ops that join tiles: partial sums match, concatenations add up."""
    if op.kind == "sum":
        shapes = {view_shape(r, graph.tensors[r["t"]].shape) for r in iter_refs(op.attrs.get("args", ()))}
        shapes |= {graph.tensors[t].shape for t in op.outputs}
        if len(shapes) != 1:
            raise InvalidGraph(f"sum {op.name!r} adds tensors of shapes {sorted(shapes)}")
    elif op.kind == "concat" and op.target == "aten.cat.default":
        parts = [view_shape(r, graph.tensors[r["t"]].shape) for r in iter_refs(op.attrs["args"][0])]
        out = graph.tensors[op.outputs[0]].shape
        dim = int(op.attrs["args"][1]) % len(out)
        rest = {p[:dim] + p[dim + 1:] for p in parts} | {out[:dim] + out[dim + 1:]}
        if len(rest) != 1 or sum(p[dim] for p in parts) != out[dim]:
            raise InvalidGraph(f"concat {op.name!r} joins {parts} along dim {dim} into {out}")


def verify(graph: OpGraph, budget: int | None = None) -> OpGraph:
    """Check the graph's invariants; raise ``InvalidGraph`` naming the first broken one.

    Specs within the IR's bounds (``check_specs``: shapes of ints >= 0 of at most
    ``MAX_ELEMENTS``, known dtypes, flops), topological order, every input produced
    exactly once before it is read, operand references in ``attrs`` consistent with
    ``inputs``/``params``, tile shapes consistent with their slices, and (when ``budget``
    is given) every op's working set within it, and tilings that cover their tensors.
    Call it on any graph received before it touches shared state. Returns the graph, so it chains.
    """
    check_specs(graph)
    available = set(graph.leaf_inputs)
    for name in (*graph.inputs, *graph.leaf_inputs):
        if name not in graph.tensors:
            raise InvalidGraph(f"graph input {name!r} has no TensorSpec")
    names: set[str] = set()
    for i, op in enumerate(graph.ops):
        if op.name in names:
            raise InvalidGraph(f"op name {op.name!r} is used twice (op #{i})")
        names.add(op.name)
        for t in op.inputs:
            if t not in available:
                raise InvalidGraph(f"op {op.name!r} (#{i}) reads {t!r} before anything produces it")
        for p in op.params:
            if p not in graph.params:
                raise InvalidGraph(f"op {op.name!r} reads unknown param {p!r}")
        if "args" in op.attrs:
            ts = set(_refs((op.attrs["args"], op.attrs.get("kwargs", {})), "t"))
            ps = set(_refs((op.attrs["args"], op.attrs.get("kwargs", {})), "p"))
            if ts != set(op.inputs) or ps != set(op.params):
                raise InvalidGraph(f"op {op.name!r}: operands in args {sorted(ts | ps)} differ "
                                   f"from declared inputs/params {sorted(op.inputs + op.params)}")
        _check_views(graph, op)
        _check_join_shapes(graph, op)
        for t in op.outputs:
            if t in available:
                raise InvalidGraph(f"tensor {t!r} is produced twice (again by {op.name!r})")
            if t not in graph.tensors:
                raise InvalidGraph(f"op {op.name!r} output {t!r} has no TensorSpec")
            available.add(t)
        if budget is not None:
            ws = graph.working_set(op)
            if ws > budget:
                raise InvalidGraph(f"op {op.name!r} needs {fmt_bytes(ws)} ({ws} bytes), "
                                   f"budget is {fmt_bytes(budget)} ({budget} bytes)")
    for name, tiling in graph.tilings.items():
        check_tiling(graph, name, tiling, available)
    for t in graph.outputs:
        if t not in available and t not in graph.params and t not in graph.tilings:
            raise InvalidGraph(f"graph output {t!r} is never produced")
    for spec in graph.params.values():
        if spec.source.slices is not None:
            extent = tuple(b - a for a, b in spec.source.slices)
            if extent != spec.shape:
                raise InvalidGraph(f"param {spec.name!r} has shape {spec.shape} but its slices "
                                   f"{spec.source.slices} select {extent}")
    return graph
