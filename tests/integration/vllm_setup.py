"""What the real-vLLM tests share: where vLLM and the model are, how a spawned instance is
configured, and how to read the gateway's view of its backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.helpers import Gateway, free_port

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = REPO / "models" / "tiny-llama"
SMALL = REPO / "models" / "tiny-llama-small"  # another model: other weights, smaller
STARTUP = 600
# The Responses API keeps stored responses only with this on (vLLM 0.32, vllm/envs.py).
ENV = 'VLLM_CPU_KVCACHE_SPACE = "1", VLLM_ENABLE_RESPONSES_API_STORE = "1"'
# A KV cache small enough to evict (issue 38): 128 blocks of 128 tokens, 16,384 tokens, so
# 16 requests of max_model_len (1,024) still fit at once.
BLOCKS = 128


def vllm_backend(name: str, core: int, model: Path = MODEL, served: str = "tiny-llama") -> str:
    return f"""
[[backends]]
name = "{name}"
[backends.spawn]
model = "{model}"
served_model_name = "{served}"
port = {free_port()}
python = "{PYTHON}"
args = ["--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager",
        "--num-gpu-blocks-override", "{BLOCKS}"]
env = {{ {ENV}, VLLM_CPU_OMP_THREADS_BIND = "{core}" }}
startup_timeout = {STARTUP}
kv_events = true
"""


def kv_endpoints(url: str) -> tuple[str, str]:
    """Where a spawned instance on ``url``'s port publishes its KV events (``kv_events =
    true``: every instance these tests spawn), and answers replays."""
    from backends.spec import SpawnSpec

    port = int(url.rsplit(":", 1)[1])
    endpoints = SpawnSpec(model="m", port=port, kv_events=True).kv_endpoints
    assert endpoints is not None
    return endpoints


def status(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(gw.url + "/admin/status").json()["backends"]}
