"""Make docs/serve.png: ``seabiscuit serve`` with SmolLM2, two prompts typed into its chat page in Chromium.

Run from the repository root: ``PYTHONPATH=. python docs/serve_screenshot.py [out.png]`` (needs Debian's
``chromium``; about a minute on two cores).
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from seabiscuit_dask.serve.server import Source, run
from tests.browser import chromium_page, write_png
from tests.clusters import wait_for
from tests.test_serve import _status

PROMPTS = ["What is the capital of France?", "Name three rivers of Europe."]
DONE = "document.querySelectorAll('.msg.assistant[data-state=done]').length"


def main(out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()
    server = threading.Thread(target=run, args=([Source("gguf", None, "smollm2")],), daemon=True, kwargs=dict(
        workers=2, scheduler=None, host="127.0.0.1", port=port, sessions=2, context=512, budget=None,
        api_key=None, device=None, stop=stop))
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(url + "/health") == 200, "the server to be ready", 600)
        with chromium_page(1100, 640) as page:
            page.navigate(url + "/")
            wait_for(lambda: page.evaluate("document.getElementById('model')?.value") == "smollm2",
                     "the model picker")
            page.evaluate("document.getElementById('max').value = 64")
            for i, prompt in enumerate(PROMPTS):
                page.evaluate("document.getElementById('prompt').focus()")
                page.call("Input.insertText", text=prompt)
                for kind in ("keyDown", "keyUp"):
                    page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                              windowsVirtualKeyCode=13)
                wait_for(lambda i=i: page.evaluate(DONE) > i, f"the answer to {prompt!r}", 120)
            print(f"wrote {write_png(page.screenshot(), out)}")
    finally:
        stop.set()
        server.join(60)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/serve.png"))
