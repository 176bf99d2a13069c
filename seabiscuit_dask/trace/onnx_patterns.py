"""Patterns of ONNX graphs that SeaBiscuit reads as one thing, each found once, by a pass that
returns what it found (``OnnxModule`` makes new nodes of it; no pass edits a node):

- ``read_at_load``: the constants folding needs, so a lazy load reads no other weight;
- ``find_quantized``: MatMul-like nodes whose B is an integer weight with a scale per output
  column (``DequantizeLinear``, ``Cast`` + ``Mul``, ``MatMulInteger``, ``QLinearMatMul``), which
  run ``sb.qlinear`` on the integers as stored, and the nodes that only dequantized them (dead);
- ``held_transposed``: float weights only ever read as a MatMul's B, held ``[out, in]`` as
  torch's linear holds them, so the decomposer tiles them as linear layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .onnx_ops import B_SLOTS, FOLDS, Node, _axis


def readers_of(nodes: Sequence[Node]) -> dict[str, list[tuple[int, int]]]:
    """Value name -> ``(node index, input slot)`` of each node that reads it."""
    out: dict[str, list[tuple[int, int]]] = {}
    for k, n in enumerate(nodes):
        for j, i in enumerate(n.inputs):
            out.setdefault(i, []).append((k, j))
    return out


def read_at_load(nodes: Sequence[Node], known: set[str]) -> set[str]:
    """The constants whose values folding needs (those a foldable node reads), but for int8
    weights that ``Cast`` + ``Mul`` dequantize only for a matmul's B: ``sb.qlinear`` runs on those
    as they are stored (their scales are read)."""
    readers = readers_of(nodes)

    def only_b(name: str) -> bool:
        return bool(readers.get(name)) and all(nodes[r].op_type in ("MatMul", "Gemm") and j == 1
                                               for r, j in readers[name])

    known, needed = set(known), set[str]()
    for n in nodes:
        cast = n.op_type == "Cast" and bool(n.outputs)
        muls = [nodes[r] for r, _ in readers.get(n.outputs[0], [])] if cast else []
        if muls and n.inputs[0] in known and all(m.op_type == "Mul" and only_b(m.outputs[0]) for m in muls):
            needed.update(i for m in muls for i in m.inputs if i != n.outputs[0])
            continue                   # NOTE: not folded: its weight stays int8 (and may stay unread)
        if n.op_type in FOLDS and all(i in known or not i for i in n.inputs):
            needed.update(i for i in n.inputs if i)
            known.update(n.outputs)
    return needed


Quantized = tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None", tuple[str, bool]]
"""An integer weight ``[out, in]``, its scale per output column, its zero point (or None), and
the initializer it is (its name, and whether the weight is its transpose)."""


def integer_weight(node: Node, slot: tuple[int, int | None], consts: Mapping[str, np.ndarray],
                    made: Mapping[str, Node]) -> Quantized | None:
    """``(w [out, in], scale [out] or None, zero [out] or None)`` when ``node``'s B input is an
    integer constant with per-column (or per-tensor) scale and zero point, else None."""
    b_name = node.inputs[slot[0]]
    trans = node.op_type == "Gemm" and bool(node.attr("transB", 0))
    col = 0 if trans else 1                     # NOTE: the axis of B that holds output columns
    if node.op_type == "Gemm" and node.attr("transA", 0):
        return None
    if slot[1] is not None:                     # MatMulInteger, QLinearMatMul: B is the integers
        q = consts.get(b_name)
        zp_name = node.inputs[slot[1]] if len(node.inputs) > slot[1] else ""
        zero = consts.get(zp_name) if zp_name else None
        if q is None or (zp_name and zero is None):
            return None
        return per_column(q, None, zero, col, b_name)
    src = made.get(b_name)
    if src is None:
        return None
    if src.op_type == "DequantizeLinear" and not src.attr("block_size", 0):
        q, scale = consts.get(src.inputs[0]), consts.get(src.inputs[1])
        zp_name = src.inputs[2] if len(src.inputs) > 2 else ""
        zero = consts.get(zp_name) if zp_name else None
        if q is None or scale is None or (zp_name and zero is None) or q.ndim != 2:
            return None
        if scale.size > 1 and _axis(int(src.attr("axis", 1)), 2) != col:
            return None
        return per_column(q, scale, zero, col, src.inputs[0])
    if src.op_type == "Mul":
        for i in (0, 1):
            cast = made.get(src.inputs[i])
            scale = consts.get(src.inputs[1 - i])
            if cast is None or cast.op_type != "Cast" or scale is None or int(cast.attr("to")) != 1:
                continue                        # NOTE: to FLOAT
            q = consts.get(cast.inputs[0])
            if q is None or q.ndim != 2 or scale.ndim > 2:
                continue
            if scale.size > 1 and ((scale.ndim == 2 and scale.shape[1 - col] != 1)
                                   or (scale.ndim == 1 and col != 1)):
                continue
            return per_column(q, scale, None, col, cast.inputs[0])
    return None


def per_column(q: np.ndarray, scale: np.ndarray | None, zero: np.ndarray | None,
                col: int, name: str) -> Quantized | None:
    """``q`` as ``[out, in]`` with its scale and zero point as one value per output column."""
    if q.ndim != 2 or q.dtype not in (np.int8, np.uint8):
        return None
    n = q.shape[col]

    def column(v: np.ndarray | None, dtype: Any) -> np.ndarray | None:
        if v is None:
            return None
        if v.size not in (1, n) or (v.dtype != dtype):
            raise ValueError
        return np.broadcast_to(v.reshape(-1), (n,)).astype(dtype)

    try:
        s = column(scale, np.float32)
        z = column(zero, q.dtype)
    except ValueError:
        return None
    if z is not None and not z.any():
        z = None
    return (q.T if col == 1 else q), s, z, (name, col == 1)


def find_quantized(nodes: Sequence[Node], consts: Mapping[str, Any], pure: Callable[[Node], bool],
                   outputs: Sequence[str]) -> tuple[dict[int, Quantized], frozenset[int]]:
    """MatMul-like nodes whose B is an integer constant (dequantized by ``DequantizeLinear`` or
    ``Cast`` + ``Mul`` with a scale per output column): node index -> ``(w [out, in], scale, zero,
    origin)``; and the dequantizing nodes that only they read (dead: those nodes run
    ``sb.qlinear`` on the integer weight instead)."""
    made = {o: n for n in nodes for o in n.outputs}
    readers = readers_of(nodes)
    found: dict[int, Quantized] = {}
    for k, n in enumerate(nodes):
        slot = B_SLOTS.get(n.op_type)
        if slot is None or len(n.inputs) <= slot[0]:
            continue
        got = integer_weight(n, slot, consts, made)
        if got is not None:
            found[k] = got
    slots = {(k, B_SLOTS[nodes[k].op_type][0]) for k in found}
    dead: set[int] = set()
    for k in reversed(range(len(nodes))):     # NOTE: a dequantizing node no live node reads is dead
        n = nodes[k]
        if k in found or pure(n) or n.op_type not in ("DequantizeLinear", "Mul", "Cast"):
            continue
        if all(readers.get(o) and o not in outputs
               and all((r, j) in slots or r in dead for r, j in readers[o]) for o in n.outputs):
            dead.add(k)
    return found, frozenset(dead)


def operand_users(nodes: Sequence[Node], quant: Mapping[int, Any], dead: frozenset[int],
                  pure: Callable[[Node], bool]) -> dict[str, list[tuple[int, int]]]:
    """Value name -> ``(node index, slot)`` of the live nodes that read it at run time (not the
    quantized weight slots, which read their integer buffers)."""
    users: dict[str, list[tuple[int, int]]] = {}
    for k, n in enumerate(nodes):
        if pure(n) or k in dead:
            continue
        for j, i in enumerate(n.inputs):
            if k not in quant or j != B_SLOTS[n.op_type][0]:
                users.setdefault(i, []).append((k, j))
    return users


def held_transposed(nodes: Sequence[Node], consts: Mapping[str, Any],
                    users: Mapping[str, list[tuple[int, int]]]) -> set[str]:
    """2-D float constants only ever read as the B of a MatMul (or a Gemm without transB): held
    ``[out, in]``, a linear layer's weight."""
    return {k for k, us in users.items()
            if k in consts and consts[k].ndim == 2 and consts[k].dtype.kind == "f"
            and all(j == 1 and (nodes[n].op_type == "MatMul" or (nodes[n].op_type == "Gemm"
                                                                 and not nodes[n].attr("transB", 0)))
                    for n, j in us)}
