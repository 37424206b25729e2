"""The admin verbs of the CLI: they talk to a running gateway's admin API."""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from typing import Any

import httpx

from gateway.config import Config

STATUS_COLUMNS = ("name", "group", "state", "pid", "uptime_s", "restarts", "in_flight",
                  "last_probe", "flaps", "url")


def _client(config: Config) -> httpx.Client:
    host = config.gateway.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    headers = {}
    if config.gateway.admin_key is not None:
        headers["Authorization"] = f"Bearer {config.gateway.admin_key.get_secret_value()}"
    return httpx.Client(base_url=f"http://{host}:{config.gateway.port}", headers=headers,
                        timeout=httpx.Timeout(10.0, read=3600.0), trust_env=False)


def _call(config: Config, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        with _client(config) as client:
            resp = client.request(method, path, json=body)
    except httpx.HTTPError as exc:
        print(f"cannot reach the gateway at {config.gateway.listen}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    data = resp.json()
    if resp.status_code >= 400:
        print(data.get("error", {}).get("message", resp.text), file=sys.stderr)
        raise SystemExit(1)
    return data


def status(config: Config, args: argparse.Namespace) -> int:
    data = _call(config, "GET", "/admin/status")
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    rows = [[str(b.get(c) if b.get(c) is not None else "-") for c in STATUS_COLUMNS]
            for b in data["backends"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(STATUS_COLUMNS)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(STATUS_COLUMNS, widths, strict=True)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    return 0


def drain(config: Config, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"then": args.then}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    print(json.dumps(_call(config, "POST", f"/admin/backends/{args.backend}/drain", body)))
    return 0


def act(config: Config, args: argparse.Namespace) -> int:
    path = (f"/admin/backends/{args.backend}/{args.command}" if args.command != "rolling-restart"
            else "/admin/rolling-restart")
    print(json.dumps(_call(config, "POST", path)))
    return 0


def canary(config: Config, args: argparse.Namespace) -> int:
    if args.action == "status":
        data = _call(config, "GET", "/admin/canary")
        if args.json:
            print(json.dumps(data, indent=1))
            return 0
        state = data["state"]
        print(f"canary {data['canary']} {state['weight']:g}% (stable {data['stable']} "
              f"{100 - state['weight']:g}%), step {state['step']}, {state['phase']}"
              f"{', paused' if state['paused'] else ''}; last change by {state['by']}: "
              f"{state['why'] or '-'}")
        for group, w in data["window"].items():
            print(f"  {group}: {w['requests']} requests, {w['errors']} errors, "
                  f"TTFT p95 {w['ttft_p95_s']}")
        return 0
    body: dict[str, Any] = {"why": args.why, "who": f"{getpass.getuser()}@{socket.gethostname()}"}
    if args.action == "set":
        if args.group is None or args.weight is None:
            print("usage: vllm-gateway canary set GROUP WEIGHT", file=sys.stderr)
            return 2
        body.update(group=args.group, weight=args.weight)
    print(json.dumps(_call(config, "POST", f"/admin/canary/{args.action}", body)))
    return 0


def reload(config: Config, args: argparse.Namespace) -> int:
    try:
        with _client(config) as client:
            resp = client.post("/admin/reload", json={"who": getpass.getuser()})
    except httpx.HTTPError as exc:
        print(f"cannot reach the gateway at {config.gateway.listen}: {exc}", file=sys.stderr)
        return 1
    data = resp.json()
    if resp.status_code != 200:
        for problem in data.get("error", {}).get("problems", []):
            print(problem, file=sys.stderr)
        print(data.get("error", {}).get("message", resp.text), file=sys.stderr)
        return 2
    print(json.dumps(data))
    return 0
