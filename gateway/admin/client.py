"""The admin verbs of the CLI: they talk to a running gateway's admin API."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.config import Config

STATUS_COLUMNS = ("name", "group", "state", "pid", "uptime_s", "restarts", "in_flight",
                  "last_probe", "flaps", "url")


URL_ENV = "VGW_ADMIN_URL"
KEY_ENV = "VGW_ADMIN_KEY"


@dataclass(frozen=True, slots=True)
class Target:
    """The gateway an admin verb talks to: ``--url``/``--admin-key`` (or ``VGW_ADMIN_URL`` /
    ``VGW_ADMIN_KEY``), else the address and admin key of the local config file."""

    url: str
    key: str | None

    @classmethod
    def of(cls, args: argparse.Namespace, load: Callable[[], Config]) -> Target:
        url = args.url or os.environ.get(URL_ENV) or None
        key = args.admin_key or os.environ.get(KEY_ENV) or None
        if url is not None:
            return cls(url.rstrip("/"), key)
        config = load()
        host = config.gateway.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        if key is None and config.gateway.admin_key is not None:
            key = config.gateway.admin_key.get_secret_value()
        return cls(f"http://{host}:{config.gateway.port}", key)

    def client(self) -> httpx.Client:
        headers = {} if self.key is None else {"Authorization": f"Bearer {self.key}"}
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False,
                            timeout=httpx.Timeout(10.0, read=3600.0))


def _call(target: Target, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        with target.client() as client:
            resp = client.request(method, path, json=body)
    except httpx.HTTPError as exc:
        print(f"cannot reach the gateway at {target.url}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        data = resp.json()
    except ValueError:
        print(f"{target.url}{path}: HTTP {resp.status_code}, not the gateway's JSON",
              file=sys.stderr)
        raise SystemExit(1) from None
    if resp.status_code >= 400:
        print(data.get("error", {}).get("message", resp.text), file=sys.stderr)
        raise SystemExit(1)
    return data


def status(target: Target, args: argparse.Namespace) -> int:
    data = _call(target, "GET", "/admin/status")
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


def drain(target: Target, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"then": args.then}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    print(json.dumps(_call(target, "POST", f"/admin/backends/{args.backend}/drain", body)))
    return 0


def act(target: Target, args: argparse.Namespace) -> int:
    path = (f"/admin/backends/{args.backend}/{args.command}" if args.command != "rolling-restart"
            else "/admin/rolling-restart")
    print(json.dumps(_call(target, "POST", path)))
    return 0


def canary(target: Target, args: argparse.Namespace) -> int:
    if args.action == "status":
        data = _call(target, "GET", "/admin/canary")
        if args.json:
            print(json.dumps(data, indent=1))
            return 0
        print(canary_sentence(data))
        return 0
    body: dict[str, Any] = {"why": args.why, "who": f"{getpass.getuser()}@{socket.gethostname()}"}
    if args.action == "set":
        if args.group is None or args.weight is None:
            print("usage: vllm-gateway canary set GROUP WEIGHT", file=sys.stderr)
            return 2
        body.update(group=args.group, weight=args.weight)
    print(json.dumps(_call(target, "POST", f"/admin/canary/{args.action}", body)))
    return 0


def reload(target: Target, args: argparse.Namespace) -> int:
    try:
        with target.client() as client:
            resp = client.post("/admin/reload", json={"who": getpass.getuser()})
    except httpx.HTTPError as exc:
        print(f"cannot reach the gateway at {target.url}: {exc}", file=sys.stderr)
        return 1
    data = resp.json()
    if resp.status_code != 200:
        for problem in data.get("error", {}).get("problems", []):
            print(problem, file=sys.stderr)
        print(data.get("error", {}).get("message", resp.text), file=sys.stderr)
        return 2
    print(json.dumps(data))
    return 0


def _pct(value: float) -> str:
    return f"{value:g} %"


def _bound(seconds: float | None) -> str:
    """A p95 read off histogram buckets is an upper bound."""
    if seconds is None:
        return "not measured yet"
    if seconds == float("inf"):
        return "over 60 s"
    return f"at most {seconds * 1000:g} ms" if seconds < 1 else f"at most {seconds:g} s"


def canary_sentence(data: dict[str, Any]) -> str:
    """``GET /admin/canary`` as an operator reads it: who gets what, where the rollout is,
    and each group's errors and TTFT over the current step's window."""
    state, steps = data["state"], data.get("steps") or []
    if not data.get("enabled"):
        return "Canary rollouts are off ([canary] enabled = false)."
    phase = state["phase"]
    where = {"manual": "the weight is set by hand",
             "promoted": "the rollout was promoted",
             "rolled_back": "the rollout was rolled back"}.get(phase, "automatic rollout")
    if phase == "rolling" and 0 <= state["step"] < len(steps):
        where += (f", step {state['step'] + 1} of {len(steps)} "
                  f"({', '.join(_pct(s) for s in steps)})")
    lines = [f"Canary group {data['canary']!r} gets {_pct(state['weight'])} of requests, "
             f"stable group {data['stable']!r} {_pct(100 - state['weight'])}; {where}"
             f"{'; paused' if state['paused'] else ''}."]
    if data.get("shadow"):
        lines.append(f"{_pct(data['shadow'])} of stable's requests are mirrored to the canary.")
    lines.append(f"Last change by {state['by']}: {state['why'] or '(no reason given)'}.")
    for group, w in data["window"].items():
        errors = w["errors"] / w["requests"] * 100 if w["requests"] else 0.0
        lines.append(f"  {group}: {w['requests']} requests, {w['errors']} errors "
                     f"({errors:.1f} %), TTFT p95 {_bound(w['ttft_p95_s'])} in this step")
    return "\n".join(lines)
