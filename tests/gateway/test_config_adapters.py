"""``[[adapters]]`` (issue 41): spawned instances of an adapter's base get LoRA with limits
derived from the adapters declared for it; impossible adapters are refused by ``check``,
each problem on its dotted path; the launcher passes the flags and the runtime-load switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.launcher import LORA_ROUTES, build
from gateway.config import ConfigError, parse


def adapter_dir(tmp: Path, name: str, rank: int) -> str:
    where = tmp / name
    where.mkdir()
    (where / "adapter_config.json").write_text(json.dumps({"r": rank}))
    return str(where)


def raw(tmp: Path, *adapters: dict[str, object], args: list[str] | None = None
        ) -> dict[str, object]:
    return {"adapters": list(adapters), "backends": [
        {"name": "v", "spawn": {"model": "/m/llama", "served_model_name": "llama", "port": 8001,
                                "command": ["vllm"], "args": args or []}},
        {"name": "other", "spawn": {"model": "qwen", "port": 8002, "command": ["vllm"]}}]}


def test_the_base_models_spawned_instances_get_lora_with_limits_from_its_adapters(
        tmp_path: Path) -> None:
    config = parse(raw(tmp_path, *({"name": f"a{i}", "base": "llama",
                                    "path": adapter_dir(tmp_path, f"a{i}", rank)}
                                   for i, rank in enumerate((8, 12, 16, 4, 8)))))
    spawn, other = (b.spawn for b in config.backends)
    assert spawn is not None and other is not None and other.lora is None
    assert spawn.lora is not None
    assert (spawn.lora.max_loras, spawn.lora.max_lora_rank, spawn.lora.max_cpu_loras) == (
        4, 16, 5)  # 4 in a batch at most, the largest rank, every adapter in host memory
    launch = build(spawn.model_copy(update={"command": None}), gpu_package=True)
    flags = launch.argv[launch.argv.index("--enable-lora"):]
    assert flags[:7] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                         "--max-cpu-loras", "5"]
    assert launch.env[LORA_ROUTES] == "1"
    assert LORA_ROUTES not in build(other.model_copy(update={"command": None}),
                                    gpu_package=True).env


def test_a_rank_between_vllms_steps_is_rounded_up_and_the_users_own_flags_win(
        tmp_path: Path) -> None:
    config = parse(raw(tmp_path, {"name": "a", "base": "llama",
                                  "path": adapter_dir(tmp_path, "a", 40)},
                       args=["--max-loras=1", "--enable-lora"]))
    spawn = config.backends[0].spawn
    assert spawn is not None and spawn.lora is not None and spawn.lora.max_lora_rank == 64
    argv = build(spawn.model_copy(update={"command": None}), gpu_package=True).argv
    assert argv.count("--enable-lora") == 1 and "--max-loras" not in argv
    assert "--max-loras=1" in argv


def test_impossible_adapters_are_refused_on_their_dotted_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse(raw(tmp_path,
                  {"name": "llama", "base": "llama", "path": adapter_dir(tmp_path, "x", 8)},
                  {"name": "b", "base": "mistral", "path": "/nowhere"},
                  {"name": "c", "base": "llama", "path": str(tmp_path / "missing")},
                  {"name": "c", "base": "llama", "path": adapter_dir(tmp_path, "y", 8)},
                  {"name": "d/../e", "base": "llama", "path": "/x"},
                  {"name": "f", "base": "llama", "path": "/x", "colour": "red"}))
    assert info.value.problems == [
        "adapters.4.name: must be 1-64 letters, digits, '_', '.' or '-'",
        "adapters.5.colour: unknown key",
    ]
    with pytest.raises(ConfigError) as info:
        parse(raw(tmp_path,
                  {"name": "llama", "base": "llama", "path": adapter_dir(tmp_path, "z", 8)},
                  {"name": "b", "base": "mistral", "path": "/nowhere"},
                  {"name": "c", "base": "llama", "path": str(tmp_path / "missing")},
                  {"name": "c", "base": "llama", "path": adapter_dir(tmp_path, "w", 8)}))
    assert info.value.problems == [
        "adapters.0.name: 'llama' is already a model or adapter",
        "adapters.1.base: no backend serves 'mistral' with LoRA (a spawned backend of that "
        "model, or a url backend with lora = true)",
        f"adapters.2.path: no adapter_config.json in {str(tmp_path / 'missing')!r}",
        "adapters.3.name: 'c' is already a model or adapter",
    ]


def test_a_url_backend_serves_adapters_when_it_says_so() -> None:
    backends = [{"name": "u", "url": "http://10.0.0.1:8000"}]
    adapters = [{"name": "a", "base": "llama", "path": "/srv/adapters/a"}]
    with pytest.raises(ConfigError):
        parse({"adapters": adapters, "backends": backends})
    config = parse({"adapters": adapters, "backends": [{**backends[0], "lora": True}]})
    assert config.backends[0].serves_lora and config.adapters[0].name == "a"
