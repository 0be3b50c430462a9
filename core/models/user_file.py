"""The user's own registry file, layered over config/models.yaml like a site config
over fleet.yaml: ``IB_MODELS_FILE``, else ``models.yaml`` in the data directory.

``ib models add`` writes entries here (never into the repository's config), ``ib models
remove`` deletes them; an entry here replaces a bundled one of the same name. Writes go
to a temporary file renamed over the old one, so a reader never sees half a file.
"""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from core import settings

MODELS_FILE_ENV = "IB_MODELS_FILE"
HEADER = "# Models added with `ib models add` (layered over config/models.yaml). Edit with `ib models`.\n"


def path() -> Path:
    return _path(os.environ.get(MODELS_FILE_ENV), settings.data_dir())


@lru_cache(maxsize=16)
def _path(explicit: str | None, data_dir: Path) -> Path:
    """Keyed by what it is built from: LiveRegistry stats the file on every look-up (the
    submit path), and building the Path each time cost more than the stat."""
    return Path(explicit).expanduser() if explicit else data_dir / "models.yaml"


_cache: dict[Path, tuple[int, dict[str, Any]]] = {}


def stamp() -> tuple[str, int] | None:
    """What changes when the file does (its path and mtime); None without a file."""
    file = path()
    try:
        return str(file), file.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def read() -> dict[str, Any]:
    """Name → entry, as written (re-read when the file changes; {} without a file)."""
    now = stamp()
    if now is None:
        return {}
    file, mtime = Path(now[0]), now[1]
    cached = _cache.get(file)
    if cached is None or cached[0] != mtime:
        data = yaml.safe_load(file.read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("models") or {}, dict):
            raise ValueError(f"{file}: expected a mapping with a 'models' section")
        cached = _cache[file] = (mtime, dict(data.get("models") or {}))
    return dict(cached[1])


def write(models: dict[str, Any]) -> Path:
    """Replace the file's entries with ``models`` (atomically)."""
    file = path()
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(HEADER)
        yaml.safe_dump({"models": models}, fh, sort_keys=False, allow_unicode=True)
    os.replace(tmp, file)
    _cache.pop(file, None)
    return file
