"""Constrained decoding: what the next token of a row may be, from a grammar (llguidance).

A ``Grammar`` is compiled once per request from a JSON schema (``json_grammar``) or a Lark
grammar (``lark_grammar``) for one tokenizer; each row of a call gets its own ``Matcher``,
which says which tokens may come next (``restrict``: the others' logits become -inf) and
follows the tokens picked (``accept``). The row's answer then always parses: it can end (the
model's end-of-text token is allowed) only where the grammar is complete.

Why llguidance (measured on this 2-core CPU with SmolLM2's 49,152-token vocabulary, the
figures in docs/serve.md): a mask takes 5-6 us at the median and 15-400 us at the 99th
percentile, a schema compiles in under 2 ms, and it has no dependencies. xgrammar's masks
are faster (2 us, p99 10 us), but it declares torch, triton and transformers as
requirements, and outlines-core takes 6.8 s to compile "any JSON object". Either mask is
far below one model step (20 ms or more), so the package's weight and compile time decide.

The tokenizer must be byte-level BPE or SentencePiece (every causal LM this serves);
llguidance cannot constrain WordPiece, whose text depends on neighbouring tokens.

A row decoding in a lane follows its grammar on the worker that makes its logits: the grammar
travels as its text, the tokenizer as its ``tokenizers`` JSON (both data, named by a hash:
``Tokenizer.key``), built there once (``tokenizer_for``) and kept for the grammars after it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import BadInput

# NOTE: compact JSON (", " and ": " between items, no other whitespace): a small model given
# free whitespace may write it forever, as vLLM found (its guided decoding's "disable any whitespace")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

MAX_TOKENIZER_CHARS = 64 << 20      # NOTE: a tokenizer's JSON a worker takes
KEPT_TOKENIZERS = 8                 # NOTE: tokenizers a process keeps built, the latest used

_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Tokenizer]] = weakref.WeakKeyDictionary()
_BUILT: OrderedDict[str, Any] = OrderedDict()      # NOTE: key -> llguidance's tokenizer, in this process
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Tokenizer:
    """llguidance's view of a tokenizer (``info``) and what builds it again in another process: its
    ``tokenizers`` JSON, vocabulary size and end-of-text tokens, named by ``key`` (their hash)."""

    info: Any = field(repr=False, compare=False)
    json: str = field(repr=False)
    vocab: int
    eos: tuple[int, ...]

    @property
    def key(self) -> str:
        return tokenizer_key(self.json, self.vocab, self.eos)


def tokenizer_key(text: str, vocab: int, eos: Sequence[int]) -> str:
    h = hashlib.sha256(text.encode())
    h.update(f"|{int(vocab)}|{','.join(str(int(e)) for e in eos)}".encode())
    return h.hexdigest()[:32]


def tokenizer_for(key: str, text: str | None, vocab: int, eos: Sequence[int]) -> Any:
    """llguidance's tokenizer named ``key``: built here before, or now from its JSON ``text``
    (checked against its key); ``GrammarError`` where it is unknown here and none came."""
    with _LOCK:
        got = _BUILT.get(key)
        if got is not None:
            _BUILT.move_to_end(key)
            return got
    if text is None:
        raise GrammarError(f"tokenizer {key} is not known in this process: send its JSON with the grammar")
    if len(text) > MAX_TOKENIZER_CHARS or tokenizer_key(text, vocab, eos) != key:
        raise GrammarError(f"a tokenizer's JSON ({len(text)} characters) does not match its key {key}")
    llg = _llguidance()
    try:
        built = llg.LLTokenizer(text, n_vocab=int(vocab), eos_token=[int(e) for e in eos])
    except (ValueError, TypeError) as e:
        raise GrammarError(f"a tokenizer's JSON cannot be read by llguidance: {e}") from None
    _keep(key, built)
    return built


def _keep(key: str, built: Any) -> None:
    with _LOCK:
        _BUILT[key] = built
        while len(_BUILT) > KEPT_TOKENIZERS:
            _BUILT.popitem(last=False)


class GrammarError(BadInput):
    """A grammar, a schema or a tokenizer cannot constrain decoding: it names which and why."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise GrammarError("constrained decoding (JSON output, tool calls) needs the llguidance package: "
                           "pip install llguidance") from None
    return llguidance


def token_info(tokenizer: Any, eos: Sequence[int]) -> Tokenizer:
    """llguidance's view of a Hugging Face tokenizer whose end-of-text tokens are ``eos``, made once
    per tokenizer (about 0.4 s for 49,152 tokens), with what builds it on a worker."""
    llg = _llguidance()
    ends = tuple(int(e) for e in eos)
    if not ends:
        raise GrammarError("a grammar needs the model's end-of-text token(s), to end an answer where it is "
                           "complete; this model has none")
    with _LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if ends in per:
            return per[ends]
    try:
        # NOTE: as llguidance.hf.from_tokenizer makes it, keeping the JSON it reads
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        text = backend.to_str()
        info = llg.LLTokenizer(text, n_vocab=len(tokenizer), eos_token=list(ends))
    except (ValueError, TypeError, AttributeError) as e:
        raise GrammarError(f"this model's tokenizer ({type(tokenizer).__name__}) cannot constrain "
                           f"decoding: {e}; a byte-level BPE or SentencePiece tokenizer "
                           "can") from None
    made = Tokenizer(info, text, len(tokenizer), ends)
    _keep(made.key, info)
    with _LOCK:
        return _TOKENIZERS.setdefault(tokenizer, {}).setdefault(ends, made)


class Grammar:
    """A grammar compiled for one tokenizer; ``matcher()`` gives each row its own state."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, describe: str) -> None:
        self.describe = describe
        self.text = grammar
        self.tokenizer = tokenizer
        self.vocab = int(tokenizer.info.vocab_size)
        self._proto = compile_matcher(tokenizer.info, grammar, describe)

    def matcher(self) -> Matcher:
        return Matcher(self._proto.deep_copy(), self.vocab, self.describe)

    def __repr__(self) -> str:
        return f"Grammar({self.describe})"


def compile_matcher(info: Any, grammar: str, describe: str = "the grammar") -> Any:
    """llguidance's matcher of ``grammar`` (its text) over tokenizer ``info``."""
    m = _llguidance().LLMatcher(info, grammar, log_level=1)
    if m.is_error():
        raise GrammarError(f"{describe} cannot be compiled: {m.get_error()}")
    return m


class Matcher:
    """One row's place in its grammar; ``fed``, the tokens it followed."""

    def __init__(self, matcher: Any, vocab: int, describe: str) -> None:
        self._m, self.vocab, self.describe = matcher, vocab, describe
        self.fed = 0
        self._bits = torch.zeros(((vocab + 31) // 32,), dtype=torch.int32)

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens that may come next."""
        self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
        return bits[:self.vocab].view(bool)

    def restrict(self, scores: torch.Tensor) -> None:
        """Set to -inf the (vocab,) float ``scores`` of every token that may not come next (and of
        every position past the tokenizer's vocabulary)."""
        ok = self.allowed()
        row = scores.numpy()
        width = min(len(ok), row.shape[0])
        np.putmask(row[:width], ~ok[:width], -np.inf)
        row[width:] = -np.inf

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} does not follow {self.describe}: {self._m.get_error()}")
        self.fed += 1



    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar (it may end here)."""
        return bool(self._m.is_accepting())


def json_grammar(tokenizer: Any, eos: Sequence[int], schema: dict[str, Any] | None = None) -> Grammar:
    """Answers that are JSON valid under ``schema`` (None: any JSON object), compact."""
    llg = _llguidance()
    if schema is None:
        schema, describe = {"type": "object"}, "a JSON object"
    else:
        describe = "the JSON schema"
    try:
        text = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{describe} cannot be compiled: {e}") from None
    return Grammar(token_info(tokenizer, eos), text, describe)


def lark_grammar(tokenizer: Any, eos: Sequence[int], lark: str, describe: str = "the grammar") -> Grammar:
    """Answers that are sentences of a Lark grammar (llguidance's dialect: ``%json {...}`` embeds
    a JSON schema)."""
    llg = _llguidance()
    try:
        text = llg.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(f"{describe} cannot be compiled: {e}") from None
    return Grammar(token_info(tokenizer, eos), text, describe)
