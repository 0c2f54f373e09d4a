"""Headless Chromium driven over the DevTools protocol: load a Streamlit page, wait until its
script has finished and the page has stopped changing, then take a screenshot and the DOM.

Chromium's own ``--screenshot`` fires at the load event, before Streamlit's websocket has
delivered the page, so the page is waited for here instead.
"""

from __future__ import annotations

import base64
import itertools
import json
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--remote-debugging-port=0")
# Whether the script still runs, how much text, how many charts drawn: the page is ready once
# the script has stopped and this has not changed for SETTLE_S.
PROBE = """JSON.stringify({
  state: document.querySelector('[data-testid="stApp"]')?.getAttribute('data-test-script-state'),
  text: document.body.innerText.length,
  charts: document.querySelectorAll('.js-plotly-plot .main-svg').length,
  skeletons: document.querySelectorAll('[data-testid="stSkeleton"]').length,
  height: Math.max(...[document.documentElement, ...document.querySelectorAll('[data-testid="stMain"], [data-testid="stAppViewContainer"], section')].map(e => e.scrollHeight)),
})"""
SETTLE_S = 1.5


@dataclass(frozen=True)
class Page:
    dom: str
    text: str


class Chromium:
    def __init__(self, binary: str, profile: Path, *, width: int = 1400, height: int = 1000) -> None:
        self.profile = profile
        self.width, self.height = width, height
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._ids = itertools.count(1)
        self._stack = ExitStack()
        self._ws = self._stack.enter_context(connect(self._page_socket(), max_size=None, open_timeout=10))

    def _page_socket(self) -> str:
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (active.exists() and active.read_text().count("\n") >= 1):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port within 30 s")
            time.sleep(0.1)
        port = active.read_text().splitlines()[0]
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            if time.monotonic() > deadline:
                raise RuntimeError("chromium opened no page target")
            time.sleep(0.1)

    def call(self, method: str, **params: Any) -> dict:
        n = next(self._ids)
        self._ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=60))
            if reply.get("id") == n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def load(self, url: str, screenshot: Path, *, timeout_s: float = 60.0) -> Page:
        """Open ``url``, wait for the Streamlit script to finish and the page to settle, save a
        full-page PNG to ``screenshot``."""
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        last, since = None, time.monotonic()
        while True:
            probe = json.loads(self.evaluate(PROBE) or "{}")
            if probe != last:
                last, since = probe, time.monotonic()
            elif (probe.get("state") == "notRunning" and probe.get("text", 0) > 0
                  and not probe.get("skeletons") and time.monotonic() - since >= SETTLE_S):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not finish rendering within {timeout_s:.0f} s "
                                   f"(last state {probe})")
            time.sleep(0.25)
        height = max(self.height, int(last.get("height", self.height)))
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=height,
                  deviceScaleFactor=1, mobile=False)
        time.sleep(0.5)  # let charts re-layout at the new height
        shot = self.call("Page.captureScreenshot", format="png")
        self.call("Emulation.clearDeviceMetricsOverride")
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        return Page(dom=self.evaluate("document.documentElement.outerHTML"),
                    text=self.evaluate("document.body.innerText"))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:  # already gone: nothing left to close
            pass
        self._stack.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
