"""Fleet policy with its precedence, through pydantic-settings.

    config/fleet.yaml (defaults, in the package)
      < the file named by IB_CONFIG_FILE (a partial fleet.yaml: only what a site changes)
        < environment variables IB_<SECTION>_<KEY> (e.g. IB_HEARTBEAT_TTL_S=30)

Each section's fields and types come from the defaults file, so an override is checked
and converted like the default it replaces ("30" becomes 30, "off" becomes False), and a
misspelt section or key in the site file is refused with its name instead of ignored.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, create_model
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

CONFIG_FILE_ENV = "IB_CONFIG_FILE"


def _field_type(value: Any) -> Any:
    return Any if value is None else type(value)


@lru_cache(maxsize=8)
def _defaults(defaults_path: Path, mtime: float) -> dict[str, dict[str, Any]]:
    return yaml.safe_load(defaults_path.read_text()) or {}


@lru_cache(maxsize=8)
def settings_class(defaults_path: Path, mtime: float) -> type[BaseSettings]:
    """A settings model built from the defaults file (cached per file version)."""
    defaults = _defaults(defaults_path, mtime)
    forbid = ConfigDict(extra="forbid")
    sections = {
        name: create_model(f"{name}_settings", __config__=forbid,
                           **{k: (_field_type(v), v) for k, v in (values or {}).items()})  # fmt: skip
        for name, values in defaults.items()
    }

    class FleetSettings(BaseSettings):
        model_config = SettingsConfigDict(extra="forbid")

        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):  # noqa: ANN001
            # The environment arrives as init values (environment_overrides): only the
            # IB_<SECTION>_<KEY> names of known keys, so other IB_* variables (IB_DATA_DIR,
            # IB_FLOWER_BASIC_AUTH, ...) are not mistaken for config.
            sources: list[PydanticBaseSettingsSource] = [init_settings]
            site = os.environ.get(CONFIG_FILE_ENV)
            if site:
                if not Path(site).is_file():
                    raise FileNotFoundError(f"{CONFIG_FILE_ENV}={site}: no such file")
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=site))
            return tuple(sources)

    fields = {name: (model, model()) for name, model in sections.items()}
    return create_model("FleetSettings", __base__=FleetSettings, **fields)


def environment_overrides(defaults: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``IB_<SECTION>_<KEY>`` for every key the defaults have (lists and maps as JSON)."""
    found: dict[str, dict[str, Any]] = {}
    for section, values in defaults.items():
        for key, default in (values or {}).items():
            raw = os.environ.get(f"IB_{section}_{key}".upper())
            if raw is not None:
                found.setdefault(section, {})[key] = json.loads(raw) if isinstance(default, (dict, list)) else raw
    return found


def load(defaults_path: Path) -> dict[str, dict[str, Any]]:
    """The effective fleet config as plain sections (defaults < site file < environment)."""
    mtime = defaults_path.stat().st_mtime
    cls = settings_class(defaults_path, mtime)
    model: BaseModel = cls(**environment_overrides(_defaults(defaults_path, mtime)))
    return {name: getattr(model, name).model_dump() for name in cls.model_fields}
