"""The Kubernetes manifests (deploy/kubernetes): every overlay renders with kubectl's built-in
kustomize, every object is valid against the Kubernetes schemas (kubernetes-validate's,
offline, strict: no unknown field), and what the deployment must hold does hold: probes,
drain before SIGTERM, non-root and read-only, the config valid for this gateway, the
discover name the headless Service's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import load

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = REPO / "deploy" / "kubernetes" / "overlays"
K8S = "1.33.0"


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (its built-in kustomize renders the overlays)"
    done = subprocess.run([kubectl, "kustomize", str(OVERLAYS / overlay)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    def named(o: dict[str, Any]) -> bool:  # generated ConfigMaps carry a hash suffix
        n = o["metadata"]["name"]
        return n == name or (kind == "ConfigMap" and n.startswith(name + "-"))

    found = [o for o in objects if o["kind"] == kind and named(o)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)}"
    return found[0]


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_every_object_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Namespace", "Deployment", "Service", "PodDisruptionBudget",
                     "HorizontalPodAutoscaler", "ConfigMap", "StatefulSet", "NetworkPolicy",
                     "PersistentVolumeClaim"}
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: "
                                 f"{exc.message} at {list(exc.path)}") from None


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_the_gateway_is_deployed_as_it_must_run(overlay: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGW_ADMIN_KEY", "from-the-secret")
    objects = render(overlay)
    gateway = one(objects, "Deployment", "vllm-gateway")
    pod = gateway["spec"]["template"]["spec"]
    box = pod["containers"][0]
    assert gateway["spec"]["replicas"] >= 2
    assert box["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert box["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert box["securityContext"]["readOnlyRootFilesystem"] is True
    assert box["resources"]["requests"]["cpu"]
    # The config the ConfigMap carries is one this gateway accepts...
    config_map = one(objects, "ConfigMap", "vllm-gateway-config")
    path = tmp_path / "config.toml"
    path.write_text(config_map["data"]["config.toml"])
    config = load(str(path))
    done = subprocess.run([sys.executable, "-m", "gateway", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    # ...that drains within the grace period, after preStop...
    pre_stop = float(box["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + config.supervisor.drain_timeout
    # ...and finds the vLLM pods through the headless Service, in this namespace.
    headless = one(objects, "Service", "vllm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    namespace = headless["metadata"]["namespace"]
    (entry,) = [b for b in config.backends if b.discover]
    assert entry.discover == (f"dns://vllm-headless.{namespace}.svc.cluster.local:"
                              f"{headless['spec']['ports'][0]['port']}")
    secret_ref = box["env"][0]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"].startswith("vllm-gateway-keys")


def test_the_gpu_overlay_asks_for_gpus_and_the_demo_does_not() -> None:
    def gpus(overlay: str) -> str | None:
        vllm = one(render(overlay), "Deployment", "vllm")
        limits: dict[str, str] = vllm["spec"]["template"]["spec"]["containers"][0][
            "resources"].get("limits", {})
        return limits.get("nvidia.com/gpu")

    assert gpus("gpu") == "1" and gpus("cpu-demo") is None


def test_valkey_and_vllm_take_connections_from_the_gateway_only() -> None:
    objects = render("gpu")
    for name, port in (("valkey-from-gateway-only", 6379), ("vllm-from-gateway-only", 8000)):
        policy = one(objects, "NetworkPolicy", name)["spec"]
        (rule,) = policy["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "vllm-gateway"}}}]
        assert rule["ports"] == [{"port": port}]
    valkey = one(objects, "StatefulSet", "valkey")
    assert valkey["spec"]["volumeClaimTemplates"]  # a persistent volume for its AOF
