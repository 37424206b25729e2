"""LangChain's ChatOpenAI on the Responses API (``use_responses_api=True``) through the
gateway, invoked and streamed, and a second turn continuing the first by its response id
(``use_previous_response_id``): the follow-up reaches the simulator that stored the first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI

from tests.helpers import Gateway, backend_toml, http_ok, sim_group, wait_for


@pytest.fixture(scope="module")
def gateway(tmp: Path) -> Iterator[Gateway]:
    with sim_group(tmp, "lc", 2) as sims:
        config = ('[routing]\npolicy = "round_robin"\n[health]\ninterval = 0.3\n'
                  + "".join(backend_toml(f"s{i}", sim.url) for i, sim in enumerate(sims)))
        gw = Gateway(tmp, config)
        wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
        yield gw
        gw.stop()


def chat(gw: Gateway, **extra: object) -> ChatOpenAI:
    return ChatOpenAI(model="sim-model", base_url=gw.url + "/v1", api_key="unused",
                      use_responses_api=True, max_retries=0, max_tokens=3,
                      **extra)  # type: ignore[arg-type]


def test_invoke_and_stream_on_the_responses_api(gateway: Gateway) -> None:
    reply = chat(gateway).invoke("hello")
    assert reply.text == " tok0 tok1 tok2"
    assert reply.response_metadata["id"].startswith("resp_")
    streamed = "".join(chunk.text for chunk in chat(gateway).stream("hello"))
    assert streamed == " tok0 tok1 tok2"


def test_a_second_turn_continues_the_first_by_its_id(gateway: Gateway) -> None:
    model = chat(gateway, use_previous_response_id=True)
    for _ in range(3):  # round robin alone would send every second turn elsewhere
        history: list[HumanMessage | AIMessage] = [HumanMessage("hello")]
        first = model.invoke(history)
        history += [first, HumanMessage("and then?")]
        second = model.invoke(history)  # sent as previous_response_id + the new message
        assert second.text == " tok0 tok1 tok2"
        stored = httpx.get(f"{gateway.url}/v1/responses/{second.response_metadata['id']}",
                           timeout=10).json()
        assert stored["previous_response_id"] == first.response_metadata["id"]
