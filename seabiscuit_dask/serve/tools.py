"""Tool calls: how a chat model is told of ``tools`` and how its calls are written and read.

A model whose chat template takes ``tools`` gets them through it (its own format). Any other
is told of them in its system message and calls one as Hermes-style models do::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` "required" or a function's name constrains the answer to such a call
(``call_grammar``: the arguments valid under that tool's parameters); "auto" leaves the
answer free and reads a call out of it where it is one (``read_calls``).
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
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


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


def read_calls(text: str, tools: tuple[Tool, ...]) -> list[ToolCall] | None:
    """The calls an answer makes, when it is nothing but calls of known tools whose arguments are
    JSON objects; else None (the answer is text)."""
    body = text.strip()
    if not body.startswith(OPEN):
        return None
    found = _CALL.findall(body)
    if not found or _CALL.sub("", body).strip():
        return None
    names = {t.name for t in tools}
    calls = []
    for raw in found:
        try:
            call = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in names or \
                not isinstance(call.get("arguments"), dict):
            return None
        calls.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False),
                              f"call_{uuid.uuid4().hex[:24]}"))
    return calls
