"""A seconds-long run of the comparison: it runs, and every stream through the gateway
has the same events and bytes as the direct run. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_compare_smoke_runs_and_chunks_match(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--smoke", "--raw", str(tmp_path / "raw.json")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["vllm-gateway"]["shapes_match"] is True
    assert summary["vllm-gateway"]["errors"] == 0
    assert summary["vllm-gateway"]["held_streams"] == 16


def test_scaling_smoke_runs_without_errors() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.scaling", "--rounds", "1", "--seconds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stderr[done.stderr.index("{"):])
    for name in ("direct", "1 worker", "2 workers"):
        (run,) = runs[name]
        assert run["requests"] > 0 and run["errors"] == 0, (name, run)
