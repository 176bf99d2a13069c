"""The Hugging Face face of generation: ``generate``'s arguments, results and streams.

A caller's ``input_ids`` (left padding and an ``attention_mask`` allowed) become one
prompt a row (``prompts_of``), its keyword arguments a ``GenerateArgs`` with the
defaults of the model's generation config, and the engine's tokens what Hugging Face
``generate`` returns (``generate_tokens``) or yields as they come (``stream_tokens``).
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BadInput
from .engine import Engine
from .grammar import Grammar
from .sampling import LogitRules, Sampling, TokenLogprob
from .sessions import Call, Session


def prompts_of(input_ids: Any, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """The real tokens of each row (those the mask keeps; every token without a mask)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        shape, dtype = getattr(input_ids, "shape", ""), getattr(input_ids, "dtype", "")
        got = f"{type(input_ids).__name__} {shape} {dtype}"
        raise BadInput(f"input_ids must be a (batch, length) LongTensor, got {got.strip()}")
    if attention_mask is None:
        rows = [r.tolist() for r in input_ids]
    else:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise BadInput(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                           f"{tuple(input_ids.shape)}: they must match")
        rows = [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise BadInput(f"row(s) {empty} of input_ids have no tokens the attention mask keeps")
    return rows


# NOTE: generate's keyword arguments that shape the logits (``LogitRules``, and a ``Grammar``)
RULES = ("min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
         "grammar")


@dataclass(frozen=True)
class GenerateArgs:
    """A generate call's settings, with Hugging Face's defaults from the model's generation config."""

    max_new: int
    sampling: Sampling
    eos: tuple[int, ...]
    pad: int

    @classmethod
    def make(cls, gen_config: Any, length: int, max_new_tokens: int | None = None,
             do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None, *, repetition_penalty: float | None = None,
             min_new_tokens: int | None = None, frequency_penalty: float | None = None,
             presence_penalty: float | None = None, logit_bias: Mapping[int, float] | None = None,
             logprobs: int | None = None, grammar: Grammar | None = None) -> GenerateArgs:
        def pick(value: Any, name: str, default: Any) -> Any:
            if value is not None:
                return value
            got = getattr(gen_config, name, None) if gen_config is not None else None
            return default if got is None else got

        if max_new_tokens is None:
            max_new_tokens = pick(None, "max_new_tokens", None)
            if max_new_tokens is None:
                max_new_tokens = max(1, int(pick(None, "max_length", 20)) - length)
        eos = pick(eos_token_id, "eos_token_id", ())
        eos_t = tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        pad = pick(pad_token_id, "pad_token_id", None)
        pad = int(pad) if pad is not None else (eos_t[0] if eos_t else 0)
        if logit_bias is not None and not isinstance(logit_bias, Mapping):
            raise BadInput(f"logit_bias must map token ids to values, got {type(logit_bias).__name__}")
        rules = LogitRules(int(pick(min_new_tokens, "min_new_tokens", 0) or 0),
                           tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
                           float(pick(repetition_penalty, "repetition_penalty", 1.0)),
                           float(frequency_penalty or 0.0), float(presence_penalty or 0.0))
        sampling = Sampling(bool(pick(do_sample, "do_sample", False)),
                            float(pick(temperature, "temperature", 1.0)), int(pick(top_k, "top_k", 50) or 0),
                            float(pick(top_p, "top_p", 1.0)), generator, rules, logprobs, grammar)
        if grammar is not None and not eos_t:
            raise BadInput("a grammar ends an answer with an end-of-text token where it is complete: give "
                           "eos_token_id")
        return cls(int(max_new_tokens), sampling, eos_t, pad)


class TokenStream:
    """The tokens of one call, a (batch,) tensor per step, as they come (``DistributedModel.stream``).
    After each step, ``logprobs`` holds each row's ``TokenLogprob`` (None for a row that ended), where
    the call asked for them (``logprobs=``); ``close`` ends the call at its next step."""

    def __init__(self, engine: Engine, call: Call, input_ids: torch.Tensor, streamer: Any) -> None:
        self.logprobs: list[TokenLogprob | None] | None = None
        self.holds: Any = None         # what must live while it is read (a chat session)
        self._call, self._engine, self._streamer = call, engine, streamer
        self._rows = self._read(engine, call, input_ids, streamer)

    @property
    def admitted(self) -> float | None:
        """When the scheduler admitted the call (``time.perf_counter``), once it did."""
        return self._call.admitted

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> torch.Tensor:
        return next(self._rows)

    def close(self) -> None:
        """End the call at its next step and free its sessions, read or not."""
        if inspect.getgeneratorstate(self._rows) == inspect.GEN_CREATED:
            # NOTE: never read: closing the generator would skip its ``finally``
            self._engine.stopped(self._call, 0)
            if self._streamer is not None:
                self._streamer.end()
        self._rows.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at collection, nothing can be told
            pass

    def _read(self, engine: Engine, call: Call, input_ids: torch.Tensor,
              streamer: Any) -> Generator[torch.Tensor, None, None]:
        if streamer is not None:
            streamer.put(input_ids.cpu())
        seen = 0
        try:
            for row in engine.results(call):
                if call.sampling.logprobs is not None:
                    self.logprobs = call.logprobs.popleft()
                if streamer is not None:
                    streamer.put(row)
                seen += 1
                yield row
        finally:
            engine.stopped(call, seen)     # NOTE: a caller that stops reading frees its sessions
            if streamer is not None:
                streamer.end()


def stream_tokens(engine: Engine, input_ids: torch.Tensor, args: GenerateArgs,
                  attention_mask: torch.Tensor | None = None, streamer: Any = None,
                  session: Session | None = None) -> TokenStream:
    """The tokens of one call, a (batch,) tensor per step, as they come; ``streamer`` is fed too."""
    prompts = prompts_of(input_ids, attention_mask)
    call = engine.submit(prompts, args.max_new, args.sampling, args.eos, args.pad,
                         sessions=[session] if session is not None else None)
    return TokenStream(engine, call, input_ids, streamer)


def generate_tokens(engine: Engine, input_ids: torch.Tensor, args: GenerateArgs,
                    attention_mask: torch.Tensor | None = None, streamer: Any = None,
                    session: Session | None = None) -> torch.Tensor:
    """What Hugging Face ``generate`` returns: the prompt then the new tokens (``pad`` after EOS)."""
    rows = list(stream_tokens(engine, input_ids, args, attention_mask, streamer, session))
    return torch.cat([input_ids.cpu(), torch.stack(rows, dim=1)], dim=1)
