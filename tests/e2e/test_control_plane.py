"""One control plane per replica (issue 37): whatever the number of serving workers, each
backend is probed and its /metrics scraped by the control process alone, and the workers
route on the states it publishes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, wait_for

WORKERS = (1, 2, 4)


@pytest.fixture(scope="module")
def fleet(tmp: Path) -> Iterator[dict[int, tuple[Gateway, Sim]]]:
    """A gateway of 1, 2 and 4 workers, each in front of a simulator of its own."""
    out: dict[int, tuple[Gateway, Sim]] = {}
    try:
        for n in WORKERS:
            sim = Sim(tmp, f"plane{n}")
            gw = Gateway(tmp, "[health]\ninterval = 0.1\nmetrics_interval = 0.1\n"
                         + backend_toml("a", sim.url), name=f"plane{n}", workers=n)
            out[n] = (gw, sim)
        for gw, _ in out.values():
            wait_for(lambda gw=gw: http_ok(gw.url + "/readyz"), 30, "ready")  # type: ignore[misc]
        yield out
    finally:
        for gw, sim in out.values():
            gw.stop()
            sim.stop()


def polled(sim: Sim) -> dict[str, int]:
    counts: dict[str, int] = sim.stats()["polled"]
    return counts


def test_probes_and_scrapes_come_once_per_replica_whatever_the_workers(
    fleet: dict[int, tuple[Gateway, Sim]],
) -> None:
    before = {n: polled(sim) for n, (_, sim) in fleet.items()}
    one = fleet[1][1]
    wait_for(lambda: polled(one)["/health"] - before[1]["/health"] >= 30, 30,
             "30 probes of the one-worker gateway's backend")
    grew = {n: {path: count - before[n][path] for path, count in polled(sim).items()}
            for n, (_, sim) in fleet.items()}
    for path in ("/health", "/metrics"):
        base = grew[1][path]
        assert base > 0, grew
        for n in WORKERS[1:]:  # the same window: about the same count, not n times it
            assert grew[n][path] <= 1.5 * base + 2, (path, grew)


def test_every_worker_routes_on_the_published_states(
    fleet: dict[int, tuple[Gateway, Sim]],
) -> None:
    gw, sim = fleet[4]
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for _ in range(20):  # fresh connections: every worker answers some
        reply = httpx.post(gw.url + "/v1/chat/completions", json=body,
                           headers={"connection": "close"}, timeout=10)
        assert reply.status_code == 200, reply.text
    sim.stop()  # the control process sees it go; every worker stops sending to it
    wait_for(lambda: all(
        httpx.get(gw.url + "/readyz", headers={"connection": "close"}).status_code == 503
        for _ in range(20)), 15, "every worker to take the backend out of rotation")
