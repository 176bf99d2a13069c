"""``seabiscuit serve`` against hostile or careless callers: slow bodies and headers, idle
connections, callers that hang up, bodies no JSON reader should trust, huge prompt lists and
scrapers without the key.

The model is a stand-in deployment (``Deployment``: a token per row per step, sessions counted
as the generation engine counts them) with a real word-level tokenizer built in memory, served
by uvicorn in this process, so each test takes well under a second of work.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import dask.config
import pytest
import torch

from seabiscuit_dask.errors import BadInput, Busy
from seabiscuit_dask.serve import ServedModel, Server, make_app
from seabiscuit_dask.serve.server import running

from .clusters import wait_for

KEY = "sk-hostile"
WORDS = ["[PAD]", "[UNK]", "[EOS]", "the", "a", "river", "flows", "to", "sea", "user", "assistant", "[", "]"]
TEMPLATE = ("{% for m in messages %}[ {{ m['role'] }} ] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[ assistant ]{% endif %}")
GUARD_S = 30.0          # NOTE: a socket read that gets no answer fails the test after this, never passes it
SHORT = {"seabiscuit.serve.body-timeout-s": 0.2, "seabiscuit.serve.header-timeout-s": 0.2,
         "seabiscuit.serve.max-concurrent-per-key": 1}


def word_tokenizer() -> Any:
    """A Hugging Face fast tokenizer (Rust ``tokenizers``, as served models have) over a few words."""
    import tokenizers
    import transformers as tf

    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    inner = tokenizers.Tokenizer(model)
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    inner.decoder = tokenizers.decoders.WordPiece()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]", pad_token="[PAD]",
                                     eos_token="[EOS]")
    tok.chat_template = TEMPLATE
    return tok


class Counting:
    """A tokenizer that records the thread of every prompt it tokenises."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __len__(self) -> int:
        return len(self.tok)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.tok(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.tok.apply_chat_template(*args, **kwargs)


class _NoWorkers:
    def run(self, fn: Any, **kwargs: Any) -> dict[str, int]:
        return {}


class Deployment:
    """A deployment's ``stream`` as ``ServedModel`` drives it, without a cluster: each call opens a
    session per row (at most ``sessions`` at once, else ``Busy``, as the engine does), gives the
    token "the" per row every ``step_s`` seconds (the time a step computes) and frees its sessions
    when it ends or is closed. ``opened``/``closed`` are set as the last call starts and ends."""

    def __init__(self, sessions: int, step_s: float) -> None:
        self.sessions, self.step_s = sessions, step_s
        self._engine = type("Engine", (), {"_open": 0})()      # NOTE: /metrics reads its _open
        self.client = _NoWorkers()
        self.opened, self.closed = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    @property
    def max_rows(self) -> int:
        return self.sessions

    def stream(self, ids: torch.Tensor, max_new: int, **kwargs: Any) -> Iterator[torch.Tensor]:
        rows = ids.shape[0]
        if rows > self.sessions:
            raise BadInput(f"{rows} rows at once; the deployment serves at most {self.sessions}")
        with self._lock:
            if self._engine._open + rows > self.sessions:
                raise Busy(f"{self._engine._open} session(s) open, {rows} more asked for")
            self._engine._open += rows
        self.closed.clear()
        self.opened.set()
        return self._steps(rows, max_new)

    def _steps(self, rows: int, max_new: int) -> Iterator[torch.Tensor]:
        try:
            for _ in range(max_new):
                time.sleep(self.step_s)
                yield torch.full((rows,), WORDS.index("the"))
        finally:
            with self._lock:
                self._engine._open -= rows
            self.closed.set()


class Seen:
    """``app`` that sets ``event`` as a request to ``path`` enters it (before it reads anything)."""

    def __init__(self, app: Any, path: str) -> None:
        self.app, self.path, self.event = app, path, threading.Event()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == self.path:
            self.event.set()
        await self.app(scope, receive, send)


@contextlib.contextmanager
def serving(settings: dict[str, Any] | None = None, step_s: float = 0.001, sessions: int = 2,
            path: str = "/v1/completions") -> Iterator[tuple[str, Server, Deployment, Counting, Seen]]:
    tok = Counting(word_tokenizer())
    dm = Deployment(sessions, step_s)
    model = ServedModel("fake", dm, tok, "generate", context=10**7, eos=(WORDS.index("[EOS]"),),
                        sessions=sessions)
    model.ready.set()
    with dask.config.set({**SHORT, **(settings or {})}):
        server = Server([model], api_key=KEY)
        seen = Seen(make_app(server), path)
        with running(seen) as url:
            yield url, server, dm, tok, seen


def http(url: str, body: Any = None, key: str | None = KEY, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, JSON body or text) of one request, errors included."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=GUARD_S) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def connect(url: str) -> socket.socket:
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=GUARD_S)
    return sock


def head(path: str, length: int | None = None, key: str = KEY) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Authorization: Bearer {key}",
             "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a test fails after ``GUARD_S``). A
    server that closes before reading what was sent resets the connection: that is a close too."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def completion(**kwargs: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": "the river flows", "max_tokens": 2, "temperature": 0, **kwargs}


def sessions_metric(url: str) -> float:
    status, text = http(url + "/metrics")
    assert status == 200, text
    found = re.search(r'^seabiscuit:num_sessions\{model_name="fake"\} (\S+)$', text, re.M)
    assert found, text
    return float(found.group(1))


# --- slow bodies, slow headers, idle connections ---------------------------------------------------
def test_a_body_that_does_not_arrive_holds_no_slot_and_is_answered_408() -> None:
    """One slot per key: a request whose body stops after one byte must not take it; it is cut
    off after ``body-timeout-s`` with a 408 and its connection closed."""
    with serving() as (url, _, _, _, seen):
        slow = connect(url)
        slow.sendall(head("/v1/completions", length=100) + b"{")
        assert seen.event.wait(GUARD_S), "the slow request never reached the app"
        status, body = http(url + "/v1/completions", completion())
        assert status == 200, body
        assert body["choices"][0]["text"] == "the the"
        answer = read_all(slow)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_headers_that_do_not_arrive_in_time_close_the_connection() -> None:
    with serving() as (url, _, _, _, _):
        loris = connect(url)
        loris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        assert read_all(loris) == b""            # closed by the server after header-timeout-s
        assert http(url + "/health", key=None)[0] == 200


def test_open_connections_are_bounded_by_closing_the_one_arriving_longest() -> None:
    """With ``max-connections`` connections trickling a body or headers, a new caller is still
    answered: the one whose request has been arriving longest (the body) is closed to make room."""
    long = {"seabiscuit.serve.max-connections": 4, "seabiscuit.serve.header-timeout-s": 600,
            "seabiscuit.serve.body-timeout-s": 600}
    with serving(long) as (url, _, _, _, seen):
        body = connect(url)
        body.sendall(head("/v1/completions", length=100) + b"{")
        assert seen.event.wait(GUARD_S), "the trickled body's request never reached the app"
        idle = [connect(url) for _ in range(3)]
        for s in idle:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        assert http(url + "/v1/completions", completion())[0] == 200
        assert read_all(body) == b""
        idle[0].sendall(b"Host: test\r\n\r\n")
        assert idle[0].recv(4096).startswith(b"HTTP/1.1 200")


# --- a caller that hangs up --------------------------------------------------------------------------
def test_a_caller_that_hangs_up_on_a_non_streaming_answer_frees_its_sessions() -> None:
    """A non-streaming completion of a million tokens, its caller gone after the first: the
    answer ends at its next token and /metrics counts no session open."""
    with serving(step_s=0.01) as (url, _, dm, _, _):
        sock = connect(url)
        body = json.dumps(completion(max_tokens=10**6, n=2)).encode()
        sock.sendall(head("/v1/completions", length=len(body)) + body)
        assert dm.opened.wait(GUARD_S), "the answer never started"
        assert sessions_metric(url) == 2
        sock.close()
        assert dm.closed.wait(GUARD_S), "the answer went on after its caller hung up"
        wait_for(lambda: sessions_metric(url) == 0, "/metrics to count no session open")
        status, body = http(url + "/v1/completions", completion(n=2))
        assert status == 200 and len(body["choices"]) == 2


# --- bodies no JSON reader should trust ------------------------------------------------------------------
DEEP = b'{"model": "fake", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("route, raw, param, says", [
    ("/v1/completions", DEEP, None, "nested"),
    ("/v1/chat/completions", b'{"model": "fake", "messages": [{"role": "user", "content": "a \\ud800"}]}',
     "messages[0].content", "surrogate"),
    ("/v1/completions", b'{"model": "fake", "prompt": ["the", "\\udfff river"]}', "prompt[1]", "surrogate"),
    ("/v1/completions", b'{"model": "fake", "prompt": "the \xed\xa0\x80 river"}', None, "UTF-8"),
])
def test_bodies_a_json_reader_cannot_trust_are_400s_naming_the_problem(route: str, raw: bytes,
                                                                       param: str | None, says: str) -> None:
    with serving() as (url, _, _, tok, _):
        status, body = http(url + route, raw=raw)
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error" and says in body["error"]["message"]
        assert body["error"]["param"] == param
        assert tok.threads == []
        assert http(url + "/v1/completions", completion())[0] == 200


# --- huge prompt lists ---------------------------------------------------------------------------------
def test_a_huge_prompt_list_is_refused_before_any_prompt_is_tokenised() -> None:
    with serving() as (url, _, _, tok, _):
        status, body = http(url + "/v1/completions", completion(prompt=["river"] * 5000))
        assert tok.threads == []
        assert status == 400 and body["error"]["param"] == "prompt", body
        assert "5000" in body["error"]["message"]
        status, body = http(url + "/v1/completions", completion(prompt=["river", "sea"], n=2))
        assert status == 400 and body["error"]["param"] == "n", body
        assert tok.threads == []


def test_prompts_are_tokenised_off_the_event_loop() -> None:
    """The event loop (uvicorn's thread) only moves bytes: a prompt's tokens are made elsewhere."""
    with serving() as (url, _, _, tok, _):
        assert http(url + "/v1/completions", completion())[0] == 200
        messages = [{"role": "user", "content": "the river"}]
        status, body = http(url + "/v1/chat/completions", {"model": "fake", "messages": messages,
                                                           "max_tokens": 1})
        assert status == 200, body
    assert len(tok.threads) == 2 and "seabiscuit-serve-http" not in tok.threads


# --- /metrics --------------------------------------------------------------------------------------------
def test_metrics_ask_for_the_key_unless_made_public() -> None:
    with serving() as (url, _, _, _, _):
        status, body = http(url + "/metrics", key=None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert http(url + "/metrics", key="sk-wrong")[0] == 401
        assert http(url + "/metrics")[0] == 200
    with serving({"seabiscuit.serve.metrics-public": True}) as (url, _, _, _, _):
        status, text = http(url + "/metrics", key=None)
        assert status == 200 and "seabiscuit:num_sessions" in text
