"""The control process: several serving processes behind one port, under one process that
is the replica's control plane.

``serve`` runs it when ``[gateway] workers`` comes to more than one ("auto": one per
core, up to the cap). This process is the control (``gateway.control``): it starts the
embedded valkey and the spawned backends, answers the workers on a private socket, binds
the port and starts the workers, each ``python -m gateway.workers FD`` serving the app on a
listening socket of its own (``SO_REUSEPORT``: the kernel spreads new connections
evenly; one shared socket let the first worker to wake accept most of a burst, as libuv
accepts until the backlog is empty). A worker that dies is replaced (after a pause when it
keeps dying) while the others go on; SIGHUP reloads here, then in every worker; SIGTERM or
SIGINT stops the workers (each finishes its requests first), then the backends and valkey.

The serving workers' own entry is ``gateway.workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import uvicorn
from prometheus_client import multiprocess
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from backends.reaper import dies_with
from gateway.config import CONFIG_ENV, CONFIG_TEXT_ENV, Config
from gateway.control.role import SLOT_ENV, Kind, Role
from gateway.control.server import WorkerTable
from gateway.kv import pending
from gateway.metrics import MULTIPROC_ENV
from gateway.workers import UVICORN

log = logging.getLogger("gateway.control")


QUICK_EXIT = 2.0  # a worker that dies sooner than this after its start waits before the next
STOP_GRACE = 10.0  # beyond the drain timeout, before a worker that will not stop is killed


class _Unsignalled(uvicorn.Server):
    """The control socket's server: the control process handles the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class Plane:
    """What the control process runs, built by the front door (``gateway.build``, and the
    lifespan that starts the embedded valkey and the backends)."""

    workers: WorkerTable
    routes: list[BaseRoute]  # the admin verbs and canary actions the workers forward
    lifespan: Callable[[], AbstractAsyncContextManager[object]]
    redis_url: Callable[[], str | None]  # the embedded valkey's, once the lifespan began
    kv: str | None = None  # routing.policy = "kv": where the KV index is published


class Control:
    def __init__(self, config: Config, path: str, processes: int, plane: Plane) -> None:
        self._config = config
        self._path = path
        self._processes = processes
        self._plane = plane
        self._workers = plane.workers
        self._running: dict[int, asyncio.subprocess.Process] = {}
        self._hung: set[int] = set()  # killed by the watchdog, not yet reaped
        self._stopping = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        private = tempfile.mkdtemp(prefix="vgw-control-")  # 0700: the socket trusts callers
        control = os.path.join(private, "control.sock")
        try:
            # Like one process: Redis and the backends start (a bad data dir exits 2 there),
            # then the port is bound.
            async with self._plane.lifespan():
                try:
                    socks = self._listen()
                except OSError as exc:
                    log.error("cannot listen on %s: %s", self._config.gateway.listen, exc)
                    return 1
                try:
                    await self._serve(socks, control, private, stop)
                finally:
                    for sock in socks:
                        sock.close()
        finally:
            shutil.rmtree(private, ignore_errors=True)
        return 0

    async def _serve(self, socks: list[socket.socket], control: str, private: str,
                     stop: asyncio.Event) -> None:
        server, serving = await self._control_server(control)
        env = self._worker_env(control, private)
        keepers = [asyncio.create_task(self._keep(slot, socks[slot % len(socks)], env))
                   for slot in range(self._processes)]
        watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")
        log.info("serving on %s with %d worker processes", self._config.gateway.listen,
                 self._processes)
        await stop.wait()
        watchdog.cancel()
        await self._stop_workers(keepers)
        server.should_exit = True
        await serving

    async def _control_server(self, path: str) -> tuple[_Unsignalled, asyncio.Task[None]]:
        app = Starlette(routes=[*self._workers.routes(), *self._plane.routes])
        server = _Unsignalled(uvicorn.Config(app, uds=path, lifespan="off", log_config=None,
                                             access_log=False))
        task = asyncio.create_task(server.serve(), name="control-socket")
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the control socket did not start")
            await asyncio.sleep(0.01)
        return server, task

    def _worker_env(self, control: str, private: str) -> dict[str, str]:
        role = Role(Kind.WORKER, control, self._plane.redis_url(), self._plane.kv)
        metrics = os.path.join(private, "metrics")
        os.mkdir(metrics)
        text = os.path.join(private, "config.toml")
        self._workers.keep(text)  # a worker started after an edit never reloaded runs ours
        env = {**os.environ, CONFIG_ENV: self._path, MULTIPROC_ENV: metrics, **role.env()}
        if os.path.exists(text):
            env[CONFIG_TEXT_ENV] = text
        return env

    def _listen(self) -> list[socket.socket]:
        """One listening socket per worker on the same port (``SO_REUSEPORT``), or one shared
        by all where the system has no such option. A replaced worker takes over its
        predecessor's socket, so connections waiting in its backlog are not lost."""
        gateway = self._config.gateway
        family = socket.AF_INET6 if ":" in gateway.host else socket.AF_INET
        reuse = hasattr(socket, "SO_REUSEPORT")
        socks: list[socket.socket] = []
        port = gateway.port
        if reuse:  # held by anyone (another gateway too): fail as a plain bind would
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((gateway.host, port))
                port = probe.getsockname()[1]
        try:
            for _ in range(self._processes if reuse else 1):
                sock = socket.socket(family, socket.SOCK_STREAM)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((gateway.host, port))
                port = sock.getsockname()[1]  # port 0: the others join the one it got
                sock.listen(UVICORN["backlog"])
                sock.set_inheritable(True)
        except OSError:
            for sock in socks:
                sock.close()
            raise
        return socks

    async def _watch(self, every: float = 1.0) -> None:
        """Kill a worker that stopped reporting (stopped, or its loop blocked): its keeper
        starts another on the same socket. Its own connections are reset; the other
        workers' are untouched."""
        workers, last = self._workers, time.monotonic()
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            if now - last > 3 * every:  # this process was paused: nobody could report
                workers.excuse()
            last = now
            for pid, seconds in workers.silent().items():
                if pid in self._hung:
                    continue
                log.error("worker pid %d has not reported for %.1f s: hung, killed and "
                          "replaced", pid, seconds)
                self._hung.add(pid)
                workers.replaced["hung"] += 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def _keep(self, slot: int, sock: socket.socket, env: dict[str, str]) -> None:
        """Keep one worker running until the gateway stops."""
        while not self._stopping:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.workers", str(sock.fileno()),
                env={**env, SLOT_ENV: str(slot)},
                pass_fds=(sock.fileno(),), preexec_fn=dies_with(os.getpid()))
            self._running[slot] = proc
            self._workers.add(proc.pid)
            code = await proc.wait()
            self._workers.forget(proc.pid)
            if self._plane.kv is not None:  # its requests ended with it
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(
                        pending.clear, os.path.join(self._plane.kv, pending.FILE), slot)
            multiprocess.mark_process_dead(proc.pid, env[MULTIPROC_ENV])  # type: ignore[no-untyped-call]
            if self._stopping:
                return
            if proc.pid in self._hung:
                self._hung.discard(proc.pid)
            else:
                self._workers.replaced["exited"] += 1
            log.error("worker %d (pid %d) exited with %s: starting another", slot, proc.pid,
                      code)
            if time.monotonic() - started < QUICK_EXIT:
                await asyncio.sleep(QUICK_EXIT)

    async def _stop_workers(self, keepers: list[asyncio.Task[None]]) -> None:
        self._stopping = True
        for proc in self._running.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        _, late = await asyncio.wait(
            keepers, timeout=self._config.supervisor.drain_timeout + STOP_GRACE)
        for proc in self._running.values():
            if proc.returncode is None:
                log.error("worker pid %d did not stop in time: killed", proc.pid)
                proc.kill()
        await asyncio.gather(*late, return_exceptions=True)


def serve(config: Config, path: str, processes: int, plane: Plane) -> int:
    return asyncio.run(Control(config, path, processes, plane).run())
