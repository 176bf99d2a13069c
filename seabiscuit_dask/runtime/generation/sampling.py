"""How a call picks its next tokens: greedy (one argmax, here only), or sampled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...errors import BadInput


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(..., vocab) logits -> (...) token ids: the likeliest, the first of equal maxima (as torch's
    and numpy's argmax, and Hugging Face's greedy search, take it)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class Sampling:
    """How a call picks its next tokens: greedy, or sampled after temperature, top-k and top-p."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not 0 < self.temperature < float("inf"):
            raise BadInput(f"temperature must be a finite number > 0 to sample, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadInput(f"top_k must be >= 0 (0: off), got {self.top_k}")

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) float logits -> (rows,) token ids."""
        if not self.do_sample:
            return greedy(logits)
        scores = logits.float() / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, idx = torch.sort(scores, descending=False, dim=-1)
            cum = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - self.top_p)
            drop[:, -1] = False                   # NOTE: the likeliest token always stays
            scores = scores.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)


def picked(sampling: Sampling, rows: Sequence[torch.Tensor]) -> list[int]:
    """The next token of each row from its step's result: a token picked already (a greedy
    group's, on the workers), or its logits, picked here as ``sampling`` picks."""
    if all(r.dim() == 0 for r in rows):
        return [int(r) for r in rows]
    if sampling.do_sample:         # NOTE: a sampling call's groups always return logits
        return sampling.pick(torch.stack(list(rows))).tolist()
    return [int(r if r.dim() == 0 else greedy(r)) for r in rows]
