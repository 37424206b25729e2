"""From a spawn spec to the command and environment that start one vLLM instance."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from backends.family import MARKER
from backends.spec import SpawnSpec, has_gpu_vllm, kv_dir

TP_FLAGS = ("--tensor-parallel-size", "-tp")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]
    env: dict[str, str]


SLEEP_ROUTES = "VLLM_SERVER_DEV_MODE"
LORA_ROUTES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # /v1/load_lora_adapter and unload


def lora_args(spec: SpawnSpec) -> list[str]:
    """vLLM's LoRA flags for the adapters the config derived, unless its own args set them."""
    if spec.lora is None:
        return []
    out = [] if "--enable-lora" in spec.args else ["--enable-lora"]
    for flag, value in (("--max-loras", spec.lora.max_loras),
                        ("--max-lora-rank", spec.lora.max_lora_rank),
                        ("--max-cpu-loras", spec.lora.max_cpu_loras)):
        if not any(a == flag or a.startswith(flag + "=") for a in spec.args):
            out += [flag, str(value)]
    return out


def kv_args(spec: SpawnSpec) -> list[str]:
    """vLLM's flags for its KV-cache events and the cached tokens of each reply, unless the
    spec's own arguments set them (issue 38)."""
    endpoints = spec.kv_endpoints
    if endpoints is None:
        return []
    where = kv_dir()
    os.makedirs(where, mode=0o700, exist_ok=True)
    if os.stat(where).st_uid != os.getuid():  # someone else's: their sockets, not ours
        raise RuntimeError(f"{where} belongs to another user: KV events can't go there")
    os.chmod(where, 0o700)
    out = []
    if not any(a.startswith("--kv-events-config") for a in spec.args):
        # max_queue_size 0: vLLM's step loop never waits on its publisher thread (the
        # bounded queue can stall the engine: vllm#53859).
        out += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoints[0],
            "replay_endpoint": endpoints[1], "topic": "kv", "max_queue_size": 0})]
    if "--enable-prompt-tokens-details" not in spec.args:
        out.append("--enable-prompt-tokens-details")
    return out


def build(spec: SpawnSpec, gpu_package: bool | None = None, backend: str | None = None) -> Launch:
    """The command and environment; ``backend`` names the backend in the environment
    (``VGW_BACKEND``), so that its processes can be recognised later as ours."""
    python = spec.python or sys.executable
    if spec.command:
        fields = {"python": python, "model": spec.model, "host": spec.host,
                  "port": str(spec.port), "served_model_name": spec.name_served}
        argv = [part.format(**fields) for part in spec.command]
    else:
        if gpu_package is None:
            gpu_package = has_gpu_vllm(python)
        if gpu_package:
            argv = [str(Path(python).parent / "vllm"), "serve", spec.model]
        else:
            argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model]
        argv += ["--host", spec.host, "--port", str(spec.port)]
        if spec.served_model_name:
            argv += ["--served-model-name", spec.served_model_name]
        if len(spec.gpus) > 1 and not any(a.startswith(TP_FLAGS) for a in spec.args):
            # One backend over several GPUs is one tensor-parallel group across all of them.
            argv += ["--tensor-parallel-size", str(len(spec.gpus))]
        argv += list(spec.args)
        argv += kv_args(spec)
        argv += lora_args(spec)
        if spec.sleep_after is not None and "--enable-sleep-mode" not in spec.args:
            argv.append("--enable-sleep-mode")
    # The gateway's own settings (VGW_*: an admin key among them) are not vLLM's to read.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGW_")}
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
        # NVLink multicast off in NCCL, PyTorch and NVSHMEM: on a shared multi-GPU host a
        # program using it can take every GPU out of service (KINDS.md). The backend's own
        # env may not turn it back on by accident; it is set before spec.env on purpose.
        env.update(NO_MULTICAST)
    if spec.sleep_after is not None:
        env[SLEEP_ROUTES] = "1"  # vLLM serves /sleep and /wake_up only in its dev mode
    if spec.lora is not None:
        env[LORA_ROUTES] = "1"  # the gateway loads each adapter where it sends it
    env.update(spec.env)
    if backend is not None:
        env[MARKER] = backend  # after spec.env: the marker is ours, not the user's to set
    else:
        env.pop(MARKER, None)  # not inherited from a gateway that itself runs as a backend
    return Launch(argv, env)
