"""schemathesis against a running gateway in its default process model, from the OpenAPI
document it serves (/openapi.json): valid, boundary and invalid requests to every route,
bounded and seeded. No gateway-originated 5xx, and nothing in the log says an exception
escaped a handler."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, wait_for

REPO = Path(__file__).resolve().parents[2]
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def gw(tmp: Path) -> Iterator[Gateway]:
    sim = Sim(tmp, "fuzz")
    # A long backend name: a generated path parameter will not drain the only backend.
    gateway = Gateway(tmp, backend_toml("backend-alpha-7f3", sim.url), name="fuzz",
                      workers=None)
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 20, "gateway ready")
    yield gateway
    gateway.stop()
    sim.stop()


def spec(gw: Gateway, tmp: Path) -> Path:
    """The document the gateway serves, its model names narrowed to the one served here
    (so most generated requests reach the backend instead of stopping at a 404)."""
    document = httpx.get(gw.url + "/openapi.json", timeout=10).json()
    document["components"]["schemas"]["Model"]["enum"] = ["sim-model"]
    path = tmp / "openapi.json"
    path.write_text(json.dumps(document))
    return path


def fuzz(gw: Gateway, tmp: Path, *select: str) -> None:
    done = subprocess.run(
        [str(SCHEMATHESIS), "run", str(spec(gw, tmp)), "--url", gw.url,
         "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "18", *select,
         "--report", "junit", "--report-dir", str(tmp / "fuzz-report")],
        capture_output=True, text=True, timeout=300, cwd=tmp)
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and " failed" not in done.stdout.split("SUMMARY")[-1]
    log = gw.proc.output()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_schemathesis_finds_no_server_error(gw: Gateway, tmp: Path) -> None:
    # The verbs that change a backend's life go last, alone: schemathesis learns the
    # backend's name from /admin/status and may stop it, after which 503 ("no healthy
    # backend") is the right answer to a completion, not a fault.
    fuzz(gw, tmp, "--exclude-path-regex", "^/admin/backends/")
    fuzz(gw, tmp, "--include-path-regex", "^/admin/backends/")
