"""A tiny run of bench.redis_burst: the report has its figures, the burst went through the
default gateway's Redis path (every session-bearing stream was pinned, hit or fell back),
and no stream failed. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STREAMS = 16


# Simulators, a gateway with its Redis, a load: more than the default 120 s when the
# shared machine is busy.
@pytest.mark.timeout(330)
def test_redis_burst_smoke_reports_and_no_stream_fails(tmp_path: Path) -> None:
    raw, doc = tmp_path / "burst.json", tmp_path / "BENCHMARKS.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.redis_burst", "--streams", str(STREAMS), "--sims", "2",
         "--session-pool", "4", "--raw", str(raw), "--out", str(doc)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(raw.read_text())
    assert result["streams"] == STREAMS
    assert (result["completed"], result["failed"]) == (STREAMS, 0), result["failure_kinds"]
    assert set(result["ttft_ms"]) >= {"p50", "p99"}
    for key in ("redis_errors_before", "redis_errors_after", "redis_unavailable_lines"):
        assert isinstance(result[key], int | float), key
    assert result["commit"]
    sticky = result["sticky"]
    assert sticky["miss"] + sticky["hit"] + sticky["fallback"] == STREAMS // 2
    text = doc.read_text()
    assert text.count("<!-- redis-burst:start -->") == 1
    assert f"| {STREAMS} | {STREAMS} | 0 |" in text
