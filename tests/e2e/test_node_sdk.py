"""The official OpenAI Node SDK (tests/node, installed by scripts/test.sh with npm) against
the real gateway: chat streamed and not, models listed and retrieved, embeddings (the SDK
asks for base64), the Responses API with a follow-up, its retrieval and its events, and a
batch (its file uploaded as the SDK uploads files)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Gateway, backend_toml, http_ok, sim_group, wait_for

NODE = Path(__file__).resolve().parents[1] / "node"


@pytest.fixture(scope="module")
def gateway(tmp: Path) -> Iterator[Gateway]:
    with sim_group(tmp, "node", 2) as sims:
        config = "[health]\ninterval = 0.3\n" + "".join(
            backend_toml(f"s{i}", sim.url) for i, sim in enumerate(sims))
        gw = Gateway(tmp, config)
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
        yield gw
        gw.stop()


def test_the_node_sdk_works_through_the_gateway(gateway: Gateway) -> None:
    node = shutil.which("node")
    if node is None or not (NODE / "node_modules" / "openai").exists():
        pytest.fail("node and tests/node/node_modules are needed: scripts/test.sh installs them")
    done = subprocess.run([node, str(NODE / "sdk.mjs"), gateway.url + "/v1", "sim-model"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["chat"] == " tok0 tok1 tok2 tok3"
    assert out["streamed"] == " tok0 tok1 tok2 tok3 tok4" and out["streamedUsage"] == 5
    assert out["models"] == ["sim-model"]
    assert out["retrieved"] == {"id": "sim-model", "max_model_len": 8192}
    assert out["missing"] == {"status": 404, "code": "model_not_found"}
    assert out["embeddings"] == [8, 8]
    assert out["responses"] == {"text": " tok0 tok1 tok2", "follows": True, "retrieved": True}
    assert out["responseEvents"][0] == "response.created"
    assert out["responseEvents"][-1] == "response.completed"
    assert out["batch"] == {"status": "completed", "completed": 3, "ids": ["n0", "n1", "n2"],
                            "listed": True, "file": True}
