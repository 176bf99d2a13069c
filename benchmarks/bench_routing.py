"""A link throttled mid-run, and what routing makes of it: latency per request and bytes over the link.

Three hosts as network namespaces, a 1 Gbit/s link from each to each (``tests/netns.py``:
``namespace_mesh``), one worker a host, a chain of ``--layers`` linear layers of ``--width``
cut across the three hosts (two layers a host). Requests of ``--batch`` rows run one after
another; after ``--requests`` of them the link one cut crosses is throttled to 20 Mbit/s
(``tc class change``). The scenario runs twice: with ``seabiscuit.routing.repair`` off (the
link is measured, nothing is repaired) and on. Printed: per phase, the median and 90th
percentile latency of a request, the bytes a request sends over the throttled link itself,
and the link's measured bandwidth; and the time from the throttle to the repaired plan.

    sudo python benchmarks/bench_routing.py [--requests 12] [--layers 6] [--width 1024] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(dm: Any, x: torch.Tensor, want: torch.Tensor, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        got = dm(x)
        out.append(time.perf_counter() - t0)
        torch.testing.assert_close(got, want)
    return out


def scenario(args: argparse.Namespace, repair: bool) -> list[dict[str, Any]]:
    from distributed import Client

    import seabiscuit_dask as sb
    from tests import netns

    os.environ["DASK_SEABISCUIT__ROUTING__REPAIR"] = str(repair)     # NOTE: the scheduler's, a process
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).eval()
    x = torch.randn(args.batch, args.width)
    with torch.no_grad():
        want = model(x)
    per_worker = int(2.6 * args.width * args.width * 4)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, netns.namespace_mesh(3, "1gbit") as hosts, \
            netns.dask_on_hosts(hosts, 1, per_worker, tmp) as sched, \
            Client(scheduler_file=sched, timeout="60s") as client:
        client.wait_for_workers(3, timeout=120)
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        dm = sb.distribute(model, client, x, budget="16MiB")
        plan = dm.plan
        host = {d.address: hosts.addresses.index(d.host) for d in plan.spec.devices}
        src, dst = next((plan.spec.devices[a].address, plan.spec.devices[b].address)
                        for a in range(3) for b in range(3) if plan.bytes_between[a, b])

        def direct() -> float:
            got = client.run(lambda dask_worker: dask_worker.plugins["seabiscuit"]._links.counters().get(
                dst, {}).get("bytes", 0.0), workers=[src])
            return float(got[src])

        def link() -> dict[str, Any]:
            dm._flush_runs()
            seen = client.sync(client.scheduler.seabiscuit_links)
            return next(x for x in seen if (x["src"], x["dst"]) == (src, dst))

        def repairs() -> list[dict[str, Any]]:
            events = client.run_on_scheduler(
                lambda dask_scheduler: list(dask_scheduler.plugins["seabiscuit"].events))
            return [e for e in events if e["action"] in ("link-relay", "link-recut")]

        def phase(name: str) -> None:
            sent = direct()
            times = timed(dm, x, want, args.requests)
            rows.append({"phase": name, "times": times, "bytes": (direct() - sent) / args.requests,
                         "link": link()["bandwidth_bytes_per_s"]})

        timed(dm, x, want, 3)
        phase("before the throttle")
        netns.throttle(hosts, host[src], host[dst], "20mbit")
        throttled_at = time.time()
        if not repair:
            phase("throttled, no repair")
        else:
            n = 0
            while not repairs() and n < 100:
                timed(dm, x, want, 1)
                n += 1
            done = repairs()
            if not done:
                print("no repair within 100 requests")
                return rows
            if done[0]["action"] == "link-recut":
                while dm.version == 0:
                    timed(dm, x, want, 1)
            timed(dm, x, want, 2)
            phase(f"throttled, repaired ({done[0]['action'][5:]})")
            seen = link()
            after = [c for c in seen["changed_at"] if c[0] >= throttled_at]
            rows.append({"phase": "throttle -> repair", "seconds": done[0]["time"] - throttled_at,
                         "requests": n, "reason": done[0]["reason"],
                         "detected_s": (after[0][0] - throttled_at) if after else float("nan")})
        dm.close()
    return rows


def main() -> None:
    from tests import netns

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    why = netns.unavailable()
    if why:
        print(f"skipped: {why}")
        return
    rows = scenario(args, repair=False) + scenario(args, repair=True)
    act = args.batch * args.width * 4
    print(f"\n{args.layers} x Linear({args.width}) on 3 hosts (1 Gbit/s links), batch {args.batch}: "
          f"{act / 1024:.0f} KiB a cut; {args.requests} requests a phase; one cut's link throttled to "
          "20 Mbit/s")
    print(f"{'phase':<34} {'median ms':>10} {'p90 ms':>8} {'bytes/request on the link':>26} "
          f"{'link Mbit/s':>12}")
    for r in rows:
        if "times" in r:
            ts = sorted(r["times"])
            p90 = ts[min(len(ts) - 1, int(0.9 * len(ts)))]
            print(f"{r['phase']:<34} {statistics.median(ts) * 1e3:>10.1f} {p90 * 1e3:>8.1f} "
                  f"{r['bytes']:>26,.0f} "
                  f"{r['link'] * 8 / 1e6:>12.1f}")
    for r in rows:
        if "seconds" in r:
            print(f"\nthrottle -> link seen slow: {r['detected_s']:.2f} s; -> repaired plan: "
                  f"{r['seconds']:.2f} s "
                  f"({r['requests']} requests)\n  {r['reason']}")


if __name__ == "__main__":
    main()
