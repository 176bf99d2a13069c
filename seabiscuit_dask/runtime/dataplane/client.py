"""What the caller does on the data plane: send each worker the inputs of its blocks and
collect the graph outputs, all in one round of concurrent RPCs (one per worker involved).

Blocks with no input from the caller start when their producers' outputs arrive;
the caller sees none of that traffic. A worker that cannot be reached fails the
request as ``RunFailed`` (a ``WorkerLost``): the caller takes the new plan and sends
it again under a new id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from distributed.comm import connect
from distributed.comm.core import CommClosedError
from distributed.core import clean_exception
from distributed.protocol import to_serialize

from ...errors import RunFailed
from ...lower.blocks import BlockSpec
from .loops import Edit
from .wire import Tensors, from_inline

Route = dict[str, tuple[list[tuple[int, tuple[str, ...]]], list[int]]]   # address -> (feeds, collects)


def route(specs: Sequence[BlockSpec], wanted: Sequence[int]) -> Route:
    """Per worker: the blocks it gets the caller's inputs for (a block that reads nothing gets
    ``{}`` to start it; one with no ops gets nothing) and the blocks whose outputs the caller
    collects there."""
    out: Route = {}
    for s in specs:
        if not s.ops:
            continue            # NOTE: a block left with nothing to do (``block_specs``) never runs
        mine = tuple(t for t, src in zip(s.imports, s.sources) if src < 0)
        if mine or not s.imports:
            out.setdefault(s.address, ([], []))[0].append((s.index, mine))
    by_index = {s.index: s for s in specs}
    for b in wanted:
        out.setdefault(by_index[b].address, ([], []))[1].append(b)
    return out


Outputs = dict[int, Mapping[str, torch.Tensor]]      # block -> the graph outputs it made


def start(client: Any, model: str, ticket: str, version: int, request: int, plan: Route,
          inputs: Mapping[str, torch.Tensor], after: int = -1) -> concurrent.futures.Future[Outputs]:
    """Send a request on the data plane from any thread; the future gives block -> outputs.
    ``after``: a request whose cache writes this one reads (its prompt's chunk before), sent
    just before it: each worker holds this one's blocks until that one cached what they read."""
    calls = _calls(plan, inputs)
    # NOTE: the worker that collects the last output reports the request's latency (dashboard)
    last = max((b for _, collects in plan.values() for b in collects), default=-1)
    timed = next((a for a, (_, collects) in plan.items() if last in collects), "")
    coro = _run(client.rpc, model, ticket, version, request, calls, timed, after=after)
    return asyncio.run_coroutine_threadsafe(coro, client.loop.asyncio_loop)


def _calls(plan: Route, inputs: Mapping[str, torch.Tensor]) -> dict[str, tuple[list[Any], list[int]]]:
    return {addr: ([[b, to_serialize(Tensors({t: inputs[t] for t in names if t in inputs}))]
                    for b, names in feeds], collects) for addr, (feeds, collects) in plan.items()}


def start_loop(client: Any, model: str, ticket: str, version: int, requests: Sequence[int], plan: Route,
               inputs: Mapping[str, torch.Tensor], logits: str,
               left: Sequence[int] | None = None, picks: Sequence[dict[str, Any] | None] | None = None
               ) -> list[concurrent.futures.Future[Outputs]]:
    """A decode loop of ``len(requests)`` greedy steps: the first fed from here, each next one by
    the worker that makes ``logits`` (its greedy tokens, positions one on). Returns a future per
    step; the steps' outputs are collected one after another, off the steps' path: the first
    step's logits, then each later step's greedy tokens in their place ((batch,) int64, all the
    loop's caller reads of them). A step whose future is cancelled stops the loop there.

    ``left`` (each row's steps, the first included; -1: no bound) makes the loop a lane named
    by its first request (``loops.Lane``): its rows change as it runs (``edit_lane``), and each
    later step's tokens come with the sessions it ran (``loops.ROWS``); ``picks``, each row's pick
    as a message (``RowPick.message``; None: greedy), with the log-probabilities its rows ask for."""
    (out_addr,) = [a for a, (_, c) in plan.items() if c]
    (wanted,) = [c for _, c in plan.values() if c]
    loop = {"requests": list(requests[1:]), "logits": logits,
            "route": [[a, [[b, list(names)] for b, names in feeds]] for a, (feeds, _) in plan.items()
                      if feeds],
            "inputs": to_serialize(Tensors(inputs))}
    if left is not None:
        loop.update(lane=int(requests[0]), left=[int(n) for n in left])
        if picks is not None and any(p is not None for p in picks):
            loop["picks"] = list(picks)
    futures: list[concurrent.futures.Future[Outputs]] = [concurrent.futures.Future() for _ in requests]

    async def run() -> None:
        try:
            first = await _run(client.rpc, model, ticket, version, requests[0], _calls(plan, inputs),
                               loops={out_addr: loop})
            _settle(futures[0], first)
            if len(requests) > 1:
                await _follow(client, out_addr, {"model": model, "ticket": ticket, "version": version,
                                                 "requests": list(requests[1:]), "blocks": wanted,
                                                 "tokens": logits}, futures[1:])
        except BaseException as e:  # noqa: BLE001 - every step not yet answered fails with it
            for f in futures:
                if not f.done():
                    f.set_exception(e)

    asyncio.run_coroutine_threadsafe(run(), client.loop.asyncio_loop)
    return futures


async def _follow(client: Any, address: str, msg: dict[str, Any],
                  futures: Sequence[concurrent.futures.Future[Outputs]]) -> None:
    """Read the steps ``msg["requests"]`` of a decode loop from the worker at ``address`` as it makes
    them, down one comm (``seabiscuit_dp_follow``): one message a step, no call per step (a
    pooled connection each, and the worker woken to read its request while the next worker's
    block ran). Stops at a cancelled step (the caller let go of it and the rest) or the first
    failure, which it raises."""
    where = f"model {msg['model']}: worker {address}"
    r = msg["requests"][0]
    try:
        comm = await connect(address, **client.connection_args)
    except (CommClosedError, OSError) as e:
        raise RunFailed(f"request {r} of {where} could not be reached: {type(e).__name__}: {e}") from e
    try:
        comm.name = "seabiscuit decode loop"
        await comm.write({"op": "seabiscuit_dp_follow", "reply": False, **msg})
        for r, f in zip(msg["requests"], futures):
            if f.cancelled():
                return
            step = await comm.read()
            if isinstance(step, dict) and step.get("status") in ("error", "uncaught-error"):
                _, error, tb = clean_exception(**step)
                raise (error or RunFailed(f"{where}: request {r} failed")).with_traceback(tb)
            if not isinstance(step, dict) or step.get("status") != "OK" or step.get("request") != r:
                raise RunFailed(f"{where} answered {str(step)[:200]} for request {r}")
            _settle(f, {int(b): from_inline(ts) for b, ts in step["outputs"]})
    except (CommClosedError, OSError) as e:
        raise RunFailed(f"request {r} of {where} could not be reached: {type(e).__name__}: {e}") from e
    finally:
        comm.abort()


def _settle(f: concurrent.futures.Future[Outputs], value: Outputs) -> None:
    if not f.done():
        f.set_result(value)


async def _run(rpc: Any, model: str, ticket: str, version: int, request: int,
               calls: Mapping[str, tuple[list[Any], list[int]]], timed: str = "",
               loops: Mapping[str, Any] | None = None, after: int = -1) -> Outputs:
    async def one(addr: str, feeds: list[Any], collects: list[int]) -> list[Any]:
        try:
            return list(await rpc(addr).seabiscuit_dp_feed(model=model, ticket=ticket, version=version,
                                                            request=request, inputs=feeds, collect=collects,
                                                            timed=addr == timed,
                                                            loop=(loops or {}).get(addr), after=after))
        except (CommClosedError, OSError) as e:
            raise RunFailed(f"request {request} of model {model}: worker {addr} could not be reached: "
                            f"{type(e).__name__}: {e}") from e

    replies = await asyncio.gather(*(one(a, f, c) for a, (f, c) in calls.items()))
    return {int(b): ts for reply in replies for b, ts in reply}


def edit_lane(client: Any, model: str, ticket: str, address: str, lane: int,
              edits: Sequence[Edit],
              after: concurrent.futures.Future[Any] | None = None) -> concurrent.futures.Future[int]:
    """Send edits of a lane's rows (``loops.Lane.edit``) to the worker that runs it (from any
    thread, not waiting), once ``after`` (the lane's edits before, which must apply first: a row
    emptied, then taken again) has its answer: its future is the count of edit messages the lane
    took with these, 0 where it runs no more steps or the worker is gone."""
    async def one() -> int:
        if after is not None:
            await asyncio.wait([asyncio.wrap_future(after)])
        try:
            return int(await client.rpc(address).seabiscuit_dp_lane(
                model=model, ticket=ticket, lane=int(lane), edits=[list(e) for e in edits]))
        except (CommClosedError, OSError):
            return 0

    return asyncio.run_coroutine_threadsafe(one(), client.loop.asyncio_loop)


def forget(client: Any, model: str, ticket: str, requests: Sequence[int], addresses: Sequence[str]) -> None:
    """Tell the workers to drop what they hold of these requests (from any thread, not waiting)."""
    async def one(addr: str) -> None:
        try:
            await client.rpc(addr).seabiscuit_dp_forget(model=model, ticket=ticket, requests=list(requests))
        except Exception:  # noqa: BLE001 - a worker gone holds nothing
            pass

    async def all_of() -> None:
        await asyncio.gather(*(one(a) for a in addresses))

    if client.status == "running":
        asyncio.run_coroutine_threadsafe(all_of(), client.loop.asyncio_loop)


def progress(client: Any, model: str, ticket: str, request: int, addresses: Sequence[str],
             timeout_s: float) -> list[list[int]]:
    """What each of ``addresses`` holds of a run (``DataPlane.status``), from any thread but the
    client's loop. A worker gone or refusing holds nothing; one that does not answer within
    ``timeout_s`` counts as running a block of it (a hung worker is for the probes to fence)."""
    async def one(addr: str) -> list[int]:
        try:
            return [int(v) for v in await asyncio.wait_for(client.rpc(addr).seabiscuit_dp_status(
                model=model, ticket=ticket, request=request), timeout_s)]
        except asyncio.TimeoutError:
            return [1, 0, 0, 0]
        except Exception:  # noqa: BLE001 - a worker gone or refusing holds nothing of it
            return [0, 0, 0, 0]

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(a) for a in addresses)))

    return asyncio.run_coroutine_threadsafe(all_of(), client.loop.asyncio_loop).result()
