"""The admin verbs against a gateway named by ``--url`` (no config file at hand), with the
key from ``--admin-key`` or ``VGW_ADMIN_KEY``; ``canary status`` as a sentence; ``/version``
with each backend's vLLM version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway import __version__
from gateway.admin.client import canary_sentence
from tests.helpers import Gateway, Sim, free_port, http_ok, wait_for

REPO = Path(__file__).resolve().parents[2]
CONFIG = """admin_key = "admin-remote-secret"
[health]
interval = 0.3
rise = 1
[canary]
enabled = true
weight = 30
"""


@pytest.fixture(scope="module")
def gw(tmp: Path) -> Iterator[Gateway]:
    stable, canary = Sim(tmp, "rst", "--model", "m"), Sim(tmp, "rca", "--model", "m")
    down = f"http://127.0.0.1:{free_port()}"
    backends = "".join(f'\n[[backends]]\nname = "{n}"\nurl = "{u}"\ngroup = "{g}"\n'
                       for n, g, u in (("stable0", "stable", stable.url),
                                       ("canary0", "canary", canary.url),
                                       ("gone", "stable", down)))
    gateway = Gateway(tmp, CONFIG + backends, name="remote")
    wait_for(lambda: http_ok(gateway.url + "/readyz"), 10, "gateway ready")
    yield gateway
    gateway.stop()
    stable.stop()
    canary.stop()


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VGW_")}
    environ["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=cwd, env={
        **environ, **(env or {})}, capture_output=True, text=True, timeout=30)


def test_admin_verbs_reach_a_remote_gateway_by_url_and_key(gw: Gateway, tmp_path: Path) -> None:
    assert not (tmp_path / "config.toml").exists()  # nothing local to read
    by_flag = cli(tmp_path, "status", "--url", gw.url, "--admin-key", "admin-remote-secret",
                  "--json")
    assert by_flag.returncode == 0, by_flag.stderr
    names = {b["name"] for b in json.loads(by_flag.stdout)["backends"]}
    assert names == {"stable0", "canary0", "gone"}
    by_env = cli(tmp_path, "status", env={"VGW_ADMIN_URL": gw.url,
                                          "VGW_ADMIN_KEY": "admin-remote-secret"})
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout.startswith("NAME") and "canary0" in by_env.stdout
    wrong = cli(tmp_path, "status", "--url", gw.url, env={"VGW_ADMIN_KEY": "wrong"})
    assert wrong.returncode == 1 and "admin key" in wrong.stderr
    assert "wrong" not in wrong.stderr


def test_canary_status_reads_as_a_sentence_with_units(gw: Gateway, tmp_path: Path) -> None:
    done = cli(tmp_path, "canary", "status", "--url", gw.url,
               env={"VGW_ADMIN_KEY": "admin-remote-secret"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("Canary group 'canary' gets 30 % of requests, stable group 'stable' "
                        "70 %; the weight is set by hand.")
    assert lines[1] == "Last change by config: start."
    assert len(lines) == 2  # no rollout: no step windows to report


def test_canary_sentence_of_a_rollout() -> None:
    data = {"enabled": True, "canary": "v2", "stable": "v1", "shadow": 10, "steps": [5, 25, 100],
            "state": {"weight": 25, "step": 1, "phase": "rolling", "paused": True,
                      "by": "ana@ops", "why": "night"},
            "window": {"v2": {"requests": 200, "errors": 3, "ttft_p95_s": 0.25},
                       "v1": {"requests": 600, "errors": 0, "ttft_p95_s": float("inf")}}}
    assert canary_sentence(data).splitlines() == [
        "Canary group 'v2' gets 25 % of requests, stable group 'v1' 75 %; automatic rollout, "
        "step 2 of 3 (5 %, 25 %, 100 %); paused.",
        "10 % of stable's requests are mirrored to the canary.",
        "Last change by ana@ops: night.",
        "  v2: 200 requests, 3 errors (1.5 %), TTFT p95 at most 250 ms in this step",
        "  v1: 600 requests, 0 errors (0.0 %), TTFT p95 over 60 s in this step"]
    assert canary_sentence({"enabled": False, "state": {}}) == (
        "Canary rollouts are off ([canary] enabled = false).")


def test_version_names_each_backends_vllm_version(gw: Gateway) -> None:
    body = httpx.get(gw.url + "/version").json()
    assert body == {"version": __version__,
                    "backends": {"stable0": "0.32.0", "canary0": "0.32.0", "gone": None}}
    assert "127.0.0.1" not in json.dumps(body)
