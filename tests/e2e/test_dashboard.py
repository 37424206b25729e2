"""The status page, rendered by a real browser (Debian's chromium, headless)."""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from backends.backend import BackendState
from gateway import __version__
from gateway.canary.rollout import Phase
from tests.e2e.browser import CHROMIUM, PILL_COLOURS, Browser, contrast, pixels
from tests.helpers import Gateway, Sim, http_ok, wait_for

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                "(scripts/test.sh installs it)")
BODY = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
GRAFANA = "http://grafana.example:3000/d/vllm-gateway"
# Every value a pill can show: backend states, breaker states, canary phases, degraded
# kinds, and one the page does not know.
PILLS = (*(s.value for s in BackendState), "closed", "half-open", "open",
         *(p.value for p in Phase), "cache", "static", "unavailable", "something-new")


def browser(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=60)


class Dash(NamedTuple):
    gw: Gateway
    broken_by: str  # the backend that answered the 5xx


@pytest.fixture(scope="module")
def dash(tmp: Path) -> Iterator[Dash]:
    """A canary at 20 %, a grafana_url, 20 requests, one degraded (static) reply and one
    5xx (an embeddings request, which has no static answer)."""
    stable, canary = Sim(tmp, "dash-s", "--model", "m"), Sim(tmp, "dash-c", "--model", "m")
    config = (f'grafana_url = "{GRAFANA}"\n'
              "[health]\ninterval = 0.3\nmetrics_interval = 0.3\n[routing]\nsticky = false\n"
              '[canary]\nenabled = true\nweight = 20\n[degraded]\nstatic_message = "later"\n'
              f'\n[[backends]]\nname = "steady"\nurl = "{stable.url}"\ngroup = "stable"\n'
              f'\n[[backends]]\nname = "fresh"\nurl = "{canary.url}"\ngroup = "canary"\n')
    gw = Gateway(tmp, config, name="dash")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        for _ in range(20):
            httpx.post(gw.url + "/v1/chat/completions", json=BODY)
        failed = httpx.post(gw.url + "/v1/chat/completions", json=BODY,
                            headers={"x-sim": "fault=500"})  # one attempt, then the static
        assert failed.headers.get("x-gateway-degraded") == "static"
        broken = httpx.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "x"},
                            headers={"x-sim": "fault=500"})
        assert broken.status_code == 500
        yield Dash(gw, broken.headers["x-gateway-backend"])
    finally:
        gw.stop()
        stable.stop()
        canary.stop()


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Browser]:
    page = Browser(tmp_path)
    yield page
    page.close()


def test_the_dashboard_shows_backends_canary_and_degraded_replies(tmp_path: Path,
                                                                  dash: Dash) -> None:
    url = dash.gw.url
    page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and "http" not in page.text.split("<script>")[0].lower()

    dom = browser("--dump-dom", url + "/dashboard").stdout
    assert '<td>steady</td><td>stable</td><td><span class="pill ready">ready' in dom
    assert '<td>fresh</td><td>canary</td><td><span class="pill ready">ready' in dom
    assert "<b>canary</b> 20 % · <b>stable</b> 80 %" in dom
    assert '<span class="pill static">static</span>' in dom
    assert '<span id="updated">updated ' in dom and '<span id="error"></span>' in dom
    assert f'<span id="version">v{__version__}</span>' in dom
    assert '<span id="uptime">up ' in dom
    assert f'<a id="grafana" target="_blank" rel="noopener noreferrer" href="{GRAFANA}">' in dom

    shot = tmp_path / "dashboard.png"
    browser("--window-size=1280,900", f"--screenshot={shot}", url + "/dashboard")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1280, 900)
    assert len(data) > 20_000  # tables and pills drawn, not a blank page


def test_every_pill_is_legible_on_its_background(dash: Dash, chromium: Browser) -> None:
    chromium.open(dash.gw.url + "/dashboard")
    wait_for(lambda: chromium.evaluate("document.querySelectorAll('.pill.static').length"),
             10, "the page drawn")
    live = [p["text"] for p in chromium.evaluate(PILL_COLOURS)]
    assert {"ready", "closed", "manual", "static"} <= set(live)  # state, breaker, phase, kind
    chromium.evaluate(f"document.body.insertAdjacentHTML('beforeend', "
                      f"'<div id=\"every-pill\">' + {list(PILLS)!r}.map(pill).join(' ') + "
                      f"'</div>')")
    pills = chromium.evaluate(PILL_COLOURS)
    assert sorted(p["text"] for p in pills) == sorted([*live, *PILLS])
    faint = [(p["text"], round(contrast(p["fg"], p["bg"]), 2)) for p in pills
             if contrast(p["fg"], p["bg"]) < 4.5]
    assert faint == []  # WCAG AA for normal text


# Where the steady backend's requests chart is on the page.
CHART_BOX = """(() => {
  const row = [...document.querySelectorAll('#trends tr')].find(
    (r) => r.cells[0].textContent.startsWith('steady '));
  const box = row.querySelector('svg').getBoundingClientRect();
  return box.width && [box.x, box.y, box.width, box.height];
})()"""
# The steady backend's TTFT chart: the path of its p50 and p99 lines.
TTFT_LINES = """(() => {
  const row = [...document.querySelectorAll('#trends tr')].find(
    (r) => r.cells[0].textContent.startsWith('steady '));
  return ['p50', 'p99'].map((q) => row.cells[3].querySelector('path.' + q)?.getAttribute('d'));
})()"""


def trends(gw: Gateway, **headers: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(gw.url + "/dashboard/data", headers={
        "connection": "close", **headers}).json()
    return data


def test_trends_chart_rates_errors_and_ttft_from_the_gateways_counters(
    dash: Dash, chromium: Browser, tmp_path: Path,
) -> None:
    def drawn() -> dict[str, Any] | None:
        found = trends(dash.gw)["trends"]
        backends = found["backends"]
        return found if {"steady", "fresh"} <= backends.keys() else None

    found = wait_for(drawn, 20, "a step with the requests in it")
    step = found["step_s"]
    assert step == 5 and found["window_s"] == 900
    backends, groups = found["backends"], found["groups"]
    # 20 chats and one embeddings request (the degraded one went to no backend).
    answered = sum(sum(backends[b]["requests"]) for b in ("steady", "fresh")) * step
    assert answered == pytest.approx(21, abs=1)
    assert sum(backends[dash.broken_by]["errors"]) * step == pytest.approx(1, abs=0.1)
    other = "fresh" if dash.broken_by == "steady" else "steady"
    assert sum(backends[other]["errors"]) == 0
    assert sum(groups["none"]["requests"]) * step == pytest.approx(1, abs=0.1)
    for series in (groups["stable"], backends["steady"]):  # stable's one backend
        p50 = [v for v in series["ttft_p50_ms"] if v is not None]
        p99 = [v for v in series["ttft_p99_ms"] if v is not None]
        assert p50 and p99 and 0 < p50[0] <= p99[0] <= 1000
    assert len(found["times"]) == len(backends["steady"]["requests"])

    chromium.open(dash.gw.url + "/dashboard")
    box = wait_for(lambda: chromium.evaluate(CHART_BOX), 10, "the steady backend's chart")
    rows = pixels(chromium.screenshot(*box))
    # The requests line (#0969da, blended by anti-aliasing), not the chart's pale fills.
    line = sum(1 for row in rows for px in row if px[2] - px[0] > 100)
    assert line >= box[2] - 4  # runs across the chart
    lines = chromium.evaluate(TTFT_LINES)
    assert all(d and d.startswith("M") for d in lines), lines  # drawn per backend too
    (tmp_path / "trends.png").write_bytes(chromium.screenshot())


def test_with_an_admin_key_set_loopback_needs_the_key_too(tmp_path: Path,
                                                          chromium: Browser) -> None:
    sim = Sim(tmp_path, "keyed", "--model", "m")
    gw = Gateway(tmp_path, 'admin_key = "adm-dash-9d1"\n[health]\ninterval = 0.3\n'
                 f'[[backends]]\nname = "only"\nurl = "{sim.url}"\n', name="keyed")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        assert httpx.get(gw.url + "/dashboard").status_code == 200  # the page itself
        assert httpx.get(gw.url + "/dashboard/data").status_code == 401  # from 127.0.0.1
        assert trends(gw, authorization="Bearer adm-dash-9d1")["backends"][0]["name"] == "only"

        chromium.open(gw.url + "/dashboard")
        wait_for(lambda: chromium.evaluate("$('error').textContent") == "admin key needed",
                 10, "the page to ask for the key")
        assert chromium.evaluate("$('backends').innerHTML") == ""
        chromium.evaluate("$('keyinput').value = 'wrong'; $('keybtn').click()")
        wait_for(lambda: chromium.evaluate("$('error').textContent") == "admin key refused",
                 10, "a wrong key refused")
        chromium.evaluate("$('keyinput').value = 'adm-dash-9d1'; $('keybtn').click()")
        wait_for(lambda: "<td>only</td>" in chromium.evaluate("$('backends').innerHTML"),
                 10, "the backends, with the key")
        assert chromium.evaluate("$('error').textContent") == ""
    finally:
        gw.stop()
        sim.stop()


def test_every_worker_draws_the_whole_gateways_trends(tmp_path: Path) -> None:
    sim = Sim(tmp_path, "many", "--model", "m")
    gw = Gateway(tmp_path, f'[health]\ninterval = 0.3\n[[backends]]\nname = "one"\n'
                 f'url = "{sim.url}"\n', name="many", workers=2)
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 20, "workers ready")
        sent = 0
        for _ in range(60):  # a new connection each: both workers take some
            reply = httpx.post(gw.url + "/v1/chat/completions", json=BODY,
                               headers={"connection": "close"})
            sent += reply.headers.get("x-gateway-backend") == "one"
        assert sent > 40
        seen: dict[int, float] = {}

        def both() -> bool:
            data = trends(gw)
            series = data["trends"]["backends"].get("one", {"requests": []})["requests"]
            seen[data["gateway"]["pid"]] = sum(series) * data["trends"]["step_s"]
            return len(seen) == 2 and all(v >= 0.9 * sent for v in seen.values())

        wait_for(both, 25, "both workers to count every request", every=0.2)
        assert all(v <= 1.1 * sent for v in seen.values())  # not one process's share
    finally:
        gw.stop()
        sim.stop()
