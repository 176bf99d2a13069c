"""Headless Chromium (Debian's ``chromium``), driven over the DevTools protocol.

Renders a page as a person would see it, runs JavaScript in it and takes
screenshots. It needs no driver that downloads its own browser: the DevTools
websocket is spoken with tornado, which distributed already brings.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tornado.websocket import websocket_connect

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Page:
    """One browser tab: ``evaluate`` JavaScript, ``screenshot`` to PNG bytes."""

    def __init__(self, ws_url: str) -> None:
        self.ws_url = ws_url
        self._id = 0
        self._loop = asyncio.new_event_loop()
        self._ws = self._loop.run_until_complete(self._connect())

    async def _connect(self) -> Any:
        return await websocket_connect(self.ws_url, max_message_size=256 << 20)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self._loop.run_until_complete(self._call(method, params))

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._id += 1
        await self._ws.write_message(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = await asyncio.wait_for(self._ws.read_message(), 60)
            if msg is None:
                raise RuntimeError(f"the browser closed the DevTools connection during {method}")
            reply = json.loads(msg)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def navigate(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JavaScript failed: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def screenshot(self) -> bytes:
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return base64.b64decode(shot["data"])

    def close(self) -> None:
        async def close_ws() -> None:      # NOTE: on its own loop: the thread may have no current one
            self._ws.close()

        self._loop.run_until_complete(close_ws())
        self._loop.close()


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1700) -> Iterator[Page]:
    """A tab of a new headless Chromium, closed (with its profile) afterwards."""
    exe = find_chromium()
    if exe is None:
        raise RuntimeError("no chromium on PATH (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="sb-chromium-")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    proc = subprocess.Popen(
        # NOTE: no background networking: on a closed network its connections only fail
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-proxy-server", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-quic", f"--user-data-dir={profile}", f"--window-size={width},{height}",
         "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    page = None
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:         # NOTE: Chromium prints its DevTools address once it listens
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            raise RuntimeError(f"chromium exited with {proc.wait()} before its DevTools port opened")
        page = Page(_page_target(port))
        yield page
    finally:
        if page is not None:
            page.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def _page_target(port: int) -> str:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    targets = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
    return next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")


# What a Bokeh page drew: per figure its title and the pixels its glyphs paint (those that
# change when the glyph renderers are hidden, so axes, grids and titles do not count).
BOKEH_PLOTS_JS = r"""
(async () => {
  const views = [], seen = new Set();
  const visit = (v) => {
    if (!v || seen.has(v)) return;
    seen.add(v); views.push(v);
    for (const c of (v.child_views || [])) visit(c);
  };
  const idx = (window.Bokeh && Bokeh.index) || {};
  (typeof idx.values === "function" ? [...idx.values()] : Object.values(idx)).forEach(visit);
  const frame = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  const pixels = (v) => {
    const c = v.export("png").canvas;
    return c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  };
  const out = [];
  for (const v of views.filter((v) => v.canvas_view)) {
    const glyphs = v.model.renderers.filter((r) => r.type === "GlyphRenderer" && r.visible);
    const drawn = pixels(v);
    glyphs.forEach((r) => { r.visible = false; });
    await frame();
    const bare = pixels(v);
    glyphs.forEach((r) => { r.visible = true; });
    await frame();
    let n = 0;
    for (let i = 0; i < drawn.length; i += 4) {
      if (Math.abs(drawn[i] - bare[i]) + Math.abs(drawn[i + 1] - bare[i + 1])
          + Math.abs(drawn[i + 2] - bare[i + 2]) > 24) n++;
    }
    out.push({title: v.model.title ? v.model.title.text : "", glyph_pixels: n});
  }
  return out;
})()
"""


def write_png(data: bytes, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
