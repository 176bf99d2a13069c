"""The OpenAI API's shapes: request bodies read and checked into plain records, answers and
errors written as OpenAI's clients expect them. No HTTP and no model here.

Every refusal is a ``SeaBiscuitError`` subclass; ``error_reply`` maps each to its HTTP status
and OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    BadInput,
    Busy,
    ClusterTooSmall,
    ModelClosed,
    QueueTimeout,
    SeaBiscuitError,
    WorkerLost,
)


class BadParam(BadInput):
    """A request parameter has the wrong type or an impossible value; ``param`` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownModel(SeaBiscuitError):
    """A request names a model this server does not serve."""


class Unauthorized(SeaBiscuitError):
    """The request carries no API key, or the wrong one."""


class Starting(SeaBiscuitError):
    """The model is still being deployed or its step programs built: ``GET /health`` says when."""


class TooLarge(BadInput):
    """A request body is larger than ``seabiscuit.serve.max-body-bytes``."""


class SlowBody(BadInput):
    """A request body did not arrive within ``seabiscuit.serve.body-timeout-s``."""


class ClientGone(SeaBiscuitError):
    """The caller hung up before its answer was ready: nobody reads what follows."""


# (status, OpenAI error type, code) per cause; the first class that matches wins
STATUS: list[tuple[type[BaseException], int, str, str | None]] = [
    (Unauthorized, 401, "invalid_request_error", "invalid_api_key"),
    (UnknownModel, 404, "invalid_request_error", "model_not_found"),
    (TooLarge, 413, "invalid_request_error", "request_too_large"),
    (SlowBody, 408, "invalid_request_error", "request_timeout"),
    (ClientGone, 499, "invalid_request_error", "client_closed_request"),
    (QueueTimeout, 503, "service_unavailable", "queue_timeout"),
    (Busy, 429, "rate_limit_exceeded", "too_many_sessions"),
    (BadInput, 400, "invalid_request_error", None),
    (WorkerLost, 503, "service_unavailable", "model_unavailable"),
    (ClusterTooSmall, 503, "service_unavailable", "model_unavailable"),
    (ModelClosed, 503, "service_unavailable", "model_closed"),
    (Starting, 503, "service_unavailable", "model_starting"),
]


def error_reply(error: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) of ``error``; anything unforeseen is a 500 whose message
    names its type only (the details go to the server's log, not to the caller)."""
    for cls, status, kind, code in STATUS:
        if isinstance(error, cls):
            return status, error_body(str(error), kind, getattr(error, "param", None), code)
    if isinstance(error, SeaBiscuitError):
        return 500, error_body(str(error), "server_error", None, type(error).__name__)
    return 500, error_body(f"internal error ({type(error).__name__}); see the server's log", "server_error",
                           None, None)


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- reading bodies ------------------------------------------------------------------------------
MAX_DEPTH = 32          # NOTE: arrays and objects within each other; OpenAI's bodies need 5
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object of UTF-8 text, nested at most ``MAX_DEPTH`` deep, or ``BadParam``."""
    try:
        text = body.decode("utf-8")     # NOTE: strict: json.loads(bytes) would let encoded surrogates in
    except UnicodeDecodeError as e:
        raise BadParam(f"the request body is not valid UTF-8: byte {e.start} ({body[e.start:e.end]!r}) "
                       f"{e.reason}; send JSON as UTF-8") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise BadParam(f"the request body is nested too deeply for this server to read (at most {MAX_DEPTH} "
                       "arrays and objects within each other)") from None
    except ValueError as e:
        raise BadParam(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadParam(f"the request body must be a JSON object, got {type(data).__name__}")
    _check_tree(data)
    return data


def _check_tree(data: Any) -> None:
    """Refuse JSON nested deeper than ``MAX_DEPTH`` and strings (keys too) holding a lone surrogate
    (``"\\ud800"`` is valid JSON but no Unicode text: tokenizers and encoders fail on it)."""
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise BadParam(f"{_path_text(path) or 'the body'} holds a lone surrogate (a \\ud800-\\udfff "
                               "escape that is not half of a pair): send Unicode text", _path_text(path))
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:
            raise BadParam(f"{_path_text(path)} is nested too deeply: at most {MAX_DEPTH} arrays and objects "
                           "within each other", _path_text(path[:1]))
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(k, str) and _SURROGATE.search(k):
                raise BadParam(f"a key of {_path_text(path) or 'the body'} holds a lone surrogate: send "
                               "Unicode text", _path_text(path) or None)
            todo.append((v, (*path, k)))


def _path_text(path: tuple[str | int, ...]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(path))


def _take(data: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None,
          *, required: bool = False) -> Any:
    if name not in data or data[name] is None:
        if required:
            raise BadParam(f"'{name}' is required", name)
        return default
    value = data[name]
    want = kinds if isinstance(kinds, tuple) else (kinds,)
    # NOTE: a bool is an int to Python, never to a JSON schema; an int is a fine float
    ok = isinstance(value, want) and not (isinstance(value, bool) and bool not in want)
    if not ok and float in want and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        names = " or ".join(_json_type(k) for k in want)
        raise BadParam(f"'{name}' must be {names}, got {_json_type(type(value))} {_short(value)}", name)
    return value


def _json_type(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
            dict: "an object", type(None): "null"}.get(kind, kind.__name__)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _range(name: str, value: float | int | None, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise BadParam(f"'{name}' must be in {left}{lo:g}, {hi:g}], got {value}", name)


@dataclass(frozen=True)
class Sampling:
    """How a request picks tokens, as the API says it (``None``: the model's generation config)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool | None:
        return None if self.temperature is None else self.temperature == 0


@dataclass(frozen=True)
class GenerationRequest:
    """A chat or text completion request, checked: the model, the prompt(s) and how to answer."""

    model: str
    prompts: list[Any]                  # chat: one list of messages; completions: strings or token lists
    chat: bool
    max_tokens: int | None
    sampling: Sampling
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    echo: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "functions", "tool_choice", "function_call",
               "response_format", "logit_bias", "best_of", "suffix", "audio", "modalities", "prediction")
MAX_N = 16
MAX_STOP = 4


def _unsupported(data: Mapping[str, Any]) -> None:
    for name in UNSUPPORTED:
        value = data.get(name)
        off = value is None or value is False or value == [] or value == {} or (
            type(value) is int and value == {"top_logprobs": 0, "best_of": 1}.get(name))
        if not off:
            raise BadParam(f"'{name}' is not supported by this server; leave it out", name)


def _common(data: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    model = _take(data, "model", str, required=True)
    limit = _take(data, "max_completion_tokens", int) if chat else None
    limit = limit if limit is not None else _take(data, "max_tokens", int)
    if limit is not None and limit < 1:
        raise BadParam(f"'max_tokens' must be at least 1, got {limit}", "max_tokens")
    temperature = _take(data, "temperature", float)
    _range("temperature", temperature, 0, 2)
    top_p = _take(data, "top_p", float)
    _range("top_p", top_p, 0, 1, lo_open=True)
    seed = _take(data, "seed", int)
    if seed is not None and not -2**63 <= seed < 2**64:
        raise BadParam(f"'seed' must fit 64 bits, got {seed}", "seed")
    n = _take(data, "n", int, 1)
    _range("n", n, 1, MAX_N)
    stop = _take(data, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadParam(f"'stop' must be a non-empty string or up to {MAX_STOP} of them, got "
                       f"{_short(list(stop))}", "stop")
    stream = _take(data, "stream", bool, False)
    options = _take(data, "stream_options", dict)
    include_usage = _take(options or {}, "include_usage", bool, False)
    if options is not None and not stream:
        raise BadParam("'stream_options' is only allowed with 'stream': true", "stream_options")
    _unsupported(data)
    return {"model": model, "max_tokens": limit, "sampling": Sampling(temperature, top_p, seed), "stop": stop,
            "n": n, "stream": stream, "include_usage": include_usage}


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(data: Mapping[str, Any]) -> GenerationRequest:
    """A ``/v1/chat/completions`` body, checked."""
    messages = _take(data, "messages", list, required=True)
    if not messages:
        raise BadParam("'messages' must hold at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadParam(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = _take(m, "role", str, required=True)
        if role not in ROLES:
            raise BadParam(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                           f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):      # NOTE: the parts form: text parts only
            texts = []
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(text, str):
                    raise BadParam(f"messages[{i}].content: only text parts are supported",
                                   f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise BadParam(f"messages[{i}].content must be a string or text parts, got "
                           f"{_json_type(type(content))}", f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return GenerationRequest(prompts=[out], chat=True, **_common(data, chat=True))


def parse_completion(data: Mapping[str, Any]) -> GenerationRequest:
    """A ``/v1/completions`` body, checked: ``prompt`` is a string, strings, token ids or lists of them."""
    prompt = _take(data, "prompt", (str, list), required=True)
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise BadParam("'prompt' must be a string, an array of strings, an array of token ids or an array "
                       "of such arrays, none empty", "prompt")
    echo = _take(data, "echo", bool, False)
    return GenerationRequest(prompts=prompts, chat=False, echo=echo, **_common(data, chat=False))


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[Any]       # strings or token-id lists
    encoding: str


def parse_embedding(data: Mapping[str, Any]) -> EmbeddingRequest:
    model = _take(data, "model", str, required=True)
    raw = _take(data, "input", (str, list), required=True)
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        inputs = [list(raw)]
    elif raw and all(isinstance(p, str) or (isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in raw):
        inputs = list(raw)
    else:
        raise BadParam("'input' must be a string, an array of strings or token-id arrays, none empty",
                       "input")
    if any(isinstance(s, str) and not s for s in inputs):
        raise BadParam("'input' must not hold empty strings", "input")
    encoding = _take(data, "encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise BadParam(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", "encoding_format")
    if data.get("dimensions") is not None:
        raise BadParam("'dimensions' is not supported by this server's models; leave it out", "dimensions")
    return EmbeddingRequest(model, inputs, encoding)


# --- stop strings --------------------------------------------------------------------------------
class StopScan:
    """The text of one answer as its tokens come, cut at the first stop string. ``feed`` returns
    what can be sent now: an end of the text that may still grow into a stop string is held back."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def feed(self, text: str, final: bool = False) -> str:
        """``text``: the whole answer so far; what to send of it now."""
        if self.stopped:
            return ""
        self.text = text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            end = cut
        else:
            end = len(text) if final else max(self.sent, len(text) - self._held(text))
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
