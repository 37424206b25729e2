"""A serving worker's entry (``python -m gateway.workers FD``), and how every serving
process runs uvicorn, the single process too. The control process that starts the
workers is ``gateway.control.process``.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import uvicorn

from gateway.config import CONFIG_ENV, GatewaySection, load
from gateway.http.server import connection_cap, guarded

# How every serving process runs uvicorn (the single process too).
UVICORN: dict[str, Any] = {
    "loop": "uvloop", "http": "httptools", "lifespan": "on", "access_log": False,
    "log_config": None, "backlog": 4096, "server_header": False,
    "proxy_headers": False,
}


def uvicorn_options(gateway: GatewaySection) -> dict[str, Any]:
    """UVICORN, and the front door's limits (for a serving process: it sets its rlimit)."""
    cap = connection_cap(gateway.max_connections)
    return {**UVICORN, "timeout_keep_alive": gateway.keep_alive_timeout,
            "http": guarded(gateway.header_timeout, gateway.max_header_bytes, cap)}


def worker(fd: int) -> None:
    """One serving worker: the app on the control process's socket."""
    sock = socket.socket(fileno=fd)
    options = uvicorn_options(load(os.environ[CONFIG_ENV]).gateway)
    uvicorn.Server(uvicorn.Config("gateway.app:from_env", factory=True, **options)).run(
        sockets=[sock])


if __name__ == "__main__":
    worker(int(sys.argv[1]))
