"""The Responses API's state through the gateway, against two simulators that each keep
their own store (as vLLM does): follow-ups, retrievals and cancels go where the response
is stored, or get a clear error naming it; with pinning off, follow-ups break."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, sim_group, wait_for

CONVERSATIONS = 20


@pytest.fixture(scope="module")
def pair(tmp: Path) -> Iterator[list[Sim]]:
    with sim_group(tmp, "resp", 2) as sims:
        yield sims


def _gateway(tmp: Path, sims: list[Sim], name: str, routing: str = "") -> Gateway:
    # Round robin without session keys: turn two lands on the other backend unless pinned.
    config = (f'[routing]\npolicy = "round_robin"\n{routing}[health]\ninterval = 0.3\n'
              + backend_toml("a", sims[0].url) + backend_toml("b", sims[1].url))
    gw = Gateway(tmp, config, name=name)
    wait_for(lambda: http_ok(gw.url + "/readyz"), 10, "gateway ready")
    return gw


@pytest.fixture(scope="module")
def gateway(tmp: Path, pair: list[Sim]) -> Iterator[Gateway]:
    gw = _gateway(tmp, pair, "pinned")
    yield gw
    gw.stop()


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def _conversations(gw: Gateway) -> int:
    """Two-turn conversations with ``previous_response_id``; how many succeed."""
    ok = 0
    sdk = client(gw)
    for i in range(CONVERSATIONS):
        first = sdk.responses.create(model="sim-model", input=f"hello {i}",
                                     max_output_tokens=3)
        try:
            second = sdk.responses.create(model="sim-model", input="and then?",
                                          previous_response_id=first.id, max_output_tokens=2)
        except openai.NotFoundError:
            continue
        ok += second.previous_response_id == first.id
    return ok


def test_every_follow_up_reaches_the_backend_that_stored_its_response(gateway: Gateway) -> None:
    assert _conversations(gateway) == CONVERSATIONS


def test_with_pinning_off_the_follow_ups_land_elsewhere_and_fail(
        tmp: Path, pair: list[Sim]) -> None:
    gw = _gateway(tmp, pair, "unpinned", "pin_responses = false\n")
    try:
        # Strict round robin puts every second turn on the other instance: none succeeds.
        assert _conversations(gw) == 0
    finally:
        gw.stop()


def test_a_streamed_response_is_pinned_and_retrieved_from_its_backend(gateway: Gateway) -> None:
    sdk = client(gateway)
    with sdk.responses.stream(model="sim-model", input="hi", max_output_tokens=3) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == " tok0 tok1 tok2"
    for _ in range(4):  # round robin would alternate: every retrieval still finds it
        raw = sdk.responses.with_raw_response.retrieve(final.id)
        assert raw.parse().id == final.id
        assert raw.headers["x-gateway-backend"] == _backend_of(gateway, final.id)


def _backend_of(gw: Gateway, response_id: str) -> str:
    raw = httpx.get(f"{gw.url}/v1/responses/{response_id}", timeout=5)
    assert raw.status_code == 200, raw.text
    return raw.headers["x-gateway-backend"]


def test_retrieving_an_unknown_id_is_a_404_naming_it(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(gateway).responses.retrieve("resp_nothing_here")
    assert "resp_nothing_here" in str(caught.value)
    body = caught.value.response.json()
    assert body["error"]["type"] == "invalid_request_error"


def test_cancel_goes_to_the_storing_backend(gateway: Gateway) -> None:
    first = client(gateway).responses.create(model="sim-model", input="x", max_output_tokens=1)
    where = _backend_of(gateway, first.id)
    for _ in range(2):
        reply = httpx.post(f"{gateway.url}/v1/responses/{first.id}/cancel", timeout=5)
        # That backend's own answer (a synchronous response can't be cancelled), not a 404.
        assert reply.status_code == 400, reply.text
        assert reply.headers["x-gateway-backend"] == where
        assert "synchronous" in reply.json()["error"]["message"]


def test_wrong_methods_on_the_stored_routes_are_405_in_the_openai_format(
        gateway: Gateway) -> None:
    reply = httpx.post(f"{gateway.url}/v1/responses/resp_x", timeout=5)
    assert reply.status_code == 405 and reply.headers["allow"] == "GET"
    assert reply.json()["error"]["code"] == "method_not_allowed"
    reply = httpx.get(f"{gateway.url}/v1/responses/resp_x/cancel", timeout=5)
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"


def test_a_follow_up_whose_backend_is_gone_gets_a_503_naming_the_id(tmp: Path) -> None:
    with sim_group(tmp, "gone", 2) as sims:
        gw = _gateway(tmp, sims, "gone")
        try:
            first = client(gw).responses.create(model="sim-model", input="x",
                                                max_output_tokens=1)
            where = _backend_of(gw, first.id)
            sims[0 if where == "a" else 1].stop()
            wait_for(lambda: httpx.get(gw.url + "/admin/status").json()["backends"][
                0 if where == "a" else 1]["state"] != "ready", 10, "backend out of rotation")
            with pytest.raises(openai.APIStatusError) as caught:
                client(gw).responses.create(model="sim-model", input="more",
                                            previous_response_id=first.id)
            assert caught.value.status_code == 503
            error = caught.value.response.json()["error"]
            assert first.id in error["message"] and error["code"] == "response_unavailable"
            assert "127.0.0.1" not in error["message"]  # no backend address leaks
            retrieval = httpx.get(f"{gw.url}/v1/responses/{first.id}", timeout=5)
            assert retrieval.status_code == 503 and first.id in retrieval.text
            # A new conversation still works, on the backend that is left.
            assert client(gw).responses.create(model="sim-model", input="new").status \
                == "completed"
        finally:
            gw.stop()
