"""The HTTP side of ``seabiscuit serve``: an ASGI app (Starlette) with OpenAI's routes.

It owns no model logic: bodies are read and checked by ``api``, answered by ``ServedModel``,
and every refusal maps onto OpenAI's error JSON and status (``api.error_reply``). The HTTP
side is the untrusted side: an API key is asked for when one is set (``/metrics`` too), bodies
are bounded in size and read in full within a deadline before a request takes one of its key's
bounded number of slots, and a caller that hangs up ends its answer at the next token, streamed
or not. Parsing, tokenising and a model's blocking calls run on threads, so the event loop only
moves bytes. (Deadlines on headers and the bound on connections are ``connections``'.)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import statistics
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import config
from ..errors import Busy, SeaBiscuitError
from . import api
from .metrics import Metrics
from .models import Delta, Finish, ServedModel, ToolCallPart, ToolCalls, Usage
from .page import PAGE

if TYPE_CHECKING:
    from ..runtime.generation import TokenLogprob
    from .tools import CallPart, ToolCall

logger = logging.getLogger("seabiscuit.serve")

_END = object()
REPORT_S = 2.0          # NOTE: how often the dashboard's serving view hears from this server
T = TypeVar("T")
# NOTE: what an answer yields as its tokens come (``ServedModel.answer``)
AnswerEvent = Delta | ToolCallPart | ToolCalls | Finish


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Server:
    """The state behind the app: the served models (by name), the API key, the limits, metrics."""

    def __init__(self, models: list[ServedModel] | None = None, *, api_key: str | None = None,
                 max_body_bytes: int | None = None, max_per_key: int | None = None,
                 body_timeout_s: float | None = None, metrics_public: bool | None = None,
                 allowed_origins: Sequence[str] | str | None = None) -> None:
        self.models: dict[str, ServedModel] = {}
        for m in models or ():
            self.add(m)
        self.api_key = api_key or None
        self.max_body = int(max_body_bytes if max_body_bytes is not None
                            else config.to_bytes(config.get("serve.max-body-bytes")))
        self.max_per_key = int(max_per_key if max_per_key is not None
                               else config.get("serve.max-concurrent-per-key"))
        self.body_timeout_s = float(body_timeout_s if body_timeout_s is not None
                                    else config.get("serve.body-timeout-s"))
        self.metrics_public = bool(metrics_public if metrics_public is not None
                                   else config.get("serve.metrics-public"))
        self.retry_after = str(int(config.get("serve.retry-after-s")))
        origins = allowed_origins if allowed_origins is not None else \
            (config.get("serve.allowed-origins") or ())
        self.allowed_origins = check_origins(origins)
        # NOTE: apart from asyncio's default pool, where embeddings run for as long as they take
        self.parsing = ThreadPoolExecutor(int(config.get("serve.parse-threads")),
                                          thread_name_prefix="seabiscuit-serve-parse")
        self.metrics = Metrics(self)
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()
        self.loading: list[str] = []      # models still being deployed (named by /health)
        self._reported = time.time()
        self._reporting: threading.Event | None = None

    def report(self) -> int:
        """Send each served model's figures since the last report to its cluster's scheduler, where
        the dashboard's serving view shows them (``dashboard.record_serving``); the reports sent."""
        from ..dashboard import record_serving

        windows, statuses = self.metrics.take()
        now, sent = time.time(), 0
        span = max(now - self._reported, 1e-3)
        self._reported = now
        for m in list(self.models.values()):
            if m.kind != "generate" or not m.ready.is_set():
                continue
            engine = getattr(m.dm, "_engine", None)
            load = engine.load() if engine is not None else {"running": 0, "waiting": 0}
            w = windows.get(m.name)
            sample = {"time": now, "name": m.name, "model": getattr(m.dm, "model_id", ""),
                      "running": load["running"], "waiting": load["waiting"],
                      "tokens_per_s": (w.tokens if w else 0) / span,
                      "requests_per_s": (w.requests if w else 0) / span,
                      "ttft_ms": statistics.median(w.ttft) * 1e3 if w and w.ttft else None,
                      "itl_ms": statistics.median(w.itl) * 1e3 if w and w.itl else None,
                      "errors": statuses if not sent else {}}   # NOTE: the process's errors, shown once
            try:
                sent += bool(m.dm.client.run_on_scheduler(record_serving, sample))
            except Exception as e:  # noqa: BLE001 - the dashboard misses a sample; serving goes on
                logger.debug("serving figures of %s not reported: %s", m.name, e)
        return sent

    def start_reporting(self, every_s: float = REPORT_S) -> None:
        """Report every ``every_s`` seconds on a thread of its own, while this server lives."""
        if self._reporting is not None:
            return
        ref = weakref.ref(self)
        stop = self._reporting = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                server = ref()
                if server is None:
                    return
                try:
                    server.report()
                except Exception as e:  # NOTE: a report is missed; the next one goes
                    logger.debug("serving figures not reported: %s", e, exc_info=True)
                del server

        threading.Thread(target=loop, name="seabiscuit-serve-report", daemon=True).start()

    def stop_reporting(self) -> None:
        """No more reports (``start_reporting``) once the one under way, if any, is sent."""
        if self._reporting is not None:
            self._reporting.set()

    def add(self, model: ServedModel) -> None:
        if model.name in self.models:
            raise api.BadParam(f"two models are named {model.name!r}: name them apart")
        self.models[model.name] = model

    @property
    def ready(self) -> bool:
        return not self.loading and bool(self.models) and all(m.ready.is_set() for m in self.models.values())

    def unavailable(self) -> dict[str, str]:
        """Model name -> why it does not serve now (closed, or stranded), for the deployed ones."""
        down = {m.name: m.unavailable() for m in list(self.models.values()) if m.ready.is_set()}
        return {name: why for name, why in down.items() if why}

    def model(self, name: str, kind: str) -> ServedModel:
        if name in self.loading:
            raise api.Starting(f"model {name!r} is still being deployed: GET /health answers 200 once it is "
                               "ready")
        m = self.models.get(name)
        if m is None:
            raise api.UnknownModel(f"model {name!r} is not served here; GET /v1/models lists "
                                   f"{', '.join(sorted(self.models)) or 'none yet'}")
        if m.kind != kind:
            route = "/v1/embeddings" if m.kind == "embed" else "/v1/chat/completions or /v1/completions"
            raise api.BadParam(f"model {name!r} serves {route}, not this route", "model")
        if not m.ready.is_set():
            raise api.Starting(f"model {name!r} is still building its step programs: GET /health answers "
                               "200 once it is ready")
        return m

    # --- the untrusted side ---------------------------------------------------------------------------
    def caller(self, request: Request) -> str:
        """The caller's key (checked when the server has one)."""
        if self.api_key is None:
            return ""
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise api.Unauthorized("a valid API key is required: send 'Authorization: Bearer <key>'")
        return key

    def take(self, key: str) -> None:
        """Take one of ``key``'s running requests, or ``Busy`` when it has ``max_per_key`` already;
        ``give`` hands it back."""
        with self._lock:
            if self._running.get(key, 0) >= self.max_per_key:
                raise Busy(f"this key has {self.max_per_key} requests running, the most it may "
                           "(seabiscuit.serve.max-concurrent-per-key): retry when one finishes")
            self._running[key] = self._running.get(key, 0) + 1

    def give(self, key: str) -> None:
        with self._lock:
            self._running[key] -= 1

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON body, read no further than ``max_body`` bytes and in full within ``body_timeout_s``
        (``SlowBody`` else), then parsed on a thread."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise api.TooLarge(f"the request body is {int(declared)} bytes, more than the "
                               f"{self.max_body} this server reads (seabiscuit.serve.max-body-bytes)")
        try:
            raw = await asyncio.wait_for(self._read(request), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise api.SlowBody(f"the request body did not arrive in full within {self.body_timeout_s:g} s "
                               "(seabiscuit.serve.body-timeout-s): send it at once") from None
        except ClientDisconnect:
            raise api.ClientGone("the caller hung up while sending its body") from None
        return await self.off_loop(api.parse_json, raw)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a parsing thread, so a large body never holds the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.parsing, fn, *args)

    async def _read(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise api.TooLarge(f"the request body is more than the {self.max_body} bytes this server "
                                   "reads (seabiscuit.serve.max-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)


def error_response(error: BaseException, retry_after: str = "1") -> JSONResponse:
    status, body = api.error_reply(error)
    if status == 500:
        logger.error("serving a request failed", exc_info=error)
    headers = {"Retry-After": retry_after} if status in (429, 503) else None
    if status == 408:
        headers = {"Connection": "close"}     # NOTE: the rest of the body must not be read as a request
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _events(run: Callable[[threading.Event], Iterator[T]]) -> AsyncGenerator[T, None]:
    """The items ``run`` yields on a thread of its own, here as they come. Leaving early (the
    caller went away) sets the event ``run`` watches, so it ends at its next item."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stopped = threading.Event()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:           # NOTE: the loop closed: nobody is waiting any more
            stopped.set()

    def work() -> None:
        try:
            for item in run(stopped):
                put(item)
                if stopped.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request, which answers with it
            put(_Failed(e))
        finally:
            put(_END)

    threading.Thread(target=work, name="seabiscuit-serve-call", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stopped.set()


class _Timing:
    """One generation request's figures for the metrics: time to its first token and between its
    tokens, its queueing, each choice's end and its reason, and its whole time."""

    def __init__(self, metrics: Metrics, model: str, prompt_tokens: int, choices: int = 1) -> None:
        self.metrics, self.model, self.prompt_tokens, self.choices = metrics, model, prompt_tokens, choices
        self.ended_choices = 0
        self.t0 = self.last = time.perf_counter()
        self.first = True
        self.queued = False
        self.done = False

    def token(self) -> None:
        now = time.perf_counter()
        window = self.metrics.window(self.model)
        if self.first:
            self.metrics.ttft.labels(self.model).observe(now - self.t0)
            window.ttft.append(now - self.t0)
            self.first = False
        else:
            self.metrics.itl.labels(self.model).observe(now - self.last)
            window.itl.append(now - self.last)
        self.last = now

    def finished(self, ev: Finish) -> None:
        """Choice ``ev.index`` ended."""
        if ev.admitted is not None and not self.queued:
            self.metrics.queue.labels(self.model).observe(max(0.0, ev.admitted - self.t0))
            self.queued = True
        self.ended_choices += 1
        self.metrics.success.labels(self.model, ev.reason).inc()
        self.metrics.request_generation.labels(self.model).observe(ev.tokens)
        self.metrics.window(self.model).tokens += ev.tokens

    def ended(self, error: BaseException | None) -> None:
        """The request ended: answered, or not (``error``: the caller went away, or a failure)."""
        if self.done:
            return
        self.done = True
        self.metrics.window(self.model).requests += 1
        self.metrics.e2e.labels(self.model).observe(time.perf_counter() - self.t0)
        self.metrics.request_prompt.labels(self.model).observe(self.prompt_tokens)
        if error is not None and self.ended_choices < self.choices:   # NOTE: each choice counts once
            reason = "abort" if isinstance(error, (api.ClientGone, asyncio.CancelledError)) else "error"
            self.metrics.success.labels(self.model, reason).inc(self.choices - self.ended_choices)


def check_origins(origins: Any) -> tuple[str, ...]:
    """The origins CORS lets call the API: each ``*`` or a scheme and host (and port), no path."""
    if isinstance(origins, str):
        origins = [o.strip() for o in origins.split(",") if o.strip()]
    out = []
    for o in origins:
        if not isinstance(o, str) or not (o == "*" or re.fullmatch(r"https?://[^/\s]+", o)):
            raise api.BadParam(f"allowed origin {o!r} is not an origin: write '*' or a scheme and host as "
                               "'https://app.example.com' (a port may follow; no path)")
        out.append(o)
    return tuple(out)


def make_app(server: Server) -> Starlette:
    """The ASGI app of ``server`` (each route reads it from ``request.app.state.server``); with
    ``server.allowed_origins``, browser apps of those origins may call it (CORS)."""
    routes = [
        Route("/", _page, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{model:path}", _model, methods=["GET"]),
        Route("/v1/chat/completions", _chat, methods=["POST"]),
        Route("/v1/completions", _completions, methods=["POST"]),
        Route("/v1/embeddings", _embeddings, methods=["POST"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(server.allowed_origins),
                             allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                             expose_headers=["Retry-After"], max_age=600)] if server.allowed_origins else []
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
    app.state.server = server
    server.start_reporting()
    return app


def _server(request: Request) -> Server:
    server: Server = request.app.state.server
    return server


async def _guarded(request: Request, route: str, handler: Callable[[Any], Awaitable[Response]], *,
                   reads_body: bool = True) -> Response:
    """``handler(body)``'s answer, for a caller whose key checks out, within one of its key's slots;
    any refusal or failure as OpenAI's error JSON. Counted in the metrics by route and status."""
    server, held = _server(request), None
    try:
        key = server.caller(request)
        # NOTE: the body is read in full before the key's slot is taken: a slow one holds none
        body = await server.body(request) if reads_body else None
        server.take(key)
        held = key
        response = await handler(body)
        if isinstance(response, StreamingResponse):     # NOTE: its slot is given back as it ends
            held = None
            return _hold_slot(server, key, response, route)
    except SeaBiscuitError as e:
        response = error_response(e, server.retry_after)
    except Exception as e:  # noqa: BLE001 - never a traceback to the caller; logged as an error
        response = error_response(e, server.retry_after)
    finally:
        if held is not None:
            server.give(held)
    server.metrics.requests.labels(route, str(response.status_code)).inc()
    server.metrics.status(response.status_code)
    return response


async def _chat(request: Request) -> Response:
    return await _guarded(request, "/v1/chat/completions", lambda body: _generate(request, body, chat=True))


async def _completions(request: Request) -> Response:
    return await _guarded(request, "/v1/completions", lambda body: _generate(request, body, chat=False))


async def _generate(request: Request, body: dict[str, Any], chat: bool) -> Response:
    """A chat or text completion: streamed as it comes, or whole once every choice finished."""
    server = _server(request)
    # NOTE: off the event loop: a body's schemas (tools, response_format) are checked as JSON schemas
    req = await server.off_loop(api.parse_chat if chat else api.parse_completion, body)
    if req.unknown:     # NOTE: as vLLM does: a field no version of the API has is let be, with a warning
        logger.warning("a request held fields this server does not know, ignored: %s", ", ".join(req.unknown))
    model = server.model(req.model, "generate")
    model.check_rows(req)
    rows = await server.off_loop(model.prompt_ids, req)
    max_new = model.budget(rows, req.max_tokens)
    usage = Usage(prompt_tokens=sum(len(r) for r in rows))
    timing = _Timing(server.metrics, model.name, usage.prompt_tokens, len(rows) * req.n)
    events = _events(lambda stopped: model.answer(req, rows, max_new, stopped))
    # NOTE: a refusal (no session free, ...) is still an HTTP error
    first = await _unless_gone(request, _first(events))
    server.metrics.prompt_tokens.labels(model.name).inc(usage.prompt_tokens)
    if req.stream:
        return StreamingResponse(_stream(server, model, req, rows, first, events, usage, timing),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts = [""] * (len(rows) * req.n)
    reasons = ["length"] * len(texts)
    logprobs: list[list[TokenLogprob]] = [[] for _ in texts]
    calls: dict[int, tuple[ToolCall, ...]] = {}
    error: BaseException | None = None
    try:
        await _unless_gone(request, _collect(_chain(first, events), texts, reasons, usage, timing, logprobs,
                                             calls))
    except BaseException as e:
        error = e
        raise
    finally:
        server.metrics.generation_tokens.labels(model.name).inc(usage.completion_tokens)
        timing.ended(error)
    return JSONResponse(_complete(model, req, rows, texts, reasons, usage, logprobs, calls))


async def _collect(events: AsyncIterator[AnswerEvent], texts: list[str], reasons: list[str], usage: Usage,
                   timing: _Timing, logprobs: list[list[TokenLogprob]],
                   calls: dict[int, tuple[ToolCall, ...]]) -> None:
    """Each choice's text (or tool calls), finish reason and log-probabilities, and the tokens
    generated, from an answer's events."""
    async for ev in events:
        if isinstance(ev, Delta):
            texts[ev.index] += ev.text
            logprobs[ev.index].extend(ev.logprobs)
            timing.token()
        elif isinstance(ev, ToolCalls):
            calls[ev.index] = ev.calls
            timing.token()
        elif isinstance(ev, Finish):
            reasons[ev.index] = ev.reason
            usage.completion_tokens += ev.tokens
            timing.finished(ev)


async def _embeddings(request: Request) -> Response:
    return await _guarded(request, "/v1/embeddings", lambda body: _embed(request, body))


async def _embed(request: Request, body: dict[str, Any]) -> Response:
    server = _server(request)
    req = api.parse_embedding(body)
    model = server.model(req.model, "embed")
    data, used = await asyncio.to_thread(model.embed, req)
    server.metrics.prompt_tokens.labels(model.name).inc(used)
    return JSONResponse({"object": "list", "model": model.name,
                         "data": [{"object": "embedding", "index": i, "embedding": d}
                                  for i, d in enumerate(data)],
                         "usage": {"prompt_tokens": used, "total_tokens": used}})


def _model_card(m: ServedModel) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "seabiscuit", "kind": m.kind,
            "context": m.context, "max_model_len": m.context, "ready": m.ready.is_set()}


async def _models(request: Request) -> Response:
    async def handle(body: None) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(m) for m in
                                                         _server(request).models.values()]})

    return await _guarded(request, "/v1/models", handle, reads_body=False)


async def _model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one model's card (the ``openai`` client's ``models.retrieve``)."""
    async def handle(body: None) -> Response:
        server, name = _server(request), request.path_params["model"]
        m = server.models.get(name)
        if m is None:
            if name in server.loading:
                raise api.Starting(f"model {name!r} is still being deployed: GET /health answers 200 once it "
                                   "is ready")
            raise api.UnknownModel(f"model {name!r} is not served here; GET /v1/models lists "
                                   f"{', '.join(sorted(server.models)) or 'none yet'}")
        return JSONResponse(_model_card(m))

    return await _guarded(request, "/v1/models/{id}", handle, reads_body=False)


async def _health(request: Request) -> Response:
    server = _server(request)
    down = await asyncio.to_thread(server.unavailable)
    if server.ready and not down:
        return JSONResponse({"status": "ok", "models": sorted(server.models)})
    waiting = server.loading + [m.name for m in server.models.values() if not m.ready.is_set()]
    body: dict[str, Any] = {"status": "unavailable" if down else "starting", "waiting_for": waiting}
    if down:
        body["unavailable"] = down
    return JSONResponse(body, status_code=503, headers={"Retry-After": server.retry_after})


async def _metrics(request: Request) -> Response:
    server = _server(request)
    if not server.metrics_public:        # NOTE: it names the workers' addresses
        try:
            server.caller(request)
        except api.Unauthorized as e:
            return error_response(e)
    body, kind = await asyncio.to_thread(server.metrics.render)
    return Response(body, media_type=kind)


async def _page(request: Request) -> Response:
    return HTMLResponse(PAGE)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    message = f"{request.method} {request.url.path}: {detail}"
    return JSONResponse(api.error_body(message, "invalid_request_error", None, code), status_code=status)


def _hold_slot(server: Server, key: str, response: StreamingResponse, route: str) -> StreamingResponse:
    """Keep ``key``'s slot (taken) until the stream ends, then give it back."""
    inner = response.body_iterator

    async def held() -> AsyncIterator[Any]:
        try:
            async for chunk in inner:
                yield chunk
        finally:
            server.give(key)
            server.metrics.requests.labels(route, str(response.status_code)).inc()
            server.metrics.status(response.status_code)

    response.body_iterator = held()
    return response


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, unless the caller hangs up first: then ``work`` is cancelled (an answer's
    thread sees it at its next token and frees its sessions) and ``ClientGone`` is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()                  # NOTE: nothing happens to a task that is done
    if not task.done() or task.cancelled():
        await asyncio.wait((task,))    # NOTE: its generators' ``finally`` run before the answer ends
        raise api.ClientGone("the caller hung up before its answer was ready")
    return task.result()


async def _hung_up(request: Request) -> None:
    """Returns when the caller hangs up (ASGI's ``http.disconnect``; its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first(events: AsyncIterator[AnswerEvent]) -> AnswerEvent | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first: AnswerEvent | None, events: AsyncIterator[AnswerEvent]) -> AsyncIterator[AnswerEvent]:
    if first is not None:
        yield first
        async for ev in events:
            yield ev


def _complete(model: ServedModel, req: api.GenerationRequest, rows: list[list[int]], texts: list[str],
              reasons: list[str], usage: Usage, logprobs: list[list[TokenLogprob]],
              calls: dict[int, tuple[ToolCall, ...]]) -> dict[str, Any]:
    asked = req.sampling.logprobs is not None
    if req.chat:
        def message(i: int, text: str) -> dict[str, Any]:
            if i in calls:
                return {"role": "assistant", "content": None, "tool_calls": [c.as_dict() for c in calls[i]]}
            return {"role": "assistant", "content": text}

        choices = [{"index": i, "message": message(i, t),
                    "logprobs": _chat_logprobs(model, logprobs[i]) if asked else None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        kind = "chat.completion"
    else:
        prefix = [model.tokenizer.decode(r) if req.echo else "" for r in rows]
        choices = [{"index": i, "text": prefix[i // req.n] + t,
                    "logprobs": _text_logprobs(model, logprobs[i], len(prefix[i // req.n]))[0]
                    if asked else None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        kind = "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model.name, "choices": choices,
            "usage": usage.as_dict(), "system_fingerprint": None}


LOGPROB_FLOOR = -9999.0     # NOTE: a log-probability of -inf (a token ruled out), as vLLM writes it in JSON


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def _chat_logprobs(model: ServedModel, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: each token's text, bytes and log-probability, and its top alternatives."""
    def entry(token: int, value: float) -> dict[str, Any]:
        text, raw = model.token_text(token)
        return {"token": text, "logprob": _lp(value), "bytes": raw}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps], "refusal": None}


def _text_logprobs(model: ServedModel, lps: Sequence[TokenLogprob],
                   offset: int) -> tuple[dict[str, Any], int]:
    """Completions' ``logprobs`` (tokens, their log-probabilities, each one's likeliest tokens with
    its own among them, and where its text starts), and the offset after them."""
    tokens, offsets = [], []
    for lp in lps:
        text = model.token_text(lp.token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops = [{model.token_text(t)[0]: _lp(v) for t, v in ((lp.token, lp.logprob), *lp.top)} for lp in lps]
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps], "top_logprobs": tops,
            "text_offset": offsets}, offset


async def _stream(server: Server, model: ServedModel, req: api.GenerationRequest, rows: list[list[int]],
                  first: AnswerEvent | None, events: AsyncGenerator[AnswerEvent, None], usage: Usage,
                  timing: _Timing) -> AsyncIterator[bytes]:
    """Server-sent events as OpenAI streams them: a chunk per piece of text, the finish reasons,
    the usage when asked for, then ``[DONE]``. An error after the first byte is an ``error`` event."""
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    head = {"id": req.id, "object": kind, "created": req.created, "model": model.name,
            "system_fingerprint": None}
    extra = {"usage": None} if req.include_usage else {}
    offsets = [0] * (len(rows) * req.n)        # NOTE: where each choice's next token's text starts

    def chunk(index: int, text: str | None, reason: str | None, role: bool = False,
              lps: tuple[TokenLogprob, ...] = (), calls: tuple[ToolCall, ...] = (),
              part: CallPart | None = None) -> bytes:
        logprobs: Any = None
        if req.sampling.logprobs is not None and lps:
            if req.chat:
                logprobs = _chat_logprobs(model, lps)
            else:
                logprobs, offsets[index] = _text_logprobs(model, lps, offsets[index])
        if req.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text is not None else {})
            if calls:       # NOTE: each call whole in one chunk: clients join the pieces of a call by index
                delta = {"tool_calls": [{"index": k, **c.as_dict()} for k, c in enumerate(calls)]}
            elif part is not None:      # NOTE: a piece of a call as it is written; its first names it
                ident = {"id": part.id, "type": "function"} if part.id is not None else {}
                name = {"name": part.name} if part.name is not None else {}
                delta = {"tool_calls": [{"index": part.call, **ident,
                                         "function": {**name, "arguments": part.arguments}}]}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return _sse({**head, "choices": [choice], **extra})

    try:
        if req.chat:
            for i in range(len(rows) * req.n):
                yield chunk(i, None, None, role=True)
        if req.echo and not req.chat:
            for i in range(len(rows) * req.n):
                prefix = model.tokenizer.decode(rows[i // req.n])
                offsets[i] = len(prefix)
                yield chunk(i, prefix, None)
        parted: set[int] = set()        # NOTE: choices whose call went out piece by piece
        async for ev in _chain(first, events):
            if isinstance(ev, Delta):
                timing.token()
                if ev.index not in parted:      # NOTE: a call cut short: its pieces went out, not its text
                    yield chunk(ev.index, ev.text, None, lps=ev.logprobs)
            elif isinstance(ev, ToolCallPart):
                timing.token()
                parted.add(ev.index)
                yield chunk(ev.index, None, None, part=ev.part)
            elif isinstance(ev, ToolCalls) and not ev.streamed:
                timing.token()
                yield chunk(ev.index, None, None, calls=ev.calls)
            elif isinstance(ev, Finish):
                usage.completion_tokens += ev.tokens
                timing.finished(ev)
                yield chunk(ev.index, None if req.chat else "", ev.reason)
        if req.include_usage:
            yield _sse({**head, "choices": [], "usage": usage.as_dict()})
        yield b"data: [DONE]\n\n"
        timing.ended(None)
    except SeaBiscuitError as e:
        timing.ended(e)
        yield _sse(api.error_reply(e)[1])
    except Exception as e:
        timing.ended(e)
        logger.error("a streamed answer failed", exc_info=e)
        yield _sse(api.error_reply(e)[1])
    finally:
        timing.ended(api.ClientGone("the caller went away mid-stream"))    # NOTE: only if not ended yet
        server.metrics.generation_tokens.labels(model.name).inc(usage.completion_tokens)
        await events.aclose()
