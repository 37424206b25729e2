"""What the soak proves: the client records read against the fault log and the gateways'
access logs, as the numbers a user would ask for, and the report (Markdown and raw JSON)."""

from __future__ import annotations

import itertools
import json
import re
import statistics
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.chaos.clients import Rec
from bench.chaos.faults import Fault, Sample

BACKEND_SETTLE = 15.0  # a backend's fault explains a move this long after it ended (breaker)
REDIS_SETTLE = 5.0  # Redis' likewise (the link's reconnect, the hashing fallback)
MAX_ATTEMPTS = 3  # upstream.max_attempts, the default
BUDGET_RATIO, BUDGET_FLOOR = 0.2, 3  # upstream.retry_budget_ratio and _floor (per process)
FAILING = ("truncated", "malformed", "hung", "disordered", "unexplained_switches",
           "over_attempts", "over_budget")


def switches(records: list[Rec], faults: list[Fault]) -> tuple[int, list[dict[str, Any]]]:
    """Sessions that moved from one backend to another between two answers: explained when
    a fault of the backend it left (or of Redis) overlaps that span, else listed."""
    by_session: dict[str, list[Rec]] = defaultdict(list)
    for rec in sorted(records, key=lambda r: r.start):
        if rec.ok and rec.backend:
            by_session[rec.session].append(rec)
    explained, unexplained = 0, []
    for session, recs in by_session.items():
        for prev, cur in itertools.pairwise(recs):
            if prev.backend == cur.backend:
                continue
            cause = next((f for f in faults if _explains(f, prev, cur)), None)
            if cause is not None:
                explained += 1
            else:
                unexplained.append({"session": session, "from": prev.backend,
                                    "to": cur.backend, "at": round(cur.start, 2),
                                    "request": cur.rid})
    return explained, unexplained


# Lines of the gateways' logs that explain a session's move (the cause the log gives).
CAUSES = (
    (re.compile(r"redis unavailable"), "redis_unavailable"),
    (re.compile(r"breaker (\S+): closed -> open"), "breaker_open"),
    (re.compile(r"backend (\S+): ready -> "), "not_ready"),
    (re.compile(r"request \S+: backend (\S+) "), "backend_failed"),
)


def log_causes(logs: list[Path], began_wall: float) -> list[Fault]:
    """What the gateways logged that moves sessions, as instants (seconds since the soak's
    start): Redis not answering (pins fall back to hashing), a breaker opening, a backend
    leaving rotation, a request failing on a backend."""
    found: list[Fault] = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"level":"info"' in line:
                continue
            try:
                entry = json.loads(line)
                at = datetime.fromisoformat(entry["ts"].replace("Z", "+00:00")).timestamp()
            except (ValueError, KeyError):
                continue
            for pattern, kind in CAUSES:
                if match := pattern.search(entry.get("msg", "")):
                    target = match.group(1) if match.groups() else "redis"
                    found.append(Fault(kind, target, at - began_wall, at - began_wall))
    return found


def _explains(fault: Fault, prev: Rec, cur: Rec) -> bool:
    if fault.kind in ("kill_redis", "redis_unavailable"):
        return fault.start <= cur.end and fault.end + REDIS_SETTLE >= prev.start
    # A fault of the backend it left, or of the one it went back to (a canary session
    # served by stable while its canary was out returns to it).
    return (fault.target in (prev.backend, cur.backend) and fault.start <= cur.end
            and fault.end + BACKEND_SETTLE >= prev.start)


def recovery(records: list[Rec], faults: list[Fault]) -> dict[str, dict[str, Any]]:
    """Per fault class, for each session it touched: seconds from the fault's start to that
    session's next answer (what its user waited)."""
    last_ok: dict[str, list[Rec]] = defaultdict(list)
    for rec in sorted(records, key=lambda r: r.start):
        last_ok[rec.session].append(rec)
    waits: dict[str, list[float]] = defaultdict(list)
    never: Counter[str] = Counter()
    for fault in faults:
        for _session, recs in last_ok.items():
            if not _touched(fault, recs):
                continue
            after = [r.end for r in recs if r.ok and r.end > fault.start]
            if after:
                waits[fault.kind].append(min(after) - fault.start)
            else:
                never[fault.kind] += 1
    return {kind: {"sessions": len(w), "p50_s": _q(w, 0.5), "p90_s": _q(w, 0.9),
                   "max_s": round(max(w), 2) if w else None, "no_answer_after": never[kind]}
            for kind, w in sorted(waits.items())}


def _touched(fault: Fault, recs: list[Rec]) -> bool:
    before = [r for r in recs if r.start <= fault.start]
    if not before or before[-1].end < fault.start - 10 or recs[-1].end < fault.start:
        return False  # not active when it struck, or it had ended
    if fault.kind == "kill_redis":
        return True
    if fault.kind in ("kill_gateway", "reload"):
        return f"gw{before[-1].replica + 1}" == fault.target
    served = [r for r in before if r.ok]
    return bool(served) and served[-1].backend == fault.target


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def attempts(logs: list[Path]) -> Counter[int]:
    """Backends asked per request, from the gateways' access logs."""
    seen: Counter[int] = Counter()
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("msg") == "request" and "attempts" in entry:
                seen[int(entry["attempts"])] += 1
    return seen


def footprint(samples: list[Sample], window: float) -> dict[str, dict[str, Any]]:
    """Each replica's RSS and open descriptors at the start and at the end of the last
    ``window`` seconds (from its restart, if it restarted inside the window): the median of
    the first and of the last tenth of the samples, so that one moment's open connections
    do not pass for growth."""
    out: dict[str, dict[str, Any]] = {}
    if not samples:
        return out
    end = max(s.at for s in samples)
    for name in sorted({s.replica for s in samples}):
        mine = [s for s in samples if s.replica == name]
        span = [s for s in mine if s.started == mine[-1].started and s.at >= end - window]
        k = max(3, len(span) // 10)
        first, last = span[:k], span[-k:]
        rss = [statistics.median(s.rss_mb for s in part) for part in (first, last)]
        fds = [statistics.median(s.fds for s in part) for part in (first, last)]
        out[name] = {"from_s": round(span[0].at, 1), "to_s": round(span[-1].at, 1),
                     "rss_mb": [round(v, 1) for v in rss], "fds": [round(v) for v in fds],
                     "rss_growth": round(rss[1] / rss[0] - 1, 3),
                     "fd_growth": round(fds[1] / fds[0] - 1, 3)}
    return out


def _budget(asked: Counter[int], processes: int) -> dict[str, int]:
    """Retries (attempts after the first) against what the budget allows the whole run:
    the ratio of the requests plus each serving process's floor."""
    retries = sum((a - 1) * n for a, n in asked.items() if a > 1)
    allowed = int(BUDGET_RATIO * sum(asked.values())) + BUDGET_FLOOR * processes
    return {"retries": retries, "retry_budget": allowed,
            "over_budget": max(0, retries - allowed)}


def summarize(records: list[Rec], faults: list[Fault], samples: list[Sample],
              logs: list[Path], window: float, began_wall: float,
              processes: int = 1) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in records)
    logged = log_causes(logs, began_wall)
    explained, unexplained = switches(records, faults + logged)
    asked = attempts(logs)
    explicit = {k: v for k, v in outcomes.items()
                if k not in ("ok", "truncated", "malformed", "hung")}
    return {
        "requests": len(records), "succeeded": outcomes["ok"],
        "failed_explicitly": dict(sorted(explicit.items())),
        "truncated": outcomes["truncated"], "malformed": outcomes["malformed"],
        "hung": outcomes["hung"], "disordered": sum(r.disordered for r in records),
        "switches_explained": explained, "unexplained_switches": len(unexplained),
        "unexplained": unexplained[:20],
        "attempts": dict(sorted(asked.items())),
        "over_attempts": sum(n for a, n in asked.items() if a > MAX_ATTEMPTS),
        **_budget(asked, processes),
        "faults": Counter(f.kind for f in faults),
        "logged_causes": Counter(f.kind for f in logged),
        "state_after_restarts": [{"kind": f.kind, "at": round(f.start, 1), **f.detail["kept"]}
                                 for f in faults if "kept" in f.detail],
        "recovery": recovery(records, faults),
        "footprint": footprint(samples, window),
    }


def failures(summary: dict[str, Any]) -> list[str]:
    """What fails the run (the CI form): each must be 0."""
    return [f"{k} = {summary[k]}" for k in FAILING if summary[k]]
