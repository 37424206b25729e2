"""The value types of config.toml that are more than a number or a string: a listen address,
a session key's source, a Redis URL (each validated where it is parsed); and the cores a
"auto" count of workers comes to."""

from __future__ import annotations

import enum
import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
OWN_CGROUP = Path("/proc/self/cgroup")


def usable_cores(cgroup: Path = CGROUP, own: Path = OWN_CGROUP) -> int:
    """The cores this process may run on, and no more than its CPU quota allows (a container
    given ``--cpus=1`` on a 64-core host has one core's worth, whatever its affinity): the
    smallest quota on the way from the process's own cgroup up to the root."""
    cores = len(os.sched_getaffinity(0))
    quotas = [q for d in _cgroup_dirs(cgroup, own) if (q := _quota(d)) is not None]
    return max(1, min(cores, math.ceil(min(quotas)))) if quotas else cores


def _cgroup_dirs(cgroup: Path, own: Path) -> list[Path]:
    """The process's own cgroup directories (v2, and v1's cpu controller) and each parent up
    to the root, which is always looked at (a container's own namespace shows "/")."""
    found = [cgroup, cgroup / "cpu"]
    try:
        lines = own.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        base = cgroup if hierarchy == "0" else (
            cgroup / "cpu" if "cpu" in controllers.split(",") else None)
        if base is None:
            continue
        here = base / path.strip("/")
        while here != base and base in here.parents:
            found.append(here)
            here = here.parent
    return found


def _quota(directory: Path) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD"), else v1's cfs pair."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
        return None if int(quota) <= 0 else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def check_listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError("must be HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("port must be 1-65535")
    return value


class SessionFrom(enum.StrEnum):
    HEADER = "header"
    BODY = "body"


class SessionSource:
    """Where a session key is read: a request header, or a top-level field of the body."""

    __slots__ = ("header", "kind", "name")

    def __init__(self, kind: SessionFrom, name: str) -> None:
        self.kind = kind
        self.name = name.lower() if kind is SessionFrom.HEADER else name
        self.header = self.name.encode("latin-1") if kind is SessionFrom.HEADER else b""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SessionSource) and (self.kind, self.name) == (
            other.kind, other.name)

    def __hash__(self) -> int:
        return hash((self.kind, self.name))

    def __repr__(self) -> str:
        return f"{self.kind}:{self.name}"


def session_source(value: object) -> SessionSource:
    if isinstance(value, SessionSource):
        return value
    if not isinstance(value, str):
        raise ValueError("must be a string, 'header:NAME' or 'body:FIELD'")
    kind, sep, name = value.partition(":")
    if not sep or kind not in tuple(SessionFrom) or not name:
        raise ValueError("must be 'header:NAME' or 'body:FIELD'")
    if kind == SessionFrom.HEADER and not name.isascii():
        raise ValueError("a header name must be ASCII")
    return SessionSource(SessionFrom(kind), name)


def check_redis_url(value: str) -> str:
    if value != "embedded" and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be 'embedded' or a redis://, rediss:// or unix:// URL")
    return value
