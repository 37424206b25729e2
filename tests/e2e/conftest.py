from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Gateway, RedisServer, Sim, backend_toml, free_port, http_ok, wait_for


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def redis_server(tmp: Path) -> Iterator[RedisServer]:
    """A real valkey-server on TCP, one per test module."""
    server = RedisServer(tmp)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sims(tmp: Path) -> Iterator[tuple[Sim, Sim]]:
    a = Sim(tmp, "a")
    b = Sim(tmp, "b", "--model", "sim-model", "--model", "other-model")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def gateway(tmp: Path, sims: tuple[Sim, Sim]) -> Iterator[Gateway]:
    """Open gateway: two simulators, one dead backend, backend b has an API key."""
    a, b = sims
    dead = f"http://127.0.0.1:{free_port()}"
    config = (
        "[health]\ninterval = 0.5\n"
        + backend_toml("a", a.url)
        + backend_toml("b", b.url, 'api_key = "env:TEST_BACKEND_KEY"')
        + backend_toml("dead", dead)
    )
    gw = Gateway(tmp, config, env={"TEST_BACKEND_KEY": "backend-secret-b"})
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    yield gw
    gw.stop()
