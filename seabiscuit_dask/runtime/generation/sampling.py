"""How a call picks its next tokens: greedy (one argmax, here only), or sampled; what shapes the
logits first (``LogitRules``: a minimum answer length, biases and penalties); and the
log-probabilities a caller asked for.

A row's pick depends on its logits, its history and its draw alone (``draw_seed``: the call's
seed, the row, how many tokens its answer has), never on where it is made or what ran before:
so a row picks the same token on the worker that makes its logits (``RowPick``, carried to a
decode lane as plain data, followed there by a ``RowPicker``, with its grammar's matcher where it
has one) as here, after a worker loss, a replay or a preemption as before. A call that decodes in
a lane has its tokens picked on the workers, and only its picks and the log-probabilities it
asked for travel back.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BadInput

if TYPE_CHECKING:
    from .grammar import Grammar, Matcher, Tokenizer

MAX_LOGPROBS = 20      # NOTE: OpenAI's bound on top_logprobs
MAX_BIAS = 1024        # NOTE: logit_bias entries a row's pick carries (OpenAI takes 300)
MAX_EOS = 64
MAX_HISTORY = 1 << 20  # NOTE: tokens of a row's history a pick carries
SEED_MASK = (1 << 63) - 1
PICK_FIELDS = frozenset({"t", "k", "p", "seed", "c", "min", "bias", "rep", "freq", "pres", "eos", "h", "at",
                         "n", "lp", "g", "gk", "gv", "ge", "gj"})
MAX_GRAMMAR = 4 << 20      # NOTE: characters of a grammar's text a row's pick carries
_M64 = (1 << 64) - 1


def draw_seed(seed: int, choice: int, position: int) -> int:
    """The seed of one sampled token: row ``choice`` of a call seeded ``seed``, the answer's token
    ``position`` (0: its first). A 64-bit mix (splitmix64's finaliser) of the three, so rows and
    positions draw apart and the same row draws the same wherever and whenever it is picked."""
    x = (seed * 0x9E3779B97F4A7C15 + (choice + 1) * 0xBF58476D1CE4E5B9
         + (position + 1) * 0x94D049BB133111EB) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) & SEED_MASK


def draw(scores: torch.Tensor, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator | None) -> torch.Tensor:
    """(rows, vocab) shaped logits -> (rows,) tokens sampled after temperature, top-k and top-p."""
    scores = scores / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, idx = torch.sort(scores, descending=False, dim=-1)
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)
        drop[:, -1] = False                   # NOTE: the likeliest token always stays
        scores = scores.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


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
    seed: int | None = None       # what its draws start from (``draw_seed``); drawn once if not given

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
        if self.seed is None:
            # NOTE: from the caller's generator where it gave one (reproducible from it), else at random
            g = self.generator
            seed = secrets.randbits(62) if g is None else int(torch.randint(0, 1 << 62, (1,), generator=g))
            object.__setattr__(self, "seed", seed)

    @property
    def plain(self) -> bool:
        """Greedy from the logits alone: no rules, no log-probabilities, no grammar (a step's tokens
        are its logits' argmax, which a decode loop queued behind it reads on the workers)."""
        return not self.do_sample and not self.rules.active and self.logprobs is None and self.grammar is None

    def row_pick(self, choice: int, tokens: Sequence[int], start: int, eos: frozenset[int] | Sequence[int]
                 ) -> RowPick | None:
        """How row ``choice`` (its tokens so far, its answer from ``start`` on) picks its next token
        where its logits are made; None for a plain greedy row (the argmax is all it needs)."""
        if self.plain:
            return None
        rules, grammar = self.rules, self.grammar
        if rules.repetition != 1.0:
            history, at = tuple(tokens), start
        elif rules.active or grammar is not None:
            history, at = tuple(tokens[start:]), 0
        else:
            history, at = (), 0
        g = grammar.tokenizer if grammar is not None else None
        return RowPick(self.temperature if self.do_sample else 0.0, self.top_k, self.top_p,
                       int(self.seed or 0), int(choice), rules, tuple(sorted(int(e) for e in eos)), history,
                       at, len(tokens) - start, -1 if self.logprobs is None else int(self.logprobs),
                       None if grammar is None else grammar.text, "" if g is None else g.key,
                       0 if g is None else g.vocab, () if g is None else g.eos, g)

    def pick(self, logits: torch.Tensor, rows: Sequence[History] = (), eos: frozenset[int] = frozenset(),
             matchers: Sequence[Matcher] = (), draws: Sequence[tuple[int, int]] | None = None
             ) -> torch.Tensor:
        """(rows, vocab) float logits -> (rows,) token ids; ``rows``: each row's history, which the
        rules read (needed when ``rules`` are active); ``matchers``: each row's place in the
        grammar (needed with one), which follow the tokens picked; ``draws``: each row's (choice,
        answer length), its draw when sampled (``draw_seed``; None: from ``generator``)."""
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
        if not self.do_sample:
            picked = greedy(scores)
        elif draws is None:
            picked = draw(scores, self.temperature, self.top_k, self.top_p, self.generator)
        else:
            if len(draws) != scores.shape[0]:
                raise BadInput(f"sampling needs each row's draw: {scores.shape[0]} rows, {len(draws)} draws")
            gen = torch.Generator()
            picked = torch.cat([draw(scores[i:i + 1], self.temperature, self.top_k, self.top_p,
                                     gen.manual_seed(draw_seed(int(self.seed or 0), c, p)))
                                for i, (c, p) in enumerate(draws)]) if len(draws) else greedy(scores)
        for m, t in zip(matchers, picked.tolist()):
            m.accept(t)
        return picked

    def choose(self, rows: Sequence[torch.Tensor], histories: Sequence[History] = (),
               eos: frozenset[int] = frozenset(), matchers: Sequence[Matcher] = (),
               draws: Sequence[tuple[int, int]] | None = None,
               picked: Sequence[TokenLogprob | None] | None = None
               ) -> tuple[list[int], list[TokenLogprob] | None]:
        """The next token of each row from its step's result: a token picked already on the workers
        (with ``picked``, the log-probabilities they sent where the call asked for them), or its
        logits, picked here (``pick``); with its log-probabilities where they were asked for."""
        if all(r.dim() == 0 for r in rows):
            tokens = [int(r) for r in rows]
            if self.logprobs is None:
                return tokens, None
            if picked is None or len(picked) != len(tokens) or any(p is None for p in picked):
                raise BadInput("a call that asks for log-probabilities got tokens picked without them")
            return tokens, [dataclasses.replace(p, token=t) for p, t in zip(picked, tokens) if p is not None]
        if self.plain:
            return [int(r if r.dim() == 0 else greedy(r)) for r in rows], None
        # NOTE: a call picked here reads logits each step (a grammar's; or a step fed from here)
        logits = torch.stack([r.reshape(-1) for r in rows]).float()
        tokens = self.pick(logits, histories, eos, matchers, draws).tolist()
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


@dataclass(frozen=True)
class RowPick:
    """How one row picks its next tokens, as plain data (``message``) the worker that makes its
    logits follows (a ``RowPicker``) as this process would: temperature 0 is greedy; ``seed`` and
    ``choice`` name its draws (``draw_seed``); ``history``, the tokens its rules read (prompt and
    answer for a repetition penalty, else the answer alone), its answer from ``start`` on;
    ``produced``, its answer's tokens so far; ``logprobs`` -1: none, else how many likeliest
    tokens come with each pick's log-probability; ``grammar``: the text of the grammar its answer
    follows (its history then holds the answer), over the tokenizer named ``tokenizer`` (a
    ``grammar.Tokenizer``'s key, of ``vocab`` tokens ending with ``grammar_eos``; ``source``, that
    tokenizer where this process made it, whose JSON goes with the message where the receiver may
    not have it yet; ``built``, llguidance's tokenizer once a message of it was read here)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    choice: int = 0
    rules: LogitRules = field(default_factory=LogitRules)
    eos: tuple[int, ...] = ()
    history: tuple[int, ...] = ()
    start: int = 0
    produced: int = 0
    logprobs: int = -1
    grammar: str | None = None
    tokenizer: str = ""
    vocab: int = 0
    grammar_eos: tuple[int, ...] = ()
    source: Tokenizer | None = field(default=None, repr=False, compare=False)
    built: Any = field(default=None, repr=False, compare=False)

    def message(self, tokenizer: bool = False) -> dict[str, Any]:
        """As plain data; ``tokenizer``: with its grammar's tokenizer's JSON (its receiver builds it
        once: ``grammar.tokenizer_for``)."""
        r = self.rules
        out = {} if self.grammar is None else {"g": self.grammar, "gk": self.tokenizer, "gv": self.vocab,
                                                 "ge": list(self.grammar_eos)}
        if tokenizer and self.grammar is not None and self.source is not None:
            out["gj"] = self.source.json
        return out | {"t": self.temperature, "k": self.top_k, "p": self.top_p, "seed": self.seed,
                "c": self.choice, "min": r.min_new, "bias": [[t, b] for t, b in r.bias], "rep": r.repetition,
                "freq": r.frequency, "pres": r.presence, "eos": list(self.eos), "h": list(self.history),
                "at": self.start, "n": self.produced, "lp": self.logprobs}

    @classmethod
    def from_message(cls, msg: Mapping[str, Any]) -> RowPick:
        """A row's pick from its ``message``; ``ValueError`` naming what is wrong with one that is not."""
        try:
            return cls._read(msg)
        except (OverflowError, TypeError) as e:         # NOTE: numbers too large for a float, and the like
            raise ValueError(f"a row's pick holds a value out of range ({e})") from None

    @classmethod
    def _read(cls, msg: Mapping[str, Any]) -> RowPick:
        if not isinstance(msg, Mapping):
            raise ValueError(f"a row's pick is a mapping, got {type(msg).__name__}")
        extra = set(msg) - PICK_FIELDS
        if extra:
            raise ValueError(f"a row's pick names unknown fields {sorted(map(str, extra))[:5]}")

        def integer(key: str, low: int, high: int) -> int:
            v = msg.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"a row's pick's {key!r} must be an integer in [{low}, {high}], got {v!r}")
            return int(v)

        def number(key: str, default: float) -> float:
            v = msg.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"a row's pick's {key!r} must be a finite number, got {v!r}")
            return float(v)

        def ints(key: str, bound: int) -> tuple[int, ...]:
            v = msg.get(key, ())
            if not isinstance(v, (list, tuple)) or len(v) > bound or \
                    not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in v):
                raise ValueError(f"a row's pick's {key!r} must list at most {bound} token ids")
            return tuple(int(t) for t in v)

        bias = msg.get("bias", ())
        if not isinstance(bias, (list, tuple)) or len(bias) > MAX_BIAS or not all(
                isinstance(b, (list, tuple)) and len(b) == 2 and type(b[0]) is int and 0 <= b[0] < 1 << 31
                and type(b[1]) in (int, float) for b in bias):
            raise ValueError(f"a row's pick's 'bias' must list at most {MAX_BIAS} (token id, value) pairs")
        history = ints("h", MAX_HISTORY)
        try:
            rules = LogitRules(integer("min", 0, 1 << 31), tuple((int(t), float(b)) for t, b in bias),
                               number("rep", 1.0), number("freq", 0.0), number("pres", 0.0))
            pick = cls(number("t", 0.0), integer("k", 0, 1 << 31), number("p", 1.0),
                       integer("seed", 0, SEED_MASK), integer("c", 0, 1 << 31), rules, ints("eos", MAX_EOS),
                       history, integer("at", 0, len(history)), integer("n", 0, 1 << 31),
                       integer("lp", -1, MAX_LOGPROBS))
        except BadInput as e:
            raise ValueError(str(e)) from None
        if pick.temperature < 0 or not 0 < pick.top_p <= 1:
            raise ValueError(f"a row's pick's temperature must be >= 0 and top_p in (0, 1], got "
                             f"{pick.temperature}, {pick.top_p}")
        if "g" in msg:
            text, key, text_json = msg.get("g"), msg.get("gk"), msg.get("gj")
            if not isinstance(text, str) or len(text) > MAX_GRAMMAR or not isinstance(key, str) \
                    or not (text_json is None or isinstance(text_json, str)):
                raise ValueError(f"a row's pick's grammar is its text (at most {MAX_GRAMMAR} characters) and "
                                 "its tokenizer's key (and JSON)")
            vocab, ends = integer("gv", 1, 1 << 24), ints("ge", MAX_EOS)
            from .grammar import GrammarError, tokenizer_for

            try:        # NOTE: built here once (its JSON came with the first grammar of it)
                built = tokenizer_for(key, text_json, vocab, ends)
            except GrammarError as e:
                raise ValueError(str(e)) from None
            pick = dataclasses.replace(pick, grammar=text, tokenizer=key, vocab=vocab, grammar_eos=ends,
                                       built=built)
        return pick

    def picker(self) -> RowPicker:
        return RowPicker(self)


class RowPicker:
    """A row's picks, one after another, where its logits are made: its ``RowPick`` and the
    history its picks add to."""

    def __init__(self, pick: RowPick) -> None:
        self.spec = pick
        self.history = list(pick.history)
        self.produced = pick.produced
        self._eos = frozenset(pick.eos)
        self._ends = self._eos | frozenset(pick.grammar_eos)
        self._gen = torch.Generator()
        self.matcher: Matcher | None = None
        self.ended = False          # its grammar took its end-of-text token
        if pick.grammar is not None:
            from .grammar import Matcher, compile_matcher, tokenizer_for

            info = pick.built if pick.built is not None else pick.source.info if pick.source is not None \
                else tokenizer_for(pick.tokenizer, None, pick.vocab, pick.grammar_eos)
            self.matcher = Matcher(compile_matcher(info, pick.grammar), int(info.vocab_size), "the grammar")
            for t in pick.history[pick.start:]:        # NOTE: the answer so far
                self.matcher.accept(t)
                self.ended = t in self._ends

    def __call__(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from the row's (vocab,) logits, and its log-probabilities if asked for."""
        p = self.spec
        raw = logits.reshape(1, -1).float()
        scores = raw
        if p.rules.active:
            scores = p.rules.apply(raw, [History(self.history, p.start)], self._eos)
        # NOTE: a row runs on in its lane past its end until its caller empties it: unconstrained then
        m = self.matcher if self.matcher is not None and not self.ended else None
        if m is not None:       # NOTE: as ``Sampling.pick`` restricts a row to its grammar
            scores = scores.clone() if scores is raw or scores is logits else scores
            m.restrict(scores[0])
            if not torch.isfinite(scores[0]).any():
                scores = raw.clone()
                m.restrict(scores[0])
        if p.temperature > 0:
            self._gen.manual_seed(draw_seed(p.seed, p.choice, self.produced))
            token = int(draw(scores, p.temperature, p.top_k, p.top_p, self._gen)[0])
        else:
            token = int(greedy(scores)[0])
        lp = logprobs_of(raw, [token], p.logprobs)[0] if p.logprobs >= 0 else None
        if m is not None:
            m.accept(token)
            self.ended = token in self._ends
        if p.rules.active or p.grammar is not None:
            self.history.append(token)
        self.produced += 1
        return token, lp
