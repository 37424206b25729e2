"""The proxies under comparison: how each one is configured and started."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import PROXY_CORE, free_port, start, wait_http

PEERS = Path(__file__).parent / ".peers"
MODELS = ("sim-model", "hold-model", "quick-model")


@dataclass
class Running:
    name: str
    urls: list[str]
    proc: subprocess.Popen[bytes] | None


def gateway(sims: list[str], tmp: Path, workers: int = 1, core: str = PROXY_CORE) -> Running:
    port = free_port()
    backends = "".join(f'\n[[backends]]\nname = "s{i}"\nurl = "{u}"\n' for i, u in enumerate(sims))
    cfg = tmp / "gateway.toml"
    cfg.write_text(f'[gateway]\nlisten = "127.0.0.1:{port}"\nlog_level = "warning"\n'
                   f"workers = {workers}\n"
                   # The workload has no session keys: no Redis needed for a pure proxy run.
                   "[routing]\nsticky = false\n[breaker]\nshare = false\n"
                   "[degraded]\ncache = false\n" + backends)
    proc = start(core, [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
                 tmp / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz")
    if workers > 1:  # every worker must have probed its backends before load starts
        time.sleep(1.0)
    return Running("vllm-gateway" if workers == 1 else f"vllm-gateway x{workers}", [url], proc)


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
