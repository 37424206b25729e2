"""The status page, rendered by a real browser (Debian's chromium, headless)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, http_ok, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                "(scripts/test.sh installs it)")
BODY = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def browser(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_dashboard_shows_backends_canary_and_degraded_replies(tmp_path: Path) -> None:
    stable, canary = Sim(tmp_path, "dash-s", "--model", "m"), Sim(tmp_path, "dash-c",
                                                                  "--model", "m")
    config = ("[health]\ninterval = 0.3\nmetrics_interval = 0.3\n[routing]\nsticky = false\n"
              '[canary]\nenabled = true\nweight = 20\n[degraded]\nstatic_message = "later"\n'
              f'\n[[backends]]\nname = "steady"\nurl = "{stable.url}"\ngroup = "stable"\n'
              f'\n[[backends]]\nname = "fresh"\nurl = "{canary.url}"\ngroup = "canary"\n')
    gw = Gateway(tmp_path, config, name="dash")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        for _ in range(20):
            httpx.post(gw.url + "/v1/chat/completions", json=BODY)
        failed = httpx.post(gw.url + "/v1/chat/completions", json=BODY,
                            headers={"x-sim": "fault=500"})  # one attempt, then the static
        assert failed.headers.get("x-gateway-degraded") == "static"
        page = httpx.get(gw.url + "/dashboard")
        assert page.status_code == 200 and "http" not in page.text.split("<script>")[0].lower()

        dom = browser("--dump-dom", gw.url + "/dashboard").stdout
        assert '<td>steady</td><td>stable</td><td><span class="pill ready">ready' in dom
        assert '<td>fresh</td><td>canary</td><td><span class="pill ready">ready' in dom
        assert "<b>canary</b> 20 % · <b>stable</b> 80 %" in dom
        assert '<span class="pill static">static</span>' in dom
        assert '<span id="updated">updated ' in dom and '<span id="error"></span>' in dom

        shot = tmp_path / "dashboard.png"
        browser("--window-size=1280,900", f"--screenshot={shot}", gw.url + "/dashboard")
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", data[16:24]) == (1280, 900)
        assert len(data) > 20_000  # tables and pills drawn, not a blank page
    finally:
        gw.stop()
        stable.stop()
        canary.stop()
