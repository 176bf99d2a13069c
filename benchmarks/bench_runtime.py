"""Distributed execution of a ~355M-parameter GPT-2 (batch 1) on a LocalCluster.

Measured in one run, medians over --reps:

- single-request latency on --workers worker processes x 1 thread, against torch
  in one process with 1 thread (the overhead of distribution on equal per-op resources)
  and with 2, each round of the three back to back (the ratios are medians of rounds);
- throughput with 8 concurrent requests on the same cluster, against torch in
  one process with 2 threads (the same total cores) answering as many requests one after
  another, the two back to back --reps/2 times (medians, and the median ratio of the rounds);
  torch's figure from before the cluster started is printed too;
- bytes moved between workers per request (the data plane's counters and Dask's
  transfer logs; the caller's inputs left out), against the plan's cut tensors;
- the scheduler's event-loop CPU time per request (in a LocalCluster it is also
  this client's comms thread: the outputs it receives are counted there);
- the latency of the same graph placed as contiguous stages alone (no layer split over
  the workers), the A/B of intra-layer parallelism.

    python benchmarks/bench_runtime.py [--seq 128] [--reps 5] [--budget 16MiB] [--workers 2]

At seq 512 the activations (an MLP hidden state is 8 MiB, the logits 98 MiB) exceed
the 16 MiB budget: they travel as tiles and the logits are assembled by the caller.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired(call, model, x, reps: int) -> dict[str, float]:
    """``call()`` and torch on 1 and on 2 threads in this process, back to back ``reps`` times: the
    median of each and of the ratios within each round (a shared machine's speed drifts by tens of
    percent over minutes; within a round it is one speed)."""
    rounds = []
    with torch.no_grad():
        for _ in range(reps):
            t = time.perf_counter()
            call()
            d = time.perf_counter() - t
            torch.set_num_threads(1)
            t = time.perf_counter()
            model(x)
            one = time.perf_counter() - t
            torch.set_num_threads(2)
            t = time.perf_counter()
            model(x)
            two = time.perf_counter() - t
            torch.set_num_threads(1)
            rounds.append((d, one, two))
    return {"s": statistics.median(r[0] for r in rounds), "1t": statistics.median(r[1] for r in rounds),
            "2t": statistics.median(r[2] for r in rounds),
            "vs_1t": statistics.median(r[0] / r[1] for r in rounds),
            "vs_2t": statistics.median(r[0] / r[2] for r in rounds)}


def concurrent_rps(call, n: int, rounds: int) -> float:
    """Requests per second with ``n`` calls in flight at once from ``n`` threads."""
    def worker() -> None:
        for _ in range(rounds):
            call()

    threads = [threading.Thread(target=worker) for _ in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n * rounds / (time.perf_counter() - t)


def paired_rps(call, model, x, n: int, rounds: int, reps: int) -> dict[str, float]:
    """``n`` concurrent calls (``rounds`` each) and torch on 2 threads answering as many requests one
    after another, back to back ``reps`` times: the median of each and of the ratios of the rounds
    (the anchor measured beside the cluster, in the same minute, as the latencies are)."""
    out = []
    with torch.no_grad():
        for _ in range(reps):
            dist = concurrent_rps(call, n, rounds)
            torch.set_num_threads(2)
            t = time.perf_counter()
            for _ in range(n * rounds):
                model(x)
            local = n * rounds / (time.perf_counter() - t)
            torch.set_num_threads(1)
            out.append((dist, local))
    return {"dist": statistics.median(r[0] for r in out), "2t": statistics.median(r[1] for r in out),
            "ratio": statistics.median(r[0] / r[1] for r in out)}


def transfer_bytes(client, since: float) -> int:
    """Bytes the workers received from each other in transfers that started after ``since``.

    (Their transfer logs are capped deques, so totals of a whole log do not subtract.)
    """
    def total(dask_worker) -> int:
        log = list(dask_worker.transfer_incoming_log)
        return int(sum(e.get("total", 0) for e in log if e["start"] >= since))

    return sum(client.run(total).values())


def data_plane_bytes(client) -> int:
    """Bytes the workers' data planes received so far (from each other and from the caller)."""
    def total(dask_worker) -> int:
        return int(dask_worker.plugins["seabiscuit"].dataplane.counters["bytes_in"])

    return sum(client.run(total).values())


def scheduler_cpu_s(client) -> float:
    return client.run_on_scheduler(lambda: time.thread_time())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", default="16MiB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="requests per thread in the throughput run")
    args = ap.parse_args()

    from distributed import Client, LocalCluster

    import seabiscuit_dask as sb
    from seabiscuit_dask.models import demo_model

    model, _ = demo_model("gpt2-medium")
    x = torch.randint(0, 50257, (1, args.seq), generator=torch.Generator().manual_seed(0))
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 4
    print(f"model: gpt2-medium, {params / 1e6:.0f}M params ({weight_bytes / 2**30:.2f} GiB fp32), "
          f"batch 1, seq {args.seq}")

    torch.set_num_threads(1)
    with torch.no_grad():
        ref = model(x).logits
        torch.set_num_threads(2)
        local_2t = median_s(lambda: model(x), args.reps)
        local_2t_rps = 1 / local_2t
    torch.set_num_threads(1)

    budget = int(weight_bytes * 0.7)         # no worker can hold the model alone
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      resources={"MEM": budget}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        t = time.perf_counter()
        dm = sb.distribute(model, client, (x,), budget=args.budget)
        deploy_s = time.perf_counter() - t
        y = dm(x).logits
        err = float((y - ref).abs().max() / ref.abs().max())
        g = dm.graph
        largest = max(t.nbytes for t in sb.trace(model, (x,)).tensors.values())
        print(f"{len(g.ops)} micro-ops, largest working set "
              f"{max(g.working_set(op) for op in g.ops) / 2**20:.2f} MiB, largest activation "
              f"{largest / 2**20:.1f} MiB, tiled outputs {list(g.tilings)}; distributed equals torch: "
              f"{err <= 1e-4} (rel err {err:.1e})")
        print(dm.plan)
        main = paired(lambda: dm(x), model, x, args.reps)
        dist_1 = main["s"]
        predicted = dm.predicted_s()
        t0, c0, b0 = time.time(), scheduler_cpu_s(client), data_plane_bytes(client)
        dm(x)
        sched_s = scheduler_cpu_s(client) - c0
        moved = transfer_bytes(client, t0) + data_plane_bytes(client) - b0 - (x.numel() * x.element_size()
                                                                            if dm.p2p else 0)
        rps = paired_rps(lambda: dm(x), model, x, 8, args.rounds, max(1, args.reps // 2))
        blocks = len(dm.specs)
        cut = dm.plan.cut_bytes
        repairs = [e.get("reason", "") for e in dm.events if e.get("action") == "plan" and e.get("version")]
        plan, graph = dm.plan, dm.graph
        dm.close()
        # What a planner blind to Dask's costs would run: the parallel plan of a Dask-free model.
        from seabiscuit_dask.placement import NO_DASK

        blind = sb.place(graph, plan.spec.with_dask(NO_DASK))
        blind = sb.Plan(graph, plan.spec, blind.device_of, info={"fused": blind.fused})
        with sb.deploy(blind, client, weights=model) as dm2:
            dm2(x)
            blind_s = median_s(lambda: dm2(x), args.reps)
        # The same cluster without intra-layer parallelism: contiguous stages, no layer split.
        from seabiscuit_dask.placement.partition import place_stages

        stages_plan = place_stages(graph, plan.spec)
        with sb.deploy(stages_plan, client, weights=model) as dm3:
            dm3(x)
            dm3(x)
            staged = paired(lambda: dm3(x), model, x, args.reps)

    print(f"\ndeploy {deploy_s:.1f} s (trace, decompose, place, write store, load); max rel err {err:.1e}")
    print(f"{'figure':<44} {'distributed':>12} {'torch':>10} {'ratio':>7} {'target':>8}")
    print("latencies run back to back with torch, --reps rounds: medians, and the median ratio of the rounds")
    print(f"{'latency, 1 request (ms)':<44} {dist_1 * 1e3:>12.1f} {main['1t'] * 1e3:>10.1f} "
          f"{main['vs_1t']:>7.3f} {'<= 0.9':>8}")
    print(f"{'latency vs torch with all the cores (ms)':<44} {dist_1 * 1e3:>12.1f} {main['2t'] * 1e3:>10.1f} "
          f"{main['vs_2t']:>7.3f} {'<= 1.3':>8}")
    print(f"{'predicted latency (ms), learned costs':<44} {predicted * 1e3:>12.1f}")
    print(f"{'a Dask-blind parallel plan, latency (ms)':<44} {blind_s * 1e3:>12.1f} {local_2t * 1e3:>10.1f} "
          f"{blind_s / local_2t:>7.3f}   ({len(blind.block_device)} tasks, predicted "
          f"{blind.makespan_s * 1e3:.0f} ms with Dask's costs)")
    print(f"{'stages alone, no layer split (ms)':<44} {staged['s'] * 1e3:>12.1f} {staged['1t'] * 1e3:>10.1f} "
          f"{staged['vs_1t']:>7.3f}   ({len(stages_plan.block_device)} tasks; against torch, the plan above "
          f"is {main['vs_1t'] / staged['vs_1t']:.3f}x its latency)")
    print("candidates place weighed (predicted ms): " + ", ".join(
        f"{k} {v * 1e3:.0f}" for k, v in plan.info.get("candidates", {}).items()))
    print(f"{'throughput, 8 concurrent (req/s)':<44} {rps['dist']:>12.2f} {rps['2t']:>10.2f} "
          f"{rps['ratio']:>7.3f} {'>= 0.9':>8}")
    print(f"{'  torch 2 threads before the cluster started':<44} {'':>12} {local_2t_rps:>10.2f} "
          f"{rps['dist'] / local_2t_rps:>7.3f}")
    print(f"{'bytes moved between workers per request':<44} {moved / 2**20:>10.2f} MiB "
          f"(plan cut {cut / 2**20:.2f} MiB, ratio {moved / max(cut, 1):.2f}, {blocks} blocks)")
    # NOTE: in a LocalCluster the scheduler shares its event loop thread with this client's comms
    print(f"{'scheduler + client loop CPU per request (ms)':<44} {sched_s * 1e3:>12.2f}")
    print(f"plan repairs while serving: {len(repairs)}" + "".join(f"\n  {r}" for r in repairs))


if __name__ == "__main__":
    main()
