"""Browsers on other origins: a page served from one calls the gateway with ``fetch`` and
reads a stream, in headless Chromium; an origin not in ``cors_origins`` is refused by the
browser; a preflight is answered without the API key."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, free_port, http_ok, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                "(scripts/test.sh installs it)")
KEY = "browser-key-1"
PAGE = """<html><body><pre id="out">pending</pre><script>
(async () => {
  const out = document.getElementById("out");
  try {
    const r = await fetch("GATEWAY/v1/chat/completions", {method: "POST",
      headers: {"content-type": "application/json", "authorization": "Bearer KEY"},
      body: JSON.stringify({model: "m", max_tokens: 4, stream: true,
                            messages: [{role: "user", content: "hi"}]})});
    const reader = r.body.getReader(), text = new TextDecoder();
    let got = "", reads = 0;
    for (;;) { const {done, value} = await reader.read(); if (done) break;
               reads++; got += text.decode(value); }
    out.textContent = "status=" + r.status + " backend=" + r.headers.get("x-gateway-backend")
      + " tokens=" + (got.match(/tok[0-9]/g) || []).length + " done=" + got.includes("[DONE]");
  } catch (e) { out.textContent = "refused " + e.name; }
})();
</script></body></html>"""


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Gateway, str, str]]:
    """The gateway, a page on an allowed origin, and the same page on another origin."""
    sim = Sim(tmp_path, "cors", "--model", "m")
    allowed, other = free_port(), free_port()
    config = (f'api_keys = ["{KEY}"]\n'
              f'cors_origins = ["http://127.0.0.1:{allowed}"]\n' + backend_toml("s", sim.url))
    gw = Gateway(tmp_path, config, name="cors")
    root = tmp_path / "page"
    root.mkdir()
    (root / "index.html").write_text(PAGE.replace("GATEWAY", gw.url).replace("KEY", KEY))
    servers = [subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                                 "127.0.0.1", "--directory", str(root)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for port in (allowed, other)]
    try:
        for port in (allowed, other):
            wait_for(lambda p=port: http_ok(f"http://127.0.0.1:{p}/"), 10, "page server")
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
        yield gw, f"http://127.0.0.1:{allowed}/", f"http://127.0.0.1:{other}/"
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)
        gw.stop()
        sim.stop()


def dom(url: str) -> str:
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--virtual-time-budget=8000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=60)
    return done.stdout


def test_a_page_on_an_allowed_origin_streams_through_fetch(
        site: tuple[Gateway, str, str]) -> None:
    _, allowed, _ = site
    assert "status=200 backend=s tokens=4 done=true" in dom(allowed)


def test_a_page_on_another_origin_is_refused_by_the_browser(
        site: tuple[Gateway, str, str]) -> None:
    _, _, other = site
    assert "refused TypeError" in dom(other)


def test_a_preflight_is_answered_without_the_key(site: tuple[Gateway, str, str]) -> None:
    gw, allowed, _ = site
    origin = allowed.rstrip("/")
    reply = httpx.options(gw.url + "/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == origin
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    # Without an Origin the API still wants its key.
    assert httpx.post(gw.url + "/v1/chat/completions", json={"model": "m"}).status_code == 401
