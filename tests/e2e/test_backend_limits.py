"""Limits the gateway puts on a backend: connections per backend, and the memory of a
spawned one (``max_rss_mb``), with a stand-in backend that grows on request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, free_port, http_ok, metric, wait_for

CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}

GROWING = '''
import http.server, json, sys
held = []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "grower", "object": "model"}]})
        self._send(body.encode() if self.path == "/v1/models" else b"")
    def do_POST(self):
        self._send(b"{}")
        if self.path == "/grow":
            held.append(b"x" * (300 << 20))  # written, so resident
    def _send(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


@pytest.mark.parametrize("client", ["aiohttp"])  # httpx has no per-host cap: a config error
def test_no_more_connections_to_a_backend_than_allowed(tmp_path: Path, client: str) -> None:
    sim = Sim(tmp_path, f"capped-{client}")
    gw = Gateway(tmp_path, f'[upstream]\nclient = "{client}"\nmax_connections_per_backend = 2\n'
                 "[health]\ninterval = 0.5\n" + backend_toml("s", sim.url), name=client)
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")

        async def main() -> tuple[list[int], int]:
            most = 0
            async with httpx.AsyncClient(timeout=60) as c:
                sent = [asyncio.create_task(c.post(gw.url + CHAT, json=BODY, headers={
                    "x-sim": "ttft=1.5"})) for _ in range(4)]
                while not all(t.done() for t in sent):  # sample while all 4 are held
                    most = max(most, (await c.get(sim.url + "/sim/stats")).json()["running"])
                    await asyncio.sleep(0.02)
                return [t.result().status_code for t in sent], most

        statuses, most = asyncio.run(main())
        assert statuses == [200] * 4  # the others waited for a connection, then went
        assert most == 2, most
        assert sim.stats()["requests"] == 4
    finally:
        gw.stop()
        sim.stop()


def test_a_spawned_backend_above_max_rss_mb_is_drained_and_restarted(tmp_path: Path) -> None:
    script = tmp_path / "grower.py"
    script.write_text(GROWING)
    port = free_port()
    config = ('[supervisor]\npolicy_interval = 0.2\nbackoff_initial = 0.1\nstop_grace = 2\n'
              f'log_dir = "{tmp_path}/logs"\n[health]\ninterval = 0.3\nrise = 1\n'
              '[[backends]]\nname = "g"\n[backends.spawn]\nmodel = "grower"\n'
              f'port = {port}\nstartup_timeout = 30\nmax_rss_mb = 200\n'
              f'command = ["{{python}}", "{script}", "{{port}}"]\n')
    gw = Gateway(tmp_path, config, name="rss")

    def backend() -> dict[str, object]:
        found: dict[str, object] = httpx.get(gw.url + "/admin/status").json()["backends"][0]
        return found

    try:
        wait_for(lambda: backend()["state"] == "ready", 30, "the stand-in to start")
        first = backend()["pid"]
        assert httpx.post(f"http://127.0.0.1:{port}/grow", timeout=30).status_code == 200
        wait_for(lambda: backend()["state"] == "ready"
                 and backend()["pid"] != first, 30, "a restart for its memory")
        assert "above max_rss_mb 200: draining and restarting" in gw.proc.output()
        assert metric(gw.url, "gateway_backend_state", backend="g", state="ready") == 1
    finally:
        gw.stop()
