"""The chaos soak's CI form: 60 s of random faults (every class at least once) under 64
official-SDK clients through two gateway replicas, four simulators and a real vLLM. It fails
on any silent truncation, hang, duplicated or reordered token, unexplained session move, or
request asked of more backends than the budget allows; the verdict's rules are tested on
their own in test_chaos_verdict.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos.faults import KINDS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_soak_loses_nothing_silently(tmp_path: Path) -> None:
    report, raw = tmp_path / "RELIABILITY.md", tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--seconds", "60", "--seed", "22", "--ci",
         "--report", str(report), "--raw", str(raw), "--keep", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(raw.read_text())
    kinds = {f["kind"] for f in result["faults"]}
    assert kinds == set(KINDS), f"not every fault class came round: {kinds}"
    records = result["records"]
    assert len(records) > 1000  # the clients kept working through it
    assert {r["model"] for r in records if r["outcome"] == "ok"} == {"sim-model", "tiny-llama"}
    assert {r["stream"] for r in records if r["outcome"] == "ok"} == {True, False}
    text = report.read_text()
    assert "| **silently truncated** (ended without an error, short or no finish) | 0 |" in text
    assert "| **hung** past the client's 60 s deadline | 0 |" in text
