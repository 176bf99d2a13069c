"""A decode step's last block and the next step's first ones, on one compute thread.

Where the worker that makes a decode loop's logits also holds the next step's first
blocks (a model whose head sits with its embedding, as a tied one does), the step
would otherwise come back to the worker's event loop between the two: the compute
thread hands the logits to the loop, the loop picks the greedy tokens and hands the
next block back to a compute thread, two thread wake-ups on the step's critical
path, while the loop thread may still be busy with the caller's copy of the last
step. A ``Chain`` runs the logits block, picks the next step's inputs
(``Loop.following``) and runs those next blocks right after it on the same thread,
when no other work waits for the compute threads (``idle``: a pipeline's other runs
go first, in age order, as ``ordered`` has them). The loop hears of the logits block
once the chained blocks ran (the chain's outcome; the caller's tokens come one block later) and
takes each chained block's result as the block of the next run (``runs.Run._adopt``),
so records, sends and failures go on as for any block, the next step's sends first.
The loop thread owns all run state; the thread here only computes.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import torch

from .host import ComputeArgs, Outcome
from .loops import Loop


class Chain:
    """The logits block ``args`` (``compute``'s arguments), then ``feeds`` (next-step blocks
    here, each reading only step inputs) of the loop's next request (see module doc)."""

    def __init__(self, compute: Callable[..., Outcome], args: ComputeArgs, loop: Loop,
                 feeds: Sequence[tuple[int, tuple[str, ...]]], idle: Callable[[], bool]) -> None:
        self.compute, self.args, self.loop, self.feeds, self.idle = compute, args, loop, list(feeds), idle
        self.next: dict[int, concurrent.futures.Future[Outcome]] = {}
        for b, _ in self.feeds:
            f = self.next[b] = concurrent.futures.Future()
            # NOTE: a chained block whose step was dropped meanwhile has nobody to read its failure
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.step: tuple[dict[str, torch.Tensor], Loop] | None = None    # the next step's inputs, loop
        self.ran = False            # the next step's blocks run here (decided before the chain returns)
        self.stopped = False        # set by the event loop: the next step is not to run

    @property
    def request(self) -> int:
        return self.loop.requests[0]

    def __call__(self) -> Outcome:
        """On a compute thread: the logits block's outcome (its failure raised; each chained block's
        outcome goes to its future). The next step's blocks run before the loop hears of the
        logits: the loop's work for them (the caller's tokens, records) then waits for this
        worker's idle time instead of holding the GIL while the next block runs; the next step's
        outputs are what the pipeline waits for. Returned, not set on a future here: the executor
        sets it once this thread is idle again (``OrderedExecutor.idle``)."""
        try:
            out, record = self.compute(*self.args)
        except BaseException:
            for f in self.next.values():
                f.cancel()
            raise
        logits = out.get(self.loop.logits)
        if logits is not None and self.loop.requests and not self.stopped:
            self.step = self.loop.following(logits)
            self.ran = not self.stopped and self.idle()
        if self.ran and self.step is not None:
            inputs = self.step[0]
            model, version = self.args[0], self.args[1]
            for b, names in self.feeds:
                try:
                    self.next[b].set_result(self.compute(model, version, self.request, b,
                                                         {t: inputs[t] for t in names}))
                except BaseException as e:  # noqa: BLE001 - handed to the run that adopts the block
                    self.next[b].set_exception(e)
        else:
            for f in self.next.values():
                f.cancel()
        return out, record
