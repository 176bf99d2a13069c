"""Sending a deployed model's requests and generation steps, and waiting for what they compute.

Every request (a forward pass) and every generation step goes through ``RequestSender.submit``:
on the data plane (``runtime.dataplane``) each worker gets the inputs of its blocks and the
outputs travel worker to worker; with ``seabiscuit.runtime.data-plane: tasks``, one Dask task
per block. A request is numbered so that no other client can name it before it is sent,
waited for within its program's usual time (``watch.Deadline``), probed past it, and let go
of on every worker once read, failed or discarded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from distributed import wait
from distributed.scheduler import KilledWorker, NoValidWorkerError

from ...errors import (
    STALE_TRIES,
    BadInput,
    BlockFailed,
    ModelClosed,
    RunFailed,
    SeaBiscuitError,
    StaleRun,
    WorkerHung,
    WorkerLost,
    restless,
)
from ...lower.blocks import request_graph
from ..dataplane import client as p2p
from ..dataplane.loops import EDITS, LOGPROB_IDS, LOGPROBS, PICKED, ROWS, Edit, picked_here
from ..local import assemble_outputs, unflatten_outputs
from ..watch import Deadline, seconds
from ..worker.integrity import request_folder
from ..worker.tasks import PICK, run_block_task
from .plans import PlanFollower
from .programs import StepLayout, StepProgram

logger = logging.getLogger(__name__)

# NOTE: passes over a finished request's checkpoint folder: each deletes what a late block wrote
# during the one before (workers never make the folder again), so two suffice but for a stall
FORGET_TRIES = 5


class Handle:
    """A submitted request or step: the blocks it was submitted as (its plan version's, which a
    later plan does not change), and its futures (tasks) or its pending reply (data plane),
    and what a step that follows it reads of it."""

    def __init__(self, program: StepProgram | None, layout: StepLayout, request: int, wanted: list[int],
                 futures: list[Any], pending: concurrent.futures.Future[Any] | None = None) -> None:
        self.program, self.layout, self.request, self.wanted, self.futures, self.pending = (
            program, layout, request, wanted, futures, pending)
        self.next: Handle | None = None         # the next step of its decode loop (data plane)
        self.lane: tuple[int, str] | None = None    # its loop is a lane: (its id, the worker that runs it)
        self.tokens = False                     # its outputs come back as greedy tokens (a loop step)
        graph = program.graph if program is not None else None
        chainable = graph is not None and len(graph.leaf_outputs) == 1 and len(wanted) == 1 \
            and "input_ids" not in graph.tilings and bool(futures)
        self.logits = graph.leaf_outputs[0] if chainable and graph is not None else ""
        self.out = futures[0] if chainable else None

    @property
    def version(self) -> int:
        return self.layout.version


def _request_error(request: int, model_id: str, stranded: str | None, e: BaseException) -> SeaBiscuitError:
    """What a failed request raises: ``WorkerLost`` when workers went away, else ``BlockFailed``."""
    where = f"request {request} of model {model_id}"
    if stranded:
        return WorkerLost(f"{where} cannot finish: {stranded}")
    if isinstance(e, (KilledWorker, NoValidWorkerError, asyncio.CancelledError)):
        return WorkerLost(f"{where} cannot finish: {type(e).__name__}: {e}")
    return BlockFailed(f"{where} failed in a block: {type(e).__name__}: {e}")


class RequestSender:
    """Sends the requests and steps of one deployed model, under the plan ``plans`` holds, and
    keeps those in flight (``inflight``) until they are read, failed or let go of."""

    def __init__(self, client: Any, plans: PlanFollower, model_id: str, token: str, ticket: str,
                 p2p: bool, checkpoint_dir: str = "") -> None:
        self.client = client
        self.plans = plans
        self.model_id = model_id
        self._token = token
        self._ticket = ticket                        # NOTE: what data-plane messages of this model show
        self.p2p = p2p
        self.checkpoint_dir = checkpoint_dir
        self.inflight: dict[int, Handle] = {}
        self.requests = itertools.count()
        self._tokenizers_at: set[tuple[str, str]] = set()     # NOTE: (worker, tokenizer key) sent whole
        self.next_request: Callable[[], int] = self._numbered
        self.client_s: deque[tuple[float, float]] = deque(maxlen=64)   # (submit, after gather) per request
        self._deadline = Deadline()                  # usual times per program: the hang bound

    def _numbered(self) -> int:
        """A new request number: in order (the scheduler runs requests in it), with 32 random
        low bits, so no other client can name a request of this model before it is sent."""
        return (next(self.requests) << 32) | secrets.randbits(32)

    # --- a whole request ----------------------------------------------------------------------
    def call(self, prog: StepProgram | None, graph: Any, feed: dict[str, Any]) -> Any:
        """Run one request of ``prog`` (None: the model's own program) on the inputs ``feed``, again
        on the newer plan where the plan changed under it or a worker hung or failed it."""
        failed = stale = 0
        while True:
            try:
                return self._request(prog, graph, feed)
            except StaleRun as e:         # NOTE: the plan changed under it: cheap to send again
                stale += 1
                if stale > STALE_TRIES:
                    raise restless(f"a request of model {self.model_id}", stale, e) from e
                self.plans.recover(e)
            except (WorkerHung, RunFailed) as e:
                failed += 1
                if failed == 3:
                    raise
                self.plans.recover(e)

    def _request(self, prog: StepProgram | None, graph: Any, feed: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        layout = prog.layout if prog is not None else self.plans.layout
        handle = self.submit(prog, layout, feed, checkpointed=True)
        t1 = time.perf_counter()
        try:
            outputs = self.outputs(handle)
            t2 = time.perf_counter()
        finally:
            self._forget_checkpoints(handle.request)
        values = {t: outputs[t] if t in outputs else feed[t] for t in graph.leaf_outputs}
        out = unflatten_outputs(graph, assemble_outputs(graph, values))
        # NOTE: what this client spends on a request besides waiting: part of Dask's cost
        self.client_s.append((t1 - t0, time.perf_counter() - t2))
        return out

    def _checkpoints(self, request: int) -> Path:
        """The folder the blocks of ``request`` checkpoint their outputs in (``checkpoint_dir``)."""
        return request_folder(self.checkpoint_dir, self.model_id, request)

    def _forget_checkpoints(self, request: int) -> None:
        """Delete ``request``'s checkpoints. Workers write only into the folder this client made,
        never make it, so once it is gone it stays gone: a block of an attempt given up on that
        wrote while it was being deleted is deleted by the next pass."""
        if not self.checkpoint_dir:
            return
        folder = self._checkpoints(request)
        for _ in range(FORGET_TRIES):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                return
        logger.warning("checkpoints of request %d of model %s not deleted: %s still holds %s", request,
                       self.model_id, folder, sorted(p.name for p in folder.iterdir())[:5])

    # --- submitting ---------------------------------------------------------------------------
    def submit(self, prog: StepProgram | None, layout: StepLayout, inputs: dict[str, Any],
               after: Handle | None = None, follows: Handle | None = None,
               checkpointed: bool = False) -> Handle:
        """Send one request of ``prog`` (None: the model's own program) under ``layout``; every
        request and generation step goes this way. ``after``: a step (as tasks) whose greedy
        tokens are this one's ``input_ids``; ``follows``: a request (on the data plane) whose
        cache writes this one reads; ``checkpointed``: its blocks checkpoint their outputs (where
        the deployment has a ``checkpoint_dir``) in a folder made here, which the caller deletes
        (``_forget_checkpoints``)."""
        self.plans.check_open()
        request = self.next_request()
        if checkpointed and self.checkpoint_dir:
            self._checkpoints(request).mkdir(parents=True, exist_ok=True)
        wanted = sorted(set(layout.out_at.values()))
        if self.p2p:
            if after is not None:
                raise BadInput(f"model {self.model_id}: a step was submitted after request {after.request}, "
                               "but the p2p data plane chains no steps that way: submit_step(steps=n) "
                               "starts a decode loop (see chains_steps)")
            pending = p2p.start(self.client, self.model_id, self._ticket, layout.version, request,
                                layout.route(wanted), inputs,
                                after=-1 if follows is None else follows.request)
            handle = Handle(prog, layout, request, wanted, [], pending)
        else:
            futures = self._as_tasks(layout, request, inputs, wanted, after)
            handle = Handle(prog, layout, request, wanted, futures)
        self.inflight[request] = handle
        return handle

    def _as_tasks(self, layout: StepLayout, request: int, inputs: dict[str, Any], wanted: list[int],
                  after: Handle | None) -> list[Any]:
        """The futures of one request sent as Dask tasks, a block each; ``after``: the step whose
        logits its blocks that read ``input_ids`` pick them from, on their worker."""
        dsk, keys = request_graph(layout.specs, request, inputs, run_block_task)
        if after is not None:
            for key in keys:
                mine = dsk[key][5]
                if "input_ids" in mine:
                    mine = {k: v for k, v in mine.items() if k != "input_ids"}
                    mine[PICK] = {"logits": after.logits, "rows": int(inputs["input_ids"].shape[0])}
                    dsk[key] = (*dsk[key][:5], mine, *dsk[key][6:], after.out)
        at = {s.index: i for i, s in enumerate(layout.specs)}
        return list(self.client.get(dsk, [keys[at[b]] for b in wanted], sync=False))

    def submit_loop(self, prog: StepProgram, layout: StepLayout, inputs: dict[str, Any],
                    steps: int, left: list[int] | None = None, picks: list[Any] | None = None) -> Handle:
        """Start a decode loop of ``steps`` greedy steps on the workers (data plane); the first
        step's handle, each one's ``next`` the step after it. ``left``: each row's steps (-1: no
        bound): the loop is a lane (``p2p.start_loop``), each handle's ``lane`` (its id, the
        worker that runs it) what ``edit_lane`` names; ``picks``, each row's ``RowPick`` (None:
        greedy), which the lane's worker follows."""
        self.plans.check_open()
        requests = [self.next_request() for _ in range(steps)]
        wanted = sorted(set(layout.out_at.values()))
        route = layout.route(wanted)
        (runs,) = [a for a, (_, c) in route.items() if c]
        # NOTE: a start takes its grammars' tokenizers whole (a loop starts anew where its worker may
        # be a new one); its edits then name them only
        messages: list[Any] = []
        whole: set[str] = set()
        for p in picks or ():       # NOTE: a tokenizer's JSON goes once a message, with its first row
            first = p is not None and bool(p.grammar) and p.tokenizer not in whole
            messages.append(None if p is None else p.message(tokenizer=first))
            if p is not None and p.grammar:
                whole.add(p.tokenizer)
        self._tokenizers_at.update((runs, p.tokenizer) for p in picks or () if p is not None and p.grammar)
        futures = p2p.start_loop(self.client, self.model_id, self._ticket, layout.version, requests,
                                 route, inputs, prog.graph.leaf_outputs[0], left,
                                 None if picks is None else messages)
        handles = [Handle(prog, layout, r, wanted, [], f) for r, f in zip(requests, futures)]
        lane = None
        if left is not None:
            lane = (requests[0], runs)
        for h, nxt in zip(handles, [*handles[1:], None]):
            h.next = nxt
            h.lane = lane
            if nxt is not None:
                nxt.tokens = True       # NOTE: collected as greedy tokens (``p2p.start_loop``)
            self.inflight[h.request] = h
        return handles[0]

    def edit_lane(self, handle: Handle, edits: list[Edit], after: Any = None) -> Any:
        """Send edits of the rows of the lane ``handle`` is a step of (``p2p.edit_lane``), after the
        edits of ``after`` (a future of this); a future of whether it took them."""
        assert handle.lane is not None
        lane, address = handle.lane
        sent: list[Edit] = []
        for e in edits:
            pick = e[5] if len(e) > 5 else None
            if pick is not None and not isinstance(pick, dict):
                # NOTE: a grammar's tokenizer goes whole to a worker the first time only
                whole = bool(pick.grammar) and (address, pick.tokenizer) not in self._tokenizers_at
                if whole:
                    self._tokenizers_at.add((address, pick.tokenizer))
                e = (*e[:5], pick.message(tokenizer=whole))
            sent.append(e)
        return p2p.edit_lane(self.client, self.model_id, self._ticket, address, lane, sent, after)

    # --- reading ------------------------------------------------------------------------------
    def step_result(self, handle: Handle, picked: list[Any] | None = None) -> Any:
        """The logits (batch, vocab) of a submitted step's last position; ``picked`` gets the tokens
        (and log-probabilities) its lane's worker picked from them, where it did."""
        assert handle.program is not None
        if handle.tokens:
            raise BadInput(f"request {handle.request} of model {self.model_id} is a decode-loop step: its "
                           "caller gets its greedy tokens (step_tokens), not its logits")
        logits = assemble_outputs(handle.program.graph, self.outputs(handle, picked=picked))[0]
        return logits[:, -1]

    def step_tokens(self, handle: Handle) -> Any:
        """The greedy tokens (batch,) of a submitted step (see ``DistributedModel.step_tokens``)."""
        return self.step_rows(handle)[0]

    def step_rows(self, handle: Handle, picks: Sequence[Any] = ()) -> tuple[Any, Any, int, dict[str, Any]]:
        """The tokens (batch,) of a submitted step, and for a later step of a lane the sessions it
        ran (batch,) and the edit messages it was built with (else None and 0), and the
        log-probabilities its rows asked for (``loops.pick_rows``). A step whose logits come here
        (a lane's first) is picked here: greedily, but for the rows of ``picks`` (row ->
        ``RowPick``) as they say, as the lane's worker picks them."""
        if not handle.tokens:
            made: list[Any] = []
            logits = self.step_result(handle, made)
            if made:        # NOTE: as the lane's worker picked them (and fed the next step)
                return made[0][0], None, 0, made[0][1]
            tokens, extra = picked_here(logits, picks)
            return torch.from_numpy(tokens), None, 0, extra
        rows: list[Any] = []
        (tokens,) = self.outputs(handle, rows).values()
        if not rows:
            if handle.lane is not None:
                raise RunFailed(f"request {handle.request} of model {self.model_id}: a lane's step came back "
                                "without the sessions it ran; the lane starts anew")
            return tokens, None, 0, {}
        return tokens, rows[0][0], int(rows[0][1][0]), rows[0][2]

    def outputs(self, handle: Handle, rows: list[Any] | None = None,
                picked: list[Any] | None = None) -> dict[str, Any]:
        """The graph output tiles a request computed; it is then let go; a failure as a SeaBiscuitError."""
        done = False
        try:
            self._await(handle)
            if handle.pending is not None:
                results = handle.pending.result()
            else:
                results = dict(zip(handle.wanted, self.client.gather(handle.futures)))
            done = True
        except SeaBiscuitError as e:
            if isinstance(e, WorkerLost):
                e.version = handle.version       # type: ignore[attr-defined]   # NOTE: see recover
            if self.plans.closed and not isinstance(e, ModelClosed):
                raise self._error(handle.request, e) from e
            raise
        except Exception as e:
            raise self._error(handle.request, e) from e
        finally:
            self.release(handle, done)
        out_at = handle.layout.out_at
        def logprobs(ts: Any) -> dict[str, Any]:
            return {k: ts[k] for k in (LOGPROBS, LOGPROB_IDS) if k in ts}

        if rows is not None:
            rows.extend((ts[ROWS], ts[EDITS], logprobs(ts))
                        for ts in results.values() if ROWS in ts and EDITS in ts)
        if picked is not None:
            picked.extend((ts[PICKED], logprobs(ts)) for ts in results.values() if PICKED in ts)
        return {t: results[b][t] for t, b in out_at.items()}

    def _error(self, request: int, e: BaseException) -> SeaBiscuitError:
        if self.plans.closed:
            return ModelClosed(f"request {request} of model {self.model_id} did not finish: the model was "
                               f"closed ({type(e).__name__})")
        return _request_error(request, self.model_id, self.plans.stranded, e)

    # --- waiting ------------------------------------------------------------------------------
    def _await(self, handle: Handle) -> None:
        """Wait for a request; past its program's bound (``watch.Deadline``) have the scheduler
        probe the request's workers: one that does not answer is fenced, and this raises
        ``WorkerHung`` once the plan that goes around it is here."""
        program = handle.program.number if handle.program is not None else 0
        t0 = time.perf_counter()
        bound = self._deadline.bound_s(program)
        while True:
            try:
                if handle.pending is not None:
                    concurrent.futures.wait([handle.pending], timeout=bound)
                    if not handle.pending.done():
                        raise TimeoutError
                else:
                    wait(handle.futures, timeout=bound)
                break
            except TimeoutError:
                self._probe(handle, t0, bound)
                bound *= 2       # NOTE: every worker answered: slow, not hung; look again later
        self._deadline.observe(program, time.perf_counter() - t0)

    def _probe(self, handle: Handle, t0: float, bound: float) -> None:
        """A request past its bound: raise ``WorkerLost`` where the model is stranded, ``WorkerHung``
        where the scheduler fenced a worker of it that did not answer, ``RunFailed`` where it was
        lost on the data plane; return where it is only slow (``t0``: when the wait began)."""
        self.plans.check_open()
        request = handle.request
        reply = self.client.sync(self.client.scheduler.seabiscuit_stalled, model=self.model_id,
                                 token=self._token, request=request)
        if reply.get("stranded"):
            self.plans.strand(str(reply["stranded"]))
            raise WorkerLost(f"request {request} of model {self.model_id} cannot finish: "
                             f"{reply['stranded']}") from None
        if reply.get("fenced"):
            self.plans.catch_up(reply.get("version"))
            raise WorkerHung(
                f"request {request} of model {self.model_id} made no progress for "
                f"{time.perf_counter() - t0:.1f} s (bound {bound:.1f} s): worker(s) "
                f"{', '.join(reply['fenced'])} did not answer a probe, were fenced and the work "
                "runs again on the others") from None
        if handle.pending is not None and self._lost(handle):
            lost = RunFailed(
                f"request {request} of model {self.model_id} made no progress for "
                f"{time.perf_counter() - t0:.1f} s (bound {bound:.1f} s) and no worker of "
                f"{handle.layout.addresses} holds any of it that moves: it was lost, and runs "
                "again")
            logger.warning("seabiscuit: %s", lost)     # NOTE: the retry hides it from the caller
            raise lost from None

    def _lost(self, handle: Handle) -> bool:
        """Whether a data-plane request past its bound is lost: no worker runs a block of it, and
        what they hold of it stays the same over a probe timeout while its reply does not come."""
        assert handle.pending is not None

        def look() -> list[list[int]]:
            return p2p.progress(self.client, self.model_id, self._ticket, handle.request,
                                handle.layout.addresses, seconds("runtime.probe-timeout"))

        first = look()
        if any(p[0] for p in first):
            return False
        concurrent.futures.wait([handle.pending], timeout=seconds("runtime.probe-timeout"))
        return not handle.pending.done() and look() == first and not handle.pending.done()

    # --- letting go ---------------------------------------------------------------------------
    def discard(self, handle: Handle) -> None:
        """Let go of a submitted step, and of the steps of a decode loop after it."""
        chain: list[Handle] = []
        h: Handle | None = handle
        while h is not None:
            chain.append(h)
            h = h.next
        for h in chain:
            self.release(h, done=h.pending is not None)      # NOTE: the data plane's, forgotten at once
            if h.pending is not None:
                h.pending.cancel()
        if handle.pending is not None:
            p2p.forget(self.client, self.model_id, self._ticket, [h.request for h in chain],
                       handle.layout.addresses)

    def release(self, handle: Handle, done: bool) -> None:
        """Let go of a request: its futures, and (unless it finished) what workers hold of it."""
        self.inflight.pop(handle.request, None)
        for f in handle.futures:
            f.release()
        if handle.pending is not None and not done:
            handle.pending.cancel()
            p2p.forget(self.client, self.model_id, self._ticket, [handle.request],
                       handle.layout.addresses)

    def cancel(self, handles: list[Handle]) -> None:
        """End requests in flight (the model closes or is stranded): their waits end at once."""
        futures = [f for h in handles for f in h.futures]
        if futures and self.client.status == "running":
            self.client.cancel(futures)
        for h in handles:
            if h.pending is not None:
                h.pending.cancel()
