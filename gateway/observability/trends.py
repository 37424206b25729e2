"""The status page's trends: requests and 5xx replies a second and TTFT p50 / p99, per
backend and per group, over the last minutes.

Every ``step`` seconds the request counter and the TTFT histogram are read as /metrics
renders them (with several serving processes, every process's values added up) into a
ring; rates and quantiles come from the differences between neighbouring samples. So
whichever worker answers /dashboard/data draws the whole gateway, and a request's path
does no work for it.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.mmap_dict import MmapedDict

from gateway.metrics import MULTIPROC_ENV, Metrics

STEP = 5.0  # seconds between samples
WINDOW = 900.0  # seconds of history kept
REQUESTS, TTFT = "gateway_requests", "gateway_ttft_seconds"
QUANTILES = (("ttft_p50_ms", 0.5), ("ttft_p99_ms", 0.99))

Reading = tuple[str, dict[str, str], float]  # a sample's name, labels and value
Reader = Callable[[], Iterable[Reading]]
Totals = dict[str, tuple[float, float]]  # name: (requests, 5xx replies)
Buckets = dict[str, tuple[float, ...]]  # name: TTFT cumulative bucket counts, bounds order


@dataclass(frozen=True, slots=True)
class Counts:
    """One side's counters (per backend or per group) at one moment: requests and 5xx
    replies, and the TTFT histogram's cumulative bucket counts in ``Trends.bounds`` order."""

    totals: Totals
    ttft: Buckets


@dataclass(frozen=True, slots=True)
class Sample:
    """The counters at one moment, per backend and per group."""

    mono: float
    wall: float
    backends: Counts
    groups: Counts


def reader(metrics: Metrics) -> Reader:
    """The two families as /metrics renders them (histogram buckets cumulative): from this
    process's registry, or in multiprocess mode from every process's files."""
    if not metrics.multiprocess:
        return lambda: [(s.name, s.labels, s.value) for family in (
            *metrics.requests.collect(), *metrics.ttft.collect()) for s in family.samples]
    return FileReader(os.environ[MULTIPROC_ENV])


class FileReader:
    """prometheus-client's multiprocess files read for the two families alone: its own
    collector would parse every metric of every process (~6 ms a process, on the loop)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._keys: dict[str, tuple[str, tuple[tuple[str, str], ...]] | None] = {}

    def _key(self, key: str) -> tuple[str, tuple[tuple[str, str], ...]] | None:
        """A file entry's sample name and labels; None for the families not read (each
        key parsed once: the series are as bounded as the labels)."""
        if key not in self._keys:
            family, name, labels, _ = json.loads(key)
            wanted = family in (REQUESTS, TTFT) and name != TTFT + "_sum"
            self._keys[key] = (name, tuple(sorted(labels.items()))) if wanted else None
        return self._keys[key]

    def __call__(self) -> list[Reading]:
        totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for kind in ("counter", "histogram"):
            for file in glob.glob(os.path.join(self._path, f"{kind}_*.db")):
                for key, value, _, _ in MmapedDict.read_all_values_from_file(file):  # type: ignore[no-untyped-call]
                    found = self._key(key)
                    if found is not None:
                        totals[found] = totals.get(found, 0.0) + value
        readings = [(name, dict(labels), value) for (name, labels), value in totals.items()]
        return cumulative(readings)


def series_of(reading: Reading) -> tuple[str, str]:
    """The (backend, group) series a TTFT bucket belongs to."""
    return reading[1]["backend"], reading[1]["group"]


def cumulative(readings: list[Reading]) -> list[Reading]:
    """Bucket counts as the files keep them (each bucket's own) made cumulative within each
    series, as the exposition format has them."""
    buckets = sorted((r for r in readings if r[0] == TTFT + "_bucket"),
                     key=lambda r: (series_of(r), float(r[1]["le"])))
    out = [r for r in readings if r[0] != TTFT + "_bucket"]
    for _, series in itertools.groupby(buckets, key=series_of):
        total = 0.0
        for name, labels, value in series:
            total += value
            out.append((name, labels, total))
    return out


def quantile(q: float, bounds: tuple[float, ...], counts: list[float]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative ``counts`` (+Inf last): linear
    within the bucket the rank falls in; in the +Inf bucket, the highest finite bound."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def rates(pairs: list[tuple[Sample, Sample]], side: Callable[[Sample], Counts],
          name: str) -> dict[str, list[float | None]]:
    """``name``'s requests and 5xx replies a second between neighbouring samples."""
    out: dict[str, list[float | None]] = {"requests": [], "errors": []}
    for a, b in pairs:
        seconds = b.mono - a.mono
        before = side(a).totals.get(name, (0.0, 0.0))
        after = side(b).totals.get(name, (0.0, 0.0))
        for i, key in enumerate(("requests", "errors")):  # a restart's reset counts as 0
            delta = max(0.0, after[i] - before[i])
            out[key].append(round(delta / seconds, 3) if seconds > 0 else 0.0)
    return out


def by_backend(sample: Sample) -> Counts:
    return sample.backends


def by_group(sample: Sample) -> Counts:
    return sample.groups


class Trends:
    def __init__(self, read: Reader, step: float = STEP, window: float = WINDOW) -> None:
        self._read = read
        self.step = step
        self.window = window
        self.bounds: tuple[float, ...] = ()
        self._ring: deque[Sample] = deque(maxlen=round(window / step) + 1)

    def tick(self, mono: float, wall: float) -> bool:
        """Take a sample when a step has passed since the last one (the caller's loop may
        run more often); whether one was taken."""
        if self._ring and mono - self._ring[-1].mono < self.step * 0.9:
            return False
        self._ring.append(self._sample(mono, wall))
        return True

    def _sample(self, mono: float, wall: float) -> Sample:
        backends: Totals = {}
        groups: Totals = {}
        backend_buckets: dict[str, dict[float, float]] = {}  # name: le: count
        group_buckets: dict[str, dict[float, float]] = {}  # a group's: its backends' summed
        for name, labels, value in self._read():
            if name == REQUESTS + "_total":
                error = value if labels["status"].startswith("5") else 0.0
                for totals, key in ((backends, labels["backend"]), (groups, labels["group"])):
                    count, errors = totals.get(key, (0.0, 0.0))
                    totals[key] = (count + value, errors + error)
            elif name == TTFT + "_bucket":
                le = float(labels["le"])
                for buckets, key in ((backend_buckets, labels["backend"]),
                                     (group_buckets, labels["group"])):
                    counts = buckets.setdefault(key, {})
                    counts[le] = counts.get(le, 0.0) + value
        if group_buckets:
            self.bounds = tuple(sorted(next(iter(group_buckets.values()))))
        return Sample(mono, wall, Counts(backends, self._ordered(backend_buckets)),
                      Counts(groups, self._ordered(group_buckets)))

    def _ordered(self, buckets: dict[str, dict[float, float]]) -> Buckets:
        return {name: tuple(counts.get(le, 0.0) for le in self.bounds)
                for name, counts in buckets.items()}

    def data(self) -> dict[str, object]:
        """One point per step: ``times`` (wall clock, the step's end), and per backend and
        per group ``requests`` and ``errors`` (5xx) a second, ``ttft_p50_ms`` and
        ``ttft_p99_ms`` (null: nothing answered in that step)."""
        pairs = list(itertools.pairwise(self._ring))
        return {"step_s": self.step, "window_s": self.window,
                "times": [round(b.wall, 1) for _, b in pairs],
                "backends": self._series(pairs, by_backend),
                "groups": self._series(pairs, by_group)}

    def _series(self, pairs: list[tuple[Sample, Sample]],
                side: Callable[[Sample], Counts]) -> dict[str, dict[str, list[float | None]]]:
        names = sorted({n for _, b in pairs for n in (*side(b).totals, *side(b).ttft)})
        out = {name: rates(pairs, side, name) for name in names}
        for name, series in out.items():
            for label, q in QUANTILES:
                series[label] = [self._quantile(side(a).ttft, side(b).ttft, name, q)
                                 for a, b in pairs]
        return out

    def _quantile(self, a: Buckets, b: Buckets, name: str, q: float) -> float | None:
        later = b.get(name)
        if later is None or len(later) != len(self.bounds):
            return None
        earlier = a.get(name) or (0.0,) * len(later)
        if len(earlier) != len(later):
            return None
        counts = [max(0.0, y - x) for x, y in zip(earlier, later, strict=True)]
        found = quantile(q, self.bounds, counts)
        return None if found is None else round(found * 1000, 1)

    def __repr__(self) -> str:
        return f"<Trends [{len(self._ring)} samples, every {self.step:g} s]>"
