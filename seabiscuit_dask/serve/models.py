"""The models a server answers with: a deployment, its tokenizer, and how text maps onto them.

``ServedModel.answer`` turns a checked ``GenerationRequest`` into events (text deltas and
finish reasons per choice) as the deployment's tokens come; ``ServedModel.embed`` pools an
encoder's last hidden states. Both block: the HTTP side runs them on threads of their own.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import BadInput
from ..runtime.generation.grammar import Grammar, GrammarError, json_grammar, lark_grammar
from .api import BadParam, EmbeddingRequest, GenerationRequest, StopScan
from .tools import (
    CallPart,
    CallReader,
    ToolCall,
    as_openai,
    call_grammar,
    could_be_call,
    messages_with_tools,
    read_calls,
    template_takes_tools,
)

if TYPE_CHECKING:
    from ..runtime.client import DistributedModel
    from ..runtime.generation import TokenLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """The characters byte-level BPE (GPT-2's) writes each byte as: printable bytes as themselves,
    the rest from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_level_alphabet()


class Detokenized:
    """An answer's text as its tokens come, each token decoded with the few before it, not the
    whole answer again: ``tokens[prefix:read]`` decode to the end of ``text`` taken already, and
    the text grows by what ``tokens[prefix:]`` decode to beyond that (so a tokenizer that drops
    a leading space at the start of a decode drops it from both). ``full`` decodes all of it, once
    at the end."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = self.read = 0

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def add(self, token: int) -> bool:
        """Take ``token``; whether the text now ends in whole characters (not half of one)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix:self.read])
        now = self._decode(self.tokens[self.prefix:])
        if now.endswith("\ufffd"):
            return False
        if len(now) > len(before):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        return True

    def full(self) -> str:
        return self._decode(self.tokens)


@dataclass(frozen=True)
class Delta:
    """New text of choice ``index``; ``tokens``: how many tokens it has produced so far;
    ``logprobs``: those of the tokens this text came of (when the request asked for them)."""

    index: int
    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finish:
    """Choice ``index`` ended: ``reason`` is "stop" (an end-of-text token or a stop string) or
    "length" (``max_tokens`` or the context reached)."""

    index: int
    reason: str
    tokens: int
    admitted: float | None = None     # when the engine admitted the request (``time.perf_counter``)


@dataclass(frozen=True)
class ToolCalls:
    """Choice ``index``'s answer is these calls of the request's tools (its ``Finish`` follows);
    ``streamed``: they went out piece by piece already (``ToolCallPart``)."""

    index: int
    calls: tuple[ToolCall, ...]
    streamed: bool = False


@dataclass(frozen=True)
class ToolCallPart:
    """A piece of a call choice ``index`` is writing (a constrained call, streamed as it is written)."""

    index: int
    part: CallPart


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


EMBED_BUCKETS = (16, 32, 64, 128, 256, 512)
GRAMMARS_KEPT = 64      # NOTE: compiled grammars a model keeps for requests that send the same schema


@dataclass(eq=False)
class ServedModel:
    """One model of a server. ``kind``: "generate" (a causal LM: chat and text completions) or
    "embed" (an encoder: embeddings, mean-pooled over the real tokens and L2-normalised)."""

    name: str
    dm: DistributedModel
    tokenizer: Any
    kind: str
    context: int
    eos: tuple[int, ...] = ()
    inputs: tuple[str, ...] = ()       # an ONNX encoder's graph inputs, fed by name
    sessions: int | None = None        # sessions it kept KV room for (None: generate.max-sessions)
    created: int = field(default_factory=lambda: int(time.time()))
    ready: threading.Event = field(default_factory=threading.Event)
    _token_texts: dict[int, tuple[str, list[int]]] = field(default_factory=dict, repr=False)
    _grammars: dict[str, Grammar] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        naming = getattr(self.dm, "name_as", None)
        if callable(naming) and getattr(self.dm, "label", "") is None:
            naming(f"model {self.name!r}")        # NOTE: the engine's messages name it as callers do

    def unavailable(self) -> str | None:
        """None while the deployment serves; else why it does not (closed, or stranded: the rest of
        the cluster cannot hold it). Blocks while the scheduler is asked: call it off the event loop."""
        ask = getattr(self.dm, "unavailable", None)
        return ask() if callable(ask) else None

    # --- generation ---------------------------------------------------------------------------
    def check_rows(self, request: GenerationRequest) -> None:
        """Refuse a request for more answers (``n`` per prompt) than the deployment makes at once
        (``DistributedModel.max_rows``: with KV room counted in tokens, more than its sessions),
        before any prompt is tokenised: a body of many short prompts costs nothing to refuse. Whether
        their tokens fit the room is the engine's to say once they are known."""
        most = int(self.dm.max_rows)
        rows = len(request.prompts) * request.n
        if rows > most:
            many = len(request.prompts) > most
            raise BadParam(f"this request asks for {len(request.prompts)} prompt(s) x n={request.n} = {rows} "
                           f"answers at once and model {self.name!r} makes at most {most}: send "
                           f"{'fewer prompts' if many else 'a smaller n'}", "prompt" if many else "n")

    def prompt_ids(self, request: GenerationRequest) -> list[list[int]]:
        """The token ids of each prompt of ``request`` (a chat through the model's chat template)."""
        tok = self.tokenizer
        if request.chat:
            if not getattr(tok, "chat_template", None):
                raise BadParam(f"model {self.name!r} has no chat template: use /v1/completions", "messages")
            messages, extra = request.prompts[0], {}
            if request.tools:
                if template_takes_tools(tok):
                    extra = {"tools": as_openai(request.tools)}
                else:
                    messages = messages_with_tools(messages, request.tools)
            try:
                out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
            except Exception as e:  # noqa: BLE001 - a template's own refusal (its roles, their order)
                raise BadParam(f"the chat template of model {self.name!r} refused these messages: "
                               f"{type(e).__name__}: {e}", "messages") from None
            ids = out["input_ids"] if hasattr(out, "keys") else out
            rows = [list(map(int, ids))]
        else:
            rows = [list(p) if isinstance(p, list) else list(tok(p)["input_ids"]) for p in request.prompts]
        vocab = len(tok)
        for i, r in enumerate(rows):
            if not r:
                raise BadParam(f"prompt {i} has no tokens", "prompt")
            bad = [t for t in r if not 0 <= t < vocab]
            if bad:
                raise BadParam(f"prompt {i} holds token ids outside the vocabulary of {vocab}: {bad[:5]}",
                               "prompt")
        return rows

    def budget(self, rows: Sequence[Sequence[int]], max_tokens: int | None) -> int:
        """New tokens each answer may have: ``max_tokens``, or what the context leaves (at most
        ``serve.default-max-tokens``); a prompt or ``max_tokens`` past the context is refused."""
        from .. import config

        longest = max(len(r) for r in rows)
        room = self.context - longest
        if room < 1:
            raise BadParam(f"the prompt is {longest} tokens and model {self.name!r} has a context of "
                           f"{self.context}: shorten it", "messages")
        if max_tokens is None:
            return min(room, int(config.get("serve.default-max-tokens")))
        if max_tokens > room:
            raise BadParam(f"max_tokens={max_tokens} and the prompt's {longest} tokens exceed the context of "
                           f"model {self.name!r} ({self.context} tokens): ask for at most {room}",
                           "max_tokens")
        return max_tokens

    def answer(self, request: GenerationRequest, rows: list[list[int]], max_new: int,
               stopped: threading.Event | None = None) -> Iterator[Delta | ToolCallPart | ToolCalls | Finish]:
        """Generate for every prompt ``n`` times; events as tokens come. Setting ``stopped``
        (the caller went away) ends the call at its next token and frees its sessions."""
        choices = [r for r in rows for _ in range(request.n)]
        width = max(len(r) for r in choices)
        ids = torch.zeros((len(choices), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(choices):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        s = request.sampling
        self.check_tokens(request)
        grammar = self.grammar(request)
        generator = torch.Generator().manual_seed(s.seed % 2**63) if s.seed is not None else None
        kwargs: dict[str, Any] = {}
        if s.greedy is not None:
            kwargs["do_sample"] = not s.greedy
        if s.temperature:
            kwargs["temperature"] = s.temperature
        if s.top_p is not None:
            kwargs["top_p"] = s.top_p
        if s.greedy is False or s.top_k:
            kwargs["top_k"] = s.top_k      # NOTE: 0 is off; Hugging Face's default is 50
        # NOTE: the answer ends at the model's end-of-text tokens (unless ``ignore_eos``) and the request's
        eos = tuple(dict.fromkeys((*(() if request.ignore_eos else self.eos), *request.stop_token_ids)))
        stream = self.dm.stream(ids, max_new, attention_mask=mask, generator=generator,
                                eos_token_id=list(eos) if eos or request.ignore_eos else None,
                                pad_token_id=self.eos[0] if self.eos else None, logprobs=s.logprobs,
                                min_new_tokens=s.min_tokens, repetition_penalty=s.repetition_penalty,
                                frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                                logit_bias=dict(s.logit_bias), grammar=grammar, **kwargs)
        made = [Detokenized(self.tokenizer) for _ in choices]
        scans = [StopScan(request.stop, armed=s.min_tokens <= 1) for _ in choices]
        pending: list[list[TokenLogprob]] = [[] for _ in choices]
        done = [False] * len(choices)
        ends = set(eos)
        calls = request.tools and request.tool_choice != "none"
        held = [calls] * len(choices)     # NOTE: an answer that may be a tool call is sent once it is known
        # NOTE: a call goes out piece by piece as it is written: one the grammar constrains, or under
        # "auto" one whose head names a known tool (the answer is then its calls, read below)
        readers = [CallReader(frozenset(t.name for t in request.tools)) for _ in choices] if calls else None
        free = request.structure is None
        try:
            for step in stream:
                lps = stream.logprobs if s.logprobs is not None else None
                for i, t in enumerate(step.tolist()):
                    if done[i]:
                        continue
                    if len(made[i].tokens) + 1 == s.min_tokens:
                        scans[i].arm()        # NOTE: stop strings count from the answer's min_tokens-th token
                    whole = made[i].add(t)
                    end = t in ends
                    lp = lps[i] if lps is not None else None
                    if lp is not None and not end:
                        pending[i].append(lp)
                    final = end or len(made[i].tokens) >= max_new
                    if not (whole or final):
                        continue              # NOTE: half a character: wait for its other bytes
                    delta = scans[i].feed(made[i].full() if final else made[i].text, final=final)
                    ended = scans[i].stopped or final
                    if held[i]:
                        if readers is not None:
                            written = scans[i].text if ended else scans[i].text[:scans[i].sent]
                            for part in readers[i].feed(written):
                                yield ToolCallPart(i, part)
                        # NOTE: under "auto", calls that went out and text after them: the answer ends
                        lost = free and readers is not None and readers[i].lost and bool(readers[i].ids)
                        if not ended and not lost and could_be_call(scans[i].text[:scans[i].sent]):
                            continue              # NOTE: its text and log-probabilities wait in the scan
                        held[i] = False
                        sent = readers[i].ids if readers is not None else None
                        made_calls = read_calls(scans[i].text, request.tools, sent) if ended else None
                        if not made_calls and sent and readers is not None:
                            # NOTE: its calls went out, then it wrote on: the calls it wrote whole answer
                            made_calls = read_calls(scans[i].text[:readers[i].complete], request.tools, sent)
                        if made_calls:
                            done[i] = True
                            yield ToolCalls(i, tuple(made_calls), streamed=bool(sent))
                            yield Finish(i, "tool_calls", len(made[i].tokens),
                                         getattr(stream, "admitted", None))
                            continue
                        # NOTE: all of it so far, as text (a stream whose call's pieces went out sends none)
                        delta = scans[i].text[:scans[i].sent]
                    # NOTE: log-probabilities alone go only where no text is held back (a stop string's start)
                    if delta or (pending[i] and not scans[i].stopped and scans[i].sent == len(scans[i].text)):
                        yield Delta(i, delta, len(made[i].tokens), tuple(pending[i]))
                        pending[i] = []
                    if ended:
                        done[i] = True
                        yield Finish(i, "length" if not (end or scans[i].stopped) else "stop",
                                     len(made[i].tokens), getattr(stream, "admitted", None))
                if all(done) or (stopped is not None and stopped.is_set()):
                    break
        finally:
            stream.close()          # NOTE: ends the call at its next step and frees its sessions

    def grammar(self, request: GenerationRequest) -> Grammar | None:
        """What every answer of ``request`` must be, compiled for this model's tokenizer (None: any
        text); cached by what it says."""
        st = request.structure
        if st is None:
            return None
        if request.ignore_eos:
            raise BadParam("'ignore_eos' and a structured answer cannot go together: the answer ends where "
                           "its structure is complete", "ignore_eos")
        key = json.dumps([st.kind, st.schema, [(t.name, t.parameters) for t in st.tools]], sort_keys=True)
        with self._lock:
            got = self._grammars.get(key)
        if got is None:
            try:
                if st.kind == "tool_call":
                    names = ", ".join(t.name for t in st.tools)
                    got = lark_grammar(self.tokenizer, self.eos, call_grammar(st.tools), f"a call of {names}")
                else:
                    got = json_grammar(self.tokenizer, self.eos, st.schema)
            except GrammarError as e:
                raise BadParam(f"model {self.name!r}: {e}",
                               "tools" if st.kind == "tool_call" else "response_format") from None
            with self._lock:
                self._grammars[key] = got
                while len(self._grammars) > GRAMMARS_KEPT:
                    self._grammars.pop(next(iter(self._grammars)))
        return got

    def check_tokens(self, request: GenerationRequest) -> None:
        """Refuse token ids (``logit_bias``, ``stop_token_ids``) the model's vocabulary lacks."""
        vocab = len(self.tokenizer)
        for name, ids in (("logit_bias", [t for t, _ in request.sampling.logit_bias]),
                          ("stop_token_ids", list(request.stop_token_ids))):
            bad = sorted(t for t in ids if t >= vocab)
            if bad:
                raise BadParam(f"'{name}' names token id(s) {bad[:5]} outside model {self.name!r}'s "
                               f"vocabulary of {vocab}", name)

    def token_text(self, token: int) -> tuple[str, list[int]]:
        """A token's text and its bytes, as OpenAI's log-probabilities name a token: a byte-level
        BPE token's own bytes (a piece of a character too), else its decoded text's."""
        got = self._token_texts.get(token)
        if got is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece) if isinstance(piece, str) else None
            if self._byte_level and isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
                raw = bytes(_BYTE_OF[c] for c in piece)
            elif byte is not None:                  # NOTE: SentencePiece's byte fallback
                raw = bytes([int(byte.group(1), 16)])
            elif isinstance(piece, str) and "\u2581" in piece:      # NOTE: SentencePiece's space
                raw = piece.replace("\u2581", " ").encode("utf-8")
            else:
                raw = str(self.tokenizer.decode([token])).encode("utf-8")
            got = self._token_texts[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got

    @property
    def _byte_level(self) -> bool:
        """Whether the tokenizer writes bytes as GPT-2's byte-level BPE does (its decoder says so)."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        return type(decoder).__name__ == "ByteLevel"

    # --- embeddings -----------------------------------------------------------------------------
    def embed(self, request: EmbeddingRequest) -> tuple[list[Any], int]:
        """(one embedding per input, float lists or base64 of float32; tokens read)."""
        tok = self.tokenizer
        data, used = [], 0
        for i, item in enumerate(request.inputs):
            row = list(item) if isinstance(item, list) else list(tok(item, truncation=True,
                                                                      max_length=self.context)["input_ids"])
            if len(row) > self.context:
                raise BadParam(f"input {i} is {len(row)} tokens; model {self.name!r} reads at most "
                               f"{self.context}", "input")
            if any(not 0 <= t < len(tok) for t in row):
                raise BadParam(f"input {i} holds token ids outside the vocabulary of {len(tok)}", "input")
            used += len(row)
            vec = self.pool(row)
            data.append(vec.tolist() if request.encoding == "float" else
                        base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode())
        return data, used

    def pool(self, row: list[int]) -> torch.Tensor:
        """The embedding of one token row: the row padded to a bucket length (one program per
        bucket), its last hidden states averaged over the real tokens, L2-normalised."""
        length = next((b for b in EMBED_BUCKETS if b >= len(row)), len(row))
        ids = torch.zeros((1, length), dtype=torch.long)
        mask = torch.zeros_like(ids)
        ids[0, :len(row)] = torch.tensor(row)
        mask[0, :len(row)] = 1
        if self.inputs:
            feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
            out = self.dm(**{n: feed[n] for n in self.inputs})
        else:
            out = self.dm(ids, attention_mask=mask)
        hidden = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise BadInput(f"model {self.name!r} does not give (batch, tokens, width) hidden states to pool")
        m = mask.unsqueeze(-1).to(hidden.dtype)
        vec = (hidden * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(vec.float(), dim=-1)[0]
