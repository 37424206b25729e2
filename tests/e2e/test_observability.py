"""What operators see: /metrics (one process and several), request logs, secrets, load."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Gateway, RedisServer, Sim, backend_toml, http_ok, wait_for

CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {"model": "sim-model", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hi"}]}
DOCUMENTED = (  # README, "Operations"
    "gateway_requests", "gateway_ttft_seconds", "gateway_inter_token_seconds",
    "gateway_request_duration_seconds", "gateway_in_flight", "gateway_backend_state",
    "gateway_group_requests", "gateway_breaker_state", "gateway_retries",
    "gateway_degraded_replies", "gateway_sticky", "gateway_redis_up",
    "gateway_backend_requests_running", "gateway_backend_requests_waiting",
    "gateway_backend_kv_cache_usage_ratio")


def scrape(url: str) -> dict[str, list[Any]]:
    families: dict[str, list[Any]] = {}
    text = httpx.get(url + "/metrics", headers={"connection": "close"}).text
    for family in text_string_to_metric_families(text):
        families[family.name] = family.samples
    return families


def total(samples: list[Any], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def pair(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    a, b = Sim(tmp, "obs-a", "--itl", "0.01"), Sim(tmp, "obs-b", "--itl", "0.01")
    yield a, b
    a.stop()
    b.stop()


def test_metrics_parse_and_hold_the_documented_set(tmp_path: Path,
                                                   pair: tuple[Sim, Sim]) -> None:
    gw = Gateway(tmp_path, "[health]\ninterval = 0.3\nmetrics_interval = 0.2\n"
                 "[routing]\nsticky = false\n"
                 + backend_toml("a", pair[0].url) + backend_toml("b", pair[1].url))
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for _ in range(3):
            list(client.chat.completions.create(model="sim-model", messages=BODY["messages"],
                                                stream=True))
            client.chat.completions.create(model="sim-model", messages=BODY["messages"])
        assert httpx.post(gw.url + CHAT, json={**BODY, "model": "nope"}).status_code == 404
        wait_for(lambda: "gateway_backend_requests_running" in scrape(gw.url), 5,
                 "the backends' own load to be scraped")
        families = scrape(gw.url)
        missing = [name for name in DOCUMENTED if name not in families]
        assert not missing
        requests = families["gateway_requests"]
        assert total(requests, "gateway_requests_total", status="200", model="sim-model") == 6
        assert total(requests, "gateway_requests_total", status="404", model="unknown") == 1
        assert total(families["gateway_ttft_seconds"], "gateway_ttft_seconds_count") == 6
        assert total(families["gateway_inter_token_seconds"],
                     "gateway_inter_token_seconds_count") == 3  # one per stream
        assert total(families["gateway_backend_state"], "gateway_backend_state",
                     backend="a", state="ready") == 1
        # No GPU here: no sample at all, not zeros.
        assert not [f for f, samples in families.items() if "gpu" in f and samples]
    finally:
        gw.stop()


def test_metrics_add_up_over_worker_processes(tmp_path: Path, pair: tuple[Sim, Sim]) -> None:
    redis = RedisServer(tmp_path)
    gw = Gateway(tmp_path, f'workers = 2\n[redis]\nurl = "{redis.url}"\n[health]\n'
                 "interval = 0.3\n" + backend_toml("a", pair[0].url)
                 + backend_toml("b", pair[1].url), name="workers")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 20, "workers ready")
        # A worker that has not probed yet answers 503; counted all the same, so no
        # request's status matters here, only that every one is counted once.
        answered = 0
        for _ in range(200):  # a new connection each: both workers take some
            reply = httpx.post(gw.url + CHAT, json=BODY, headers={"connection": "close"})
            answered += reply.status_code == 200
        assert answered > 0
        def pids() -> set[int]:
            return {httpx.get(gw.url + "/healthz", headers={"connection": "close"}).json()[
                "pid"] for _ in range(20)}

        wait_for(lambda: len(pids()) == 2, 10, "both workers to answer")
        for _ in range(8):  # whichever worker answers, the sum is the same
            families = scrape(gw.url)
            assert total(families["gateway_requests"], "gateway_requests_total") == 200
            assert total(families["gateway_ttft_seconds"],
                         "gateway_ttft_seconds_count") == answered
    finally:
        gw.stop()
        redis.stop()


SECRETS = {"VGW_TEST_KEY": "sk-client-7f3a9c", "VGW_TEST_ADMIN": "adm-5be21d90",
           "VGW_TEST_BACKEND": "bk-upstream-4411e"}


def test_one_json_line_per_request_and_no_secret_anywhere(tmp_path: Path) -> None:
    sim = Sim(tmp_path, "secretive", "--itl", "0.01")
    config = ('api_keys = ["env:VGW_TEST_KEY"]\nadmin_key = "env:VGW_TEST_ADMIN"\n'
              "[health]\ninterval = 0.3\n[degraded]\nstatic_message = 'later'\n"
              + backend_toml("s", sim.url, 'api_key = "env:VGW_TEST_BACKEND"'))
    gw = Gateway(tmp_path, config, name="secrets", env=SECRETS)
    seen: list[str] = []
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        key = {"authorization": f"Bearer {SECRETS['VGW_TEST_KEY']}"}
        admin = {"authorization": f"Bearer {SECRETS['VGW_TEST_ADMIN']}"}
        for r in (httpx.post(gw.url + CHAT, json=BODY, headers=key),
                  httpx.post(gw.url + CHAT, json={**BODY, "stream": True}, headers=key),
                  httpx.post(gw.url + CHAT, json=BODY, headers={**key, "x-sim": "fault=500"}),
                  httpx.post(gw.url + CHAT, json={**BODY, "model": "x"}, headers=key),
                  httpx.post(gw.url + CHAT, json=BODY, headers={"authorization": "Bearer no"}),
                  httpx.get(gw.url + "/admin/status", headers=admin),
                  httpx.get(gw.url + "/admin/status"),
                  httpx.get(gw.url + "/dashboard/data", headers=admin),
                  httpx.get(gw.url + "/metrics")):
            seen.append(r.text + json.dumps(dict(r.headers)))
        assert sim.stats()["last_headers"]  # the backend key was sent upstream...
    finally:
        gw.stop()
        sim.stop()
    output = gw.proc.output() + sim.proc.output()
    for secret in SECRETS.values():  # ...and never written anywhere else
        assert secret not in output and not any(secret in s for s in seen)
    lines = [json.loads(line) for line in gw.proc.output().splitlines() if line.startswith("{")]
    requests = [line for line in lines if line["msg"] == "request"]
    assert len(requests) == 4  # the proxied ones; the 401 never reached the proxy
    by_status = {r["status"]: r for r in requests}
    assert set(by_status) == {200, 404}
    streamed = next(r for r in requests if r["stream"])
    assert streamed["backend"] == "s" and streamed["group"] == "stable"
    assert streamed["ttft_ms"] > 0 and streamed["duration_ms"] >= streamed["ttft_ms"]
    assert streamed["chunks"] >= 4
    assert any(r.get("note") == "degraded static" for r in requests)


def test_load_that_other_clients_put_on_a_backend_steers_requests_away(
    tmp_path: Path, pair: tuple[Sim, Sim],
) -> None:
    gw = Gateway(tmp_path, "[health]\ninterval = 0.3\nmetrics_interval = 0.1\n"
                 "[routing]\nsticky = false\n"
                 + backend_toml("a", pair[0].url) + backend_toml("b", pair[1].url), name="load")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")

        async def elsewhere() -> None:  # another client talks to backend a directly
            async with httpx.AsyncClient(timeout=300) as client:
                await asyncio.gather(*(client.post(pair[0].url + CHAT, json=BODY, headers={
                    "x-sim": "ttft=300"}) for _ in range(4)))  # held until cancelled

        async def main() -> list[str]:
            side = asyncio.create_task(elsewhere())
            async with httpx.AsyncClient(timeout=30) as client:
                deadline = asyncio.get_running_loop().time() + 10
                while 'gateway_backend_requests_running{backend="a"} 4.0' not in (
                        await client.get(gw.url + "/metrics")).text:
                    assert asyncio.get_running_loop().time() < deadline, "a's load not seen"
                    await asyncio.sleep(0.05)
                names = [(await client.post(gw.url + CHAT, json=BODY)).headers[
                    "x-gateway-backend"] for _ in range(6)]
                assert pair[0].stats()["running"] == 4  # the other client's load held on
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
            return names

        assert asyncio.run(main()) == ["b"] * 6
    finally:
        gw.stop()


# A user agent that tries everything: quotes and '=' to forge fields, a tab, NEL and the
# line separator (raw bytes a header may carry; CR and LF end the header), and 10 KB.
AGENT = (b'evil" status=500 backend=forged\t\xe2\x80\xa8FORGED1\xc2\x85FORGED2 '
         + b"A" * 10_000)
LOGFMT = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_hostile_user_agent_is_logged_cut_and_escaped(tmp_path: Path, pair: tuple[Sim, Sim],
                                                        fmt: str) -> None:
    gw = Gateway(tmp_path, f'log_format = "{fmt}"\n[health]\ninterval = 0.3\n'
                 + backend_toml("a", pair[0].url), name=f"agent-{fmt}")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "ready")
        reply = httpx.post(gw.url + CHAT, json=BODY, headers={"user-agent": AGENT})
        assert reply.status_code == 200
        rid = reply.headers["x-request-id"]
        line = wait_for(lambda: next((ln for ln in gw.proc.output().splitlines()
                                      if rid in ln), None), 10, "the access line")
    finally:
        gw.stop()
    lines = gw.proc.output().splitlines()  # Python's splitlines splits on NEL and U+2028 too
    assert not any(ln.startswith(("FORGED", "\x85", "\u2028")) for ln in lines)
    assert sum(rid in ln for ln in lines) == 1
    if fmt == "json":
        fields = json.loads(line)
        assert fields["user_agent"] == AGENT[:256].decode("latin-1")
    else:
        fields = {k: v for k, v in LOGFMT.findall(line.split(": request ", 1)[1])}
        assert fields["user_agent"].startswith(
            '"evil\\" status=500 backend=forged\\t\xe2\\x80\xa8FORGED1\xc2\\x85FORGED2 AAA')
        assert fields["user_agent"].endswith('A"')
        assert len(fields["user_agent"]) < 256 + 20  # cut, then a few escapes
    assert fields["status"] in (200, "200") and fields["backend"] == "a"
    assert fields["id"] == rid
