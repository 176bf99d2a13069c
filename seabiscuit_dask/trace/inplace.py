"""In-place writes made out of place, so that a graph holds side-effect-free ops only.

An op that writes into its operand (``relu_``, ``x += y``, ``x[:, 1:] = y``, ``masked_fill_``) cannot
run on tiles: once ``x`` is cut, no tile sees a write made through a view of it, and a kernel that
writes into an operand changes a tensor that other ops, or the caller, still read. A write into a
tensor an op has just made, which no earlier view shares, becomes its out-of-place op in the
exported graph itself (``add_`` -> ``add``, later readers read its result), so the graph keeps
every other op as exported. Anything else (a write through a view, into an input) is left to
torch.export's functionalization, which makes ``slice_scatter``, ``select_scatter``,
``index_put``, ... of whole tensors.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.fx.node import Argument, Target

from ..errors import UnsupportedOp

OpOverload = torch._ops.OpOverload
# NOTE: functionalization turns reshapes into views where the strides it traced allow one; tiles
# have strides of their own, and without writes a reshape computes what the view did
RESHAPES = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def name_of(target: OpOverload) -> str:
    """``torch.ops.aten.add_.Tensor`` -> ``"aten.add_.Tensor"``."""
    return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"


def in_place_targets(ep: ExportedProgram) -> list[str]:
    """Targets of the calls in ``ep`` that write into an operand (``copy_``, ``masked_fill_``, ...)."""
    return sorted({name_of(n.target) for n in ep.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, OpOverload) and n.target._schema.is_mutable})


def out_of_place(target: Target) -> OpOverload | None:
    """The out-of-place twin of an ATen op that writes into its first operand only
    (``aten.add_.Tensor`` -> ``aten.add.Tensor``, same arguments); else None."""
    if not isinstance(target, OpOverload) or target.namespace != "aten" or not target._schema.is_mutable:
        return None
    args = target._schema.arguments
    written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    name = target._schema.name.split("::")[-1]
    if written != args[:1] or not name.endswith("_"):
        return None
    twin = getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)
    if not isinstance(twin, OpOverload) or twin._schema.is_mutable:
        return None
    return twin if [a.name for a in twin._schema.arguments] == [a.name for a in args] else None


def aliases(node: torch.fx.Node) -> bool:
    """Does ``node``'s result share storage with an operand (a view, an in-place op's result)?
    Anything but an ATen call is taken to."""
    t = node.target
    return not isinstance(t, OpOverload) or any(r.alias_info is not None for r in t._schema.returns)


def fresh(x: Argument, write: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    """Is ``x`` a tensor an op made (not an input, view or alias) of which no view is taken before
    ``write``, so that ``write`` changes no tensor but ``x``?"""
    return (isinstance(x, torch.fx.Node) and x.op == "call_function" and not aliases(x)
            and all(u is write or order[u] > order[write] or not aliases(u) for u in x.users))


def write_fresh_tensors_out_of_place(gm: torch.fx.GraphModule) -> int:
    """Each write into a ``fresh`` tensor becomes its out-of-place twin, read by every later
    reader of the tensor; how many were rewritten."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for n in list(gm.graph.nodes):
        twin = out_of_place(n.target) if n.op == "call_function" else None
        if twin is None or not fresh(n.args[0], n, order):
            continue
        x = n.args[0]
        for u in list(x.users):
            if u is not n and order[u] > order[n]:
                u.replace_input_with(x, n)
        n.target = twin
        done += 1
    if done:
        gm.recompile()
    return done


def functionalise(ep: ExportedProgram, name: str) -> ExportedProgram:
    """``ep`` (of model ``name``) with no op that writes into an operand (module docstring).

    Writes into fresh tensors are rewritten in ``ep``'s own graph; if others remain, a new
    program from torch.export's functionalization (no decomposition table: high-level ops such
    as ``linear`` and SDPA stay whole), its views made reshapes.
    """
    if not in_place_targets(ep):
        return ep
    write_fresh_tensors_out_of_place(ep.graph_module)
    if not in_place_targets(ep):
        return ep
    out = ep.run_decompositions({})
    for n in out.graph.nodes:
        if n.op == "call_function" and n.target in RESHAPES:
            n.target = torch.ops.aten.reshape.default
    out.graph_module.recompile()
    left = in_place_targets(out)
    if left:
        raise UnsupportedOp(f"{name}: in-place ops {left} remain after functionalization, and no tile may "
                            "write into another's tensor; rewrite them out of place in the model "
                            "(y = x.op(...) for x.op_(...))")
    return out
