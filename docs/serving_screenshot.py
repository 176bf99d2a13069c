"""Make docs/dashboard-serving.png: the SeaBiscuit dashboard page while ``seabiscuit serve`` answers
real load (SmolLM2 over two of three local workers, 16 streaming OpenAI clients asking for answers of 32
to 64 tokens on 8 sessions' room), seen in Chromium; and docs/dask-status-serving.png, Dask's own
status page at the same time (its task stream draws the data plane's block runs).

Run from the repository root: ``PYTHONPATH=. python docs/serving_screenshot.py [out.png]`` (needs
Debian's ``chromium``; about two minutes on two cores).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import openai
from distributed import Client, LocalCluster

import seabiscuit_dask as sb
from seabiscuit_dask.dashboard.page import TITLES
from seabiscuit_dask.serve import Server, make_app
from seabiscuit_dask.serve.server import Source, deploy, load, running
from tests.browser import BOKEH_PLOTS_JS, chromium_page, write_png
from tests.clusters import wait_for

CLIENTS = 16
SERVING = [TITLES[k] for k in ("serving_load", "serving_tokens", "serving_latency", "memory")]
QUESTIONS = ["What is the capital of France?", "Name three rivers of Europe.", "Why is the sky blue?",
             "Write a haiku about the sea.", "What is 12 times 13?", "Who wrote Hamlet?"]


def chat(url: str, i: int, until: float) -> None:
    """One client's streamed chats, one after another, until ``until``."""
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    k = i
    while time.time() < until:
        ask = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
        stream = api.chat.completions.create(model="smollm2", stream=True, max_tokens=32 + 8 * (i % 5),
                                             temperature=0, messages=ask)
        for _ in stream:
            pass
        k += 1


def main(out: Path) -> None:
    # NOTE: budgets that take two of the three workers to hold the model (as bench_serve.py sizes them)
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address="127.0.0.1:0",
                      resources={"MEM": 500e6}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        page_url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/seabiscuit"
        served = deploy(load(Source("gguf", None, "smollm2"), print), client, sessions=8, context=512,
                        budget=None, device=None)
        status_url = page_url.replace("/seabiscuit", "/status")
        with running(make_app(Server([served]))) as url:
            until = time.time() + 75
            clients = [threading.Thread(target=chat, args=(url, i, until)) for i in range(CLIENTS)]
            for t in clients:
                t.start()
            with chromium_page(1400, 1000) as status:
                status.navigate(status_url)         # NOTE: Dask's task stream starts with its page
                time.sleep(50)      # NOTE: a minute of load on the pages' time axes, then the pictures
                print(f"wrote {write_png(status.screenshot(), out.with_name('dask-status-serving.png'))}")
            with chromium_page(1400, 1700) as page:
                page.navigate(page_url)
                drawn = wait_for(lambda: (p := page.evaluate(BOKEH_PLOTS_JS)) and all(
                    x["glyph_pixels"] > 0 for x in p if x["title"] in SERVING) and p, "the serving figures")
                print(f"wrote {write_png(page.screenshot(), out)}")
                for x in drawn:
                    print(f"{x['glyph_pixels']:>8} pixels drawn: {x['title']}")
            for t in clients:
                t.join()
        served.dm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/dashboard-serving.png"))
