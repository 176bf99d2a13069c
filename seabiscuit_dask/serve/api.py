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
    """How a request picks tokens, as the API says it (``None``: the model's generation config).
    ``top_k`` 0 is off; ``logit_bias`` pairs token ids with values added to their logits;
    ``logprobs``: None, or how many likeliest tokens come with each picked one's log-probability."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int = 0
    min_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    @property
    def greedy(self) -> bool | None:
        return None if self.temperature is None else self.temperature == 0


@dataclass(frozen=True)
class Structure:
    """What an answer must be: any JSON object (``json_object``), JSON valid under ``schema``
    (``json_schema``), or a call of one of ``tools`` (``tool_call``: its arguments valid under that
    tool's parameters)."""

    kind: str
    schema: dict[str, Any] | None = None
    name: str | None = None
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, the JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class GenerationRequest:
    """A chat or text completion request, checked: the model, the prompt(s) and how to answer.
    ``ignore_eos``: answers go on past the model's end-of-text tokens (to ``max_tokens``);
    ``stop_token_ids``: tokens that end an answer as those do."""

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
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    unknown: tuple[str, ...] = ()       # fields it held that this server does not know (logged)
    structure: Structure | None = None  # what the answer must be (``response_format``), or None: any text
    tools: tuple[Tool, ...] = ()        # functions the model is told of
    tool_choice: str = "none"           # "none", "auto", "required", or the name of the tool it must call
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


# NOTE: fields of OpenAI's API and vLLM's extensions this server does not do, and the values
# meaning "off" that are taken: any other value is refused, naming the field
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"), "best_of": (None, 1),
    "suffix": (None, ""), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "allowed_token_ids": (None,),
    "bad_words": (None, []), "prompt_logprobs": (None,), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "truncate_prompt_tokens": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True), "chat_template": (None,),
    "documents": (None,), "web_search_options": (None,), "logits_processors": (None,),
}
# NOTE: fields that change nothing of an answer (who asks, how it is stored or billed), taken and let be
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
           "reasoning_effort", "safety_identifier", "prompt_cache_key", "request_id", "priority",
           "chat_template_kwargs", "add_special_tokens", "spaces_between_special_tokens", "verbosity")
TAKEN_CHAT = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n",
              "stop", "stream", "top_k", "min_tokens", "ignore_eos", "frequency_penalty", "presence_penalty",
              "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "stop_token_ids",
              "response_format", "tools", "tool_choice")
TAKEN_COMPLETION = (*[f for f in TAKEN_CHAT if f not in ("messages", "max_completion_tokens", "top_logprobs",
                                                         "tools", "tool_choice")], "prompt", "echo")
MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_BIAS = 300          # NOTE: OpenAI's bound on logit_bias entries


def _unsupported(data: Mapping[str, Any], taken: tuple[str, ...]) -> list[str]:
    """Refuse a field this server does not do, set to anything but "off"; the names of fields it
    does not know at all (the caller logs them: vLLM ignores such fields with a warning)."""
    for name, off in UNSUPPORTED.items():
        value = data.get(name)
        if name in data and not any(type(value) is type(o) and value == o for o in off):
            raise BadParam(f"'{name}' is not supported by this server (set to {_short(value)}); leave "
                           "it out", name)
    return sorted(k for k in data if k not in taken and k not in UNSUPPORTED and k not in IGNORED)


def _logit_bias(data: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    raw = _take(data, "logit_bias", dict, {})
    if len(raw) > MAX_BIAS:
        raise BadParam(f"'logit_bias' may hold at most {MAX_BIAS} tokens, got {len(raw)}", "logit_bias")
    out = []
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise BadParam(f"'logit_bias' keys must be token ids written as strings (\"1234\"), got {key!r}",
                           "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadParam(f"'logit_bias' values must be numbers in [-100, 100], got {_short(value)} for "
                           f"token {key}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _schema(schema: Any, where: str) -> dict[str, Any]:
    """A JSON schema, checked as one (Draft 2020-12's meta-schema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise BadParam(f"{where} must be a JSON schema (an object), got {_json_type(type(schema))}", where)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise BadParam(f"{where} is not a valid JSON schema: {e.message}", where) from None
    return schema


def _response_format(data: Mapping[str, Any]) -> Structure | None:
    """``response_format``: None for ``{"type": "text"}`` (or none), else what the answer must be."""
    fmt = _take(data, "response_format", dict)
    if fmt is None:
        return None
    kind = _take(fmt, "type", str, required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    if kind != "json_schema":
        raise BadParam(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                       "response_format")
    spec = _take(fmt, "json_schema", dict, required=True)
    name = _take(spec, "name", str, "answer")
    return Structure("json_schema", _schema(spec.get("schema", {}), "response_format.json_schema.schema"),
                     name)


def _tools(data: Mapping[str, Any]) -> tuple[tuple[Tool, ...], str]:
    """``tools`` and ``tool_choice``: the tools, and "none", "auto", "required" or a tool's name."""
    raw = _take(data, "tools", list, [])
    if len(raw) > MAX_TOOLS:
        raise BadParam(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(raw)}", "tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise BadParam(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                           f"tools[{i}]")
        name = _take(fn, "name", str, required=True)
        if not _TOOL_NAME.fullmatch(name):
            raise BadParam(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got "
                           f"{_short(name)}", f"tools[{i}].function.name")
        given = fn.get("parameters")
        params = _schema({"type": "object", "properties": {}} if given is None else given,
                         f"tools[{i}].function.parameters")
        tools.append(Tool(name, _take(fn, "description", str, ""), params))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        twice = sorted(n for n in set(names) if names.count(n) > 1)
        raise BadParam(f"'tools' names a function twice: {twice}", "tools")
    choice = data.get("tool_choice")
    if choice is None:
        return tuple(tools), "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadParam(f"'tool_choice' must be none, auto, required or a function, got {choice!r}",
                           "tool_choice")
        if choice != "none" and not tools:
            raise BadParam(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return tuple(tools), choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise BadParam("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", "tool_choice")
    if name not in names:
        raise BadParam(f"'tool_choice' names function {name!r}, which 'tools' does not have "
                       f"({', '.join(names) or 'none'})", "tool_choice")
    return tuple(tools), name


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
    top_k = _take(data, "top_k", int, 0)
    _range("top_k", top_k, -1, 2**31)
    min_tokens = _take(data, "min_tokens", int, 0)
    _range("min_tokens", min_tokens, 0, 2**31)
    if limit is not None and min_tokens > limit:
        raise BadParam(f"'min_tokens' ({min_tokens}) must be at most 'max_tokens' ({limit})", "min_tokens")
    penalties = {}
    for name in ("frequency_penalty", "presence_penalty"):
        penalties[name] = _take(data, name, float, 0.0)
        _range(name, penalties[name], -2, 2)
    repetition = _take(data, "repetition_penalty", float, 1.0)
    _range("repetition_penalty", repetition, 0, 2, lo_open=True)
    if chat:
        wants = _take(data, "logprobs", bool, False)
        top = _take(data, "top_logprobs", int)
        _range("top_logprobs", top, 0, MAX_LOGPROBS)
        if top is not None and not wants:
            raise BadParam("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if wants else None
    else:
        logprobs = _take(data, "logprobs", int)
        _range("logprobs", logprobs, 0, MAX_LOGPROBS)
    stop_ids = _take(data, "stop_token_ids", list, [])
    if len(stop_ids) > 64 or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                     for t in stop_ids):
        raise BadParam(f"'stop_token_ids' must be up to 64 token ids, got {_short(stop_ids)}",
                       "stop_token_ids")
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
    sampling = Sampling(temperature, top_p, seed, max(top_k, 0), min_tokens, penalties["frequency_penalty"],
                        penalties["presence_penalty"], repetition, _logit_bias(data), logprobs)
    return {"model": model, "max_tokens": limit, "sampling": sampling, "stop": stop, "n": n, "stream": stream,
            "include_usage": include_usage, "ignore_eos": _take(data, "ignore_eos", bool, False),
            "stop_token_ids": tuple(stop_ids), "structure": _response_format(data)}


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
        calls = _tool_calls(m, i) if role == "assistant" else None
        if calls and content is None:
            content = ""
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
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            message["tool_call_id"] = _take(m, "tool_call_id", str, "")
        out.append(message)
    common = _common(data, chat=True)
    tools, choice = _tools(data)
    if choice not in ("none", "auto"):
        if common["structure"] is not None:
            raise BadParam(f"'tool_choice' {choice!r} and 'response_format' each say what the answer must "
                           "be: send one of them", "tool_choice")
        chosen = tuple(t for t in tools if choice == "required" or t.name == choice)
        common["structure"] = Structure("tool_call", tools=chosen)
    return GenerationRequest(prompts=[out], chat=True, unknown=tuple(_unsupported(data, TAKEN_CHAT)),
                             tools=tools if choice != "none" else (), tool_choice=choice, **common)


def _tool_calls(m: Mapping[str, Any], i: int) -> list[dict[str, Any]] | None:
    """An assistant message's ``tool_calls`` as chat templates read them: each a function's name and
    its arguments (an object, read from the JSON text OpenAI's API sends)."""
    raw = m.get("tool_calls")
    if raw is None or raw == []:
        return None
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise BadParam(f"{where} must be an array of calls", where)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str):
            raise BadParam(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"arguments\": ...}}", where)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
                _check_tree(args)           # NOTE: parsed after the body was checked: the same bounds
            except (ValueError, RecursionError):
                raise BadParam(f"{where}[{j}].function.arguments is not JSON: {_short(args)}",
                               where) from None
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls


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
    common = _common(data, chat=False)
    return GenerationRequest(prompts=prompts, chat=False, echo=echo,
                             unknown=tuple(_unsupported(data, TAKEN_COMPLETION)), **common)


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
    what can be sent now: an end of the text that may still grow into a stop string is held back.
    A scan made not ``armed`` looks for stop strings only from where the text was when ``arm``
    was called (``min_tokens``: an answer stops at none before its minimum length)."""

    def __init__(self, stop: tuple[str, ...], armed: bool = True) -> None:
        self.stop = stop
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.start: int | None = 0 if armed else None

    def arm(self) -> None:
        """Stop strings count from here on."""
        if self.start is None:
            self.start = len(self.text)

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def feed(self, text: str, final: bool = False) -> str:
        """``text``: the whole answer so far; what to send of it now."""
        if self.stopped:
            return ""
        self.text = text
        start = self.start
        cut = -1 if start is None else \
            min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            end = cut
        elif final or start is None:
            end = len(text)
        else:
            end = max(self.sent, start, len(text) - self._held(text))
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
