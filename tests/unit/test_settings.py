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
