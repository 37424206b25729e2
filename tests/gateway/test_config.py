from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import AUTO_WORKERS_CAP, ConfigError, load, parse
from gateway.config.values import SessionFrom, usable_cores
from tests.factories import config, raw_config

REPO = Path(__file__).resolve().parents[2]


def problems(raw: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return info.value.problems


def test_every_problem_is_reported_at_once_with_its_dotted_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    found = problems({
        "gateway": {"listen": "nohost", "api_keys": ["env:NO_SUCH_VAR"], "colour": "red"},
        "upstream": {"idle_timeout": "soon"},
        "backends": [
            {"name": "a", "url": "ftp://x"},
            {"name": "a", "url": "http://h:1"},
            {"name": "b", "url": "http://h:99999", "api_key": "env:NO_SUCH_VAR"},
        ],
    })
    assert found == [
        "gateway.listen: must be HOST:PORT",
        "gateway.api_keys.0: environment variable NO_SUCH_VAR is not set",
        "gateway.colour: unknown key",
        "upstream.idle_timeout: Input should be a valid number, unable to parse string as a number",
        "backends.0.url: must be an http:// or https:// URL",
        "backends.2.url: bad port: Port out of range 0-65535",
        "backends.2.api_key: environment variable NO_SUCH_VAR is not set",
        "backends.1.name: duplicate backend name 'a' (first at backends.0)",
    ]


def test_backends_are_required() -> None:
    assert problems({}) == ["backends: required key is missing"]


def test_secrets_resolve_from_env_and_never_print(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_SECRET", "s3cr3t")
    config = parse({"gateway": {"api_keys": ["env:GW_SECRET", "plain"]},
                    "backends": [{"name": "a", "url": "http://127.0.0.1:1/"}]})
    assert [k.get_secret_value() for k in config.gateway.api_keys] == ["s3cr3t", "plain"]
    assert "s3cr3t" not in repr(config) and "plain" not in repr(config)
    assert config.backends[0].url == "http://127.0.0.1:1"


def test_config_is_frozen() -> None:
    with pytest.raises(ValueError, match="frozen"):
        config().gateway.listen = "0.0.0.0:1"  # type: ignore[misc]


def test_defaults_allow_a_ten_minute_prefill() -> None:
    defaults = config()
    assert defaults.upstream.first_byte_timeout >= 600
    assert defaults.upstream.max_connections >= 1000
    assert [str(s) for s in defaults.routing.session_keys] == ["header:x-session-id",
                                                               "body:user"]


def test_session_keys_are_parsed_once_into_sources() -> None:
    header, body = config(routing={"session_keys": ["header:X-Conv", "body:User"]}
                          ).routing.session_keys
    assert (header.kind, header.name, header.header) == (SessionFrom.HEADER, "x-conv", b"x-conv")
    assert (body.kind, body.name, body.header) == (SessionFrom.BODY, "User", b"")
    with pytest.raises(ConfigError) as bad:
        config(routing={"session_keys": ["cookie:x", "header:", 7]})
    assert bad.value.problems == [
        "routing.session_keys.0: must be 'header:NAME' or 'body:FIELD'",
        "routing.session_keys.1: must be 'header:NAME' or 'body:FIELD'",
        "routing.session_keys.2: must be a string, 'header:NAME' or 'body:FIELD'"]


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[gateway\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load(bad)
    with pytest.raises(ConfigError, match="file not found"):
        load(tmp_path / "absent.toml")


@pytest.mark.parametrize("verb", ["check", "serve"])
def test_cli_exits_2_listing_problems(tmp_path: Path, verb: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[gateway]\nlisten = "x"\n[[backends]]\nname = "a"\nurl = "nope"\n')
    done = subprocess.run([sys.executable, "-m", "gateway", verb, "--config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"{path}:2: gateway.listen: must be HOST:PORT",
        f"{path}:5: backends.0.url: must be an http:// or https:// URL",
    ]


def test_shipped_config_is_valid() -> None:
    done = subprocess.run([sys.executable, "-m", "gateway", "check", "--config",
                           str(REPO / "config.toml")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_a_backend_is_either_url_or_spawn() -> None:
    found = problems({"backends": [
        {"name": "a"},
        {"name": "b", "url": "http://h:1", "spawn": {"model": "m", "port": 8101}},
        {"name": "c", "spawn": {"model": "m"}},
    ]})
    assert found == [
        "backends.0: give 'url', 'discover' or a [backends.spawn] table (exactly one)",
        "backends.1: give 'url', 'discover' or a [backends.spawn] table (exactly one)",
        "backends.2.spawn.port: required key is missing",
    ]


def test_a_bad_discover_name_is_reported_at_its_key() -> None:
    found = problems({"backends": [
        {"name": "a", "discover": "dns://vllm-headless.ns.svc.cluster.local"},
        {"name": "b", "discover": "http://h:1"},
        {"name": "c", "discover": "dns://not-an-address/vllm:8000"},
        {"name": "d", "discover": "dns://127.0.0.1:5353/vllm.test:8000"},
    ]})
    assert found == [
        "backends.0.discover: needs a name and a port: dns://NAME:PORT",
        "backends.1.discover: must be dns://NAME:PORT or dns://SERVER[:PORT]/NAME:PORT",
        "backends.2.discover: 'not-an-address' does not appear to be an IPv4 or IPv6 address",
    ]


def test_workers_default_to_one_per_core_up_to_the_cap() -> None:
    default = config()
    assert default.gateway.workers == "auto"
    assert default.gateway.processes == max(1, min(usable_cores(), AUTO_WORKERS_CAP))


@pytest.mark.parametrize(("files", "cores"), [
    ({"cpu.max": "100000 100000\n"}, 1),  # --cpus=1
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: both, each part-time
    ({"cpu.max": "max 100000\n"}, None),  # no quota: the affinity decides
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),  # no cgroup files
])
def test_auto_workers_follow_the_containers_cpu_quota(
    tmp_path: Path, files: dict[str, str], cores: int | None,
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if cores is None else min(cores, affinity)
    assert usable_cores(tmp_path, tmp_path / "no-such-file") == expected


def test_auto_workers_find_a_quota_set_on_the_processs_own_cgroup(tmp_path: Path) -> None:
    """A systemd unit's CPUQuota, or a container sharing the host's cgroup namespace: the
    quota is on the process's own cgroup (or a parent), not on the root."""
    root = tmp_path / "fs"
    unit = root / "system.slice" / "gateway.service"
    unit.mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "system.slice" / "cpu.max").write_text("100000 100000\n")  # 1 core, a parent
    (unit / "cpu.max").write_text("max 100000\n")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/system.slice/gateway.service\n")
    assert usable_cores(root, own) == 1
    own.write_text("0::/\n")  # its own namespace: the root's quota (none here)
    assert usable_cores(root, own) == len(os.sched_getaffinity(0))


def test_workers_mix_with_spawned_backends_and_the_embedded_redis() -> None:
    both = parse({"gateway": {"workers": 3},
                  "backends": [{"name": "a", "spawn": {"model": "m", "port": 8101}}]})
    assert both.gateway.processes == 3 and both.redis.url == "embedded" and both.uses_redis


def test_workers_is_a_count_or_auto() -> None:
    assert problems(raw_config(gateway={"workers": 0}))[0].startswith("gateway.workers")
    assert problems(raw_config(gateway={"workers": "many"}))[0].startswith("gateway.workers")


def test_embedded_redis_data_dir_defaults_beside_the_working_directory() -> None:
    assert config().redis.data_dir == "data/valkey"


def test_embedded_redis_data_dir_must_name_a_directory() -> None:
    assert problems(raw_config(redis={"data_dir": ""})) == [
        "redis.data_dir: String should have at least 1 character"]
    assert problems(raw_config(redis={"data_dir": "  "})) == [
        "redis.data_dir: must name a directory"]
    assert problems(raw_config(redis={"data_dir": "a\0b"})) == [
        "redis.data_dir: must not contain a NUL character"]


def test_a_per_backend_cap_the_chosen_client_cannot_keep_is_refused() -> None:
    raw = raw_config(upstream={"client": "httpx", "max_connections_per_backend": 2})
    assert any(p.startswith("upstream.max_connections_per_backend: the httpx client")
               for p in problems(raw))
    raw["upstream"] = {"client": "aiohttp", "max_connections_per_backend": 2}
    assert parse(raw).upstream.max_connections_per_backend == 2


def test_key_limits_alone_use_redis() -> None:
    """Limits are shared through Redis: with nothing else using it, a limited key still
    does (without it each process counted alone, and ``fail_closed`` refused everything)."""
    bare = {"routing": {"sticky": False}, "breaker": {"share": False},
            "degraded": {"cache": False},
            "backends": [{"name": "a", "url": "http://127.0.0.1:8001"}]}
    assert not parse(bare).uses_redis
    limited = parse({**bare, "keys": [{"name": "k", "key": "sk-" + "x" * 20, "rpm": 5}]})
    assert limited.uses_redis


def test_check_says_which_backends_the_kv_policy_sees_exactly(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[routing]\npolicy = "kv"\n'
                    '[[backends]]\nname = "s"\n[backends.spawn]\nmodel = "m"\nport = 8101\n'
                    '[[backends]]\nname = "u"\nurl = "http://h:8000"\n'
                    '[[backends]]\nname = "e"\nurl = "http://h:8001"\n'
                    'kv_events = "tcp://h:5557"\n')
    done = subprocess.run([sys.executable, "-m", "gateway", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{path}: OK (3 backends)", "  s: exact: its KV events",
        "  u: estimated: no KV events (kv_events), routed by what the gateway sent it",
        "  e: exact: its KV events"]


def test_an_instance_that_could_never_be_awake_on_its_gpu_is_refused() -> None:
    def spawn(name: str, port: int, share: str, **more: object) -> dict[str, object]:
        return {"name": name, "spawn": {"model": "m", "port": port, "gpus": [0], "command": ["x"],
                                        "args": ["--gpu-memory-utilization", share], **more}}

    always = spawn("always", 8001, "0.6")
    lazy = spawn("lazy", 8002, "0.5", start="on_demand", stop_after=60)
    assert problems({"backends": [always, lazy]}) == [
        "backends.1.spawn.gpus: GPU 0 can never hold it awake: it takes 0.5 of its memory, "
        "and instances that never sleep or stop hold 0.6"]
    fits = [always, spawn("lazy", 8002, "0.4", start="on_demand", stop_after=60),
            spawn("sleepy", 8003, "0.4", sleep_after=60)]  # they take turns
    parse({"backends": fits})
