"""Headless Chromium (Debian's), driven over the DevTools protocol: open a page, evaluate
script in it, take a screenshot; and the PNG decoder and WCAG contrast the status page's
tests check it with. No browser download, no new dependency (``websockets`` comes with
uvicorn[standard])."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.helpers import wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, tmp: Path, width: int = 1280, height: int = 900) -> None:
        assert CHROMIUM is not None
        profile = tmp / "chromium-profile"
        self._proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--remote-debugging-port=0", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        active = profile / "DevToolsActivePort"
        port = wait_for(lambda: active.exists() and active.read_text().split("\n")[0], 20,
                        "chromium's DevTools port")
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list").json()
        page = next(t for t in targets if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self._ws: ClientConnection = self._stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None))
        self._ids = itertools.count(1)
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events in between are let go)."""
        sent = next(self._ids)
        self._ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=30))
            if message.get("id") == sent:
                assert "error" not in message, message["error"]
                result: dict[str, Any] = message["result"]
                return result

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        wait_for(lambda: self.evaluate("document.readyState") == "complete", 20, url)

    def evaluate(self, script: str) -> Any:
        found = self.call("Runtime.evaluate", expression=script, returnByValue=True,
                          awaitPromise=True)
        assert "exceptionDetails" not in found, found["exceptionDetails"]
        return found["result"].get("value")

    def screenshot(self, x: float = 0, y: float = 0, width: float = 0,
                   height: float = 0) -> bytes:
        """The page as a PNG, or the clip given."""
        clip = ({"clip": {"x": x, "y": y, "width": width, "height": height, "scale": 1}}
                if width else {})
        shot = self.call("Page.captureScreenshot", format="png", **clip)
        return base64.b64decode(shot["data"])

    def close(self) -> None:
        self._stack.close()
        self._proc.terminate()
        self._proc.wait(10)


def pixels(png: bytes) -> list[list[tuple[int, ...]]]:
    """A PNG's rows of RGB(A) pixels: 8-bit truecolour, not interlaced (what Chromium
    writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", png[16:29])
    assert depth == 8 and colour in (2, 6) and interlace == 0
    step = 3 if colour == 2 else 4
    data, at = b"", 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        if kind == b"IDAT":
            data += png[at + 8:at + 8 + length]
        at += 12 + length
    raw, stride, rows = zlib.decompress(data), width * step, []
    previous = bytearray(stride)
    for r in range(height):
        start = r * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up, corner = previous[i], previous[i - step] if i >= step else 0
            guess = (0, left, up, (left + up) // 2, paeth(left, up, corner))[kind]
            line[i] = (line[i] + guess) & 0xFF
        rows.append([tuple(line[i:i + step]) for i in range(0, stride, step)])
        previous = line
    return rows


def paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


# Each .pill's text colour and the background it is read against: its own, else the first
# ancestor's that is not transparent, blended down to the page's white.
PILL_COLOURS = """[...document.querySelectorAll('.pill')].map((el) => {
  const rgba = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const layers = [];
  for (let n = el; n; n = n.parentElement) {
    const bg = rgba(getComputedStyle(n).backgroundColor);
    if (bg.length === 4 && bg[3] === 0) continue;
    layers.push(bg.length === 4 ? bg : [...bg, 1]);
    if (layers[layers.length - 1][3] === 1) break;
  }
  let under = [255, 255, 255];
  for (const [r, g, b, a] of layers.reverse()) {
    under = [r, g, b].map((c, i) => c * a + under[i] * (1 - a));
  }
  const fg = rgba(getComputedStyle(el).color).slice(0, 3);
  return {text: el.textContent, cls: el.className, fg, bg: under};
})"""


def luminance(rgb: list[float]) -> float:
    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: list[float], b: list[float]) -> float:
    """WCAG 2's contrast ratio, 1 to 21."""
    light, dark = sorted((luminance(a), luminance(b)), reverse=True)
    return (light + 0.05) / (dark + 0.05)
