"""Every kind of secret configured, the gateway at debug level, the usual scenarios and the
broken ones run through it: no secret in any log line, metric, admin or status view, or
reply body (issue 19: "no secret ever appears...")."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import openai

from tests.helpers import Gateway, Sim, backend_toml, free_port, wait_for

SECRETS = {
    "api literal": "sk-literal-aaa111", "api env": "sk-env-bbb222", "admin": "adm-ccc333",
    "backend env": "bk-env-ddd444", "backend literal": "bk-lit-eee555",
    "url password": "urlpass-fff666",
}
ENV = {"T_API_KEY": SECRETS["api env"], "T_BACKEND_KEY": SECRETS["backend env"]}


def test_no_secret_reaches_a_log_a_metric_a_view_or_a_reply(tmp: Path) -> None:
    a, b, c = Sim(tmp, "sa"), Sim(tmp, "sb"), Sim(tmp, "sc")
    dead = f"http://127.0.0.1:{free_port()}"
    config = (f'api_keys = ["{SECRETS["api literal"]}", "env:T_API_KEY"]\n'
              f'admin_key = "{SECRETS["admin"]}"\nlog_level = "debug"\n'
              "[health]\ninterval = 0.3\n"
              + backend_toml("a", a.url, 'api_key = "env:T_BACKEND_KEY"')
              + backend_toml("b", b.url, f'api_key = "{SECRETS["backend literal"]}"')
              + backend_toml("c", c.url.replace("http://", f"http://u:{SECRETS['url password']}@"))
              + backend_toml("dead", dead))
    gw = Gateway(tmp, config, name="secrets", env=ENV)
    seen: list[str] = []
    try:
        admin = {"authorization": f"Bearer {SECRETS['admin']}"}
        wait_for(lambda: [s for s in httpx.get(gw.url + "/readyz", headers=admin).json()[
            "backends"].values()].count("ready") == 3, 20, "a, b and c ready")
        for key in (SECRETS["api literal"], SECRETS["api env"]):
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            reply = client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            seen.append(reply.model_dump_json())
            seen.extend(str(chunk) for chunk in client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                stream=True))
        headers = {"authorization": f"Bearer {SECRETS['api literal']}"}
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}
        for fault in ("500", "inband", "crash", "cut"):
            reply = httpx.post(gw.url + "/v1/chat/completions", json={**body, "stream": True},
                               headers={**headers, "x-sim": f"fault={fault},after=1"})
            seen.append(reply.text)
        for wrong in ("Bearer nope", "Basic " + SECRETS["api literal"], ""):
            seen.append(httpx.post(gw.url + "/v1/chat/completions", json=body,
                                   headers={"authorization": wrong}).text)
        seen.append(httpx.get(gw.url + "/admin/status",
                              headers={"authorization": "Bearer wrong"}).text)
        views = {path: httpx.get(gw.url + path, headers=admin) for path in (
            "/admin/status", "/dashboard/data", "/admin/canary", "/metrics", "/readyz")}
        assert all(v.status_code == 200 for v in views.values()), views
        assert "***@127.0.0.1" in views["/admin/status"].text  # c's URL, read and redacted
        seen.extend(v.text for v in views.values())
        seen.append(httpx.get(gw.url + "/v1/models", headers=headers).text)
        seen.append(httpx.post(gw.url + "/admin/backends/b/drain", headers=admin,
                               json={"timeout": 5}).text)
        seen.append(httpx.post(gw.url + "/admin/backends/b/start", headers=admin).text)
        os.kill(gw.proc.popen.pid, signal.SIGHUP)
        wait_for(lambda: "config reloaded" in gw.proc.output(), 10, "the reload")
    finally:
        gw.stop()
        for sim in (a, b, c):
            sim.stop()
    seen.append(gw.proc.output())
    output = gw.proc.output()  # the failure paths wrote their lines, and they are read here
    for line in output.splitlines():
        json.loads(line)  # JSON logs stay valid JSON, one object per line
    assert "api key invalid" in output
    assert "mid-stream" in output or "mid-response" in output
    leaks = {name: [s[:200] for s in seen if secret in s] for name, secret in SECRETS.items()}
    assert not any(leaks.values()), leaks
