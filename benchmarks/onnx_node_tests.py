"""SeaBiscuit as an ONNX backend: the ONNX node tests per op type, traced, decomposed and run.

Prints, per op type, the cases passed / failed / skipped (skipped: an op SeaBiscuit does not
map, or a dtype torch does not compute with), and the op types whose cases that ran passed at
or above --claim (default 95%).

    PYTHONPATH=. python benchmarks/onnx_node_tests.py [--budget 4KiB] [--only Conv,MatMul] [--why]
"""

from __future__ import annotations

import argparse
import time

from tests.onnx_nodes import node_cases, op_type, run_case, tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="4KiB")
    ap.add_argument("--only", default="", help="comma-separated op types")
    ap.add_argument("--claim", type=float, default=0.95)
    ap.add_argument("--why", action="store_true", help="print why each case failed")
    a = ap.parse_args()
    only = {s for s in a.only.split(",") if s}
    cases = [c for c in node_cases() if op_type(c) != "expanded" and (not only or op_type(c) in only)]
    t0 = time.perf_counter()
    results = []
    for c in cases:
        status, why = run_case(c, a.budget)
        results.append((op_type(c), status))
        if a.why and status == "failed":
            print(f"  {c.name}: {why}")
    counts = tally(results)
    print(f"{len(cases)} node test cases, {len(counts)} op types, budget {a.budget}, "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'op type':<28} {'passed':>6} {'failed':>6} {'skipped':>7} {'share':>6}")
    claimed = []
    for kind in sorted(counts):
        c = counts[kind]
        ran = c["passed"] + c["failed"]
        share = c["passed"] / ran if ran else 0.0
        if ran and share >= a.claim:
            claimed.append(kind)
        if ran:
            print(f"{kind:<28} {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {share:>6.0%}")
    skipped = sorted(k for k, c in counts.items() if not (c["passed"] + c["failed"]))
    print(f"\nat or above {a.claim:.0%} of the cases that ran ({len(claimed)}): {', '.join(claimed)}")
    print(f"not mapped ({len(skipped)}): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
