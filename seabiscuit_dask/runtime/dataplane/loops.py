"""A decode loop at the worker that makes its logits: the steps that follow, each fed from the
tokens picked from the one before, with no caller in between (``Loop``); the greedy pick
itself (``greedy``), and the step inputs a loop feeds (``STEP_INPUTS``).

A loop may be a lane (``Lane``): its rows change while it runs. The caller's edits (a
session joins an empty row, or a row is emptied) apply to the next step built, and each row
may run a given number of steps, then empties itself (a call's last token), so rows join
and leave between steps with no restart of the loop. Each step of a lane tells its caller
the sessions it ran (``Run.rows``): the caller reads tokens by session, not by edit timing.
A row of a lane that does not pick greedily from its logits alone (sampled, logit rules,
log-probabilities) comes with its pick as plain data (``generation.sampling.RowPick``): the
lane follows it (``pick_rows``), and the step's tokens go back with the log-probabilities its
rows asked for (``LOGPROBS``, ``LOGPROB_IDS``), never its logits.

This is the generation engine's, not the data plane's: the data plane only carries a loop's
steps (``runs.Run.advance``) and reads a loop from its message (``decode_loop``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedModel, WorkerLost

STEP_INPUTS = ("input_ids", "position_ids", "sb_sessions", "sb_start", "sb_valid")
FLOATS = (torch.float32, torch.float64)
ROWS = "sb_rows"         # NOTE: the sessions a lane's step ran, sent with its tokens
EDITS = "sb_edits"       # NOTE: and how many of the caller's edit messages it had applied
LOGPROBS = "sb_logprobs"         # NOTE: (batch, 1 + k) float32: a pick's, then its top k's (NaN: none)
LOGPROB_IDS = "sb_logprob_ids"   # NOTE: (batch, k) int64: the top k's token ids (-1: none)
PICKED = "sb_picked"             # NOTE: (batch,) int64: a step's tokens as picked, beside its logits
MAX_EDITS = 4096         # NOTE: edits a lane holds unapplied at once; more are refused
MAX_VALUE = 1 << 31      # NOTE: sessions, slots, tokens and steps of an edit stay below this
# NOTE: (row, session or -1 to empty it, first slot, token, steps or -1[, its pick or its message, or None])
Edit = tuple[Any, ...]
Picked = tuple[np.ndarray, dict[str, torch.Tensor]]     # a step's tokens (batch,), and its log-probabilities


def row_pickers(picks: Sequence[Any]) -> list[Any]:
    """Each row's ``RowPicker`` (None: greedy) from its pick's message, its ``RowPick`` (in this
    process) or itself (made already, off the event loop); ``ValueError`` naming what is wrong for
    one that cannot be followed (a malformed message, a grammar that does not compile)."""
    from ..generation.sampling import RowPick, RowPicker  # NOTE: here: the engine's package imports this one

    out = []
    for m in picks:
        try:
            if m is None or isinstance(m, RowPicker):
                out.append(m)
            else:
                out.append((m if isinstance(m, RowPick) else RowPick.from_message(m)).picker())
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a grammar's or a rule's own error: the row is refused
            raise ValueError(f"a row's pick cannot be followed ({type(e).__name__}: {e})") from None
        except BaseException as e:
            if type(e).__name__ != "PanicException":      # NOTE: llguidance's Rust side panicked
                raise
            raise ValueError(f"a row's grammar failed in llguidance ({e})") from None
    return out


def logprob_of_row(extra: dict[str, torch.Tensor], row: int) -> Any:
    """Row ``row``'s ``TokenLogprob`` (its token left -1: its caller knows it) from the
    log-probabilities a step's picks sent with its tokens (``pick_rows``): None where it asked
    for none."""
    from ..generation.sampling import TokenLogprob  # NOTE: here: the engine's package imports this one

    values, ids = extra.get(LOGPROBS), extra.get(LOGPROB_IDS)
    if values is None or ids is None or math.isnan(float(values[row, 0])):
        return None
    top = [(int(t), float(v)) for t, v in zip(ids[row].tolist(), values[row, 1:].tolist()) if t >= 0]
    return TokenLogprob(-1, float(values[row, 0]), tuple(top))


def picked_here(logits: torch.Tensor, picks: Sequence[Any]) -> Picked:
    """``pick_rows`` for a step whose rows' picks (``RowPick``s, None: greedy) start with it: one
    no loop on the workers ran."""
    return pick_rows(logits, {i: p for i, p in enumerate(row_pickers(picks)) if p is not None})


def pick_rows(logits: torch.Tensor, pickers: dict[int, Any]) -> Picked:
    """The tokens of a step from its (batch, length, vocab) or (batch, vocab) logits: each row's
    greedy token, but a row of ``pickers`` (row -> its ``RowPicker``) picks as it says; with the
    log-probabilities the rows asked for (``LOGPROBS``, ``LOGPROB_IDS``; none asked: empty)."""
    last = logits if logits.dim() == 2 else logits[:, -1]
    tokens = greedy_numpy(last.unsqueeze(1)).copy()
    if not pickers:
        return tokens, {}
    if not last.is_cpu:
        last = last.detach().cpu()      # NOTE: a row's rules and draws index with tensors made on the CPU
    lps = {}
    for row, picker in pickers.items():
        tokens[row], lp = picker(last[row])
        if lp is not None:
            lps[row] = lp
    if not lps:
        return tokens, {}
    k = max(len(lp.top) for lp in lps.values())
    values = torch.full((len(tokens), 1 + k), float("nan"), dtype=torch.float32)
    ids = torch.full((len(tokens), k), -1, dtype=torch.long)
    for row, lp in lps.items():
        values[row, 0] = lp.logprob
        for j, (t, v) in enumerate(lp.top):
            ids[row, j], values[row, 1 + j] = t, v
    return tokens, {LOGPROBS: values, LOGPROB_IDS: ids}


class Lane:
    """The rows of a decode loop that change as it runs (see module doc): edits from the caller
    (any thread: the event loop takes them, a compute thread may build the step), applied to
    the next step built; each row's steps left (-1: no bound)."""

    def __init__(self, lane: int, left: Sequence[int], picks: Sequence[Any] = ()) -> None:
        self.id = int(lane)
        self.left = np.asarray(left, dtype=np.int64).copy()
        # NOTE: row -> its ``RowPicker``, for the rows of the step built last (greedy: none)
        self.pickers: dict[int, Any] = {i: p for i, p in enumerate(row_pickers(picks)) if p is not None}
        self.open = True
        self.taken = 0              # edit messages taken, and applied to a step built
        self.applied = 0
        self._edits: list[Edit] = []
        self._lock = threading.Lock()
        self._built: tuple[int, dict[str, torch.Tensor], int] | None = None

    def edit(self, edits: Sequence[Edit]) -> int:
        """Queue ``edits`` (one message of the caller's) for the next step built: how many messages
        the lane has taken with it (``applied`` reaches it once a step built holds them), or 0
        where the lane runs no more steps (the caller starts a loop anew) or holds too many."""
        rows = len(self.left)
        made = []
        for e in edits:
            if len(e) not in (5, 6) or not all(isinstance(v, int) and not isinstance(v, bool) for v in e[:5]):
                raise ValueError(f"an edit is (row, session, slot, token, steps[, pick]), got {str(e)[:200]}")
            if not 0 <= e[0] < rows:
                raise ValueError(f"row {e[0]} of a lane of {rows} rows")
            if not all(-1 <= v < MAX_VALUE for v in e[1:5]):
                raise ValueError(f"an edit's session, slot, token and steps must be in [-1, {MAX_VALUE}): "
                                 f"{e[:5]}")
            # NOTE: its picker made here, not as the step is built (on the logits' critical path)
            made.append((*e[:5], row_pickers([e[5]])[0] if len(e) == 6 else None))
        with self._lock:
            if not self.open or len(self._edits) + len(edits) > MAX_EDITS:
                return 0
            self._edits.extend(made)
            self.taken += 1
            return self.taken

    def close(self) -> None:
        """It runs no more steps: edits from now on are refused, and its rows' pickers go (their
        histories and matchers)."""
        with self._lock:
            self.open = False
            self.pickers = {}

    def apply(self, request: int, x: dict[str, torch.Tensor], last: bool = False) -> dict[str, torch.Tensor]:
        """Step ``request``'s inputs ``x`` as the lane has them: rows whose steps ran out emptied,
        then the edits that came. Built once a request: asked again, the same inputs. The lane
        closes (refuses edits) with its ``last`` step, or one with every row empty (it stops)."""
        with self._lock:
            if self._built is not None and self._built[0] == request:
                return self._built[1]
            edits, self._edits = self._edits, []
            self.applied = self.taken
            left = self.left
            out = x
            for row, session, start, token, steps, pick in edits:
                left[row] = steps if session >= 0 else 0     # NOTE: this step is one of them
                out = _set_row(out, x, row, session, start, token)
                if session >= 0 and pick is not None:
                    self.pickers[row] = pick
                else:
                    self.pickers.pop(row, None)
            for i in np.flatnonzero(left == 0).tolist():
                self.pickers.pop(i, None)
                if int(out["sb_sessions"][i]) >= 0:
                    out = _set_row(out, x, i, -1, 0, 0)
            left[left > 0] -= 1
            if last or not bool((out["sb_sessions"] >= 0).any()):
                self.open = False
            self._built = (request, out, self.applied)
            return out

    def applied_by(self, request: int) -> int:
        """The edit messages step ``request`` was built with (its caller reads which left)."""
        with self._lock:
            return self._built[2] if self._built is not None and self._built[0] == request else self.applied


def _set_row(out: dict[str, torch.Tensor], x: dict[str, torch.Tensor], row: int, session: int,
             start: int, token: int) -> dict[str, torch.Tensor]:
    """``out`` (``x`` or a copy made here) with ``row`` as session ``session``'s next token
    ``token`` at slot ``start``, or empty for session -1. ``x``'s tensors may be shared with
    the step before (still running here): they are copied, never written."""
    if out is x:
        out = {k: v.clone() for k, v in x.items()}
    live = session >= 0
    out["input_ids"][row] = int(token) if live else 0
    out["position_ids"][row] = int(start) if live else 0
    out["sb_sessions"][row] = int(session)
    out["sb_start"][row] = int(start) if live else 0
    out["sb_valid"][row] = live
    return out


@dataclass(eq=False)
class Loop:
    """A decode loop at the worker that makes a step's logits: the steps still to run after it,
    each fed from the greedy tokens of the one before (no caller in between)."""

    requests: list[int]                                   # the next steps' request ids, in order
    route: list[tuple[str, list[tuple[int, tuple[str, ...]]]]]   # worker -> its blocks and their inputs
    logits: str                                           # the output tile the tokens come from
    inputs: dict[str, torch.Tensor]                       # this step's inputs (positions, sessions, ...)
    ahead: tuple[np.ndarray, bool, dict[str, torch.Tensor]] | None = None   # ``prepare``'s
    lane: Lane | None = None                              # its rows change as it runs
    picked: Picked | None = None                          # this step's picks, once made (``pick``)

    @property
    def picks(self) -> bool:
        """Whether a row of this step picks otherwise than greedily (its tokens are ``pick``'s):
        asked before ``following`` built the next step (the lane's rows are that step's since)."""
        return self.lane is not None and bool(self.lane.pickers)

    def pick(self, logits: torch.Tensor) -> Picked:
        """This step's tokens from its logits, and the log-probabilities its rows asked for: made once
        (a row's picks follow one another: its history grows with each)."""
        if self.picked is None:
            self.picked = pick_rows(logits, self.lane.pickers if self.lane is not None else {})
        return self.picked

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
        """The next step's inputs (this step's tokens, ``pick``'s; positions one on; pad rows stay
        as they are) and the loop after it."""
        self.prepare()
        assert self.ahead is not None
        step, live, rest = self.ahead
        tokens = self.pick(logits)[0]
        nxt = {"input_ids": torch.from_numpy((tokens if live else tokens * step).reshape(-1, 1)), **rest}
        if self.lane is not None:
            nxt = self.lane.apply(self.requests[0], nxt, last=len(self.requests) == 1)
        return nxt, Loop(self.requests[1:], self.route, self.logits, nxt, lane=self.lane)


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
        lane = None
        if msg.get("lane") is not None:
            rows = int(inputs["sb_sessions"].shape[0])
            left = [int(n) for n in msg.get("left") or [-1] * rows]
            if len(left) != rows or not all(-1 <= n < MAX_VALUE for n in left):
                raise ValueError(f"a lane of {rows} rows with steps left {left[:8]}")
            picks = msg.get("picks") or [None] * rows
            if not isinstance(picks, (list, tuple)) or len(picks) != rows:
                raise ValueError(f"a lane of {rows} rows with picks {str(picks)[:80]}")
            # NOTE: the first step ran
            lane = Lane(int(msg["lane"]), [n - 1 if n > 0 else n for n in left], picks)
        return Loop([int(r) for r in msg["requests"]][:4096], route, str(msg["logits"]), inputs, lane=lane)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise WorkerLost(f"a decode loop's message is malformed ({e}): the step runs once") from e

