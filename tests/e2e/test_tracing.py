"""OpenTelemetry spans (``[tracing] enabled``): a gateway served in this process (uvicorn in
a thread) whose spans go to the SDK's in-memory exporter, in front of real simulators.

One SERVER span per request under the client's ``traceparent``, one CLIENT span per upstream
attempt under it (status, retry flag), the attempt's context sent to the backend as its
``traceparent``, the trace id in the access-log line; off, nothing is made and the client's
header passes through untouched."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind

from gateway.app import GatewayApp
from gateway.config import (
    load,
    setting_problems,
)
from gateway.observability import tracing
from tests.helpers import Sim, free_port

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
BODY = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def sims(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    good, bad = Sim(tmp, "tr-good", "--model", "m"), Sim(tmp, "tr-bad", "--model", "m",
                                                         "--fault", "500")
    yield good, bad
    good.stop()
    bad.stop()


Scenario = Callable[[str], Awaitable[Any]]


def serve(tmp: Path, config: str, scenario: Scenario) -> tuple[GatewayApp, Any]:
    """Run a gateway app on a real port in this process's main thread (its lifespan sets
    signal handlers) while ``scenario(url)`` runs; the scenario's result."""
    port = free_port()
    path = tmp / f"trace-{port}.toml"
    path.write_text(f'[gateway]\nlisten = "127.0.0.1:{port}"\nworkers = 1\n{config}')
    app = GatewayApp(load(path, {}), config_path=str(path))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           lifespan="on"))
    url = f"http://127.0.0.1:{port}"

    async def run() -> Any:
        serving = asyncio.create_task(server.serve())
        try:
            async with httpx.AsyncClient() as client:
                for _ in range(750):  # 15 s
                    if not serving.done() and server.started:
                        try:
                            if (await client.get(url + "/readyz")).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                    assert not serving.done(), "the gateway did not start"
                    await asyncio.sleep(0.02)
            return await scenario(url)
        finally:
            server.should_exit = True
            await serving

    return app, asyncio.run(run())


def config(sims: tuple[Sim, Sim], extra: str = "") -> str:
    good, bad = sims
    return (f"{extra}\n[routing]\nsticky = false\npolicy = \"round_robin\"\n"
            "[degraded]\ncache = false\n[breaker]\nenabled = false\n"
            "[health]\ninterval = 0.3\nrise = 1\n"
            f'[[backends]]\nname = "good"\nurl = "{good.url}"\n'
            f'[[backends]]\nname = "bad"\nurl = "{bad.url}"\n')


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "make", lambda settings: tracing.Tracing(
        settings, SimpleSpanProcessor(exporter)) if settings.enabled else None)
    return exporter


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "gateway.access"]


async def traced_pair(url: str, headers: dict[str, str], sim: Sim) -> Any:
    """Two requests (round robin: one meets the failing backend first); what the good
    simulator last received."""
    async with httpx.AsyncClient() as client:
        for _ in range(2):
            reply = await client.post(url + "/v1/chat/completions", json=BODY, headers=headers)
            assert reply.status_code == 200
        return (await client.get(sim.url + "/sim/stats")).json()["last_headers"]


def test_a_request_and_each_attempt_are_spans_under_the_clients_trace(
    tmp_path: Path, sims: tuple[Sim, Sim], exported: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    headers = {"traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "vendor=1"}
    _, seen = serve(tmp_path, config(sims, "[tracing]\nenabled = true\nsample_ratio = 0.0"),
                    lambda url: traced_pair(url, headers, sims[0]))
    spans = exported.get_finished_spans()
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    clients = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert len(servers) == 2 and len(clients) == 3, [s.name for s in spans]
    for server in servers:  # the client's sampled parent wins over sample_ratio 0
        assert format(server.context.trace_id, "032x") == TRACE
        assert format(server.parent.span_id, "016x") == PARENT
        assert server.attributes["http.response.status_code"] == 200
        assert server.attributes["gateway.backend"] == "good"
    retried = next(s for s in servers if s.attributes["gateway.attempts"] == 2)
    assert retried.attributes["gateway.retried"] is True
    under = sorted((s for s in clients if s.parent.span_id == retried.context.span_id),
                   key=lambda s: s.start_time)
    assert [(s.attributes["gateway.backend"], s.attributes["http.response.status_code"],
             s.attributes["gateway.retry"]) for s in under] == [
        ("bad", 500, False), ("good", 200, True)]
    assert under[0].status.is_ok is False and under[0].end_time <= under[1].start_time
    # What the backend got: the trace goes on, its parent is the attempt, not the client.
    sent = {k.lower(): v for k, v in seen}
    _, trace_id, parent_id, flags = sent["traceparent"].split("-")
    last = max((s for s in clients if s.attributes["gateway.backend"] == "good"),
               key=lambda s: s.start_time)
    assert (trace_id, parent_id, flags) == (TRACE, format(last.context.span_id, "016x"), "01")
    assert sent["tracestate"] == "vendor=1"
    assert [line["trace_id"] for line in lines(caplog)] == [TRACE, TRACE]


def test_an_unsampled_request_makes_no_span_and_logs_no_trace_id(
    tmp_path: Path, sims: tuple[Sim, Sim], exported: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    serve(tmp_path, config(sims, "[tracing]\nenabled = true\nsample_ratio = 0.0"),
          lambda url: traced_pair(url, {}, sims[0]))
    assert exported.get_finished_spans() == ()
    assert [line["trace_id"] for line in lines(caplog)] == [None, None]


def test_off_nothing_is_made_and_the_clients_traceparent_passes_through(
    tmp_path: Path, sims: tuple[Sim, Sim], exported: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    header = f"00-{TRACE}-{PARENT}-01"
    app, seen = serve(tmp_path, config(sims),
                      lambda url: traced_pair(url, {"traceparent": header}, sims[0]))
    assert app.parts.proxy._open._tracing is None  # nothing made: the attempts carry none
    assert exported.get_finished_spans() == ()
    assert {k.lower(): v for k, v in seen}["traceparent"] == header
    assert [line["trace_id"] for line in lines(caplog)] == [None, None]


def test_tracing_without_the_extra_is_a_config_error(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    from gateway import config
    monkeypatch.setattr(config, "find_spec", lambda name: None)
    path = tmp_path / "c.toml"
    path.write_text('[tracing]\nenabled = true\n[[backends]]\nname = "a"\n'
                    'url = "http://127.0.0.1:1"\n')
    assert setting_problems(load(path, {"VGW_TRACING__ENABLED": "false"})) == []
    with pytest.raises(Exception) as bad:
        load(path, {})
    assert bad.value.problems == [  # type: ignore[attr-defined]
        f"{path}:2: tracing.enabled: needs the otel extra: pip install 'vllm-gateway[otel]'"]
