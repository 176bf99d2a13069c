"""Make docs/dashboard-serving.png: the SeaBiscuit dashboard page while ``seabiscuit serve`` answers
real load (SmolLM2 on three local workers, 16 streaming OpenAI clients on 8 sessions' room), seen in
Chromium.

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
from seabiscuit_dask.serve import Server, make_app
from seabiscuit_dask.serve.server import Source, deploy, load, running
from tests.browser import BOKEH_PLOTS_JS, chromium_page, write_png
from tests.clusters import wait_for

CLIENTS = 16
QUESTIONS = ["What is the capital of France?", "Name three rivers of Europe.", "Why is the sky blue?",
             "Write a haiku about the sea.", "What is 12 times 13?", "Who wrote Hamlet?"]


def chat(url: str, i: int, until: float) -> None:
    """One client's streamed chats, one after another, until ``until``."""
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    k = i
    while time.time() < until:
        ask = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
        stream = api.chat.completions.create(model="smollm2", stream=True, max_tokens=48, temperature=0,
                                             messages=ask)
        for _ in stream:
            pass
        k += 1


def main(out: Path) -> None:
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address="127.0.0.1:0",
                      resources={"MEM": 1e9}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        page_url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/seabiscuit"
        served = deploy(load(Source("gguf", None, "smollm2"), print), client, sessions=8, context=512,
                        budget=None, device=None)
        with running(make_app(Server([served]))) as url:
            until = time.time() + 75
            clients = [threading.Thread(target=chat, args=(url, i, until)) for i in range(CLIENTS)]
            for t in clients:
                t.start()
            time.sleep(50)          # NOTE: a minute of load on the page's time axis, then the picture
            with chromium_page(1400, 1700) as page:
                page.navigate(page_url)
                wait_for(lambda: (p := page.evaluate(BOKEH_PLOTS_JS)) and
                         all(x["glyph_pixels"] > 0 for x in p if "GPU" not in x["title"]), "plots")
                print(f"wrote {write_png(page.screenshot(), out)}")
            for t in clients:
                t.join()
        served.dm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/dashboard-serving.png"))
