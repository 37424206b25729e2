"""The compose stack, validated without a container engine: Debian's docker-compose parses
it (and the gateway's config file passes ``check`` under the environment it renders, with an
admin key and without), promtool checks Prometheus' config and the SLO alert rules, and the
Grafana dashboard and the alerts only use metrics the gateway exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from gateway.config import load
from gateway.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
METRIC = re.compile(r"\bgateway_[a-z_]+")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/test.sh installs it)")
    return path


def exported() -> set[str]:
    """Every series name the gateway's registry can expose (labelled metrics that saw no
    value yet have no samples, so the names come from their type)."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_count", "_sum", "_created")}
    return {family.name + suffix for family in Metrics().registry.collect()
            for suffix in suffixes[family.type]}


def referenced(text: str) -> set[str]:
    return set(METRIC.findall(text))


def render(**env: str) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` with only ``env`` set, as a shell with nothing exported."""
    return subprocess.run([tool("docker-compose"), "-f", str(COMPOSE / "docker-compose.yml"),
                           "config"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


def stack(**env: str) -> dict[str, Any]:
    run = render(**env)
    assert run.returncode == 0, run.stderr
    rendered: dict[str, Any] = yaml.safe_load(run.stdout)
    return rendered


def test_docker_compose_parses_the_stack() -> None:
    assert "version" not in yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    services = stack(MODEL_DIR="/models/x")["services"]
    assert set(services) == {"gateway", "redis", "vllm-a", "vllm-b", "prometheus", "grafana"}
    for name, gpu in (("vllm-a", "0"), ("vllm-b", "1")):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["device_ids"] == [gpu] and "gpu" in devices[0]["capabilities"]
        assert "/models/x:/models:ro" in services[name]["volumes"]
    assert services["gateway"]["build"]["dockerfile"] == "Dockerfile"


def test_the_stack_refuses_to_start_without_a_model_dir() -> None:
    run = render()  # else an empty ./models: vLLM would fail on each of its restarts
    assert run.returncode != 0 and "set MODEL_DIR" in run.stderr


def test_a_config_error_cannot_restart_the_gateway_forever() -> None:
    services = stack(MODEL_DIR="/m")["services"]
    policy = re.fullmatch(r"on-failure:(\d+)", services["gateway"]["restart"])
    assert policy is not None and 1 <= int(policy[1]) <= 10  # exit 2 gives up, a crash retries
    assert {services[s]["restart"] for s in services if s != "gateway"} == {"unless-stopped"}


@pytest.mark.parametrize("key", [None, "s3cret"])
def test_the_admin_key_is_optional_and_reaches_the_gateway_by_its_variable(
        key: str | None) -> None:
    host = {"MODEL_DIR": "/m"} | ({} if key is None else {"VGW_ADMIN_KEY": key})
    environ = {k: str(v) for k, v in stack(**host)["services"]["gateway"]["environment"].items()}
    assert environ == {"VGW_GATEWAY__ADMIN_KEY": key or ""}
    # The container's own view: its config file under only the variables compose passes it.
    done = subprocess.run([sys.executable, "-m", "gateway", "check", "--config",
                           str(COMPOSE / "gateway.toml")], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={"PATH": "/usr/bin:/bin", **environ})
    assert done.returncode == 0, done.stdout + done.stderr
    config = load(COMPOSE / "gateway.toml", environ)
    secret = config.gateway.admin_key
    assert (None if secret is None else secret.get_secret_value()) == key
    assert [b.name for b in config.backends] == ["vllm-a", "vllm-b"]
    assert config.redis.url == "redis://redis:6379/0"


def test_promtool_accepts_the_config_and_the_slo_rules() -> None:
    promtool = tool("promtool")
    for args in (["check", "config", str(COMPOSE / "prometheus" / "prometheus.yml")],
                 ["check", "rules", str(COMPOSE / "prometheus" / "alerts.yml")]):
        run = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
    rules = yaml.safe_load((COMPOSE / "prometheus" / "alerts.yml").read_text())
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    for slo in ("> 0.5", "> 0.001", "> 0.8", "> 85"):  # the seeds' four SLOs
        assert slo in exprs


def test_dashboard_and_alerts_use_only_exported_metrics() -> None:
    dashboard = json.loads((COMPOSE / "grafana" / "dashboards" / "vllm-gateway.json")
                           .read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    alerts = (COMPOSE / "prometheus" / "alerts.yml").read_text()
    names = exported()
    used = referenced(exprs) | referenced(alerts)
    assert len(referenced(exprs)) >= 15
    assert sorted(n for n in used if n not in names) == []
    provisioned = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" /
                                  "prometheus.yml").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {provisioned["datasources"][0]["uid"]}


def test_the_image_installs_the_package_the_readme_installs() -> None:
    lines = [line.split(None, 1) for line in (REPO / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    steps = [(op.upper(), rest.strip()) for op, rest in lines if op.isalpha()]
    installed = next(i for i, (op, rest) in enumerate(steps) if op == "RUN"
                     and rest.split()[:3] == ["pip", "install", "'.[otel]'"])  # tracing ready
    copied = {part for op, rest in steps[:installed] if op == "COPY" for part in rest.split()}
    assert {"pyproject.toml", "gateway", "backends"} <= copied  # all of it, before the install
    assert ("ENTRYPOINT", '["vllm-gateway"]') in steps
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "pip install -q -e ." in install  # the same pyproject, editable for development
