"""Blocks as executables: what one Dask task runs for one request.

``block_specs(plan)`` cuts a plan into ``BlockSpec`` s, frozen descriptions that
travel to the workers as plain dicts: the block's ops in order, the tensors it
imports (from other blocks or the graph's inputs), the tensors it exports (read
by other blocks, or graph outputs) and the parameter tiles it owns. A view another
block makes of a tensor, no smaller than it (each layer's ``unsqueeze`` of one rotary
table), is made again in the block that reads it, which reads its source instead
(``_remade_views``): a hop then carries one entry per tensor, not one per layer. A view
that all its readers make again is dropped; a block of such views alone is left with no
ops, and no request starts it.
``BlockProgram`` is a spec compiled on its worker with its weights resident:
``program.run(imports) -> exports``.

``request_graph`` builds the Dask graph of one request: one task per block,
never one per micro-op; a block's task depends on the tasks of the blocks it
imports from. Keys are ``("sb-<model>", version, request, block)`` so the
scheduler plugin can pin each one to the worker the plan chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from dask.sizeof import sizeof

from .. import config
from ..errors import InvalidGraph
from ..ir import Op, OpGraph, ParamSpec, TensorSpec
from .fuse import LinearGroupKernel, fused_linear, linear_groups, should_fuse, span
from .kernels import compile_args, resolve_target
from .layout import LINEAR, check_forms, check_layouts, columns_kernel
from .patterns import op_groups
from .registry import require_registered

if TYPE_CHECKING:
    from ..placement.plan import Plan

KEY_PREFIX = "sb-"
Key = Hashable
# NOTE: the blocks of a model's other programs (generation steps) are numbered from p * STRIDE,
# so one (model, version, block) names a block of any program and the model's tiles are shared.
PROGRAM_STRIDE = 1 << 20


def program_block(program: int, block: int) -> int:
    """The block number, in keys and specs, of ``block`` of program ``program`` (0: the model's)."""
    return program * PROGRAM_STRIDE + block


def split_block(block: int) -> tuple[int, int]:
    """``program_block``'s inverse: (program, block within it)."""
    return divmod(int(block), PROGRAM_STRIDE)


@sizeof.register(torch.Tensor)
def _sizeof_tensor(t: torch.Tensor) -> int:
    # NOTE: Dask has no sizeof for torch; without this a block's outputs count as ~80 bytes
    # in its memory accounting and transfer records.
    return int(t.numel() * t.element_size()) + 64


def parse_key(key: Key) -> tuple[str, int, int, int] | None:
    """``("sb-<model>", version, request, block)`` -> its parts; None for other keys."""
    if (isinstance(key, tuple) and len(key) == 4 and isinstance(key[0], str)
            and key[0].startswith(KEY_PREFIX)):
        try:
            return key[0][len(KEY_PREFIX):], int(key[1]), int(key[2]), int(key[3])
        except (TypeError, ValueError):
            return None
    return None


def task_name(model_id: str) -> str:
    """The first element of every request key of ``model_id``."""
    return f"{KEY_PREFIX}{model_id}"


@dataclass(frozen=True)
class BlockSpec:
    """One block of a plan, self-contained: enough for a worker to compile and run it."""

    model: str
    version: int
    index: int
    device: str
    ops: tuple[Op, ...]
    params: Mapping[str, ParamSpec]
    imports: Mapping[str, TensorSpec]     # tensor name -> spec, in first-use order
    exports: tuple[str, ...]
    sources: tuple[int, ...]              # for each import: the block that exports it, -1 = graph input
    address: str = ""                     # the worker that owns it in its plan
    checksums: Mapping[str, int] = field(default_factory=dict)   # param -> CRC-32 of its tile, if known
    checkpoint_dir: str = ""              # where block outputs are checkpointed ("" = not)
    verify_every: int = 0                 # check resident tiles every N runs (0 = only on reads)
    kind: str = ""                        # its plan device's kind: "cpu" runs on the CPU even on a GPU worker
    # NOTE: the data plane's routes: per consumer block, its worker and the exports it reads
    sends: tuple[tuple[int, str, tuple[str, ...]], ...] = ()
    outputs: tuple[str, ...] = ()         # exports that are graph outputs (the caller collects them)
    layouts: Mapping[str, str] = field(default_factory=dict)   # param -> how it is held (``layout``)
    # NOTE: param -> the rows counts its linear layers run in columns (``layout.columns``)
    forms: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    kv_context: int = 0                   # tokens a KV cache of its sessions grows to at most (0: any)

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    @property
    def program(self) -> int:
        return split_block(self.index)[0]

    @property
    def deps(self) -> tuple[int, ...]:
        """Blocks this one reads from, each once."""
        return tuple(dict.fromkeys(s for s in self.sources if s >= 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "version": self.version, "index": self.index, "device": self.device,
            "ops": [op.to_dict() for op in self.ops],
            "params": {k: p.to_dict() for k, p in self.params.items()},
            "imports": {k: t.to_dict() for k, t in self.imports.items()},
            "exports": list(self.exports), "sources": list(self.sources), "address": self.address,
            "checksums": dict(self.checksums), "checkpoint_dir": self.checkpoint_dir,
            "verify_every": self.verify_every, "kind": self.kind,
            "sends": [[b, a, list(ts)] for b, a, ts in self.sends], "outputs": list(self.outputs),
            "layouts": dict(self.layouts), "forms": {k: list(v) for k, v in self.forms.items()},
            "kv_context": self.kv_context,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockSpec:
        return cls(
            str(d["model"]), int(d["version"]), int(d["index"]), str(d["device"]),
            tuple(Op.from_dict(o) for o in d["ops"]),
            {k: ParamSpec.from_dict(k, p) for k, p in d["params"].items()},
            {k: TensorSpec.from_dict(t) for k, t in d["imports"].items()},
            tuple(d["exports"]), tuple(int(s) for s in d["sources"]), str(d.get("address", "")),
            {k: int(v) for k, v in dict(d.get("checksums") or {}).items()}, str(d.get("checkpoint_dir", "")),
            int(d.get("verify_every", 0)), str(d.get("kind", "")),
            tuple((int(b), str(a), tuple(str(t) for t in ts)) for b, a, ts in d.get("sends") or ()),
            tuple(str(t) for t in d.get("outputs") or ()),
            check_layouts(d.get("layouts") or {}, f"block spec b{d['index']} of model {d['model']}"),
            check_forms(d.get("forms") or {}, f"block spec b{d['index']} of model {d['model']}"),
            max(0, int(d.get("kv_context", 0) or 0)),
        )


def block_specs(plan: Plan, model_id: str, version: int = 0, checkpoint_dir: str = "",
                verify_every: int = 0, program: int = 0) -> list[BlockSpec]:
    """Cut ``plan`` (a ``Plan``) into self-contained block specs, in block order.

    Tile checksums come from ``graph.meta["tile_crc32"]`` when the weights were
    written by SeaBiscuit (``deploy.write_store``), and how each tile is held from
    ``graph.meta["weight_layouts"]`` (``lower.layout``). ``program`` > 0 numbers the
    blocks of another program of the model (``program_block``).
    """
    if program:
        first = program_block(program, 0)
        return [replace(s, index=s.index + first,
                        sources=tuple(x + first if x >= 0 else x for x in s.sources),
                        sends=tuple((b + first, a, ts) for b, a, ts in s.sends))
                for s in block_specs(plan, model_id, version, checkpoint_dir, verify_every)]
    graph = plan.graph
    crcs = graph.meta.get("tile_crc32") or {}
    context = int(graph.meta.get("kv_context", 0) or 0)
    layouts = graph.meta.get("weight_layouts") or {}
    forms = graph.meta.get("matmul_forms") or {}
    block_of = plan.block_of.tolist()
    blocks = plan.blocks
    made_in: dict[str, int] = {}
    for op, b in zip(graph.ops, block_of):
        for t in op.outputs:
            made_in[t] = b
    members: list[list[Op]] = [[] for _ in blocks]
    for op, b in zip(graph.ops, block_of):
        members[b].append(op)
    members = _remade_views(graph, made_in, members)
    leaves = set(graph.leaf_outputs)
    while True:
        imports, exported = _links(members, made_in, graph.leaf_outputs)
        # NOTE: a view whose readers all make it again themselves is read by no one: it goes (a
        # block of such views alone is left with no ops, and no run starts it: ``dataplane.route``)
        # (ops are in order, so a block's op that reads a view comes after it: one set per block)
        read = [{t for op in mine for t in op.inputs} for mine in members]
        dead = [{id(op) for op in mine if _remakes(graph, op)
                 and not any(t in exported[b] or t in leaves or t in read[b] for t in op.outputs)}
                for b, mine in enumerate(members)]
        if not any(dead):
            break
        members = [[op for op in mine if id(op) not in gone] for mine, gone in zip(members, dead)]
    sends: list[dict[int, list[str]]] = [{} for _ in blocks]
    for b in range(len(blocks)):
        for t, src in imports[b].items():
            if src >= 0:
                sends[src].setdefault(b, []).append(t)
    address = [plan.spec.devices[plan.spec.index(blk.device)].address for blk in blocks]
    out = []
    for b, blk in enumerate(blocks):
        ops = tuple(members[b])
        params = {p: graph.params[p] for op in ops for p in op.params}
        dev = plan.spec.devices[plan.spec.index(blk.device)]
        out.append(BlockSpec(model_id, version, b, blk.device, ops, params,
                             {t: graph.tensors[t] for t in imports[b]}, tuple(exported[b]),
                             tuple(imports[b].values()), dev.address,
                             {p: int(crcs[p]) for p in params if p in crcs}, checkpoint_dir, verify_every,
                             dev.kind, tuple((c, address[c], tuple(ts)) for c, ts in sends[b].items()),
                             tuple(t for t in exported[b] if t in leaves),
                             {p: str(layouts[p]) for p in params if p in layouts},
                             {p: tuple(int(r) for r in forms[p]) for p in params if p in forms}, context))
    return out


def _links(members: list[list[Op]], made_in: Mapping[str, int],
           leaf_outputs: Sequence[str]) -> tuple[list[dict[str, int]], list[dict[str, None]]]:
    """Per block: what it imports (tensor -> the block that makes it, -1 for a graph input) and
    what it exports (what other blocks import from it, and the graph's outputs it makes)."""
    exported: list[dict[str, None]] = [{} for _ in members]
    imports: list[dict[str, int]] = [{} for _ in members]
    for b, mine in enumerate(members):
        own = {t for op in mine for t in op.outputs}
        for op in mine:
            for t in op.inputs:
                if t in own or t in imports[b]:
                    continue
                src = made_in.get(t, -1)
                imports[b][t] = src
                if src >= 0:
                    exported[src][t] = None
    for t in leaf_outputs:
        if t in made_in:
            exported[made_in[t]][t] = None
    return imports, exported


def _remade_views(graph: OpGraph, made_in: Mapping[str, int], members: list[list[Op]]) -> list[list[Op]]:
    """Each block's ops, with the views it reads from another block put in before their first
    reader, where ``_remakes`` allows (their sources are read instead, or made again in turn)."""
    producer = {t: op for op in graph.ops for t in op.outputs}
    out = []
    for b, ops in enumerate(members):
        own = {t for op in ops for t in op.outputs}
        new: list[Op] = []

        def remake(t: str) -> None:
            op = producer.get(t)
            if op is None or t in own or made_in.get(t, b) == b or not _remakes(graph, op):
                return
            remake(op.inputs[0])
            new.append(op)
            own.add(t)

        for op in ops:
            for t in op.inputs:
                remake(t)
            new.append(op)
        out.append(new)
    return out


def _remakes(graph: OpGraph, op: Op) -> bool:
    """Whether a block that reads ``op``'s output makes it again rather than import it: a view of
    one tensor, with no weights, whose output takes as many bytes as its input at least (an
    ``unsqueeze``, a ``reshape``, an ``expand``; a slice would make the hop carry more)."""
    if op.kind != "view" or op.params or len(op.inputs) != 1 or len(op.outputs) != 1:
        return False
    src, dst = graph.tensors.get(op.inputs[0]), graph.tensors.get(op.outputs[0])
    return src is not None and dst is not None and dst.nbytes >= src.nbytes


Step = tuple[Callable[..., Any], Any, Any, tuple[str, ...], bool, tuple[str, ...]]


class BlockProgram:
    """A block compiled on its worker: kernels resolved, weights loaded, frees precomputed.

    Runs are re-entrant (each has its own environment), so a worker with several
    threads may run blocks of several requests at once.
    """

    def __init__(self, spec: BlockSpec, weights: Mapping[str, torch.Tensor], device: torch.device,
                 fuse: bool = False, fuse_ops: bool | None = None) -> None:
        require_registered(spec.ops, f"block b{spec.index} of model {spec.model}")
        self.spec = spec
        self.device = device
        self.weights = dict(weights)
        # NOTE: (fn, args, kwargs, inputs, outputs, multi) per kernel, before frees are known
        kernels: list[tuple[Any, Any, Any, tuple[str, ...], tuple[str, ...], bool]] = []
        fused = self._fused(fuse)
        skip = {j for first, (_, members) in fused.items() for j in members if j != first}
        if fuse_ops is None:
            fuse_ops = should_fuse(device, config.get("lower.fuse-ops"))
        self.runs = tuple(op_groups(spec.ops, spec.exports)) if fuse_ops else ()
        groups = {g.at: g for g in self.runs}
        skip |= {j for g in self.runs for j in g.ops}
        for i, op in enumerate(spec.ops):
            if i in groups:
                g = groups[i]
                kernels.append((g.kernel, compile_args(g.args, device), None, g.reads, g.outputs, True))
            elif i in fused:
                kernel, members = fused[i]
                ins = tuple(dict.fromkeys(t for j in members for t in spec.ops[j].inputs))
                outs = tuple(spec.ops[j].outputs[0] for j in members)
                kernels.append((kernel, compile_args([spec.ops[i].attrs["args"][0]], device), None, ins,
                                outs, True))
            elif i not in skip:
                kw = op.attrs.get("kwargs")
                kernels.append((self._kernel(op),
                                compile_args(op.attrs.get("args", ()), device),
                                compile_args(kw, device) if kw else None, op.inputs, op.outputs,
                                bool(op.attrs.get("multi"))))
        self.fused_groups = len(fused)
        keep = set(spec.exports)
        last: dict[str, int] = {}
        for i, (_, _, _, ins, _, _) in enumerate(kernels):
            for t in ins:
                last[t] = i
        steps: list[Step] = []
        for i, (fn, args, kwargs, ins, outs, multi) in enumerate(kernels):
            frees = tuple(t for t in dict.fromkeys(ins) if last.get(t) == i and t not in keep)
            frees += tuple(t for t in outs if t not in last and t not in keep)
            steps.append((fn, args, kwargs, outs, multi, frees))
        self.steps = steps

    def _kernel(self, op: Op) -> Callable[..., Any]:
        """The op's kernel: the registered one, run in columns for the rows counts its spec names for a
        linear layer's weight (``layout.columns_kernel``)."""
        fn = _direct(resolve_target(op.target, op))
        args = op.attrs.get("args", ())
        if op.target != LINEAR or self.device.type != "cpu" or len(args) < 2 or op.attrs.get("kwargs"):
            return fn
        w = args[1]
        rows = self.spec.forms.get(w["p"]) if isinstance(w, Mapping) and set(w) == {"p"} else None
        return columns_kernel(rows, fn) if rows else fn

    def _fused(self, fuse: bool) -> dict[int, tuple[LinearGroupKernel, tuple[int, ...]]]:
        """First op of each linear group whose weights lie end to end -> (its kernel, the group's ops)."""
        if not fuse:
            return {}
        shapes = {n: tuple(p.shape) for n, p in self.spec.params.items()}
        out: dict[int, tuple[LinearGroupKernel, tuple[int, ...]]] = {}
        for g in linear_groups(self.spec.ops, shapes):
            weight = span([self.weights[w] for w in g.weights])
            bias = span([self.weights[b] for b in g.biases]) if g.biases else None
            if weight is None or (g.biases and bias is None):
                continue            # NOTE: tiles not packed together (loaded by another block): run apart
            out[g.ops[0]] = (fused_linear(weight, bias, g.sizes), g.ops)
        return out

    @property
    def op_groups(self) -> dict[str, int]:
        """How many runs of small ops of each kind run as one kernel (``lower.patterns``)."""
        return dict(Counter(g.kind for g in self.runs))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    @classmethod
    def load(cls, spec: BlockSpec, load_param: Callable[[ParamSpec], torch.Tensor],
             device: torch.device, fuse: bool = False) -> BlockProgram:
        """Compile ``spec``, getting each parameter tile from ``load_param``; ``fuse``: run the
        linear tiles over one input as one kernel where their weights are packed (``lower.fuse``)."""
        return cls(spec, {name: load_param(p) for name, p in spec.params.items()}, device, fuse)

    def run(self, imports: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env: dict[str, torch.Tensor] = dict(self.weights)
        dev = self.device
        for name in self.spec.imports:
            try:
                x = imports[name]
            except KeyError:
                raise InvalidGraph(f"block b{self.spec.index} of model {self.spec.model}: import "
                                   f"{name!r} missing (got {sorted(imports)[:5]})") from None
            env[name] = x.to(dev) if x.device != dev else x
        with torch.inference_mode():      # NOTE: no autograd bookkeeping at all (2-3% of a decode step)
            for fn, args, kwargs, outs, multi, frees in self.steps:
                out = fn(*args(env)) if kwargs is None else fn(*args(env), **kwargs(env))
                if multi:
                    env.update(zip(outs, out))
                else:
                    env[outs[0]] = out
                for t in frees:
                    del env[t]
        return _exported(env, self.spec.exports, dev.type != "cpu")


def _exported(env: Mapping[str, torch.Tensor], names: Sequence[str], cpu: bool) -> dict[str, torch.Tensor]:
    """What leaves a block: plain tensors again (a caller in this process may write into them), a
    copy of kilobytes for a decode step. Exports that are one tensor inside the block (each
    layer's view of one rotary table) leave as one copy, so the wire sends it once (``wire.pack``)."""
    out: dict[str, torch.Tensor] = {}
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    for t in names:
        x = env[t]
        if not cpu and not x.is_inference():
            out[t] = x
            continue
        key = (x.device, x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
        if key not in copies or not x.numel():
            copies[key] = x.cpu() if cpu else x.clone()
        out[t] = copies[key]
    return out


def _direct(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An ATen overload's own C++ callable (what ``OpOverload.__call__`` calls: one Python frame
    less for each of a block's thousands of ops); any other kernel as it is."""
    op = getattr(fn, "_op", None) if isinstance(fn, torch._ops.OpOverload) else None
    return op if callable(op) else fn


def run_block(program: BlockProgram, graph_inputs: Mapping[str, torch.Tensor],
              deps: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Gather a block's imports from the graph inputs and its dependencies' exports, run it."""
    imports: dict[str, torch.Tensor] = {}
    for d in deps:
        imports.update(d)
    for name in program.spec.imports:
        if name in graph_inputs:
            imports[name] = graph_inputs[name]
    return program.run(imports)


def request_graph(specs: Sequence[BlockSpec], request: int, inputs: Mapping[str, torch.Tensor],
                  fn: Callable[..., Any]) -> tuple[dict[Any, Any], list[Any]]:
    """The Dask graph of one request: ``{key: (fn, model, version, request, block, inputs, *deps)}``.

    ``inputs`` are the graph's input tensors; each block task carries only those it
    imports. Returns the graph and the key of every block, in block order.
    """
    keys = [(task_name(s.model), s.version, request, s.index) for s in specs]
    by_index = {s.index: key for s, key in zip(specs, keys)}
    dsk: dict[Any, Any] = {}
    for s, key in zip(specs, keys):
        mine = {t: inputs[t] for t, src in zip(s.imports, s.sources) if src < 0 and t in inputs}
        dsk[key] = (fn, s.model, s.version, request, s.index, mine, *[by_index[d] for d in s.deps])
    return dsk, keys
