from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from backends.launcher import build
from backends.spec import SpawnSpec, kv_dir


def spec(**kw: object) -> SpawnSpec:
    return SpawnSpec.model_validate({"model": "/m/tiny", "port": 8101, **kw})


def test_cpu_package_uses_the_module_entry_point() -> None:
    launch = build(spec(served_model_name="tiny", args=["--max-model-len", "1024"]),
                   gpu_package=False)
    assert launch.argv == [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                           "--model", "/m/tiny", "--host", "127.0.0.1", "--port", "8101",
                           "--served-model-name", "tiny", "--max-model-len", "1024"]


def test_gpu_package_uses_vllm_serve_and_visible_devices() -> None:
    launch = build(spec(python="/opt/venv/bin/python", gpus=[2], host="0.0.0.0"),
                   gpu_package=True)
    assert launch.argv[:3] == ["/opt/venv/bin/vllm", "serve", "/m/tiny"]
    assert launch.argv[3:7] == ["--host", "0.0.0.0", "--port", "8101"]
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "2"
    assert launch.env["NCCL_NVLS_ENABLE"] == "0"  # one GPU of a multi-GPU host: still off
    assert "--tensor-parallel-size" not in launch.argv


def test_multi_gpu_turns_nvlink_multicast_off_and_env_wins() -> None:
    launch = build(spec(gpus=[0, 1], args=["--tensor-parallel-size", "2"],
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}), gpu_package=True)
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert launch.env["NCCL_NVLS_ENABLE"] == "0"
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert launch.argv[-2:] == ["--tensor-parallel-size", "2"]


def test_command_template() -> None:
    launch = build(spec(command=["{python}", "-m", "x", "--port", "{port}",
                                 "--name", "{served_model_name}"], served_model_name="t"))
    assert launch.argv == [sys.executable, "-m", "x", "--port", "8101", "--name", "t"]


def test_several_gpus_make_one_tensor_parallel_group_unless_told_otherwise() -> None:
    launch = build(spec(gpus=[2, 3]), gpu_package=True)
    assert launch.argv[-2:] == ["--tensor-parallel-size", "2"]
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert {k: launch.env[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                       "NVSHMEM_DISABLE_NVLS")} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1"}
    explicit = build(spec(gpus=[0, 1, 2, 3], args=["-tp", "2", "--pipeline-parallel-size", "2"]),
                     gpu_package=True)
    assert explicit.argv.count("-tp") == 1 and "--tensor-parallel-size" not in explicit.argv


def test_no_gpus_no_gpu_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    launch = build(spec(), gpu_package=False)
    assert "CUDA_VISIBLE_DEVICES" not in launch.env and "NCCL_NVLS_ENABLE" not in launch.env


def test_the_backend_is_named_in_the_environment_and_the_user_cannot_override_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGW_BACKEND", "the-gateway-itself")
    launch = build(spec(env={"VGW_BACKEND": "spoofed"}), gpu_package=False, backend="b1")
    assert launch.env["VGW_BACKEND"] == "b1"
    assert "VGW_BACKEND" not in build(spec(), gpu_package=False).env


def test_the_gateways_own_settings_do_not_reach_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting from the environment (the admin key among them) is the gateway's alone;
    a variable the spawn spec sets by name still goes through."""
    monkeypatch.setenv("VGW_GATEWAY__ADMIN_KEY", "sk-admin-secret-0001")
    monkeypatch.setenv("VGW_ADMIN_KEY", "sk-admin-secret-0002")
    monkeypatch.setenv("HOME_OF_TEST", "kept")
    env = build(spec(env={"VGW_MINE": "1"}), gpu_package=False).env
    assert not {"VGW_GATEWAY__ADMIN_KEY", "VGW_ADMIN_KEY"} & set(env)
    assert env["HOME_OF_TEST"] == "kept" and env["VGW_MINE"] == "1"


def test_kv_events_go_to_unix_sockets_named_after_the_port_with_cached_tokens() -> None:
    launch = build(spec(kv_events=True), gpu_package=False)
    at = launch.argv.index("--kv-events-config")
    told = json.loads(launch.argv[at + 1])
    pub, replay = spec(kv_events=True).kv_endpoints or ("", "")
    assert told == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                    "replay_endpoint": replay, "topic": "kv", "max_queue_size": 0}
    assert pub == f"ipc://{kv_dir()}/8101.pub" and replay == f"ipc://{kv_dir()}/8101.replay"
    assert os.stat(kv_dir()).st_mode & 0o777 == 0o700  # no other user binds there
    assert "--enable-prompt-tokens-details" in launch.argv
    own = build(spec(kv_events=True, args=["--kv-events-config={}"]), gpu_package=False)
    assert "--kv-events-config" not in own.argv  # the user's own wins
    assert "--kv-events-config" not in build(spec(), gpu_package=False).argv


def test_the_kv_policy_turns_events_on_for_spawned_backends_only() -> None:
    from gateway.config import parse

    raw = {"routing": {"policy": "kv"}, "backends": [
        {"name": "s", "spawn": {"model": "/m", "port": 8101}},
        {"name": "u", "url": "http://h:8000", "kv_events": "tcp://h:5557",
         "kv_replay": "tcp://h:5558"},
        {"name": "off", "spawn": {"model": "/m", "port": 8102, "kv_events": False}}]}
    config = parse(raw)
    assert [b.kv_endpoints is not None for b in config.backends] == [True, True, False]
    assert config.backends[1].kv_endpoints == ("tcp://h:5557", "tcp://h:5558")
    plain = parse({"backends": [{"name": "s", "spawn": {"model": "/m", "port": 8101}}]})
    assert plain.backends[0].kv_endpoints is None
    from gateway.config import ConfigError

    bound = {"backends": [{"name": "u", "url": "http://h:8000", "kv_events": "tcp://*:5557"}]}
    with pytest.raises(ConfigError, match=r"backends\.0\.kv_events: .*tcp://HOST:PORT"):
        parse(bound)


def gpu_venv(root: Path) -> str:
    """An environment that looks like one with vLLM's GPU package (what has_gpu_vllm reads)."""
    (root / "bin").mkdir()
    (root / "bin" / "vllm").touch()
    (root / "lib" / "python3.12" / "site-packages" / "vllm-0.26.0.dist-info").mkdir(parents=True)
    return str(root / "bin" / "python")


def test_sleep_after_turns_vllms_sleep_mode_and_its_routes_on(tmp_path: Path) -> None:
    python = gpu_venv(tmp_path)
    launch = build(spec(sleep_after=300, python=python, args=["--max-model-len", "1024"]))
    assert launch.argv[-1] == "--enable-sleep-mode"
    assert launch.env["VLLM_SERVER_DEV_MODE"] == "1"  # /sleep and /wake_up are dev routes
    plain = build(spec(python=python))
    assert "--enable-sleep-mode" not in plain.argv and "VLLM_SERVER_DEV_MODE" not in plain.env
    given = build(spec(sleep_after=300, python=python, args=["--enable-sleep-mode"]))
    assert given.argv.count("--enable-sleep-mode") == 1


def test_sleep_is_refused_where_vllm_has_no_sleep_mode_and_before_a_stop(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs vLLM's sleep mode"):
        spec(sleep_after=300)  # this environment: vllm-cpu, or no vLLM
    python = gpu_venv(tmp_path)
    with pytest.raises(ValueError, match="stop_after must be longer than sleep_after"):
        spec(sleep_after=300, stop_after=300, python=python)
    assert spec(sleep_after=300, stop_after=301, python=python).on_demand
