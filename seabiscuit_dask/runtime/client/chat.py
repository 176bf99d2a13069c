"""``ChatSession``: a conversation with a deployed model whose KV cache stays on the workers.

Each turn prefills only its own tokens: the earlier turns and their answers are cached where
the model's attention blocks are (``dm.session()``).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ...errors import BadInput, SessionClosed
from ..generation import Engine, GenerateArgs, stream_tokens


class GeneratingModel(Protocol):
    """What a session reads of its model (a ``DistributedModel``)."""

    model_id: str

    def _generation_engine(self) -> Engine: ...

    def _generation_args(self, input_ids: Any, max_new_tokens: Any, do_sample: Any, temperature: Any,
                         top_k: Any, top_p: Any, eos: Any, pad: Any, generator: Any,
                         attention_mask: Any = None, **rules: Any) -> tuple[Engine, GenerateArgs]: ...


class ChatSession:
    """A session of a ``DistributedModel`` kept across calls (``dm.session()``)."""

    def __init__(self, dm: GeneratingModel, session: Any) -> None:
        self.dm, self._session, self._closed = dm, session, False
        self._engine = dm._generation_engine()
        # NOTE: a session its caller drops unclosed frees its slot and caches all the same
        self._finalizer = weakref.finalize(self, self._engine.close_session, session, False)
        self._finalizer.atexit = False

    @property
    def tokens(self) -> list[int]:
        """Every token of the conversation so far (prompts and answers)."""
        return list(self._session.tokens)

    def stream(self, input_ids: Any, max_new_tokens: int | None = None, **kwargs: Any) -> Any:
        """``DistributedModel.stream`` for this conversation's next turn (a (1, n) LongTensor); its
        keyword arguments too (logit rules, ``logprobs``)."""
        if self._closed:
            raise SessionClosed(f"session {self._session.sid} of model {self.dm.model_id} is closed; open "
                                "another (dm.session())")
        if getattr(input_ids, "shape", (0,))[0] != 1:
            raise BadInput(f"a session takes one prompt per turn, got input_ids of shape "
                           f"{tuple(getattr(input_ids, 'shape', ()))}")
        streamer = kwargs.pop("streamer", None)
        mask = kwargs.pop("attention_mask", None)
        names = ("do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "generator")
        do_sample, temperature, top_k, top_p, eos, pad, generator = [kwargs.pop(n, None) for n in names]
        engine, args = self.dm._generation_args(input_ids, max_new_tokens, do_sample, temperature, top_k,
                                                top_p, eos, pad, generator, attention_mask=mask, **kwargs)
        stream = stream_tokens(engine, input_ids, args, mask, streamer, session=self._session)
        # NOTE: ``dm.session().stream(...)`` drops the session at once, and its finalizer would close
        # it under its own turn: the stream keeps it alive while it is read
        stream.holds = self
        return stream

    def generate(self, input_ids: Any, max_new_tokens: int | None = None, **kwargs: Any) -> Any:
        """This turn's prompt followed by its answer, as ``DistributedModel.generate`` returns it."""
        rows = list(self.stream(input_ids, max_new_tokens, **kwargs))
        return torch.cat([input_ids.cpu(), torch.stack(rows, dim=1)], dim=1)

    def close(self) -> None:
        """Free the conversation's KV cache on every worker."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            self._engine.close_session(self._session)

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
