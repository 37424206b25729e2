"""Turns the comparison's raw rounds into figures, a table, a plot and docs/BENCHMARKS.md."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench import scaling

START, END = "<!-- compare:start -->", "<!-- compare:end -->"
PLOT = "bench_compare.png"


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def summarise(rounds: dict[str, list[dict[str, Any]]],
              capacity: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    base = rounds.get("direct", [])
    out: dict[str, dict[str, Any]] = {}
    for name, rs in rounds.items():
        pairs = list(zip(rs, base, strict=False))

        def added(phase: str, key: str, q: str, pairs: list[Any] = pairs) -> float:
            return _med([r[phase][key][q] - d[phase][key][q] for r, d in pairs])

        c64 = [r["c64"] for r in rs]
        plain = [r["plain"] for r in rs]
        out[name] = {
            "ttft_add_c1_p50": added("c1", "ttft_ms", "p50"),
            "ttft_add_c1_p99": added("c1", "ttft_ms", "p99"),
            "ttft_add_c64_p50": added("c64", "ttft_ms", "p50"),
            "ttft_add_c64_p99": added("c64", "ttft_ms", "p99"),
            "gap_add_c64_p99": added("c64", "gap_ms", "p99"),
            "ttft_add_burst_p50": added("burst", "ttft_ms", "p50"),
            "ttft_add_burst_p99": added("burst", "ttft_ms", "p99"),
            "plain_rps": _med([p["rps"] for p in plain]),
            "cpu_s_per_1k_streams": _med([p["proxy_cpu_s"] / p["requests"] * 1000 for p in c64]),
            "cpu_s_per_1k_plain": _med([p["proxy_cpu_s"] / p["requests"] * 1000 for p in plain]),
            "errors": sum(p[k]["errors"] for p in rs for k in p),
            "load_core_busy_max": max(p[k]["load_core_busy"] for p in rs
                                     for k in ("c1", "c64", "burst")),
            "load_core_busy_plain": max(p["plain"]["load_core_busy"] for p in rs),
            "shapes_match": all(r["c64"]["shapes"] == d["c64"]["shapes"] for r, d in pairs),
            "held_streams": capacity.get(name, {}).get("held"),
            "rss_peak_mb": capacity.get(name, {}).get("rss_peak_mb"),
        }
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = ("| target | +TTFT p50 @1 ms | +TTFT p99 @1 ms | +TTFT p50 @64 ms | +TTFT p99 @64 ms "
            "| +gap p99 @64 ms | +TTFT p50 / p99, 64 at once ms | streams held, 0 errors "
            "| non-stream req/s | CPU s / 1k streams "
            "| CPU s / 1k non-stream | peak RSS MiB | event + byte counts = direct "
            "| load core busy, streams / non-stream |")
    rows = [head, "|" + "---|" * 14]
    for name, s in summary.items():
        rows.append(
            f"| {name} | {s['ttft_add_c1_p50']:.2f} | {s['ttft_add_c1_p99']:.2f} "
            f"| {s['ttft_add_c64_p50']:.2f} | {s['ttft_add_c64_p99']:.2f} "
            f"| {s['gap_add_c64_p99']:.2f} "
            f"| {s['ttft_add_burst_p50']:.2f} / {s['ttft_add_burst_p99']:.2f} "
            f"| {s['held_streams']} | {s['plain_rps']:.0f} "
            f"| {s['cpu_s_per_1k_streams']:.2f} | {s['cpu_s_per_1k_plain']:.2f} "
            f"| {s['rss_peak_mb']} | {'yes' if s['shapes_match'] else 'no'} "
            f"| {s['load_core_busy_max']:.0%} / {s['load_core_busy_plain']:.0%} |"
        )
    return "\n".join(rows)


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in summary if n != "direct"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("added TTFT p50 at 64 streams (ms; at or below 0.01 drawn at 0.01)", "ttft_add_c64_p50",
         True),
        ("proxy CPU s per 1,000 streams", "cpu_s_per_1k_streams", True),
        ("proxy CPU s per 1,000 non-stream requests", "cpu_s_per_1k_plain", True),
    ]
    for ax, (title, key, log) in zip(axes, panels, strict=True):
        actual = [summary[n][key] for n in names]
        values = [max(v, 1e-2) for v in actual]
        ax.bar(names, values, color=["#2a9d8f" if n.startswith("vllm-gateway") else "#8d99ae"
                                     for n in names])
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=20)
        for i, (v, a) in enumerate(zip(values, actual, strict=True)):
            ax.annotate(f"{a:.2f}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write(doc: Path, setup: str, summary: dict[str, dict[str, Any]], argv: list[str],
          workers: dict[str, Any] | None = None) -> None:
    plot(summary, doc.parent / PLOT)
    command = " ".join([".venv/bin/python -m bench.compare", *argv])
    section = (
        f"{START}\n```bash\nbash bench/install_peers.sh\n{command}\n```\n\n{setup}.\n\n"
        "Added figures are the target minus the direct run of the same round. Streams: 64 "
        "chunks 20 ms apart, 64 open at any moment with evenly spaced arrivals (c64 phase, "
        "the steady state of 64 concurrent streams); 8 chunks, 64 started in the same instant "
        "(64 at once: the burst's queueing on each side); 8 chunks at one stream at a time "
        "(c1 phase); "
        "held streams: 8 chunks 0.5 s apart, all open at once; non-stream: 8 tokens, no delay, "
        "64 concurrent. 'event + byte counts = direct': every stream's number of events and "
        "of bytes equal the direct run's (counts only; tests/e2e/test_passthrough.py compares "
        "the bytes themselves). 'load core busy': CPU of the load generator and both "
        "simulators over wall time on their core; a streaming phase above 95 % fails the run. "
        "The non-stream "
        "phase drives that core to its ceiling on purpose: the direct run's req/s is the "
        "simulators' and load generator's ceiling, so proxies' req/s near it say only that "
        "they keep up; compare their CPU per request.\n\n"
        f"{table(summary)}\n\n![comparison]({PLOT})\n"
        + (f"\n**Workers** ({workers['setup']}; `python -m bench.scaling` runs it alone): the "
           "Python simulators and load generator cannot drive two workers on this machine, so "
           "this phase uses wrk and an nginx answering a fixed chat completion, both in C.\n\n"
           f"{scaling.table(workers)}\n" if workers else "")
        + END
    )
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if START in text and END in text:
        text = text[: text.index(START)] + section + text[text.index(END) + len(END):]
    else:
        text += "\n## Side by side: direct, vllm-gateway, nginx, vllm-router, LiteLLM\n\n" + section
    doc.write_text(text)
