"""PyTorch -> OpGraph through non-strict ``torch.export``.

The exported ATen graph keeps high-level ops (``linear``, ``conv2d``,
``embedding``, ``scaled_dot_product_attention``), which is the level the
decomposer splits. Works on models whose parameters live on the ``meta``
device: nothing is allocated, so a 40 GB model is traced in well under 1 GB.
In-place writes (``x[:, 1:] = y``, ``masked_fill_``) are rewritten out of place
(``inplace.py``): a graph holds side-effect-free ops only.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.node import Target
from torch.utils import _pytree as pytree

from .. import config
from .. import ops as O
from ..cost import op_flops
from ..errors import SeaBiscuitError, UnsupportedModel, UnsupportedOp
from ..ir import Op, OpGraph, ParamSource, ParamSpec, TensorSpec, operand_names
from .inplace import functionalise


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def target_name(target: Target) -> str:
    """``torch.ops.aten.linear.default`` -> ``"aten.linear.default"``."""
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        return f"{ns}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def tensor_spec(val: Any, where: str) -> TensorSpec:
    if not isinstance(val, torch.Tensor):
        raise UnsupportedModel(f"{where} produces a {type(val).__name__}, not a tensor; "
                               "only tensor-valued ops with static shapes are supported")
    return TensorSpec(tuple(int(s) for s in val.shape), dtype_name(val.dtype))


def as_example_tuple(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def default_kwargs(model: torch.nn.Module, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Hugging Face models: ask for no KV cache (its cache object is not exportable)."""
    kw = dict(kwargs or {})
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "use_cache", False) and "use_cache" not in kw:
        try:
            accepts = "use_cache" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            accepts = False
        if accepts:
            kw["use_cache"] = False
    return kw


# NOTE: torch.export keeps its tracing state in process globals: one export at a time
# (generation builds step programs on its own threads).
_EXPORT_LOCK = threading.Lock()
EXPORT_FAILED = "torch.export failed"    # NOTE: how a failure of ``export`` begins


@contextlib.contextmanager
def _batched_experts(model: torch.nn.Module) -> Iterator[None]:
    """Mixture-of-experts layers of Hugging Face models traced with ``batched_mm`` (plain ATen
    matmuls over the experts' weights) instead of a grouped-matmul kernel of transformers' own,
    which no worker runs; the same numbers. The model's setting is restored afterwards."""
    changed: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        impl = getattr(cfg, "_experts_implementation", None)
        if impl is not None and impl not in ("eager", "batched_mm"):
            try:
                cfg._experts_implementation = "batched_mm"
            except (AttributeError, ValueError, TypeError):
                continue
            changed.append((cfg, impl))
    try:
        yield
    finally:
        for cfg, impl in changed:
            cfg._experts_implementation = impl


def export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExportedProgram:
    """Run non-strict ``torch.export``; any failure becomes ``UnsupportedModel``."""
    was_training = model.training
    model.eval()
    try:
        with _EXPORT_LOCK, torch.no_grad(), _batched_experts(model):
            ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
            return functionalise(ep, type(model).__name__)
    except SeaBiscuitError:
        raise                      # NOTE: the model's own refusal (an ONNX node) says it best
    except Exception as e:
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                  for a in pytree.tree_leaves((args, kwargs))]
        msg = str(e).strip().splitlines()
        head = msg[0] if msg else type(e).__name__
        raise UnsupportedModel(
            f"{EXPORT_FAILED} for {type(model).__name__} with inputs {shapes}: "
            f"{type(e).__name__}: {head[:500]}") from e
    finally:
        model.train(was_training)


class _Converter:
    """Turns one ExportedProgram into an OpGraph."""

    def __init__(self, ep: ExportedProgram, model: torch.nn.Module, name: str) -> None:
        self.ep = ep
        self.model = model
        self.name = name
        self.refs: dict[str, dict[str, str]] = {}      # fx node name -> {"t"|"p": name}
        self.tensors: dict[str, TensorSpec] = {}
        self.params: dict[str, ParamSpec] = {}
        self.inputs: list[str] = []
        self.ops: list[Op] = []
        self.multi: dict[str, tuple[str, ...]] = {}    # fx node name -> element tensor names
        self.inline_limit = config.to_bytes(config.get("trace.inline-constant-bytes"),
                                            "seabiscuit.trace.inline-constant-bytes")

    # --- placeholders ------------------------------------------------------------------
    def placeholders(self) -> None:
        sig = self.ep.graph_signature
        state = dict(self.ep.state_dict)
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        buffers.update(getattr(self.model, "sb_buffers", {}))
        nodes = {n.name: n for n in self.ep.graph.nodes if n.op == "placeholder"}
        for spec in sig.input_specs:
            node = nodes[spec.arg.name]
            kind = spec.kind.name
            if kind == "USER_INPUT":
                if not isinstance(node.meta.get("val"), torch.Tensor):
                    continue  # NOTE: non-tensor inputs (flags) are baked into the graph
                t = tensor_spec(node.meta.get("val"), f"input {node.name!r}")
                self.tensors[node.name] = t
                self.inputs.append(node.name)
                self.refs[node.name] = {"t": node.name}
                continue
            if kind not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                raise UnsupportedModel(f"{self.name}: export input {node.name!r} of kind "
                                       f"{kind} is not supported")
            key = spec.target
            if kind == "CONSTANT_TENSOR":
                value = self.ep.constants[key]
            elif kind == "BUFFER" and not spec.persistent:
                value = buffers.get(key, self.ep.constants.get(key))
            else:
                value = state.get(key)
            val = value if isinstance(value, torch.Tensor) else node.meta.get("val")
            ts = tensor_spec(val, f"parameter {key!r}")
            source = ParamSource("model", key)
            persistent = kind == "PARAMETER" or (kind == "BUFFER" and spec.persistent)
            if not persistent and isinstance(value, torch.Tensor) and not value.is_meta \
                    and ts.nbytes <= self.inline_limit:
                source = ParamSource("inline", key, data=tuple(value.detach().cpu().flatten().tolist()))
            self.params[key] = ParamSpec(key, ts.shape, ts.dtype, source)
            self.refs[node.name] = {"p": key}

    # --- arguments ---------------------------------------------------------------------
    def encode(self, a: Any, where: str) -> Any:
        if isinstance(a, torch.fx.Node):
            if a.name in self.multi:
                raise UnsupportedModel(f"{where}: tuple-valued {a.name!r} used without indexing")
            if a.name not in self.refs:
                raise UnsupportedModel(f"{where}: operand {a.name!r} is not a tensor op output")
            return dict(self.refs[a.name])
        if isinstance(a, (list, tuple)):
            return [self.encode(x, where) for x in a]
        if isinstance(a, torch.dtype):
            return {"dtype": dtype_name(a)}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        if isinstance(a, torch.layout):
            return {"layout": str(a).removeprefix("torch.")}
        if isinstance(a, torch.memory_format):
            return {"memory_format": str(a).removeprefix("torch.")}
        if isinstance(a, float) and not math.isfinite(a):
            return {"float": str(a)}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise UnsupportedModel(f"{where}: argument of type {type(a).__name__} is not supported")

    def normalise(self, target: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                  where: str) -> tuple[list[Any], dict[str, Any]]:
        """Positional args as the schema lists them; keyword-only args in kwargs."""
        schema = target._schema
        pos = list(args)
        kw: dict[str, Any] = {}
        positional = [a for a in schema.arguments if not a.kwarg_only]
        last_needed = max([i for i, a in enumerate(positional) if a.name in kwargs] + [-1])
        for i in range(len(pos), last_needed + 1):
            a = positional[i]
            if a.name in kwargs:
                pos.append(kwargs[a.name])
            elif a.has_default_value():
                pos.append(a.default_value)
            else:  # pragma: no cover - export always passes required args
                raise UnsupportedModel(f"{where}: missing argument {a.name!r}")
        for a in schema.arguments:
            if a.kwarg_only and a.name in kwargs:
                kw[a.name] = kwargs[a.name]
        return ([self.encode(x, where) for x in pos],
                {k: self.encode(v, where) for k, v in kw.items()})

    # --- calls -----------------------------------------------------------------------------
    def call(self, node: torch.fx.Node) -> None:
        target = node.target
        stack = node.meta.get("nn_module_stack") or {}
        scope = list(stack.values())[-1][0] if stack else ""
        where = f"op {node.name!r} in module {scope or type(self.model).__name__!r}"
        if target is operator.getitem:
            src, idx = node.args
            assert isinstance(src, torch.fx.Node) and isinstance(idx, int)
            self.refs[node.name] = {"t": self.multi[src.name][idx]}
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise UnsupportedModel(f"{where}: {target_name(target)} is not an ATen operator; "
                                   "control flow and Python callables cannot be decomposed")
        tname = target_name(target)
        if tname in O.ASSERTS:
            return
        if tname not in O.OPS:
            # NOTE: refused here, so that no graph naming it is ever stored or sent to a worker.
            raise UnsupportedOp(f"{self.name}: {where} calls {tname}, which is not in SeaBiscuit's "
                                f"op registry. {O.registry_hint()}")
        args, kwargs = self.normalise(target, node.args, dict(node.kwargs), where)
        val = node.meta.get("val")
        op_name = f"{scope}.{node.name}" if scope else node.name
        attrs: dict[str, Any] = {"args": args, "kwargs": kwargs}
        if isinstance(val, (list, tuple)):
            outs = tuple(f"{node.name}.{i}" for i in range(len(val)))
            for out, v in zip(outs, val):
                self.tensors[out] = tensor_spec(v, where)
            self.multi[node.name] = outs
            attrs["multi"] = True
        else:
            outs = (node.name,)
            self.tensors[node.name] = tensor_spec(val, where)
            self.refs[node.name] = {"t": node.name}
        inputs, params = operand_names(args, kwargs)
        flops = op_flops(tname, args, [self.tensors[o].shape for o in outs], self.shape_of)
        self.ops.append(Op(op_name, O.kind_of(tname), tname, inputs, outs, params,
                           attrs, scope, flops))

    def shape_of(self, ref: Any) -> tuple[int, ...] | None:
        r = O.ref_name(ref)
        if r is None:
            return None
        tag, name = r
        return self.tensors[name].shape if tag == "t" else self.params[name].shape

    def convert(self) -> OpGraph:
        self.placeholders()
        outputs: list[str] = []
        for node in self.ep.graph.nodes:
            if node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                for leaf in pytree.tree_leaves(self.user_outputs(node)):
                    if not isinstance(leaf, torch.fx.Node) or leaf.name not in self.refs:
                        raise UnsupportedModel(f"{self.name}: output {leaf!r} is not a tensor")
                    _tag, name = O.ref_name(self.refs[leaf.name]) or ("", "")
                    outputs.append(name)
            elif node.op != "placeholder":
                raise UnsupportedModel(f"{self.name}: fx node kind {node.op!r} is not supported")
        used = {p for op in self.ops for p in op.params} | set(outputs)
        params = {k: v for k, v in self.params.items() if k in used}
        return OpGraph(tuple(self.ops), self.tensors, params, tuple(self.inputs),
                       tuple(outputs), self.meta())

    def user_outputs(self, node: torch.fx.Node) -> list[Any]:
        """What the model returns: the output node less the new values of the buffers and inputs it
        wrote into (functionalization returns those too)."""
        # NOTE: a write into a buffer or an input is a side effect, not a result: it is dropped
        out = node.args[0]
        results = list(out) if isinstance(out, (list, tuple)) else [out]
        specs = self.ep.graph_signature.output_specs
        if len(results) != len(specs):
            return results
        return [r for r, s in zip(results, specs) if s.kind.name == "USER_OUTPUT"]

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "source": "torch.export"}
        try:
            meta["out_spec"] = pytree.treespec_dumps(self.ep.call_spec.out_spec)
        except Exception:  # noqa: BLE001 - an unserialisable spec only loses output structure
            meta["out_spec"] = None
        aliases: dict[str, list[str]] = {}
        by_id: dict[int, list[str]] = {}
        for n, t in self.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(t), []).append(n)
        for names in by_id.values():
            for n in names if len(names) > 1 else ():
                aliases[n] = [m for m in names if m != n]
        meta["aliases"] = aliases
        meta["param_shapes"] = {k: list(v.shape) for k, v in self.params.items()}
        return meta


def trace_module(model: torch.nn.Module, example_inputs: Any,
                 kwargs: Mapping[str, Any] | None = None) -> OpGraph:
    """Trace ``model`` at the shapes of ``example_inputs`` into an OpGraph."""
    args = as_example_tuple(example_inputs)
    kw = default_kwargs(model, kwargs)
    ep = export(model, args, kw)
    graph = _Converter(ep, model, type(model).__name__).convert()
    return graph.with_meta(kwarg_order=list(kw))
