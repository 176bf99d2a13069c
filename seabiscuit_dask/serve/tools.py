"""Tool calls: how a chat model is told of ``tools`` and how its calls are written and read.

A model whose chat template takes ``tools`` gets them through it (its own format). Any other
is told of them in its system message and calls one as Hermes-style models do::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` "required" or a function's name constrains the answer to such a call
(``call_grammar``: the arguments valid under that tool's parameters); "auto" leaves the
answer free and reads a call out of it where it is one (``read_calls``). Either way a call is
streamed as it is written (``CallReader``), under "auto" once its head names a known tool.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..runtime.generation.grammar import JSON_OPTIONS
from .api import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# NOTE: a call's head as Hermes-style models and ``call_grammar`` write it: its name, then its arguments
_NAMED = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*'
_HEAD = re.compile(r"\s*" + re.escape(OPEN) + r"\s*" + _NAMED)
_ARGS_AT = re.compile(_NAMED)


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text (as OpenAI sends
    them), with an id the caller's ``role: "tool"`` answer names."""

    name: str
    arguments: str
    id: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def as_openai(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def messages_with_tools(messages: list[dict[str, Any]], tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """``messages`` for a template that knows nothing of tools: the tools described in the system
    message, the assistant's earlier calls and the tools' answers written as text."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                   ensure_ascii=False) for t in tools)
    told = ("You can call these functions; each line is one, with the JSON schema of its arguments:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call one, answer with nothing but\n"
            f'{OPEN}\n{{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}}'
            f"\n{CLOSE}")
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            written = "\n".join(f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]},
                                                         ensure_ascii=False) + f"\n{CLOSE}" for c in calls)
            m["content"] = (m.get("content") or "") + written
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{told}"}
    else:
        out.insert(0, {"role": "system", "content": told})
    return out


def call_grammar(tools: tuple[Tool, ...]) -> str:
    """A Lark grammar (llguidance's) of one call of one of ``tools``, arguments checked by schema."""
    options = JSON_OPTIONS
    choices = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"x-guidance": options, "anyOf": choices} if len(choices) > 1 else {"x-guidance": options,
                                                                                  **choices[0]}
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}\n'


def could_be_call(text: str) -> bool:
    """Whether an answer beginning ``text`` may still turn out to be a tool call."""
    head = text.lstrip()
    return head.startswith(OPEN) or OPEN.startswith(head)


def read_calls(text: str, tools: tuple[Tool, ...], ids: list[str] | None = None) -> list[ToolCall] | None:
    """The calls an answer makes, when it is nothing but calls of known tools whose arguments are
    JSON objects; else None (the answer is text). Each call's arguments are their text as the model
    wrote them (where its name comes first, as it is told to write it: what its streamed fragments
    join to), and its id the one of ``ids`` it was streamed with, if any."""
    found = _calls_in(text.strip())
    if not found:
        return None
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    for raw, call in found:
        if not isinstance(call, dict) or call.get("name") not in names or \
                not isinstance(call.get("arguments"), dict):
            return None
        at = _ARGS_AT.match(raw)
        arguments = raw[at.end():_DECODER.raw_decode(raw, at.end())[1]] if at else \
            json.dumps(call["arguments"], ensure_ascii=False)
        calls.append(ToolCall(call["name"], arguments, ids[len(calls)] if ids and len(calls) < len(ids)
                              else call_id()))
    return calls


def _calls_in(body: str) -> list[tuple[str, Any]] | None:
    """Each call's JSON text and value where ``body`` is nothing but ``<tool_call>`` JSON
    ``</tool_call>`` pieces; else None. A call ends where its JSON does (its strings may hold
    anything, a closing tag too), then its closing tag must follow."""
    out: list[tuple[str, Any]] = []
    at = 0
    while at < len(body):
        if not body.startswith(OPEN, at):
            return None
        start = _past_space(body, at + len(OPEN))
        try:
            value, end = _DECODER.raw_decode(body, start)
        except ValueError:
            return None
        close = _past_space(body, end)
        if not body.startswith(CLOSE, close):
            return None
        out.append((body[start:end], value))
        at = _past_space(body, close + len(CLOSE))
    return out or None


_DECODER = json.JSONDecoder()


def _past_space(text: str, at: int) -> int:
    """The first place from ``at`` on in ``text`` that is not white space."""
    return len(text) - len(text[at:].lstrip())


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallPart:
    """A piece of a call as it is written: its first carries its id and name, every one a piece of its
    arguments' JSON text (OpenAI's streamed ``tool_calls`` fragments, joined by ``call``)."""

    call: int
    arguments: str
    id: str | None = None
    name: str | None = None


class CallReader:
    """Reads an answer that is tool calls as it is written (``feed`` the text so far, each time):
    a call's id and name once its head is written, then its arguments' text as it grows, the
    call's closing brace and tag left out. Where the answer stops looking like calls written
    name first (``lost``), it reads no more: the answer is read whole at its end (``read_calls``).
    ``names``: the tools it may call; a head naming another is lost, before anything of it is
    read (an answer left free, ``"auto"``, may write anything)."""

    HEAD_CHARS = 256        # NOTE: a call's head longer than this is not one

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self.names = names
        self.ids: list[str] = []
        self.complete = 0           # NOTE: the text's length through the last call read whole
        self.lost = False
        self._at = 0                # NOTE: characters of the text read
        self._state = "head"        # NOTE: "head": before a call, "args": in its arguments, "tail": after
        self._depth = 0
        self._string = self._escape = False

    def feed(self, text: str) -> list[CallPart]:
        """The pieces of calls written since the last feed."""
        out: list[CallPart] = []
        while not self.lost:
            if self._state == "head":
                head = _HEAD.match(text, self._at)
                if head is None:
                    self.lost = not _may_become(text[self._at:])
                    return out
                name = json.loads(f'"{head.group(1)}"')
                if self.names is not None and name not in self.names:
                    self.lost = True
                    return out
                self.ids.append(call_id())
                out.append(CallPart(len(self.ids) - 1, "", self.ids[-1], name))
                self._at, self._state, self._depth = head.end(), "args", 0
            elif self._state == "args":
                while self._depth == 0 and self._at < len(text) and text[self._at].isspace():
                    self._at += 1           # NOTE: before the arguments' object: not theirs
                start = self._at
                self._read_arguments(text)
                if self._at > start and not self.lost:
                    out.append(CallPart(len(self.ids) - 1, text[start:self._at]))
                if self._state == "args":
                    return out
            else:
                tail = _TAIL.match(text, self._at)
                if tail is None:
                    rest = text[self._at:].lstrip()
                    after = rest[1:].lstrip() if rest.startswith("}") else None
                    self.lost = not (rest == "" or rest == "}" or
                                     (after is not None and CLOSE.startswith(after)))
                    return out
                self._at, self._state = tail.end(), "head"
                self.complete = self._at
        return out

    def _read_arguments(self, text: str) -> None:
        """Read the arguments' text as far as it is written: to the closing brace of their object."""
        while self._at < len(text):
            c = text[self._at]
            if self._depth == 0 and c != "{":
                self.lost = True            # NOTE: arguments that are not an object
                return
            self._at += 1
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "tail"
                    return


_TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE))


def _may_become(rest: str) -> bool:
    """Whether text after the calls read so far may still become a call's head (or is nothing)."""
    if not could_be_call(rest):
        return False
    head = rest.lstrip()
    key = head.split('"arguments"', 1)
    return len(head) <= CallReader.HEAD_CHARS and (len(key) == 1 or ":" not in key[1])
