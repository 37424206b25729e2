"""The proxies under comparison: how each one is configured and started."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import PROXY_CORE, REPO, free_port, start, wait_http

PEERS = Path(__file__).parent / ".peers"
MODELS = ("sim-model", "hold-model", "quick-model")
SHIPPED = Path(__file__).resolve().parents[1] / "config.toml"
# What the trimmed gateway changes in the shipped config. Together these leave Redis out
# (nothing uses it, so the embedded one is not started), and log_level drops the info-level
# access log; the default gateway keeps all of them as shipped.
TRIMMED: dict[str, object] = {
    "gateway.log_level": "warning",
    "routing.sticky": False,
    "breaker.share": False,
    "degraded.cache": False,
}


@dataclass
class Running:
    name: str
    urls: list[str]
    proc: subprocess.Popen[bytes] | None
    log: Path | None = None


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def _table(name: str, table: dict[str, Any]) -> str:
    plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
    out = f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in plain.items())
    return out + "".join(_table(f"{name}.{k}", v) for k, v in table.items()
                         if isinstance(v, dict))


def to_toml(raw: dict[str, Any]) -> str:
    """The few TOML shapes a gateway config uses: tables, arrays of tables, plain values."""
    out = []
    for name, value in raw.items():
        if isinstance(value, dict):
            out.append(_table(name, value))
        else:  # an array of tables: [[backends]], [[models]]
            out.extend(_table(name, v).replace(f"[{name}]", f"[[{name}]]", 1) for v in value)
    return "\n".join(out)


def gateway_config(sims: list[str], port: int, trimmed: bool, workers: int = 1,
                   shipped: Path = SHIPPED) -> str:
    """config.toml as shipped (``shipped``: another checkout's, for a baseline), its spawned
    backends replaced by url backends on ``sims``; ``trimmed`` applies TRIMMED on top."""
    raw = tomllib.loads(shipped.read_text())
    raw["gateway"] = {**raw.get("gateway", {}), "listen": f"127.0.0.1:{port}"}
    if workers != 1:
        raw["gateway"]["workers"] = workers
    if trimmed:
        for dotted, value in TRIMMED.items():
            section, key = dotted.split(".")
            raw[section] = {**raw.get(section, {}), key: value}
    raw["backends"] = [{"name": f"s{i}", "url": u} for i, u in enumerate(sims)]
    return to_toml(raw)


def gateway(sims: list[str], tmp: Path, workers: int = 1, core: str | None = PROXY_CORE,
            trimmed: bool = True, repo: Path = REPO) -> Running:
    port = free_port()
    # Its own working directory: relative paths of the shipped config (logs/, Redis data)
    # land there, not in the repository.
    home = Path(tempfile.mkdtemp(prefix="gw-", dir=tmp))
    cfg = home / "gateway.toml"
    cfg.write_text(gateway_config(sims, port, trimmed, workers, repo / "config.toml"))
    proc = start(core, [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
                 home / "gateway.log", cwd=home, repo=repo)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz")
    if workers > 1:  # every worker must have probed its backends before load starts
        time.sleep(1.0)
    name = "vllm-gateway " + ("trimmed" if trimmed else "default")
    return Running(name if workers == 1 else f"{name} x{workers}", [url], proc,
                   home / "gateway.log")


def gateway_default(sims: list[str], tmp: Path) -> Running:
    return gateway(sims, tmp, trimmed=False)


def nginx(sims: list[str], tmp: Path) -> Running:
    port = free_port()
    prefix = tmp / "nginx"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    servers = "".join(f"    server {u.removeprefix('http://')};\n" for u in sims)
    (prefix / "nginx.conf").write_text(f"""
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 16384; }}
worker_rlimit_nofile 65536;
http {{
  access_log off;
  upstream sims {{
{servers}    keepalive 1024;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://sims;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 3600s;
    }}
  }}
}}
""")
    proc = start(PROXY_CORE, ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                              "-g", "daemon off;"], tmp / "nginx.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models")
    return Running("nginx", [url], proc)


def vllm_router(sims: list[str], tmp: Path) -> Running:
    port = free_port()
    proc = start(PROXY_CORE, [str(PEERS / "router/bin/vllm-router"), "--host", "127.0.0.1",
                              "--port", str(port), "--policy", "round_robin",
                              "--worker-urls", *sims], tmp / "router.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", timeout=60)
    return Running("vllm-router", [url], proc)


def litellm(sims: list[str], tmp: Path) -> Running:
    port = free_port()
    entries = []
    for model in MODELS:
        for sim in sims:
            entries.append(f"""  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {sim}/v1
      api_key: none
""")
    cfg = tmp / "litellm.yaml"
    cfg.write_text("model_list:\n" + "".join(entries)
                   + "litellm_settings:\n  drop_params: true\n  telemetry: false\n"
                   # No database and no key: the bench sends no Authorization, like the others.
                   + "general_settings:\n  dangerously_permit_weak_or_unset_master_key: true\n")
    proc = start(PROXY_CORE, [str(PEERS / "litellm/bin/litellm"), "--config", str(cfg),
                              "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                 tmp / "litellm.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health/liveliness", timeout=120)
    return Running("litellm", [url], proc)


def available() -> dict[str, bool]:
    import shutil

    return {
        "nginx": shutil.which("nginx") is not None,
        "vllm-router": (PEERS / "router/bin/vllm-router").exists(),
        "litellm": (PEERS / "litellm/bin/litellm").exists(),
    }
