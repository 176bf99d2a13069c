"""Make docs/dashboard.png: SmolLM2 generating on three local workers, one drained, seen in Chromium.

Run from the repository root: ``PYTHONPATH=. python docs/screenshot.py [out.png]`` (needs Debian's
``chromium``; about two minutes on two cores).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
from distributed import Client, LocalCluster

import seabiscuit_dask as sb
from seabiscuit_dask.demo import CHAT_PROMPT, prompt_ids
from seabiscuit_dask.models import load_gguf
from tests.browser import BOKEH_PLOTS_JS, chromium_page, write_png
from tests.clusters import wait_for


def main(out: Path) -> None:
    model, tok = load_gguf()
    ids = prompt_ids(tok, CHAT_PROMPT, True)
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address="127.0.0.1:0",
                      resources={"MEM": 400e6}) as cluster, Client(cluster) as client:
        client.register_plugin(sb.SeaBiscuitSchedulerPlugin())
        page_url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/seabiscuit"
        with sb.distribute(model, client, torch.zeros(1, 128, dtype=torch.long),
                           kwargs={"logits_to_keep": 1}, sessions=4, context=384) as dm:
            callers = [threading.Thread(target=dm.generate, args=(ids, 24 + 8 * i)) for i in range(3)]
            for t in callers:
                t.start()
            for t in callers:
                t.join()
            spec = dm.plan.spec
            dm.drain(spec.devices[spec.names.index(dm.plan.blocks[-1].device)].address)
            with dm.session() as chat:
                chat.generate(ids, max_new_tokens=24)       # a session keeps its KV cache on the workers
                print(tok.decode(dm.generate(ids, max_new_tokens=16)[0, ids.shape[1]:]))
                with chromium_page(1400, 1500) as page:
                    page.navigate(page_url)
                    wait_for(lambda: (p := page.evaluate(BOKEH_PLOTS_JS)) and len(p) == 5
                             and all(x["glyph_pixels"] > 0 for x in p if "GPU" not in x["title"]), "plots")
                    write_png(page.screenshot(), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("dashboard.png")))
