"""A step program's inputs, named once and made in one place.

A step program (``trace.decoder``) takes the new tokens and their positions, then
the three inputs that say what the step is: each row's session, the cache slot of
its first new token, and which of its tokens are real. A decode loop on the workers
(the data plane) feeds exactly these five.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import BadInput
from ...trace.decoder import STEP_INPUTS as CACHE_INPUTS

TOKENS, POSITIONS = "input_ids", "position_ids"
SESSIONS, START, VALID = CACHE_INPUTS       # NOTE: in ``trace.decoder``'s order
STEP_INPUTS = (TOKENS, POSITIONS, *CACHE_INPUTS)

Row = tuple[int, int, Sequence[int]]         # (session, first slot, new tokens)


def step_inputs(rows: Sequence[Row], batch: int, length: int) -> dict[str, torch.Tensor]:
    """Step inputs for ``rows`` of (session, first slot, new tokens), left-padded to ``length``;
    rows past ``rows`` are empty (session -1, computed and ignored)."""
    ids = torch.zeros((batch, length), dtype=torch.long)
    pos = torch.zeros((batch, length), dtype=torch.long)
    valid = torch.zeros((batch, length), dtype=torch.bool)
    sessions = torch.full((batch,), -1, dtype=torch.long)
    start = torch.zeros((batch,), dtype=torch.long)
    for b, (sid, first, toks) in enumerate(rows):
        n = len(toks)
        if n > length:
            raise BadInput(f"{n} tokens do not fit a step of {length}")
        ids[b, length - n:] = torch.tensor(toks, dtype=torch.long)
        pos[b, length - n:] = torch.arange(first, first + n)
        valid[b, length - n:] = True
        sessions[b], start[b] = sid, first
    return {TOKENS: ids, POSITIONS: pos, SESSIONS: sessions, START: start, VALID: valid}


def lane_inputs(rows: Sequence[Row | None], batch: int) -> dict[str, torch.Tensor]:
    """Decode step inputs of a lane: row ``i`` is ``rows[i]`` ((session, slot, (token,))), empty
    where None or past ``rows`` (session -1, computed and ignored)."""
    ids = torch.zeros((batch, 1), dtype=torch.long)
    pos = torch.zeros((batch, 1), dtype=torch.long)
    valid = torch.zeros((batch, 1), dtype=torch.bool)
    sessions = torch.full((batch,), -1, dtype=torch.long)
    start = torch.zeros((batch,), dtype=torch.long)
    for b, row in enumerate(rows):
        if row is None:
            continue
        sid, first, toks = row
        if len(toks) != 1:
            raise BadInput(f"a lane's row takes one token a step, got {len(toks)}")
        ids[b, 0], pos[b, 0], valid[b, 0] = int(toks[0]), first, True
        sessions[b], start[b] = sid, first
    return {TOKENS: ids, POSITIONS: pos, SESSIONS: sessions, START: start, VALID: valid}
