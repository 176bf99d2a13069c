"""Synthetic operator graphs for placement tests: no model, just sizes and edges."""

from __future__ import annotations

import random

from seabiscuit_dask.ir import Op, OpGraph, ParamSource, ParamSpec, TensorSpec


def random_dag(n_ops: int, seed: int = 0, max_fanin: int = 3, param_kib: tuple[int, int] = (0, 512),
               out_kib: tuple[int, int] = (1, 64), window: int = 8) -> OpGraph:
    """A random DAG of ``n_ops`` ops: each reads 1..max_fanin tensors made by the last ``window`` ops."""
    rnd = random.Random(seed)
    tensors = {"x": TensorSpec((256,), "float32")}
    params: dict[str, ParamSpec] = {}
    ops = []
    made = ["x"]
    for i in range(n_ops):
        k = rnd.randint(1, min(max_fanin, len(made)))
        ins = rnd.sample(made[-window:], min(k, len(made[-window:])))
        out = f"t{i}"
        tensors[out] = TensorSpec((rnd.randint(*out_kib) * 256,), "float32")
        ps = ()
        kib = rnd.randint(*param_kib)
        if kib:
            p = f"w{i}"
            params[p] = ParamSpec(p, (kib * 256,), "float32", ParamSource("model", p))
            ps = (p,)
        kind = rnd.choice(["linear", "elementwise", "matmul", "concat"])
        ops.append(Op(f"layers.{i // 10}.op{i}", kind, f"test.{kind}", tuple(ins), (out,), ps,
                      scope=f"layers.{i // 10}", flops=rnd.randint(1, 50) * 10**6))
        made.append(out)
    return OpGraph(tuple(ops), tensors, params, ("x",), (made[-1],), {"name": f"dag{seed}"})


def chain(sizes_kib: list[int], out_kib: int = 4, flops: int = 10**6) -> OpGraph:
    """A chain x -> op0 -> op1 -> ...; op i holds ``sizes_kib[i]`` KiB of weights."""
    tensors = {"x": TensorSpec((out_kib * 256,), "float32")}
    params = {}
    ops = []
    prev = "x"
    for i, kib in enumerate(sizes_kib):
        out = f"t{i}"
        tensors[out] = TensorSpec((out_kib * 256,), "float32")
        ps: tuple[str, ...] = ()
        if kib:
            params[f"w{i}"] = ParamSpec(f"w{i}", (kib * 256,), "float32", ParamSource("model", f"w{i}"))
            ps = (f"w{i}",)
        ops.append(Op(f"op{i}", "linear", "test.linear", (prev,), (out,), ps, flops=flops))
        prev = out
    return OpGraph(tuple(ops), tensors, params, ("x",), (prev,), {"name": "chain"})
