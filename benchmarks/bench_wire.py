"""What packing and unpacking a data-plane message costs, in this process.

The message is a decode step's to the second stage of a Llama-style model split in two:
``--layers`` layers' views of one rotary table pair (cos and sin, 64 wide), two hidden
states of ``--hidden`` and the step's small inputs. Measured in one run, medians of
``--reps``: ``wire.pack_message`` and ``wire.unpack_message`` of that message as it is
(each layer's view of the same two tables, sent once) and with every view a tensor of its
own (what distinct tensors cost: each goes as its own frame).

    python benchmarks/bench_wire.py [--layers 15] [--hidden 576] [--reps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from seabiscuit_dask.runtime.dataplane.wire import Tensors, pack_message, unpack_message


def message(layers: int, hidden: int, shared: bool) -> dict[str, Any]:
    cos, sin = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    ts = {"h": torch.randn(1, 1, hidden), "residual": torch.randn(1, 1, hidden)}
    for i in range(layers):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        ts[f"cos{i}"], ts[f"sin{i}"] = (c, s) if shared else (c.clone(), s.clone())
    ts.update(sb_sessions=torch.zeros(1, dtype=torch.long), sb_start=torch.zeros(1, dtype=torch.long),
              sb_valid=torch.ones(1, 1, dtype=torch.bool))
    return {"op": "push", "model": "0" * 16, "ticket": "t", "version": 1, "request": 7, "block": 1,
            "tensors": Tensors(ts)}


def median_us(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'message':<34} {'tensors':>8} {'bytes':>8} {'pack us':>9} {'unpack us':>10}")
    for shared in (True, False):
        msg = message(args.layers, args.hidden, shared)
        frames, total = pack_message([msg])
        buf = bytearray(b"".join(bytes(f) for f in frames))
        got = unpack_message(buf)[0]["tensors"]
        assert all(torch.equal(got[n], t) for n, t in msg["tensors"].items())
        pack = median_us(lambda msg=msg: pack_message([msg]), args.reps)
        unpack = median_us(lambda buf=buf: unpack_message(buf), args.reps)
        what = "views of one table pair (sent once)" if shared else "every view its own tensor"
        print(f"{what:<34} {len(msg['tensors']):>8} {total:>8} {pack:>9.1f} {unpack:>10.1f}")


if __name__ == "__main__":
    main()
