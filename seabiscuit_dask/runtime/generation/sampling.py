"""How a call picks its next tokens: greedy (one argmax, here only), or sampled; what shapes the
logits first (``LogitRules``: a minimum answer length, biases and penalties); and the
log-probabilities a caller asked for.

A call whose tokens are picked from its logits alone, greedily (``Sampling.on_workers``), has them
picked on the workers; any other call reads its rows' logits here, where each row's history is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...errors import BadInput

if TYPE_CHECKING:
    from .grammar import Grammar, Matcher

MAX_LOGPROBS = 20      # NOTE: OpenAI's bound on top_logprobs


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(..., vocab) logits -> (...) token ids: the likeliest, the first of equal maxima (as torch's
    and numpy's argmax, and Hugging Face's greedy search, take it)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class LogitRules:
    """What changes a row's logits before its token is picked, in this order (vLLM's):

    - ``min_new``: its end-of-text tokens are ruled out until its answer has this many tokens;
    - ``bias``: (token id, value) pairs added to the logits (OpenAI's ``logit_bias``);
    - ``repetition``: every token of the row so far, prompt included, has its logit divided by this
      where positive and multiplied where negative (Hugging Face's and vLLM's ``repetition_penalty``);
    - ``frequency``, ``presence``: every token of the answer so far has ``frequency`` times its
      count and ``presence`` once taken off its logit (OpenAI's penalties).
    """

    min_new: int = 0
    bias: tuple[tuple[int, float], ...] = ()
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    def __post_init__(self) -> None:
        if self.min_new < 0:
            raise BadInput(f"min_new_tokens must be >= 0, got {self.min_new}")
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise BadInput(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition}")
        for name, value in (("frequency_penalty", self.frequency), ("presence_penalty", self.presence)):
            if not math.isfinite(value):
                raise BadInput(f"{name} must be a finite number (0: off), got {value}")
        bad = [(t, b) for t, b in self.bias if t < 0 or not math.isfinite(b)]
        if bad:
            raise BadInput(f"logit_bias takes token ids >= 0 and finite values, got {bad[:3]}")

    @property
    def active(self) -> bool:
        return bool(self.min_new or self.bias or self.repetition != 1.0 or self.frequency or self.presence)

    def check_vocab(self, vocab: int) -> None:
        """Refuse biases of token ids the model does not have."""
        bad = sorted(t for t, _ in self.bias if t >= vocab)
        if bad:
            raise BadInput(f"logit_bias names token id(s) {bad[:5]} outside the vocabulary of {vocab}")

    def apply(self, scores: torch.Tensor, rows: Sequence[History], eos: frozenset[int]) -> torch.Tensor:
        """(rows, vocab) float logits shaped by the rules, each row by its ``History``."""
        if not self.active:
            return scores
        scores = scores.clone()
        vocab = scores.shape[-1]
        ends = torch.tensor(sorted(e for e in eos if 0 <= e < vocab), dtype=torch.long)
        if self.bias:
            ids = torch.tensor([t for t, _ in self.bias], dtype=torch.long)
            values = torch.tensor([b for _, b in self.bias], dtype=scores.dtype)
        for i, h in enumerate(rows):
            answer = h.tokens[h.start:]
            if len(answer) < self.min_new and len(ends):
                scores[i, ends] = float("-inf")
            if self.bias:
                scores[i].index_add_(0, ids, values)
            if self.repetition != 1.0 and h.tokens:
                seen = torch.unique(torch.tensor(h.tokens, dtype=torch.long))
                seen = seen[seen < vocab]
                got = scores[i, seen]
                scores[i, seen] = torch.where(got > 0, got / self.repetition, got * self.repetition)
            if (self.frequency or self.presence) and answer:
                ids_a, counts = torch.unique(torch.tensor(answer, dtype=torch.long), return_counts=True)
                keep = ids_a < vocab
                ids_a, counts = ids_a[keep], counts[keep]
                scores[i, ids_a] -= counts.to(scores.dtype) * self.frequency + self.presence
        return scores


@dataclass(frozen=True)
class History:
    """One row's tokens so far (prompt and answer) and where its answer starts in them."""

    tokens: Sequence[int]
    start: int


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a picked token under the model (its logits before any rule,
    temperature or top-k/p: vLLM's raw log-probabilities), and the ``top`` likeliest tokens with
    theirs, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Sampling:
    """How a call picks its next tokens: greedy, or sampled after temperature, top-k and top-p;
    its logits shaped by ``rules`` first, then restricted to what ``grammar`` allows (each row
    following it with a ``Matcher`` of its own); ``logprobs``: None, or the count of likeliest
    tokens whose log-probabilities come with each picked one's (0: the picked token's alone)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    rules: LogitRules = field(default_factory=LogitRules)
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not 0 < self.temperature < float("inf"):
            raise BadInput(f"temperature must be a finite number > 0 to sample, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadInput(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadInput(f"logprobs must be in [0, {MAX_LOGPROBS}] (the likeliest tokens to return with "
                           f"each picked one), got {self.logprobs}")

    @property
    def on_workers(self) -> bool:
        """Whether its tokens can be picked where the logits are made: greedy, from the logits alone,
        no log-probabilities asked for."""
        return not self.do_sample and not self.rules.active and self.logprobs is None and self.grammar is None

    def pick(self, logits: torch.Tensor, rows: Sequence[History] = (), eos: frozenset[int] = frozenset(),
             matchers: Sequence[Matcher] = ()) -> torch.Tensor:
        """(rows, vocab) float logits -> (rows,) token ids; ``rows``: each row's history, which the
        rules read (needed when ``rules`` are active); ``matchers``: each row's place in the
        grammar (needed with one), which follow the tokens picked."""
        scores = logits.float()
        if self.rules.active:
            if len(rows) != scores.shape[0]:
                raise BadInput(f"logit rules need each row's history: {scores.shape[0]} rows, {len(rows)} "
                               "histories")
            scores = self.rules.apply(scores, rows, eos)
        if self.grammar is not None:
            if len(matchers) != scores.shape[0]:
                raise BadInput(f"a grammar needs each row's matcher: {scores.shape[0]} rows, {len(matchers)}")
            scores = scores.clone() if scores is logits else scores
            for i, m in enumerate(matchers):
                m.restrict(scores[i])
                if not torch.isfinite(scores[i]).any():     # NOTE: a rule ruled out all the grammar allows
                    scores[i] = logits[i].float()
                    m.restrict(scores[i])
        picked = self._pick(scores)
        for m, t in zip(matchers, picked.tolist()):
            m.accept(t)
        return picked

    def _pick(self, scores: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return greedy(scores)
        scores = scores / self.temperature
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

    def choose(self, rows: Sequence[torch.Tensor], histories: Sequence[History] = (),
               eos: frozenset[int] = frozenset(),
               matchers: Sequence[Matcher] = ()) -> tuple[list[int], list[TokenLogprob] | None]:
        """The next token of each row from its step's result (a token picked already on the workers,
        or its logits, picked here), with its log-probabilities where they were asked for."""
        if all(r.dim() == 0 for r in rows):
            return [int(r) for r in rows], None
        if self.on_workers:
            return [int(r if r.dim() == 0 else greedy(r)) for r in rows], None
        # NOTE: such a call's steps always return logits (it is never in a lane nor a queued group)
        logits = torch.stack(list(rows)).float()
        tokens = self.pick(logits, histories, eos, matchers).tolist()
        return tokens, (logprobs_of(logits, tokens, self.logprobs) if self.logprobs is not None else None)


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each row's picked token's log-probability under ``logits`` and its ``top`` likeliest ones'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), float(p), tuple((int(a), float(b)) for a, b in tp))
            for t, p, tp in zip(tokens, picked, tops)]
