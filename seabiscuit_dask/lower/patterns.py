"""Runs of small ops of one block computed as one kernel: the same numbers, fewer ATen calls.

A decode step of a small model spends as much time in its thousands of small ops (an RMS
norm is eight of them, a rotary embedding seven, each int4 matmul converts its input to bf16
again) as in its weight matmuls. ``op_groups(ops, exports)`` finds the runs a block can compute
in fewer calls and returns each as an ``OpGroup``: the ops it stands for, the operands it reads,
the tensors it writes and a kernel. Each kernel computes bit for bit what its ops compute:

- ``rms_norm``: ``x.to(f32)``, ``pow(2)``, ``mean(-1)``, ``+ eps``, ``rsqrt``, ``*``, ``.to(dtype)``,
  ``weight *`` (Hugging Face's ``RMSNorm``) as one function: ``torch.rms_norm`` where it gives the
  same bits for that dtype and width (``same_norm``, tried once), else the same operations;
- ``rotary``: ``q * cos + cat(-q2, q1) * sin`` as ``q * cos + roll(q, half) * sin'``, where ``sin'``
  is ``sin`` with its first half negated (made once per ``sin`` a step, shared by the query and key
  of a layer): a product with a negated factor is the negated product, exactly;
- ``q4_inputs``: the int4 matmuls of one input (a layer's query, key and value, or its gate and up)
  convert that input to bf16 once (``qlinear.q4linear_kernel``'s own steps otherwise).

A group is found only where its inner tensors are read by its own ops alone and leave the block
nowhere, in a block with no op that writes in place; it runs where its last op ran (the first,
for ``q4_inputs``, whose operands are all there then). Graphs are unchanged: this is how a worker
runs the ops a graph names (``BlockProgram``, config ``seabiscuit.lower.fuse-ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedOp
from ..ir import Op
from .registry import torch_dtype

Q4LINEAR = "sb.q4linear.default"
_END = 2 ** 63 - 1


@dataclass(frozen=True)
class OpGroup:
    """Ops of one block run as one kernel: ``kernel(*args) -> outputs`` (a tuple), run at op ``at``.

    ``args`` are operand references as ops hold them (``{"t": name}``, ``{"p": name}`` or constants),
    ``reads`` the tensors among them, ``outputs`` the tensors it writes (read after it, or exported)."""

    kind: str
    ops: tuple[int, ...]
    at: int
    args: tuple[Any, ...]
    reads: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: Callable[..., tuple[torch.Tensor, ...]]


def _t(ref: Any) -> str | None:
    """The tensor a plain operand names (``{"t": name}``), else None."""
    return str(ref["t"]) if isinstance(ref, Mapping) and set(ref) == {"t"} else None


def _p(ref: Any) -> str | None:
    return str(ref["p"]) if isinstance(ref, Mapping) and set(ref) == {"p"} else None


def _dtype(ref: Any) -> torch.dtype | None:
    """The dtype a ``{"dtype": name}`` operand names (through the registry's table), else None."""
    if isinstance(ref, Mapping) and set(ref) == {"dtype"}:
        try:
            return torch_dtype(ref["dtype"])
        except UnsupportedOp:
            return None
    return None


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, Mapping) and set(v) == {"float"}:
        try:
            return float(v["float"])
        except (TypeError, ValueError):
            return None
    return None


class _Graph:
    """Who makes and who reads each tensor of a block's ops."""

    def __init__(self, ops: Sequence[Op], exports: Sequence[str]) -> None:
        self.ops = ops
        self.exports = set(exports)
        self.maker: dict[str, int] = {}
        self.readers: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            for t in dict.fromkeys(op.inputs):
                self.readers.setdefault(t, []).append(i)
            for t in op.outputs:
                self.maker[t] = i

    def args(self, i: int) -> tuple[Any, ...]:
        op = self.ops[i]
        return tuple(op.attrs.get("args", ())) if not op.attrs.get("kwargs") else ()

    def _plain(self, i: int | None, target: str) -> int | None:
        """``i`` if op ``i`` is a ``target`` op with one output and positional operands only."""
        if i is None:
            return None
        op = self.ops[i]
        if op.target != target or len(op.outputs) != 1 or op.attrs.get("kwargs") or op.attrs.get("multi"):
            return None
        return i

    def made_by(self, name: str | None, target: str) -> int | None:
        """The op making ``name`` if it is a plain ``target`` op (``_plain``)."""
        return self._plain(self.maker.get(name) if name is not None else None, target)

    def only_reader(self, name: str, target: str) -> int | None:
        """The one op reading ``name`` (not exported) if it is a plain ``target`` op, else None."""
        readers = self.readers.get(name, [])
        return self._plain(readers[0], target) if len(readers) == 1 and name not in self.exports else None

    def inner(self, names: Sequence[str], members: set[int]) -> bool:
        """Every one of ``names`` is read by ``members`` alone and not exported."""
        return all(t not in self.exports and set(self.readers.get(t, [])) <= members for t in names)

    def read_after(self, name: str, at: int, members: set[int]) -> bool:
        """``name`` leaves the group (exported, or read by another op) and only after op ``at``."""
        outside = [r for r in self.readers.get(name, []) if r not in members]
        return (name in self.exports or bool(outside)) and all(r > at for r in outside)


def _binary(g: _Graph, i: int, a: str) -> Any | None:
    """The other operand of binary op ``i`` whose one operand is tensor ``a``."""
    args = g.args(i)
    if len(args) != 2:
        return None
    if _t(args[0]) == a:
        return args[1]
    if _t(args[1]) == a:
        return args[0]
    return None


def _rms_norm(g: _Graph, r: int) -> OpGroup | None:
    """The RMS norm around ``rsqrt`` op ``r``: [to f32] pow mean add rsqrt mul [to dtype] [weight mul]."""
    (a_ref, *rest) = g.args(r) or (None,)
    if rest or g.ops[r].target != "aten.rsqrt.default":
        return None
    a = g.made_by(_t(a_ref), "aten.add.Tensor")
    if a is None:
        return None
    a_args = g.args(a)
    eps = _number(a_args[1]) if len(a_args) == 2 else None
    m = g.made_by(_t(a_args[0]) if a_args else None, "aten.mean.dim")
    if eps is None or m is None:
        return None
    m_args = g.args(m)
    if len(m_args) != 3 or not isinstance(m_args[1], (list, tuple)) or list(m_args[1]) != [-1] \
            or m_args[2] is not True:
        return None
    p = g.made_by(_t(m_args[0]), "aten.pow.Tensor_Scalar")
    p_args = g.args(p) if p is not None else ()
    if p is None or len(p_args) != 2 or _number(p_args[1]) != 2.0 or _t(p_args[0]) is None:
        return None
    h = str(_t(p_args[0]))
    rs = g.ops[r].outputs[0]
    y = g.only_reader(rs, "aten.mul.Tensor")
    if y is None or _t(_binary(g, y, rs)) != h:
        return None
    members = [p, m, a, r, y]
    inner = [g.ops[j].outputs[0] for j in (p, m, a, r)]
    last = y
    cast = None
    c = g.only_reader(g.ops[y].outputs[0], "aten.to.dtype")
    if c is not None and len(g.args(c)) == 2 and _dtype(g.args(c)[1]) is not None:
        cast = _dtype(g.args(c)[1])
        inner.append(g.ops[last].outputs[0])
        members.append(c)
        last = c
    weight = None
    wm = g.only_reader(g.ops[last].outputs[0], "aten.mul.Tensor")
    if wm is not None and _p(_binary(g, wm, g.ops[last].outputs[0])) is not None:
        weight = _binary(g, wm, g.ops[last].outputs[0])
        inner.append(g.ops[last].outputs[0])
        members.append(wm)
        last = wm
    # NOTE: the cast to float32 that makes ``h``, where there is one; ``h`` is still written where other
    # ops read it (the residual), after the group
    lead = g.made_by(h, "aten.to.dtype")
    source: Any = {"t": h}
    lead_dtype = None
    if lead is not None and len(g.args(lead)) == 2 and _dtype(g.args(lead)[1]) is not None \
            and _t(g.args(lead)[0]) is not None:
        lead_dtype = _dtype(g.args(lead)[1])
        source = g.args(lead)[0]
        members.insert(0, lead)
    group = set(members)
    if not g.inner(inner, group) or any(j > last for j in members):
        return None
    outputs = [g.ops[last].outputs[0]]
    if lead_dtype is not None:
        if g.read_after(h, last, group):
            outputs.append(h)
        elif not g.inner([h], group):
            return None
    args = (source,) if weight is None else (source, weight)
    return OpGroup("rms_norm", tuple(sorted(group)), last, args, tuple(t for t in (_t(source),) if t),
                   tuple(outputs), _rms_kernel(lead_dtype, float(eps), cast, len(outputs) == 2))


_SAME_NORM: dict[tuple[torch.dtype, torch.device, int, float], bool] = {}


def same_norm(h: torch.Tensor, eps: float) -> bool:
    """Whether ``torch.rms_norm`` over the last dimension gives, bit for bit, the graph's
    ``h * rsqrt(mean(h ** 2) + eps)`` for tensors like ``h`` (its dtype, device and width): tried once
    on 64 rows of numbers of several scales. Asked on CPUs only, where this torch computes it with the
    same operations (a build that fused it otherwise would fail the probe); a GPU's fused kernel and
    its ``mean`` sum in orders that change with the rows, which no probe of one shape vouches for."""
    key = (h.dtype, h.device, int(h.shape[-1]), eps)
    got = _SAME_NORM.get(key)
    if got is None:
        g = torch.Generator().manual_seed(0)
        probe = (torch.randn(64, key[2], generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1))
        probe = probe.to(h.dtype).to(h.device)
        want = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps)
        got = _SAME_NORM[key] = bool(torch.equal(torch.rms_norm(probe, (key[2],), None, eps), want))
    return got


def _rms_kernel(lead: torch.dtype | None, eps: float, cast: torch.dtype | None,
                keep: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    def run(x: torch.Tensor, w: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        h = x.to(lead) if lead is not None else x
        if h.dim() and h.device.type == "cpu" and same_norm(h, eps):
            y = torch.rms_norm(h, (h.shape[-1],), None, eps)
        else:
            y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if cast is not None:
            y = y.to(cast)
        if w is not None:
            y = w * y
        return (y, h) if keep else (y,)
    return run


class _Signed:
    """``sin`` with its first half negated, made once for each ``sin`` tensor (the last one seen)."""

    def __init__(self) -> None:
        self.last: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def __call__(self, s: torch.Tensor, half: int) -> torch.Tensor:
        seen, signed = self.last          # NOTE: one read: another thread may replace the pair
        if seen is s and signed is not None:
            return signed
        signed = torch.cat((-s[..., :half], s[..., half:]), dim=-1)
        self.last = (s, signed)
        return signed


def _rotary(g: _Graph, c: int, signed: _Signed) -> OpGroup | None:
    """``q * cos + cat(-q[half:], q[:half]) * sin`` around the ``cat`` op ``c``."""
    args = g.args(c)
    if g.ops[c].target != "aten.cat.default" or len(args) != 2 or len(args[0]) != 2 or args[1] != -1:
        return None
    n = g.made_by(_t(args[0][0]), "aten.neg.default")
    x1 = g.made_by(_t(args[0][1]), "aten.slice.Tensor")
    x2 = g.made_by(_t(g.args(n)[0]) if n is not None and len(g.args(n)) == 1 else None, "aten.slice.Tensor")
    if n is None or x1 is None or x2 is None:
        return None
    a1, a2 = g.args(x1), g.args(x2)
    if len(a1) != 4 or len(a2) != 4 or _t(a1[0]) is None or _t(a1[0]) != _t(a2[0]):
        return None
    half = a1[3]
    if a1[1] not in (-1, 3) or a2[1] != a1[1] or a1[2] != 0 or not isinstance(half, int) \
            or a2[2] != half or a2[3] != _END or half < 1:
        return None
    q = str(_t(a1[0]))
    ct = g.ops[c].outputs[0]
    ms = g.only_reader(ct, "aten.mul.Tensor")
    sin = _binary(g, ms, ct) if ms is not None else None
    if ms is None or _t(sin) is None:
        return None
    ad = g.only_reader(g.ops[ms].outputs[0], "aten.add.Tensor")
    if ad is None or len(g.args(ad)) != 2:
        return None
    other = _t(_binary(g, ad, g.ops[ms].outputs[0]))
    mc = g.made_by(other, "aten.mul.Tensor")
    cos = _binary(g, mc, q) if mc is not None else None
    if mc is None or _t(cos) is None:
        return None
    first = _t(g.args(ad)[0]) == other       # NOTE: the sum in the order the graph adds
    members = {x1, x2, n, c, ms, mc, ad}
    inner = [g.ops[j].outputs[0] for j in (x1, x2, n, c, ms, mc)]
    # NOTE: cos and sin come from outside the run (not one of its own tensors, nor q: ``q * q``)
    if not g.inner(inner, members) or max(members) != ad or {_t(cos), _t(sin)} & {q, *inner}:
        return None
    reads = tuple(dict.fromkeys((q, str(_t(cos)), str(_t(sin)))))
    return OpGroup("rotary", tuple(sorted(members)), ad, ({"t": q}, cos, sin), reads,
                   (g.ops[ad].outputs[0],), _rotary_kernel(half, int(a1[1]), first, signed))


def _rotary_kernel(half: int, dim: int, cos_first: bool,
                   signed: _Signed) -> Callable[..., tuple[torch.Tensor]]:
    slice_ = torch.ops.aten.slice.Tensor

    def run(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        if q.shape[-1] != 2 * half or dim % q.dim() != q.dim() - 1 or sin.shape[-1] != 2 * half:
            # NOTE: the graph's own steps, as its ops name them
            rot = torch.cat((-slice_(q, dim, half, _END), slice_(q, dim, 0, half)), dim=-1)
            rotated = rot * sin
        else:
            rotated = q.roll(half, -1) * signed(sin, half)
        scaled = q * cos
        return (scaled + rotated if cos_first else rotated + scaled,)
    return run


def _q4_groups(g: _Graph) -> list[OpGroup]:
    """The int4 matmuls (no keyword arguments, plain operands) reading one tensor, in twos or more."""
    from ..qlinear import q4linear_kernel

    found: dict[tuple[str, int], list[int]] = {}
    for i, op in enumerate(g.ops):
        args = g.args(i)
        if (op.target != Q4LINEAR or len(args) != 5 or len(op.outputs) != 1 or op.attrs.get("multi")
                or _t(args[0]) is None or _p(args[1]) is None or _p(args[2]) is None
                or not (args[3] is None or _p(args[3]) is not None) or not isinstance(args[4], int)):
            continue
        found.setdefault((str(_t(args[0])), int(args[4])), []).append(i)
    out = []
    for (x, group), members in found.items():
        if len(members) < 2:
            continue
        operands = tuple(a for i in members for a in g.args(i)[1:4])
        out.append(OpGroup("q4_inputs", tuple(members), members[0], ({"t": x}, *operands), (x,),
                           tuple(g.ops[i].outputs[0] for i in members), _q4_kernel(group, q4linear_kernel)))
    return out


def _q4_kernel(group: int, alone: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, ...]]:
    from ..qlinear import q4_path, q4linear_packed

    def run(x: torch.Tensor, *operands: Any) -> tuple[torch.Tensor, ...]:      # NOTE: (w, sz, bias) each
        triples = [operands[j:j + 3] for j in range(0, len(operands), 3)]
        if q4_path(x) != "kernel":
            return tuple(alone(x, w, sz, b, group) for w, sz, b in triples)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)        # NOTE: once for every weight
        return tuple(q4linear_packed(x, rows, w, sz, b, group) for w, sz, b in triples)
    return run


def writes_in_place(op: Op) -> bool:
    """An ATen op that writes into an operand (``add_``, ``copy_``, ``_index_put_impl_``, ``__iand__``,
    any op given ``out=``): groups around it could read a tensor before it is written."""
    parts = op.target.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else ""
    dunder = name.startswith("__") and name.endswith("__")
    kwargs = op.attrs.get("kwargs") or {}
    return (bool(name) and (name.startswith("__i") if dunder else name.endswith("_"))) or "out" in kwargs


def op_groups(ops: Sequence[Op], exports: Sequence[str]) -> list[OpGroup]:
    """The groups of ``ops`` (a block's, in order) that run as one kernel each, none sharing an op."""
    if any(writes_in_place(op) for op in ops):
        return []
    g = _Graph(ops, exports)
    signed = _Signed()
    found: list[OpGroup] = []
    taken: set[int] = set()
    for i, op in enumerate(ops):
        got = _rms_norm(g, i) if op.target == "aten.rsqrt.default" else \
            _rotary(g, i, signed) if op.target == "aten.cat.default" else None
        if got is not None and not taken & set(got.ops):
            found.append(got)
            taken |= set(got.ops)
    for q4 in _q4_groups(g):
        if not taken & set(q4.ops):
            found.append(q4)
            taken |= set(q4.ops)
    return found
