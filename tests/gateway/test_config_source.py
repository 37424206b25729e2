"""Where config values come from: the file's lines in every problem (as ``nginx -t``), the
environment's ``VGW_SECTION__KEY`` overrides, and ``serve --listen`` over both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load

FILE = '''# the gateway
[gateway]
listen = "127.0.0.1:8080"
api_keys = ["sk-file-key-0000000001"]

[routing]
policy = "nope"          # line 7

[[backends]]
name = "a"
url = "http://127.0.0.1:9001"

[[backends]]
name = "b"
weight = 5000            # line 15
[backends.spawn]
model = "m"
port = 99999             # line 18

[[keys]]
name = "team"
key = "sk-team-key-00000000001"
rpm = -1                 # line 23
'''


def problems(path: Path, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(path, env or {})
    return info.value.problems


def test_every_problem_names_its_file_line(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(FILE)
    found = problems(path)
    assert f"{path}:7: routing.policy: Input should be 'least_loaded', 'round_robin', " \
           "'prefix' or 'kv'" in found
    assert f"{path}:15: backends.1.weight: Input should be less than or equal to 1000" in found
    assert f"{path}:18: backends.1.spawn.port: Input should be less than or equal to 65535" \
        in found
    assert any(p.startswith(f"{path}:23: keys.0.rpm: ") for p in found), found
    assert len(found) == 4  # all at once


def test_a_missing_key_points_at_its_table(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[gateway]\nlisten = "127.0.0.1:1"\n\n[[backends]]\nname = "a"\n'
                    'url = "http://127.0.0.1:1"\n\n[[backends]]\nurl = "http://127.0.0.1:2"\n')
    assert problems(path) == [f"{path}:8: backends.1.name: required key is missing"]


def test_the_environment_sets_any_key_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[gateway]\nlisten = "127.0.0.1:8080"\n[[backends]]\nname = "a"\n'
                    'url = "http://127.0.0.1:9001"\n')
    config = load(path, {
        "VGW_GATEWAY__LISTEN": "0.0.0.0:9000", "VGW_GATEWAY__WORKERS": "3",
        "VGW_ROUTING__STICKY": "false", "VGW_REDIS__TIMEOUT": "0.5",
        "VGW_GATEWAY__API_KEYS": '["sk-env-key-000000000001"]',
        "VGW_BACKENDS__0__MAX_CONCURRENT": "4", "VGW_CANARY__ROLLOUT__MIN_REQUESTS": "7",
        "VGW_GATEWAY__ADMIN_KEY": "",  # empty: as if unset
        "VGW_ADMIN_KEY": "not-an-override", "OTHER__THING": "x"})
    assert config.gateway.listen == "0.0.0.0:9000" and config.gateway.workers == 3
    assert config.routing.sticky is False and config.redis.timeout == 0.5
    assert [k.get_secret_value() for k in config.gateway.api_keys] == [
        "sk-env-key-000000000001"]
    assert config.backends[0].max_concurrent == 4
    assert config.canary.rollout.min_requests == 7
    assert config.gateway.admin_key is None


def test_a_bad_override_is_named_by_its_variable(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[gateway]\nlisten = "x"\n[[backends]]\nname = "a"\n'
                    'url = "http://127.0.0.1:9001"\n')
    found = problems(path, {"VGW_REDIS__TIMEOUT": "soon", "VGW_NOPE__X": "1",
                            "VGW_BACKENDS__3__URL": "http://h:1",
                            "VGW_GATEWAY__LISTEN__PORT": "1"})
    assert sorted(found) == sorted([
        "VGW_BACKENDS__3__URL: backends.3: no such table or entry",
        "VGW_GATEWAY__LISTEN__PORT: gateway.listen: no such table or entry",
        f"{path}:2: gateway.listen: must be HOST:PORT",
        "VGW_NOPE__X: nope: unknown key",
        "VGW_REDIS__TIMEOUT: redis.timeout: Input should be a valid number, unable to parse "
        "string as a number"])


def test_serve_listen_wins_over_the_environment_and_is_named_when_bad(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9001"\n')
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path),
                           "--listen", "nohost"], capture_output=True, text=True, timeout=30,
                          env={"VGW_GATEWAY__LISTEN": "127.0.0.1:1", "PATH": "/usr/bin"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["--listen: gateway.listen: must be HOST:PORT"]


def test_version_flag() -> None:
    from gateway import __version__
    done = subprocess.run([sys.executable, "-m", "gateway", "--version"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0 and done.stdout == f"vllm-gateway {__version__}\n"


def test_free_form_keys_keep_the_variables_case_and_the_files_keys_are_matched(
        tmp_path: Path) -> None:
    """A spawn's ``env`` and a model's ``groups`` are the user's names: their case is the
    variable's (or the file's, when the file has the key in another case)."""
    path = tmp_path / "c.toml"
    path.write_text('[gateway]\nlisten = "127.0.0.1:8080"\n[[models]]\nname = "m"\n'
                    'groups = { Canary = "m-old" }\n[[backends]]\nname = "s"\n'
                    'group = "Stable"\n[backends.spawn]\nmodel = "x"\nport = 8100\n'
                    '[[backends]]\nname = "c"\ngroup = "Canary"\nurl = "http://127.0.0.1:1"\n')
    config = load(path, {"VGW_BACKENDS__0__SPAWN__ENV__VLLM_USE_V1": "0",
                         "VGW_MODELS__0__GROUPS__CANARY": "m-new",
                         "VGW_MODELS__0__GROUPS__Stable": "m-stable"})
    spawn = config.backends[0].spawn
    assert spawn is not None and spawn.env == {"VLLM_USE_V1": "0"}
    assert config.models[0].groups == {"Canary": "m-new", "Stable": "m-stable"}


@pytest.mark.parametrize("name", ["VGW_REDIS_URL", "VGW_GATEWAY_LISTEN", "VGW_routing_policy"])
def test_a_setting_written_with_one_underscore_is_an_error_not_ignored(
        tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[gateway]\nlisten = "127.0.0.1:8080"\n[[backends]]\nname = "a"\n'
                    'url = "http://127.0.0.1:1"\n')
    with pytest.raises(ConfigError) as caught:
        load(path, {name: "x", "VGW_MY_SECRET": "kept for env:VGW_MY_SECRET",
                    "VGW_ADMIN_KEY": "the admin client's"})
    assert caught.value.problems == [
        f"{name}: not a setting: a section and its key are joined by two underscores "
        f"(VGW_{name[4:].split('_', 1)[0]}__{name[4:].split('_', 1)[1]})"]
