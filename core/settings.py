"""Fleet policy, typed: config/fleet.yaml with its precedence, and where files live.

    config/fleet.yaml (every key, with its comment: the one place defaults are written)
      < the file named by IB_CONFIG_FILE (a partial fleet.yaml: only what a site changes)
        < environment variables IB_<SECTION>_<KEY> (e.g. IB_HEARTBEAT_TTL_S=30)

Each section is a pydantic class below, so call sites read ``cfg.celery.result_expires_s``
as the type it is, an override is converted like the value it replaces ("30" becomes 30,
"off" becomes False), a misspelt section or key in the site file is refused with its
name, and a key missing from fleet.yaml is an error at load instead of a default written
a second time in code. Secrets (the Redis password, Flower's credentials) never come from
these files, only from the environment (core.connection, ops.flower.process).
"""

from __future__ import annotations

import json
import os
import typing
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_FILE_ENV = "IB_CONFIG_FILE"


def config_dir() -> Path:
    """models.yaml, backends.yaml, fleet.yaml, profiles.json: ``IB_CONFIG_DIR`` or the repository's."""
    return Path(os.environ.get("IB_CONFIG_DIR") or REPO_ROOT / "config")


def data_dir() -> Path:
    """Prepared models, the embedded broker's files, logs: ``IB_DATA_DIR`` or ~/.local/share."""
    path = _data_path(os.environ.get("IB_DATA_DIR"), os.environ.get("HOME"))
    # A stat where the folder exists: mkdir's refusal costs ~0.1 ms, and every registry
    # look-up on the submit path reaches here (core.models.user_file.path).
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=16)
def _data_path(explicit: str | None, home: str | None) -> Path:
    """The data directory for these environment values (keyed by them, so a changed
    ``IB_DATA_DIR`` or ``HOME`` is seen; building the Path each call was ~40 µs)."""
    return Path(explicit) if explicit else Path.home() / ".local" / "share" / "inference-backend"


@cache
def load_yaml(name: str) -> dict[str, Any]:
    """A config file as read (models.yaml, backends.yaml); typed by its owner."""
    path = config_dir() / name
    with path.open() as fh:
        return yaml.safe_load(fh) or {}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DecisionPolicy(Section):
    """The tree's thresholds and what the hard constraints do (dispatcher.routing.decision)."""

    latency_threshold_ms: float
    throughput_threshold_tok_s: float
    default_latency_target_ms: float
    default_throughput_target_tok_s: float
    no_worker_policy: Literal["queue", "fallback", "reject"]
    fallback_order: dict[str, list[str]]
    # Prefix affinity: backends whose workers keep prompt KV state, the fewest leading
    # blocks some worker must hold for affinity to apply, and what one job in flight on a
    # worker costs against the share of the prompt it would evaluate
    # (dispatcher.routing.decision.affinity_cost).
    prefix_affinity_backends: list[str]
    prefix_min_blocks: int
    prefix_load_weight: float = Field(ge=0)
    # A worker's own queue holds at most this many jobs per unit of its capacity; past
    # it, a job goes to the shared queue rather than wait behind the holder's backlog.
    prefix_max_queued_per_slot: float
    policy: Literal["tree", "profile"]


class PrefixSettings(Section):
    enabled: bool
    block_tokens: int
    max_blocks: int
    hint_ttl_s: int
    max_worker_blocks: int
    tenant_isolation: bool = True
    shared_system_prompts: list[str] = []


class ClientSettings(Section):
    fleet_cache_s: float
    fleet_stale_s: float
    result_timeout_s: float = Field(gt=0)
    lost_check_s: float = Field(gt=0)


class CelerySettings(Section):
    visibility_timeout_s: int
    job_time_limit_s: float
    result_expires_s: int
    prefetch_multiplier: int
    group_jobs: int = Field(ge=1)  # jobs per message at most (ib.generate_group); 1: one each
    group_backends: list[str]


class HeartbeatSettings(Section):
    interval_s: float
    ttl_s: float


class Priorities(Section):
    """Redis transport levels: lower is served first."""

    interactive: int
    normal: int
    batch: int

    def level(self, priority: str) -> int:
        return int(getattr(self, priority))

    def steps(self) -> list[int]:
        return sorted({self.interactive, self.normal, self.batch})


class RedisSettings(Section):
    retry_s: float
    embedded_maxmemory: str


class BatchSettings(Section):
    default_completion_window: str
    max_completion_window: str
    retention_s: int
    default_latency_target_ms: float
    default_throughput_target_tok_s: float
    max_queued: int
    feed_chunk: int
    feed_interval_s: float
    feed_idle_interval_s: float
    feeder_in_workers: bool
    feeder_lease_s: float
    validate_chunk: int
    max_line_bytes: int
    validation_stale_s: float
    cancel_grace_s: float
    lost_line_check_s: float


class FlowerSettings(Section):
    port: int
    show_text: bool


class MetricsSettings(Section):
    port: int
    host_port: int


class GatewaySettings(Section):
    """`ib serve`, the OpenAI-compatible HTTP gateway (gateway/)."""

    host: str
    port: int
    files_url: str
    max_body_bytes: int
    max_file_bytes: int
    max_json_depth: int
    max_inflight_per_key: int
    max_active_batches_per_key: int
    default_max_tokens: int
    request_timeout_s: float
    retry_after_s: int
    redis_wait_s: float
    file_expiry_s: int = Field(ge=3600)
    min_file_expiry_s: int = Field(ge=1)
    max_files_per_key: int = Field(ge=0)
    max_file_bytes_per_key: int = Field(ge=0)
    batch_stagings: int = Field(ge=1)


class HealthSettings(Section):
    """A worker past one of these stops taking jobs (workers.lifecycle.health); 0 turns a memory limit off."""

    max_ram_frac: float
    max_rss_mb: float
    max_gpu_mem_frac: float
    max_gpu_temp_c: float
    max_ecc_uncorrected: int
    xid_fatal: bool
    own_queue_grace_s: float = Field(ge=0)


class FleetSettings(BaseSettings):
    """config/fleet.yaml, section by section."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    decision: DecisionPolicy
    prefix: PrefixSettings
    client: ClientSettings
    celery: CelerySettings
    heartbeat: HeartbeatSettings
    priorities: Priorities
    redis: RedisSettings
    batch: BatchSettings
    flower: FlowerSettings
    metrics: MetricsSettings
    gateway: GatewaySettings
    health: HealthSettings

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first. The environment arrives as init values (environment_overrides):
        # only the IB_<SECTION>_<KEY> names of known keys, so other IB_* variables
        # (IB_DATA_DIR, IB_FLOWER_BASIC_AUTH, ...) are not mistaken for config.
        sources: list[PydanticBaseSettingsSource] = [init_settings]
        site = os.environ.get(CONFIG_FILE_ENV)
        if site:
            if not Path(site).is_file():
                raise FileNotFoundError(f"{CONFIG_FILE_ENV}={site}: no such file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=site))
        defaults = config_dir() / "fleet.yaml"
        sources.append(InitSettingsSource(settings_cls, init_kwargs=_defaults(defaults, defaults.stat().st_mtime)))
        return tuple(sources)


@lru_cache(maxsize=8)
def _defaults(path: Path, mtime: float) -> dict[str, Any]:
    """fleet.yaml parsed once per version of the file."""
    return yaml.safe_load(path.read_text()) or {}


def environment_overrides() -> dict[str, dict[str, Any]]:
    """``IB_<SECTION>_<KEY>`` for every key the sections have (lists and maps as JSON)."""
    found: dict[str, dict[str, Any]] = {}
    for section, field in FleetSettings.model_fields.items():
        model = typing.cast(type[BaseModel], field.annotation)
        for key, spec in model.model_fields.items():
            raw = os.environ.get(f"IB_{section}_{key}".upper())
            if raw is not None:
                container = typing.get_origin(spec.annotation) in (dict, list)
                found.setdefault(section, {})[key] = json.loads(raw) if container else raw
    return found


def fleet_config() -> FleetSettings:
    """The effective fleet policy (defaults < site file < environment), read anew each
    call so that a changed environment (a test, a reloaded site file) is seen."""
    return FleetSettings(**environment_overrides())
