"""Settings: typed fleet config with its precedence, and secrets from the environment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core import connection, settings


def test_env_overrides_fleet_config(monkeypatch):
    monkeypatch.setenv("IB_HEARTBEAT_TTL_S", "7")
    monkeypatch.setenv("IB_DECISION_NO_WORKER_POLICY", "reject")
    cfg = settings.fleet_config()
    assert cfg.heartbeat.ttl_s == 7 and isinstance(cfg.heartbeat.ttl_s, float)
    assert cfg.decision.no_worker_policy == "reject"


def test_a_boolean_override_reads_words(monkeypatch):
    monkeypatch.setenv("IB_BATCH_FEEDER_IN_WORKERS", "false")
    assert settings.fleet_config().batch.feeder_in_workers is False
    monkeypatch.setenv("IB_BATCH_FEEDER_IN_WORKERS", "1")
    assert settings.fleet_config().batch.feeder_in_workers is True


def test_password_comes_from_the_environment_and_is_quoted(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "rediss://cache.example:6380/2")
    monkeypatch.setenv("REDIS_PASSWORD", "p@ss/word")
    assert connection.redis_url() == "rediss://:p%40ss%2Fword@cache.example:6380/2"


def test_a_url_with_credentials_is_left_alone(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://user:secret@h:6379/0")
    monkeypatch.setenv("REDIS_PASSWORD", "other")
    assert connection.redis_url() == "redis://user:secret@h:6379/0"


def test_precedence_defaults_then_site_file_then_environment(tmp_path, monkeypatch):
    site = tmp_path / "site.yaml"
    site.write_text("heartbeat:\n  ttl_s: 30\n  interval_s: 5\ndecision:\n  policy: profile\n")
    monkeypatch.setenv("IB_CONFIG_FILE", str(site))
    monkeypatch.setenv("IB_HEARTBEAT_TTL_S", "45")
    monkeypatch.delenv("IB_HEARTBEAT_INTERVAL_S", raising=False)  # the test session's own override
    cfg = settings.fleet_config()
    assert cfg.heartbeat.model_dump() == {"interval_s": 5, "ttl_s": 45}  # file over defaults, environment over file
    assert cfg.decision.policy == "profile" and cfg.decision.prefix_min_blocks == 4  # the rest: defaults


def test_a_misspelt_key_or_a_bad_value_is_refused_by_name(tmp_path, monkeypatch):
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
    assert connection.broker_url("redis://h:6379/0") == "redis://h:6379/0"
    monkeypatch.setenv("BROKER_URL", "amqp://guest:guest@rabbit:5672//")
    assert connection.broker_url("redis://h:6379/0").startswith("amqp://")
    assert [
        connection.is_redis_broker(u)
        for u in ("redis://h", "rediss://h", "sentinel://h:26379", "amqp://h", "pyamqp://h")
    ] == [True, True, True, False, False]


def test_other_ib_variables_are_not_taken_for_config(monkeypatch):
    monkeypatch.setenv("IB_FLOWER_BASIC_AUTH", "ops:secret")  # a secret, not a flower.* key
    monkeypatch.setenv("IB_DATA_DIR", "/tmp/x")
    monkeypatch.setenv("IB_DECISION_PREFIX_AFFINITY_BACKENDS", '["vllm"]')  # lists and maps as JSON
    cfg = settings.fleet_config()
    assert "basic_auth" not in cfg.flower.model_dump() and cfg.decision.prefix_affinity_backends == ["vllm"]


def test_a_key_missing_from_the_defaults_file_is_an_error_not_a_silent_default(tmp_path, monkeypatch):
    """The defaults live in config/fleet.yaml alone: a key dropped from it fails at load."""
    import shutil

    import yaml

    cfg_dir = tmp_path / "config"
    shutil.copytree(settings.config_dir(), cfg_dir)
    fleet = yaml.safe_load((cfg_dir / "fleet.yaml").read_text())
    del fleet["celery"]["result_expires_s"]
    (cfg_dir / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    monkeypatch.setenv("IB_CONFIG_DIR", str(cfg_dir))
    with pytest.raises(ValidationError, match="result_expires_s"):
        settings.fleet_config()
    monkeypatch.setenv("IB_CELERY_RESULT_EXPIRES_S", "600")  # any layer may supply it
    assert settings.fleet_config().celery.result_expires_s == 600


def test_sections_are_typed_and_frozen():
    cfg = settings.fleet_config()
    assert cfg.priorities.steps() == [0, 3, 6] and cfg.priorities.level("batch") == 6
    with pytest.raises(ValidationError):
        cfg.celery.job_time_limit_s = 1  # type: ignore[misc]  # a process's config is read, never patched


def test_backends_file_is_typed_and_a_misspelt_key_is_refused():
    from core.backends import LlamaCppSpec, load_backends

    specs = load_backends()
    assert isinstance(specs["llamacpp"], LlamaCppSpec) and specs["llamacpp"].sequences == specs["llamacpp"].max_seqs
    assert specs["onnx"].speculative is None and specs["pytorch"].speculative.method == "ngram"
    data = {"backends": {name: spec.model_dump(exclude_none=True) for name, spec in specs.items()}}
    data["backends"]["llamacpp"]["max_sequences"] = 4
    with pytest.raises(ValidationError, match="max_sequences"):
        load_backends(data)


def test_a_spec_for_a_model_carries_its_context_and_refuses_unknown_changes():
    from core.backends import load_backends
    from core.registry import ModelRegistry

    model = ModelRegistry.from_config().get("smollm2-135m")
    spec = load_backends()["llamacpp"]
    served = spec.for_model(model, device="cpu", prefix_cache_mb=0)
    assert served.max_model_len == model.context_length and served.prefix_cache_mb == 0 and served.device == "cpu"
    assert spec.max_model_len is None  # the loaded spec itself is left as it was
    with pytest.raises(ValidationError, match="prefix_cache"):
        spec.for_model(model, prefix_cache=0)  # a misspelt engine key in a test or a benchmark
    config = served.engine_config()
    assert config["speculative"] == spec.speculative.model_dump() and "formats" not in config
