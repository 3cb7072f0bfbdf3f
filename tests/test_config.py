"""Config validation: every error names the field and the offending value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tokenpools.cli import app
from tokenpools.model.config import ConfigError, load_config, parse_config
from tokenpools.model.keys import hash_key
from tokenpools.shipped import EXAMPLE_CONFIG

EXAMPLE = EXAMPLE_CONFIG


def base() -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "p",
                "model": "Qwen3-8B",
                "perReplica": {"tokensPerSecond": 480, "kvCacheGiB": 4.5, "concurrency": 16},
            }
        ],
        "entitlements": [
            {
                "name": "a",
                "tenantId": "t",
                "pool": "p",
                "serviceClass": "guaranteed",
                "concurrency": 4,
            }
        ],
    }


def error_of(data: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_example_config_loads_with_converted_units() -> None:
    config = load_config(EXAMPLE)
    pool = config.pools["qwen3-8b"]
    assert pool.capacity.kv_tokens == pytest.approx(4.5 * 2**30 / 147_456)
    gold = config.entitlements["guaranteed-a"]
    # baseline derived from 6 of 16 slots
    assert gold.baseline.throughput == pytest.approx(180)
    assert gold.baseline.kv_tokens == pytest.approx(pool.capacity.kv_tokens * 6 / 16)


def test_kv_in_gib_is_converted_with_the_pool_profile() -> None:
    data = base()
    data["entitlements"][0]["kvCacheGiB"] = 1.0
    ent = parse_config(data).entitlements["a"]
    assert ent.baseline.kv_tokens == pytest.approx(2**30 / 147_456)


def test_negative_value_names_field_and_value() -> None:
    data = base()
    data["entitlements"][0]["tokensPerSecond"] = -5
    msg = error_of(data)
    assert "entitlements[0].tokensPerSecond" in msg and "-5" in msg


def test_non_numeric_value() -> None:
    data = base()
    data["pools"][0]["perReplica"]["concurrency"] = "lots"
    msg = error_of(data)
    assert "pools[0].perReplica.concurrency" in msg and "'lots'" in msg


def test_unknown_key_is_rejected() -> None:
    data = base()
    data["entitlements"][0]["tokensPerSec"] = 5
    assert "entitlements[0].tokensPerSec: Extra inputs are not permitted" in error_of(data)


def test_unknown_service_class() -> None:
    data = base()
    data["entitlements"][0]["serviceClass"] = "gold"
    msg = error_of(data)
    assert "entitlements[0].serviceClass" in msg and "'gold'" in msg


def test_duplicate_names() -> None:
    data = base()
    data["entitlements"].append(dict(data["entitlements"][0]))
    data["pools"].append(dict(data["pools"][0]))
    msg = error_of(data)
    assert "entitlements[1].name: duplicate name 'a'" in msg
    assert "pools[1].name: duplicate name 'p'" in msg


def test_unknown_pool_reference() -> None:
    data = base()
    data["entitlements"][0]["pool"] = "nope"
    assert "entitlements[0].pool: unknown pool 'nope'" in error_of(data)


def test_unknown_model() -> None:
    data = base()
    data["pools"][0]["model"] = "GPT-9"
    msg = error_of(data)
    assert "pools[0]" in msg and "'GPT-9'" in msg and "Qwen3-8B" in msg


def test_custom_model_profile() -> None:
    data = base()
    data["pools"][0]["model"] = {
        "name": "tiny",
        "layers": 2,
        "kvHeads": 1,
        "headDim": 8,
        "bytesPerElement": 1,
    }
    assert parse_config(data).pools["p"].model.kv_bytes_per_token == 32


def test_both_kv_units_is_an_error() -> None:
    data = base()
    data["entitlements"][0]["kvTokens"] = 10
    data["entitlements"][0]["kvCacheGiB"] = 1
    assert "kvCacheGiB or kvTokens, not both" in error_of(data)


def test_replica_bounds() -> None:
    data = base()
    data["pools"][0].update(replicas=5, minReplicas=1, maxReplicas=4)
    assert "minReplicas <= replicas <= maxReplicas" in error_of(data)


def test_plaintext_api_key_is_refused_and_shared_keys_are_reported() -> None:
    data = base()
    data["entitlements"][0]["apiKeys"] = ["sk-plaintext"]
    assert "sha256 hashes only" in error_of(data)
    data = base()
    key = hash_key("k")
    data["entitlements"][0]["apiKeys"] = [key]
    data["entitlements"].append({**data["entitlements"][0], "name": "b"})
    assert "also the key of entitlement 'a'" in error_of(data)


def test_top_level_must_be_a_mapping() -> None:
    assert "expected a mapping" in error_of(["pools"])


def test_missing_required_field() -> None:
    data = base()
    del data["entitlements"][0]["tenantId"]
    assert "entitlements[0].tenantId: Field required" in error_of(data)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_check_config_prints_states_and_priorities() -> None:
    result = CliRunner().invoke(app, ["check-config", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert "guaranteed-a" in result.output and "Bound" in result.output
    assert "93.8" in result.output and "20.3" in result.output and "60.4" in result.output
    assert "ok: 2 pools, 7 entitlements" in result.output


def test_check_config_fails_with_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "pools: []\nentitlements:\n  - {name: a, tenantId: t, pool: x, serviceClass: spot}\n"
    )
    result = CliRunner().invoke(app, ["check-config", str(bad)])
    assert result.exit_code == 1
    assert "entitlements[0].pool: unknown pool 'x'" in result.output


def test_hash_key_command() -> None:
    result = CliRunner().invoke(app, ["hash-key", "sk-x"])
    assert result.output.strip() == hash_key("sk-x")
    piped = CliRunner().invoke(app, ["hash-key"], input="sk-x\n")  # kept out of shell history
    assert piped.exit_code == 0 and piped.output.strip() == hash_key("sk-x")
    empty = CliRunner().invoke(app, ["hash-key"], input="")
    assert empty.exit_code != 0 and "no key given" in empty.output


def test_key_schema_example_and_version_commands() -> None:
    made = CliRunner().invoke(app, ["gen-key"])
    key, hashed = made.stdout.strip(), made.stderr.strip()
    assert key.startswith("sk-tp-") and len(key) > 40 and hashed.endswith(hash_key(key))
    schema = json.loads(CliRunner().invoke(app, ["schema"]).stdout)
    assert schema["required"] == ["pools"] and "BackendSpec" in schema["$defs"]
    example = CliRunner().invoke(app, ["example-config"]).stdout
    assert parse_config(yaml.safe_load(example)).pools  # a valid config, as shipped
    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.stdout.startswith("tokenpools 0.")


def test_state_section_defaults_to_memory_and_converts_units() -> None:
    assert parse_config(base()).state.backend == "memory"
    state = parse_config(
        {**base(), "state": {"backend": "redis", "url": "redis://db:6380/2", "timeoutMs": 20}}
    ).state
    assert (state.backend, state.url, state.timeout_s) == ("redis", "redis://db:6380/2", 0.02)
    assert state.fallback_fraction == 0.5
    assert "state.fallbackFraction" in error_of({**base(), "state": {"fallbackFraction": 2}})
    assert "state.timeoutMs" in error_of({**base(), "state": {"timeoutMs": 0}})


def test_check_config_does_not_need_redis(tmp_path: Path) -> None:
    path = tmp_path / "redis.yaml"
    path.write_text(EXAMPLE.read_text() + "state: {backend: redis, url: 'redis://127.0.0.1:1/0'}\n")
    result = CliRunner().invoke(app, ["check-config", str(path)])
    assert result.exit_code == 0, result.output
    assert "state: shared in Redis at redis://127.0.0.1:1/0" in result.output
