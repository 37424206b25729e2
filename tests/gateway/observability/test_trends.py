"""The status page's trends: rates and TTFT quantiles from differences between samples of
the request counter and the TTFT histogram."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.metrics import LATENCY, MULTIPROC_ENV, Metrics
from gateway.observability.trends import FileReader, Reading, Trends, quantile, reader

QUIET = {"ttft_p50_ms": [None], "ttft_p99_ms": [None]}  # a step with no first byte


def served(m: Metrics, backend: str, group: str, status: str, n: int = 1) -> None:
    m.requests.labels(backend, group, "model", status).inc(n)


def test_rates_per_backend_and_group_with_5xx_apart() -> None:
    m = Metrics()
    trends = Trends(reader(m), step=5, window=60)
    served(m, "a", "stable", "200", 10)
    assert trends.tick(100.0, 1000.0)
    served(m, "a", "stable", "200", 10)
    served(m, "a", "stable", "502", 5)
    served(m, "c", "canary", "200", 20)  # a series first seen in this step
    served(m, "none", "none", "404")
    assert trends.tick(105.0, 1005.0)
    data = trends.data()
    assert data["times"] == [1005.0]
    assert data["backends"] == {"a": {"requests": [3.0], "errors": [1.0], **QUIET},
                                "c": {"requests": [4.0], "errors": [0.0], **QUIET},
                                "none": {"requests": [0.2], "errors": [0.0], **QUIET}}
    groups = data["groups"]
    assert isinstance(groups, dict)
    assert groups["stable"]["requests"] == [3.0] and groups["stable"]["errors"] == [1.0]
    assert groups["canary"]["requests"] == [4.0]


def test_ttft_quantiles_come_from_the_steps_observations_alone() -> None:
    m = Metrics()
    trends = Trends(reader(m), step=5, window=60)
    for _ in range(100):
        m.ttft.labels("fast", "stable").observe(3.0)  # before the first sample: in no step
    trends.tick(0.0, 0.0)
    for _ in range(98):
        m.ttft.labels("fast", "stable").observe(0.02)
    for _ in range(2):
        m.ttft.labels("slow", "stable").observe(2.0)  # the group's slowest 2 %
    trends.tick(5.0, 5.0)
    trends.tick(10.0, 10.0)  # a step with nothing answered
    data = trends.data()
    groups, backends = data["groups"], data["backends"]
    assert isinstance(groups, dict) and isinstance(backends, dict)
    p50, p99 = groups["stable"]["ttft_p50_ms"], groups["stable"]["ttft_p99_ms"]
    assert p50[1] is None and p99[1] is None
    assert 10 < p50[0] <= 25  # in the (10 ms, 25 ms] bucket
    assert 1000 < p99[0] <= 2500  # in the (1 s, 2.5 s] bucket: the backends summed
    fast, slow = backends["fast"], backends["slow"]
    assert 10 < fast["ttft_p50_ms"][0] <= fast["ttft_p99_ms"][0] <= 25
    assert 1000 < slow["ttft_p50_ms"][0] <= slow["ttft_p99_ms"][0] <= 2500
    assert fast["ttft_p50_ms"][1] is None and slow["ttft_p99_ms"][1] is None


def test_a_sample_is_taken_once_a_step_and_the_ring_keeps_the_window() -> None:
    m = Metrics()
    trends = Trends(reader(m), step=5, window=20)
    assert [trends.tick(t, t) for t in (0.0, 1.0, 4.4, 4.6, 9.6)] == [
        True, False, False, True, True]
    for t in range(15, 60, 5):
        trends.tick(float(t), float(t))
    times = trends.data()["times"]
    assert times == [40.0, 45.0, 50.0, 55.0]  # 20 s: five samples, four steps
    assert repr(trends) == "<Trends [5 samples, every 5 s]>"


def test_a_counter_that_went_back_counts_as_nothing() -> None:
    counts = iter([7.0, 3.0])

    def read() -> Iterable[Reading]:
        labels = {"backend": "a", "group": "stable", "model": "m", "status": "200"}
        return [("gateway_requests_total", labels, next(counts))]

    trends = Trends(read, step=1, window=10)
    trends.tick(0.0, 0.0)
    trends.tick(1.0, 1.0)
    assert trends.data()["backends"] == {"a": {"requests": [0.0], "errors": [0.0], **QUIET}}


@pytest.mark.parametrize(("q", "counts", "expected"), [
    (0.5, [0, 10, 10], 0.15),  # halfway into the (0.1, 0.2] bucket
    (0.99, [5, 5, 10], 0.2),  # in +Inf: the highest finite bound
    (0.5, [0, 0, 0], None),  # nothing observed
    (0.25, [4, 4, 4], 0.025),  # in the first bucket, from 0
])
def test_quantile_reads_a_histogram_as_prometheus_does(q: float, counts: list[float],
                                                       expected: float | None) -> None:
    found = quantile(q, (0.1, 0.2, float("inf")), counts)
    assert found == (None if expected is None else pytest.approx(expected))


def test_the_buckets_are_the_metrics_own() -> None:
    m = Metrics()
    trends = Trends(reader(m))
    m.ttft.labels("b", "g").observe(0.1)
    trends.tick(0.0, 0.0)
    assert trends.bounds == (*LATENCY, float("inf"))


WORKER = """
from gateway.metrics import Metrics
m = Metrics()
m.requests.labels("a", "stable", "m", "200").inc({n})
m.requests.labels("a", "stable", "m", "503").inc()
m.ttft.labels("a", "stable").observe(0.02)
m.ttft.labels("b", "stable").observe({slow})
m.ttft.labels("b", "stable").observe(0.02)
m.duration.labels("stable").observe(1.0)
"""


def test_the_files_of_every_process_read_as_their_collector_reads_them(tmp_path: Path) -> None:
    for n, slow in ((3, 0.7), (5, 40.0)):  # two processes: two sets of files
        subprocess.run([sys.executable, "-c", WORKER.format(n=n, slow=slow)], check=True,
                       env={MULTIPROC_ENV: str(tmp_path)}, cwd=Path(__file__).parents[3])
    files = sorted(str(p) for p in tmp_path.glob("*.db"))
    wanted = {"gateway_requests_total", "gateway_ttft_seconds_bucket"}
    theirs = sorted((s.name, sorted(s.labels.items()), s.value)
                    for family in MultiProcessCollector.merge(files, accumulate=True)
                    for s in family.samples if s.name in wanted)
    ours = sorted((name, sorted(labels.items()), value)
                  for name, labels, value in FileReader(str(tmp_path))())
    assert ours == theirs
    assert ("gateway_requests_total", sorted({"backend": "a", "group": "stable", "model": "m",
                                              "status": "200"}.items()), 8.0) in ours
    inf = [("backend", "b"), ("group", "stable"), ("le", "+Inf")]
    assert ("gateway_ttft_seconds_bucket", inf, 4.0) in ours
