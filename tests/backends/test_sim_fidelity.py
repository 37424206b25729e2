"""The simulator against replies recorded from real vLLM 0.32 (tests/fixtures/).

The same requests (fixtures/vllm_wire.EXCHANGES) go to the simulator; status, the headers
that matter, JSON key sets and SSE framing must match what vLLM answered. The fixture is
committed, so this runs without vLLM; tests/fixtures/record_vllm.py re-records it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.vllm_wire import (
    EXCHANGES,
    MAX_MODEL_LEN,
    MODEL,
    NOT_COMPARED,
    UNCOMPARED_KEYS,
    replay,
)
from tests.helpers import Sim

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_0.32_replies.json"
RECORDED: dict[str, Any] = json.loads(FIXTURE.read_text())
COMPARED = [e.name for e in EXCHANGES if e.name not in NOT_COMPARED]


@pytest.fixture(scope="module")
def sim_replies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    sim = Sim(tmp_path_factory.mktemp("fidelity"), "fidelity", "--model", MODEL,
              "--max-prompt-len", str(MAX_MODEL_LEN))
    try:
        yield replay(sim.url, EXCHANGES)
    finally:
        sim.stop()


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """Where two reply descriptions differ, one line per place (empty when equal)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing in the simulator" for k in want if k not in got]
        out += [f"{path}.{k}: only in the simulator" for k in got if k not in want]
        for k in want.keys() & got.keys():
            out += differences(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items in vLLM, {len(got)} in the simulator: "
                    f"vLLM {json.dumps(want)} sim {json.dumps(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got, strict=True)) for d in
                differences(w, g, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: vLLM {want!r}, simulator {got!r}"]


def compared(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in UNCOMPARED_KEYS}


def test_fixture_covers_the_request_set() -> None:
    assert RECORDED["vllm_version"] == "0.32.0"
    assert list(RECORDED["replies"]) == [e.name for e in EXCHANGES]


@pytest.mark.parametrize("name", COMPARED)
def test_simulator_answers_like_vllm(name: str, sim_replies: dict[str, Any]) -> None:
    want = compared(RECORDED["replies"][name])
    got = compared(sim_replies[name])
    found = differences(want, got)
    assert not found, "\n".join([*found, "simulator's reply: " + sim_replies[name]["sample"]])


@pytest.mark.parametrize("source", ["vllm", "sim"])
def test_base64_embeddings_hold_four_bytes_a_value(source: str,
                                                   sim_replies: dict[str, Any]) -> None:
    replies = RECORDED["replies"] if source == "vllm" else sim_replies
    floats = replies["embeddings_float"]["vector_bytes"]
    packed = replies["embeddings_base64"]["vector_bytes"]
    assert packed == floats * 2  # two inputs, each decoding to 4 bytes per float
