"""A decode loop at the worker that makes its logits: the steps that follow, each fed from the
greedy tokens of the one before, with no caller in between (``Loop``); the greedy pick itself
(``greedy``), and the step inputs a loop feeds (``STEP_INPUTS``).

This is the generation engine's, not the data plane's: the data plane only carries a loop's
steps (``runs.Run.advance``) and reads a loop from its message (``decode_loop``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedModel, WorkerLost

STEP_INPUTS = ("input_ids", "position_ids", "sb_sessions", "sb_start", "sb_valid")
FLOATS = (torch.float32, torch.float64)


@dataclass(eq=False)
class Loop:
    """A decode loop at the worker that makes a step's logits: the steps still to run after it,
    each fed from the greedy tokens of the one before (no caller in between)."""

    requests: list[int]                                   # the next steps' request ids, in order
    route: list[tuple[str, list[tuple[int, tuple[str, ...]]]]]   # worker -> its blocks and their inputs
    logits: str                                           # the output tile the tokens come from
    inputs: dict[str, torch.Tensor]                       # this step's inputs (positions, sessions, ...)
    ahead: tuple[np.ndarray, bool, dict[str, torch.Tensor]] | None = None   # ``prepare``'s

    def prepare(self) -> None:
        """Work out what the next step reads but its tokens: which rows are live (pad rows stay as
        they are) and their positions one on. ``following`` does it where it was not done before;
        the worker does it once the step that reads these inputs is on its way (idle time: the
        critical path of the next step then only picks tokens)."""
        if self.ahead is not None:
            return
        x = self.inputs
        # NOTE: in numpy: these few ops come right after a block that streamed its weights through
        # the caches, where each of torch's costs 10x its warm time (0.2 ms in all, numpy 0.15)
        step = (x["sb_sessions"].numpy() >= 0).astype(np.int64)    # NOTE: 1 for a live row, 0 for a pad
        self.ahead = (step, bool(step.all()), {
            "position_ids": torch.from_numpy(x["position_ids"].numpy() + step.reshape(-1, 1)),
            "sb_sessions": x["sb_sessions"], "sb_start": torch.from_numpy(x["sb_start"].numpy() + step),
            "sb_valid": x["sb_valid"]})

    def following(self, logits: torch.Tensor) -> tuple[dict[str, torch.Tensor], Loop]:
        """The next step's inputs (greedy tokens, positions one on; pad rows stay as they are) and
        the loop after it."""
        self.prepare()
        assert self.ahead is not None
        step, live, rest = self.ahead
        tokens = greedy_numpy(logits)
        nxt = {"input_ids": torch.from_numpy((tokens if live else tokens * step).reshape(-1, 1)), **rest}
        return nxt, Loop(self.requests[1:], self.route, self.logits, nxt)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(B, L, V) logits -> (B,) int64 tokens, the last position's argmax: what a decode loop feeds
    on, and what its caller collects in place of the logits."""
    if logits.is_cpu and logits.dtype in FLOATS:
        return torch.from_numpy(greedy_numpy(logits))
    if logits.dim() != 3 or not logits.is_floating_point():
        raise UnsupportedModel(f"greedy tokens need (batch, length, vocab) float logits, got "
                               f"{tuple(logits.shape)} {logits.dtype}")
    return logits[:, -1].detach().argmax(dim=-1).to(torch.long)


def greedy_numpy(logits: torch.Tensor) -> np.ndarray:
    """``greedy`` as a (B,) int64 numpy array: where ``logits`` are float32 or float64 on the CPU,
    numpy's argmax straight on their memory (a row of SmolLM2's 49k logits: 6 against torch's
    45 us; each of the torch calls it saves a cold 10-40 us right after a block run). Both take the
    first of equal maxima."""
    if not (logits.is_cpu and logits.dtype in FLOATS):
        return greedy(logits).cpu().numpy()
    a = (logits.detach() if logits.requires_grad else logits).numpy()
    if a.ndim != 3:
        raise UnsupportedModel(f"greedy tokens need (batch, length, vocab) float logits, got {a.shape} "
                               f"{logits.dtype}")
    return a[:, -1].argmax(axis=-1).astype(np.int64, copy=False)


def decode_loop(msg: Any) -> Loop | None:
    """A ``Loop`` from its message (``dataplane.client.start``); None for none. The worker
    feeds only blocks of the model's own plan (its route) and only these five step inputs."""
    if not msg:
        return None
    try:
        inputs = {str(k): v for k, v in dict(msg["inputs"]).items()}
        if set(inputs) != set(STEP_INPUTS) or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
            raise ValueError(f"inputs {sorted(inputs)}")
        route = [(str(a), [(int(b), tuple(str(t) for t in names)) for b, names in feeds])
                 for a, feeds in msg["route"]]
        if any(t not in STEP_INPUTS for _, feeds in route for _, names in feeds for t in names):
            raise ValueError("a route names other inputs")
        return Loop([int(r) for r in msg["requests"]][:4096], route, str(msg["logits"]), inputs)
    except (KeyError, TypeError, ValueError) as e:
        raise WorkerLost(f"a decode loop's message is malformed ({e}): the step runs once") from e

