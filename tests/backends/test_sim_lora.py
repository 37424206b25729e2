"""The simulator's LoRA batch slots, as vLLM's scheduler keeps them (``backends/sim/lora.py``
names the source): a batch runs at most ``--max-loras`` adapters; a request for one more
waits in the waiting queue (``vllm:num_requests_waiting``, ``waiting_lora_adapters``)
until a running adapter's last request ends. Base-model requests never wait for a slot."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from backends.sim.app import SimApp
from backends.sim.options import SimOptions


def chat(model: str, tokens: int = 2) -> dict[str, object]:
    return {"model": model, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "which slot"}]}


def gauge(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name))


async def until(probe: Callable[[], Awaitable[bool]], deadline: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + deadline
    while not await probe():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def test_an_adapter_beyond_max_loras_waits_for_a_slot_the_base_model_does_not(
        tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": 8}))
    app = SimApp(SimOptions(models=("base",), enable_lora=True, max_loras=1,
                            runtime_lora=True, itl=0.2))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            for name in ("a", "b"):
                loaded = await client.post("/v1/load_lora_adapter", json={
                    "lora_name": name, "lora_path": str(tmp_path / name)})
                assert loaded.status_code == 200
            long_a = asyncio.create_task(client.post("/v1/chat/completions",
                                                     json=chat("a", 50)))

            async def a_runs() -> bool:
                return app.lora.running["a"] == 1
            await until(a_runs)
            b = asyncio.create_task(client.post("/v1/chat/completions", json=chat("b")))

            async def b_waits() -> bool:
                text = (await client.get("/metrics")).text
                return 'waiting_lora_adapters="b"' in gauge(text, "vllm:lora_requests_info")
            await until(b_waits)
            text = (await client.get("/metrics")).text
            assert gauge(text, "vllm:num_requests_waiting").endswith(" 1")
            assert 'running_lora_adapters="a"' in gauge(text, "vllm:lora_requests_info")
            base = await client.post("/v1/chat/completions", json=chat("base"))
            assert base.status_code == 200  # the base model takes no adapter slot
            assert not b.done()
            long_a.cancel()  # a's last request ends: b takes its slot
            assert (await b).status_code == 200
            text = (await client.get("/metrics")).text
            assert 'waiting_lora_adapters=""' in gauge(text, "vllm:lora_requests_info")
    asyncio.run(asyncio.wait_for(main(), 20))
