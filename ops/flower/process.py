"""Flower, the Celery monitoring UI, run against the fleet's broker with basic auth.

Credentials come from the environment (``IB_FLOWER_BASIC_AUTH=user:password``, or Flower's
own ``FLOWER_BASIC_AUTH``) and reach Flower through its environment, never its command line
(which `ps` shows). Without them `ib up` makes a random password and prints it once;
`ib flower` refuses unless ``--no-auth`` is given on purpose.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from core import settings
from ops.subprocesses import spawn_logged, terminate, wait_http

AUTH_ENV = "IB_FLOWER_BASIC_AUTH"


def configured_auth() -> str | None:
    auth = os.environ.get(AUTH_ENV) or os.environ.get("FLOWER_BASIC_AUTH")
    if auth and ":" not in auth:
        raise ValueError(f"{AUTH_ENV} must be user:password")
    return auth


def generated_auth(user: str = "admin") -> str:
    return f"{user}:{secrets.token_urlsafe(12)}"


class FlowerProcess:
    """`celery flower` as a subprocess, with its log in the data directory."""

    def __init__(
        self, redis_url: str, port: int, auth: str | None, address: str = "127.0.0.1", log_dir: Path | None = None
    ) -> None:
        """``address``: loopback unless asked (a container publishing it passes 0.0.0.0)."""
        self.redis_url, self.port, self.auth, self.address = redis_url, port, auth, address
        self.log_path = (log_dir or settings.data_dir() / "logs") / f"flower-{port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery",
            "--app=ops.flower.app",
            "flower",
            f"--port={self.port}",
            f"--address={self.address}",
            "--purge_offline_workers=300",  # a worker gone five minutes leaves the dashboard
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("FLOWER_BASIC_AUTH", AUTH_ENV)}
        env["REDIS_URL"] = self.redis_url
        if self.auth:
            env["FLOWER_BASIC_AUTH"] = self.auth
        return env

    def start(self, timeout: float = 60) -> FlowerProcess:
        self.proc = spawn_logged(
            self.command(), self.log_path, env=self.environment(), cwd=settings.REPO_ROOT, start_new_session=True
        )
        wait_http(self.proc, f"{self.url}/healthcheck", "flower", self.log_path, timeout)  # /healthcheck needs no auth
        return self

    def stop(self) -> None:
        terminate(self.proc, timeout=15)
