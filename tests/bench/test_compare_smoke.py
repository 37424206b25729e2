"""A seconds-long run of the comparison: it runs, and every stream through the gateway, in
the default configuration and trimmed, has the same events and bytes as the direct run.
No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# Three targets started and stopped, then the scaling phase: more than the default 120 s when
# the shared machine is busy.
@pytest.mark.timeout(330)
def test_compare_smoke_runs_and_chunks_match(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--smoke", "--raw", str(tmp_path / "raw.json")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout[done.stdout.index("{"):])
    for name in ("vllm-gateway default", "vllm-gateway trimmed"):
        summary = out["summary"][name]
        assert summary["shapes_match"] is True, name
        assert summary["errors"] == 0, name
        assert summary["held_streams"] == 16, name
    # The default run is read for what its Redis link went through; only it has Redis.
    (record,) = out["redis"]["vllm-gateway default"]
    assert set(record) == {"redis_errors", "redis_unavailable_lines", "sticky_routed"}
    assert record["sticky_routed"] > 0  # the sessions went through its pins
    assert list(out["redis"]) == ["vllm-gateway default"]


def test_default_gateway_config_is_the_shipped_one() -> None:
    """The default run changes nothing of config.toml but the listen address and the
    backends; the trimmed run changes exactly TRIMMED on top."""
    import tomllib

    from bench import targets

    shipped = tomllib.loads(targets.SHIPPED.read_text())
    sims = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    default = tomllib.loads(targets.gateway_config(sims, 9, trimmed=False))
    trimmed = tomllib.loads(targets.gateway_config(sims, 9, trimmed=True))
    assert default["backends"] == [{"name": "s0", "url": sims[0]}, {"name": "s1", "url": sims[1]}]
    assert default["gateway"].pop("listen") == "127.0.0.1:9"
    shipped["gateway"].pop("listen")
    assert {k: v for k, v in default.items() if k != "backends"} == {
        k: v for k, v in shipped.items() if k != "backends"}
    changed = {f"{s}.{k}": v for s, table in trimmed.items() if isinstance(table, dict)
               for k, v in table.items() if default.get(s, {}).get(k) != v and k != "listen"}
    assert changed == targets.TRIMMED


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
