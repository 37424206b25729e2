"""The Grafana dashboard's template variables: instance (Prometheus' scrape label), group,
backend and model, each offered from the gateway's own series, and every panel query
filtered on each of them whose label its metric carries, so that picking one narrows every
panel it can."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import Metrics

DASHBOARD = (Path(__file__).resolve().parents[2] / "compose" / "grafana" / "dashboards" /
             "vllm-gateway.json")
VARIABLES = ("instance", "group", "backend", "model")
SELECTOR = re.compile(r"\b(gateway_[a-z_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*')
LABEL_VALUES = re.compile(r"label_values\((gateway_[a-z_]+)(?:\{([^}]*)\})?,\s*(\w+)\)")


def labels() -> dict[str, set[str]]:
    """The labels of every series name the gateway exports, and the ``instance`` Prometheus
    adds when it scrapes (prometheus-client keeps a metric's label names only privately)."""
    suffixes = {"counter": ("_total",), "gauge": ("",),
                "histogram": ("_bucket", "_count", "_sum")}
    return {family.name + suffix: {"instance", *metric._labelnames}
            for metric in vars(Metrics()).values() if isinstance(metric, MetricWrapperBase)
            for family in metric.describe() for suffix in suffixes[family.type]}


def matchers(inner: str | None) -> set[tuple[str, str, str]]:
    """The label matchers between one selector's braces (all of them, or the test fails)."""
    assert re.fullmatch(rf"(?:{MATCHER.pattern},?)*", inner or ""), inner
    return {(m[1], m[2], m[3]) for m in MATCHER.finditer(inner or "")}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def test_the_four_variables_offer_their_label_from_the_gateways_series() -> None:
    known = labels()
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == set(VARIABLES)
    for name, variable in variables.items():
        assert variable["type"] == "query" and variable["datasource"]["uid"] == "prometheus"
        assert variable["multi"] is True and variable["includeAll"] is True
        assert variable["allValue"] == ".*"  # All: every series, also values not listed yet
        query = LABEL_VALUES.fullmatch(variable["query"])
        assert query is not None, variable["query"]
        metric, inner, label = query.groups()
        assert label == name and name in known[metric]
        if name != "instance":  # the lists follow the instances picked
            assert ("instance", "=~", "$instance") in matchers(inner)


def test_every_query_filters_on_each_variable_its_metric_carries() -> None:
    known = labels()
    for expr in exprs():
        selectors = SELECTOR.findall(expr)
        assert selectors, expr
        for metric, inner in selectors:
            used = {(label, op, value) for label, op, value in matchers(inner)
                    if value.startswith("$")}
            wanted = {(v, "=~", f"${v}") for v in VARIABLES if v in known[metric]}
            assert used == wanted, f"{metric} in {expr}"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs it)")
    rules = [{"record": f"dashboard:query{i}", "expr": re.sub(r"\$\w+", ".*", expr)}
             for i, expr in enumerate(exprs())]
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
