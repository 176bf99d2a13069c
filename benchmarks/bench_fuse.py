"""Linear tiles fused into one kernel (``seabiscuit.lower.fuse-tiles``) against one kernel per tile.

A decoder's blocks on one device, run through a worker's ``ResidentBlocks`` as a
worker runs them, with fusion off and on, in one process, medians over --reps:
kernels per forward pass, linear groups fused, weight bytes held (the same: tiles
are views of the packed buffers) and time per forward pass at --seq tokens. On a
CUDA machine it runs on the GPU too (``--device cuda``), where kernel launches
are what fusion saves.

    python benchmarks/bench_fuse.py [--layers 8] [--seq 1] [--budget 1MiB] [--reps 30] [--device cpu]
"""

from __future__ import annotations

import argparse

import dask.config
import torch
import transformers as tf

import seabiscuit_dask as sb
from seabiscuit_dask.ir import fmt_bytes
from seabiscuit_dask.lower.blocks import block_specs
from seabiscuit_dask.runtime.worker.agent import median_s
from seabiscuit_dask.runtime.worker.resident import ResidentBlocks
from seabiscuit_dask.runtime.worker.store import stored

MODEL = "0123456789abcdef"


class _Owner:
    """Keeps the weight store alive."""


def smollm_like(layers: int) -> torch.nn.Module:
    """SmolLM2-135M's shape (576 wide, 9 heads, 3 KV heads), ``layers`` deep, seeded weights."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True)
    return tf.LlamaForCausalLM(cfg).eval()


def forward_s(r: ResidentBlocks, specs, graph, x, reps: int, device: str) -> float:
    by_index = {s.index: s for s in specs}

    def fetch(model: str, version: int, block: int):
        return by_index[block].to_dict()

    def once() -> None:
        outs: dict[int, dict[str, torch.Tensor]] = {}
        for s in specs:
            outs[s.index], _ = r.run(MODEL, 0, 0, s.index, {graph.inputs[0]: x}, [outs[d] for d in s.deps],
                                     fetch)
        if device == "cuda":
            torch.cuda.synchronize()

    once()
    return median_s(once, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1)
    ap.add_argument("--budget", default="1MiB", help="micro-op budget: smaller cuts more tiles")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = smollm_like(a.layers)
    x = torch.randint(0, 49152, (1, a.seq), generator=torch.Generator().manual_seed(0))
    graph = sb.decompose(sb.trace(model, x, kwargs={"logits_to_keep": 1}), a.budget)
    owner = _Owner()
    graph, _ = stored(graph, model, owner)
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=1, cpu_memory="64GiB")
    specs = block_specs(sb.place(graph, spec), MODEL, 0)
    rows = []
    for fuse in (False, True):
        with dask.config.set({"seabiscuit.lower.fuse-tiles": fuse}):
            r = ResidentBlocks(1 << 40, a.device)
            r.versions[MODEL] = 0
            s = forward_s(r, specs, graph, x, a.reps, a.device)
            progs = list(r.programs.values())
            rows.append((fuse, sum(len(p.steps) for p in progs), sum(p.fused_groups for p in progs),
                         r.weight_bytes, s))
    print(f"{a.layers}-layer SmolLM2-shaped decoder, {len(graph.ops)} micro-ops at {a.budget}, "
          f"{len(specs)} block(s), seq {a.seq}, {a.device}, median of {a.reps}")
    print(f"{'fusion':<8} {'kernels':>8} {'groups':>7} {'weights':>11} {'ms/pass':>9} {'vs off':>7}")
    base = rows[0][4]
    for fuse, kernels, groups, nbytes, s in rows:
        print(f"{'on' if fuse else 'off':<8} {kernels:>8} {groups:>7} {fmt_bytes(nbytes):>11} "
              f"{s * 1e3:>9.2f} {base / s:>6.2f}x")


if __name__ == "__main__":
    main()
