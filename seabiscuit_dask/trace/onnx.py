"""ONNX in: a model file, folder or ``ModelProto`` as a module that ``torch.export`` traces.

``load_onnx(source)`` returns an ``OnnxModule``: its buffers are the graph's initializers
(and the constants computed from them alone, e.g. ``ConstantOfShape`` weights), named
after them, and its ``forward`` runs the nodes with torch, one small function per ONNX
op (``ONNX_OPS``). Shape arithmetic (``Shape``, ``Gather`` on shapes, ``Range``,
``ConstantOfShape``, ...) is folded in numpy for the shapes being traced, so
``torch.export`` sees only the tensor ops, at the ATen level the decomposer splits and
the op registry runs: ONNX graphs go through the same pipeline as PyTorch modules.

A node whose op has no entry raises ``UnsupportedOp`` naming the node, before anything
is traced; a truncated or malformed file raises ``BadCheckpoint`` with its size.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import BadCheckpoint, BadInput, UnsupportedModel, UnsupportedOp
from .onnx_ops import B_SLOTS, FOLDS, ONNX_OPS, Node, QuantSlot, QuantWeight, Value, _tensor
from .onnx_patterns import find_quantized, held_transposed, operand_users, read_at_load
from .onnx_read import Place, embedded_places, external_place, initializer_array, read_model

if TYPE_CHECKING:
    from onnx import ModelProto

    from ..ir import OpGraph

INLINE_ELEMENTS = 64                  # constants larger than this live as buffers of the module
# NOTE: in the template key: the op functions and the patterns (a changed one makes new templates)
_OPS_HASH = hashlib.sha256(b"".join((Path(__file__).parent / f).read_bytes() for f in (
    "onnx.py", "onnx_ops.py", "onnx_patterns.py"))).hexdigest()[:16]


def is_onnx(source: Any) -> bool:
    """Whether ``source`` is ONNX: a ``ModelProto``, an ``.onnx`` file, or a folder with ``model.onnx``."""
    if type(source).__name__ == "ModelProto":
        return True
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        return p.suffix == ".onnx" or (p.is_dir() and (p / "model.onnx").is_file())
    return False


class LazyArray:
    """An external-data weight not read at load: its shape and dtype and where its bytes are.
    The module holds an unread stand-in (``_as_buffer``); workers read its tiles from the file
    (``ParamSource`` raw)."""

    def __init__(self, place: tuple[Path, int, np.dtype, tuple[int, ...]], transposed: bool = False) -> None:
        self.place, self.transposed = place, transposed
        self.dtype = place[2]
        self.shape = tuple(reversed(place[3])) if transposed else place[3]
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))

    @property
    def T(self) -> LazyArray:     # NOTE: numpy's name
        return LazyArray(self.place, not self.transposed)


def _as_buffer(v: np.ndarray | LazyArray) -> torch.Tensor:
    """A constant as a module buffer: its values, or (lazy) an unwritten tensor of its shape for
    ``torch.export`` to trace (never read: ``OnnxModule.forward`` refuses to run eagerly, and
    ``WeightStore`` leaves it out); the pages of an untouched ``torch.empty`` are never mapped."""
    if isinstance(v, LazyArray):
        return torch.empty(v.shape, dtype=torch.from_numpy(np.zeros(0, v.dtype)).dtype)
    return torch.from_numpy(np.array(v, copy=True, order="C"))


def _same(place: Place, v: Any) -> bool:
    """Whether a constant is the initializer at ``place`` as stored (its dtype and shape)."""
    return bool(np.dtype(v.dtype) == place[2] and tuple(v.shape) == place[3])


def _safe(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name) or "t"
    base = base if not base[0].isdigit() else f"t_{base}"
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out


class OnnxModule(torch.nn.Module):
    """An ONNX graph as a torch module (``load_onnx``): ``forward(*inputs)`` in the graph's input order."""

    def __init__(self, model: ModelProto, path: Path | None = None, name: str = "",
                 constants: Mapping[str, Any] | None = None, lazy: bool = False) -> None:
        super().__init__()
        self.path = path           # NOTE: the .onnx file it was read from (None: a ModelProto)
        self._derived: dict[tuple[Path, frozenset[str]], Path] = {}    # NOTE: (folder, keys) -> file
        folder = path.parent if path is not None else None
        g = model.graph
        self.onnx_name = name or str(g.name) or "onnx"
        self.opset = max([int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")] or [13])
        nodes = [Node.of(n, self.opset) for n in g.node]
        missing = [n for n in nodes if n.op_type not in ONNX_OPS or n.domain not in ("", "ai.onnx")]
        if missing:
            n = missing[0]
            kinds = sorted({f"{m.domain + '.' if m.domain else ''}{m.op_type}" for m in missing})
            raise n.fail(f"op {n.domain + '.' if n.domain else ''}{n.op_type} is not supported "
                         f"({len(missing)} node(s) of {len(kinds)} unsupported op type(s): "
                         f"{', '.join(kinds[:10])}); supported: {len(ONNX_OPS)} op types")
        external = {t.name: external_place(t, folder) for t in g.initializer
                    if t.data_location == 1 and t.name not in (constants or {})}
        places: dict[str, Place] = {**(embedded_places(path) if path is not None else {}), **external}
        for k in constants or {}:
            places.pop(k, None)
        needed = read_at_load(nodes, {t.name for t in g.initializer} | set(constants or {})) \
            if lazy else set()
        # NOTE: lazy: external weights (2-D and up) that no folding reads stay in their file
        consts: dict[str, Any] = {t.name: LazyArray(external[t.name]) if lazy and t.name in external
                                  and t.name not in needed and len(t.dims) >= 2
                                  and int(np.prod(t.dims)) > INLINE_ELEMENTS else initializer_array(t, folder)
                                  for t in g.initializer}
        # NOTE: buffer -> (file, offset, stored shape, transposed) of the buffers that are an initializer
        # (or its transpose) as stored: in the model file or in its external data
        self.stored_at: dict[str, tuple[str, int, tuple[int, ...], bool]] = {}
        self.lazy_buffers: set[str] = set()         # NOTE: buffers standing in for unread external data
        # NOTE: graph inputs given as constants (shape operands, say) are traced as their values
        consts.update({k: np.asarray(v) for k, v in (constants or {}).items()})
        self.input_names = [i.name for i in g.input if i.name not in consts]
        self.input_dims = {i.name: [d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                                    for d in i.type.tensor_type.shape.dim] for i in g.input}
        self.output_names = [o.name for o in g.output]
        self.consts = self._fold_pure(nodes, consts)
        self.buffer_of: dict[str, str] = {}
        taken: set[str] = set()
        quant, self.dead = find_quantized(nodes, self.consts, self._pure, self.output_names)
        users = operand_users(nodes, quant, self.dead, self._pure)
        weights_t = held_transposed(nodes, self.consts, users)
        transposed = {i for k in weights_t for i, _ in users[k]}
        slots: dict[int, QuantSlot] = {}
        for k, v in self.consts.items():
            if (k in users or k in self.output_names) and v.size > INLINE_ELEMENTS:
                b = _safe(k, taken)
                held = v.T if k in weights_t else v      # NOTE: [out, in], as torch's linear holds it
                self.register_buffer(b, _as_buffer(held))
                if isinstance(held, LazyArray):
                    self.lazy_buffers.add(b)
                self.buffer_of[k] = b
                if k in places and _same(places[k], v):
                    self.stored_at[b] = (str(places[k][0]), places[k][1], places[k][3], k in weights_t)
        for i, (w, scale, zero, origin) in quant.items():
            n = nodes[i]
            names: list[str | None] = []
            for what, arr in (("w", w), ("scale", scale), ("zero", zero)):
                if arr is None:
                    names.append(None)
                    continue
                b = _safe(f"{n.inputs[B_SLOTS[n.op_type][0]]}_{what}", taken)
                self.register_buffer(b, _as_buffer(arr))
                names.append(b)
                if isinstance(arr, LazyArray):
                    self.lazy_buffers.add(b)
                if what == "w" and origin[0] in places:
                    f, offset, _, shape = places[origin[0]]
                    self.stored_at[b] = (str(f), offset, shape, origin[1])
            slots[i] = QuantSlot(B_SLOTS[n.op_type][0], names[0] or "", names[1], names[2])
        self.nodes = [replace(n, weight_t=i in transposed, quant=slots.get(i)) for i, n in enumerate(nodes)]
        # NOTE: only what forward reads is kept; the buffers are the weights' one copy
        self.folded = set(self.consts)
        self.consts = {k: v for k, v in self.consts.items()
                       if k not in self.buffer_of and (k in users or k in self.output_names)}
        digest = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]
        self.fingerprint = digest

    def bind_stored(self, graph: OpGraph) -> OpGraph:
        """``graph`` with the params that are initializers as stored read from the model's files: a
        tile reads only its own bytes of the ``.onnx`` file or of its external data (``ParamSource``
        kind ``raw``), and nothing is copied."""
        from dataclasses import replace

        from ..ir import ParamSource, ParamSpec

        if self.path is None:
            return graph
        derived = {p.source.key for p in graph.params.values() if p.source.kind == "model"
                   and p.source.key not in self.stored_at and p.source.key not in self.lazy_buffers}
        made = self._derived_file(derived) if derived else None
        params = {}
        for name, p in graph.params.items():
            place = self.stored_at.get(p.source.key) if p.source.kind == "model" else None
            if place is not None:
                f, offset, stored, transposed = place
                p = ParamSpec(name, p.shape, p.dtype, ParamSource("raw", p.source.key, p.source.slices, f,
                                                                  offset=offset, stored=stored,
                                                                  transposed=transposed))
            elif made is not None and p.source.key in derived:
                src = ParamSource("safetensors", p.source.key, p.source.slices, str(made))
                p = ParamSpec(name, p.shape, p.dtype, src)
            params[name] = p
        return replace(graph, params=params)

    def _derived_file(self, keys: set[str]) -> Path:
        """A safetensors file in the cache folder holding the buffers ``keys``, which load computed
        from the initializers (folded constants, dequantized tables, per-column scales): named by
        their content, so it is written once and any worker that reads it reads these values."""
        from safetensors.torch import save_file

        from ..config import cache_dir

        made = (cache_dir(), frozenset(keys))
        known = self._derived.get(made)
        if known is not None and known.is_file():
            return known                 # NOTE: a program of another size: hashed and written already
        tensors, digest = {}, hashlib.sha256()
        for k in sorted(keys):
            t = getattr(self, k).detach().contiguous().clone()
            tensors[k] = t
            digest.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        path = cache_dir() / "onnx" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.onnx_name)}-" \
                                      f"{digest.hexdigest()[:24]}.safetensors"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f"{path.name}.{os.getpid()}.part")
            save_file(tensors, os.fspath(part))
            os.replace(part, path)
        self._derived[made] = path
        return path

    def extra_repr(self) -> str:
        # NOTE: in the template key (templates.architecture_key): the graph and the op functions
        return f"onnx={self.fingerprint}, opset={self.opset}, ops={_OPS_HASH}"

    def _pure(self, node: Node) -> bool:
        return node.op_type in FOLDS and all(
            not i or (i in self.consts and not isinstance(self.consts[i], LazyArray)) for i in node.inputs)

    def _fold_pure(self, nodes: list[Node], consts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The constants computed from initializers and Constant nodes alone, at load."""
        self.consts = dict(consts)
        for node in nodes:
            if self._pure(node):
                outs = FOLDS[node.op_type](node, [self.consts.get(i) if i else None for i in node.inputs])
                for name, v in zip(node.outputs, outs):
                    self.consts[name] = np.asarray(v)
        return self.consts

    def forward(self, *args: torch.Tensor) -> Any:
        if self.lazy_buffers and not torch.compiler.is_exporting():
            raise BadCheckpoint(f"ONNX model {self.onnx_name} was loaded without reading its "
                                f"{len(self.lazy_buffers)} external weight(s) (load_onnx(..., lazy=True), "
                                "as sb.trace and sb.distribute load a path): it traces, and workers read "
                                "the weights from their file, but it does not run here; load_onnx(path) "
                                "reads them")
        if len(args) != len(self.input_names):
            raise BadInput(f"ONNX model {self.onnx_name} takes {len(self.input_names)} input(s) "
                           f"({', '.join(self.input_names)}), got {len(args)}")
        env: dict[str, Value] = dict(zip(self.input_names, args))
        for k, node in enumerate(self.nodes):
            if k in self.dead or all(o in self.folded for o in node.outputs):
                continue                       # NOTE: folded at load, or feeds only quantized weights
            vals = [self._quant_value(node.quant) if node.quant is not None and j == node.quant.input
                    else self._value(i, env) if i else None for j, i in enumerate(node.inputs)]
            fold = node.op_type in FOLDS and all(v is None or isinstance(v, np.ndarray) for v in vals)
            try:
                outs = (FOLDS if fold else ONNX_OPS)[node.op_type](node, vals)
            except UnsupportedOp:
                raise
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                shapes = [tuple(v.shape) if v is not None else None for v in vals]
                raise UnsupportedModel(f"ONNX node {node.name!r} ({node.op_type}) failed on inputs of "
                                       f"shapes {shapes}: {type(e).__name__}: {str(e)[:300]}") from e
            for name, v in zip(node.outputs, outs):
                env[name] = v
        out = tuple(_tensor(self._value(o, env)) for o in self.output_names)
        return out[0] if len(out) == 1 else out

    def _quant_value(self, slot: QuantSlot) -> QuantWeight:
        return QuantWeight(getattr(self, slot.w), getattr(self, slot.scale) if slot.scale else None,
                           getattr(self, slot.zero) if slot.zero else None)

    def _value(self, name: str, env: Mapping[str, Value]) -> Value:
        if name in env:
            return env[name]
        if name in self.buffer_of:
            return getattr(self, self.buffer_of[name])
        if name in self.consts:
            return self.consts[name]
        raise UnsupportedModel(f"ONNX model {self.onnx_name}: value {name!r} is used before it is made")

    def example_shapes(self, example_inputs: Sequence[Any]) -> None:
        """Check example inputs against the graph's declared dims (symbolic ones take the example's)."""
        for name, x in zip(self.input_names, example_inputs):
            dims = self.input_dims.get(name) or []
            shape = tuple(getattr(x, "shape", ()))
            if dims and len(dims) != len(shape):
                raise BadInput(f"ONNX input {name!r} has {len(dims)} dims {dims}, the example has shape "
                               f"{shape}")
            for i, (d, s) in enumerate(zip(dims, shape)):
                if isinstance(d, int) and d and d != s:
                    raise BadInput(f"ONNX input {name!r} dim {i} is {d}, the example has {s} (shape {shape})")


def load_onnx(source: Any, constants: Mapping[str, Any] | None = None, lazy: bool = False) -> OnnxModule:
    """An ONNX model (path, folder with ``model.onnx``, or ``ModelProto``) as an ``OnnxModule``;
    ``constants``: graph inputs whose values are fixed (they are no inputs of the module then).
    ``lazy``: external-data weights that no folding needs are not read: the module holds them on
    the meta device (it traces, it does not run eagerly) and workers read their tiles from the
    file; ``sb.trace`` and ``sb.distribute`` load a path so."""
    model, path = read_model(source)
    name = Path(source).stem if isinstance(source, (str, os.PathLike)) else ""
    return OnnxModule(model, path, name, constants, lazy).eval()


def symbolic_inputs(module: OnnxModule) -> dict[str, list[Any]]:
    """Inputs whose declared dims are symbolic (names or unknown), to explain a missing example."""
    return {n: d for n, d in module.input_dims.items() if n in module.input_names
            and any(not isinstance(x, int) or not x for x in d)}
