"""Settings: environment overrides and secrets from the environment."""

from __future__ import annotations

from dispatcher import settings


def test_env_overrides_fleet_config(monkeypatch):
    monkeypatch.setenv("IB_HEARTBEAT_TTL_S", "7")
    monkeypatch.setenv("IB_DECISION_NO_WORKER_POLICY", "reject")
    cfg = settings.fleet_config()
    assert cfg["heartbeat"]["ttl_s"] == 7
    assert cfg["decision"]["no_worker_policy"] == "reject"


def test_a_boolean_override_reads_words(monkeypatch):
    monkeypatch.setenv("IB_BATCH_FEEDER_IN_WORKERS", "false")
    assert settings.fleet_config()["batch"]["feeder_in_workers"] is False
    monkeypatch.setenv("IB_BATCH_FEEDER_IN_WORKERS", "1")
    assert settings.fleet_config()["batch"]["feeder_in_workers"] is True


def test_password_comes_from_the_environment_and_is_quoted(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "rediss://cache.example:6380/2")
    monkeypatch.setenv("REDIS_PASSWORD", "p@ss/word")
    assert settings.redis_url() == "rediss://:p%40ss%2Fword@cache.example:6380/2"


def test_a_url_with_credentials_is_left_alone(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://user:secret@h:6379/0")
    monkeypatch.setenv("REDIS_PASSWORD", "other")
    assert settings.redis_url() == "redis://user:secret@h:6379/0"


def test_precedence_defaults_then_site_file_then_environment(tmp_path, monkeypatch):
    site = tmp_path / "site.yaml"
    site.write_text("heartbeat:\n  ttl_s: 30\n  interval_s: 5\ndecision:\n  policy: profile\n")
    monkeypatch.setenv("IB_CONFIG_FILE", str(site))
    monkeypatch.setenv("IB_HEARTBEAT_TTL_S", "45")
    monkeypatch.delenv("IB_HEARTBEAT_INTERVAL_S", raising=False)  # the test session's own override
    cfg = settings.fleet_config()
    assert cfg["heartbeat"] == {"interval_s": 5, "ttl_s": 45}  # file over defaults, environment over file
    assert cfg["decision"]["policy"] == "profile" and cfg["decision"]["prefix_min_blocks"] == 4  # the rest: defaults


def test_a_misspelt_key_or_a_bad_value_is_refused_by_name(tmp_path, monkeypatch):
    import pytest
    from pydantic import ValidationError

    site = tmp_path / "site.yaml"
    site.write_text("heartbeat:\n  ttl_seconds: 30\n")
    monkeypatch.setenv("IB_CONFIG_FILE", str(site))
    with pytest.raises(ValidationError, match="ttl_seconds"):
        settings.fleet_config()
    monkeypatch.delenv("IB_CONFIG_FILE")
    monkeypatch.setenv("IB_HEARTBEAT_TTL_S", "soon")
    with pytest.raises(ValidationError, match="ttl_s"):
        settings.fleet_config()
    monkeypatch.setenv("IB_HEARTBEAT_TTL_S", "15")
    monkeypatch.setenv("IB_CONFIG_FILE", str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        settings.fleet_config()


def test_broker_url_defaults_to_redis_and_rabbitmq_is_not_the_redis_transport(monkeypatch):
    monkeypatch.delenv("BROKER_URL", raising=False)
    assert settings.broker_url("redis://h:6379/0") == "redis://h:6379/0"
    monkeypatch.setenv("BROKER_URL", "amqp://guest:guest@rabbit:5672//")
    assert settings.broker_url("redis://h:6379/0").startswith("amqp://")
    assert [settings.is_redis_broker(u) for u in ("redis://h", "rediss://h", "sentinel://h:26379", "amqp://h", "pyamqp://h")] == [
        True, True, True, False, False]  # fmt: skip


def test_other_ib_variables_are_not_taken_for_config(monkeypatch):
    monkeypatch.setenv("IB_FLOWER_BASIC_AUTH", "ops:secret")  # a secret, not a flower.* key
    monkeypatch.setenv("IB_DATA_DIR", "/tmp/x")
    monkeypatch.setenv("IB_DECISION_PREFIX_AFFINITY_BACKENDS", '["vllm"]')  # lists and maps as JSON
    cfg = settings.fleet_config()
    assert "basic_auth" not in cfg["flower"] and cfg["decision"]["prefix_affinity_backends"] == ["vllm"]
