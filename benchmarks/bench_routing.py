"""A link throttled mid-run, and what routing makes of it: latency per request and bytes over the link.

Three hosts as network namespaces, a 1 Gbit/s link from each to each (``tests/netns.py``:
``namespace_mesh``), one worker a host, a chain of ``--layers`` linear layers of ``--width``
cut across the three hosts (two layers a host). Requests of ``--batch`` rows run one after
another; after ``--requests`` of them the link one cut crosses is throttled to 20 Mbit/s
(``tc class change``). The scenario runs twice: with ``seabiscuit.routing.repair`` off (the
link is measured, nothing is repaired) and on. Printed: per phase, the median and 90th
percentile latency of a request, the bytes a request sends over the throttled link itself,
and the link's measured bandwidth; and the time from the throttle to the repaired plan.

With ``--loaded``, no namespaces and no throttle: a LocalCluster of three worker processes on this
machine's loopback, ``--hogs`` busy loops beside them, ``--callers`` threads sending requests for
``--seconds``: every link is as fast as ever, and what the scheduler made of them is printed per
link (transfers, stalls, changes confirmed, the fitted and the applied figures), with the repair
events (``link-*``) and the plan's version at the end.

    sudo python benchmarks/bench_routing.py [--requests 12] [--layers 6] [--width 1024] [--batch 64]
    python benchmarks/bench_routing.py --loaded [--hogs 2] [--seconds 30] [--callers 2] [--width 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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


def link_table(dask_scheduler: Any = None) -> list[dict[str, Any]]:
    """On the scheduler: per link, what its estimator made of the transfers."""
    out = []
    for (src, dst), est in sorted(dask_scheduler.plugins["seabiscuit"].state.links.links.items()):
        now, history = est.estimate(), [h[1] * 8e-6 for h in est.history]
        out.append({"link": f"{src.rsplit(':', 1)[-1]} -> {dst.rsplit(':', 1)[-1]}", "transfers": est.count,
                    "stalls": getattr(est, "stalls", float("nan")), "changes": est.changes,
                    "mbit": now.bandwidth_bytes_per_s * 8e-6, "ms": now.latency_s * 1e3,
                    "applied_mbit": est.applied.bandwidth_bytes_per_s * 8e-6,
                    "applied_ms": est.applied.latency_s * 1e3,
                    "history_mbit": [min(history), max(history)]})
    return out


def loaded(args: argparse.Namespace) -> None:
    """Three worker processes on loopback beside ``--hogs`` busy loops, requests for ``--seconds``:
    the links as the scheduler learned them (see module doc)."""
    from distributed import Client, LocalCluster

    import seabiscuit_dask as sb

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).eval()
    x = torch.randn(args.batch, args.width)
    with torch.no_grad():
        want = model(x)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=None,
                          resources={"MEM": int(2.6 * args.width * args.width * 4)}) as cluster, \
                Client(cluster) as client:
            client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
            dm = sb.distribute(model, client, x, budget="16MiB")
            timed(dm, x, want, 3)
            stop, times = threading.Event(), []

            def caller() -> None:
                while not stop.is_set():
                    times.extend(timed(dm, x, want, 1))

            threads = [threading.Thread(target=caller) for _ in range(args.callers)]
            for t in threads:
                t.start()
            stop.wait(args.seconds)
            stop.set()
            for t in threads:
                t.join()
            dm._flush_runs()
            links = client.run_on_scheduler(link_table)
            events = client.run_on_scheduler(
                lambda dask_scheduler: [e["action"] for e in dask_scheduler.plugins["seabiscuit"].events])
            version = dm.version
            dm.close()
    finally:
        for h in hogs:
            h.kill()
    print(f"\n{args.layers} x Linear({args.width}) on 3 worker processes (loopback), batch {args.batch}: "
          f"{args.batch * args.width * 4 / 1024:.0f} KiB a cut; {args.hogs} busy loops beside them; "
          f"{len(times)} requests in {args.seconds:.0f} s from {args.callers} callers, median "
          f"{statistics.median(times) * 1e3:.1f} ms")
    print(f"{'link':<14} {'transfers':>9} {'stalls':>7} {'changes':>8} {'Mbit/s':>8} {'ms':>7} "
          f"{'applied Mbit/s':>15} {'applied ms':>11} {'history Mbit/s':>18}")
    for r in links:
        print(f"{r['link']:<14} {r['transfers']:>9} {r['stalls']:>7} {r['changes']:>8} {r['mbit']:>8.0f} "
              f"{r['ms']:>7.3f} {r['applied_mbit']:>15.0f} {r['applied_ms']:>11.3f} "
              f"{r['history_mbit'][0]:>8.0f} - {r['history_mbit'][1]:<8.0f}")
    kinds = {k: events.count(k) for k in sorted(set(events)) if k.startswith("link-")}
    print(f"changes confirmed: {sum(r['changes'] for r in links)} over {sum(r['transfers'] for r in links)} "
          f"transfers; repair events: {kinds or 'none'}; plan version {version}")


def main() -> None:
    from tests import netns

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=None, help="1024; 512 with --loaded")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--loaded", action="store_true", help="loopback beside busy loops, no throttle")
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--callers", type=int, default=2)
    args = ap.parse_args()
    if args.loaded:
        args.width = args.width or 512
        loaded(args)
        return
    args.width = args.width or 1024
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
