"""Run worker and gateway processes on this machine: for `ib demo`, `ib up`, the tests and
the benchmarks.

Each worker is a real `ib worker` subprocess with its own log file; ``wait_ready`` polls
the fleet's heartbeats, and a worker that dies during start-up is reported with the tail
of its log instead of a silent time-out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from core import connection, settings
from core.fleet import read_fleet
from ops.subprocesses import free_port, spawn_logged, terminate, wait_http


class WorkerProcess:
    # what `python -m` runs with the `ib worker` arguments (a benchmark's own entry point,
    # bench.sim_worker, injects a simulated engine)
    module = "ops.cli"

    def __init__(
        self,
        backend: str,
        redis_url: str,
        model: str = "smollm2-135m",
        worker_id: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.backend = backend
        self.model = model
        self.redis_url = redis_url
        self.worker_id = worker_id or f"{backend}-{uuid.uuid4().hex[:8]}"
        self.args = [
            sys.executable,
            "-m",
            self.module,
            "worker",
            f"--backend={backend}",
            f"--model={model}",
            f"--worker-id={self.worker_id}",
            *(extra_args or []),
        ]
        self.env = {**os.environ, **(env or {}), "REDIS_URL": redis_url}
        log_dir = log_dir or settings.data_dir() / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.worker_id}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        # Its own process group, so kill() takes the engine's helper processes with it
        # (vLLM's EngineCore), as a crashed container would.
        self.proc = spawn_logged(self.args, self.log_path, env=self.env, cwd=settings.REPO_ROOT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        """The worker's process id (its engine's helpers are its children)."""
        if self.proc is None:
            raise RuntimeError(f"worker {self.worker_id} is not started")
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 300, healthy: bool = True) -> None:
        """Until the worker heartbeats as ready (and healthy, unless ``healthy=False``)."""
        client = redis.Redis.from_url(connection.with_password(self.redis_url))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.worker_id} exited with {self.proc.returncode}:\n{self.log_tail()}")
            fleet = read_fleet(client)
            workers = fleet.live() if healthy else [w for w in fleet.workers if w.status == "ready"]
            if any(w.worker_id == self.worker_id for w in workers):
                return
            time.sleep(0.2)
        raise TimeoutError(f"worker {self.worker_id} not ready after {timeout} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no warm shutdown, no goodbye heartbeat (a crash, as far as the fleet knows)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM: Celery's warm shutdown finishes running jobs, then the worker leaves."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayProcess:
    """`ib serve` as a subprocess on loopback (the tests, the demo, the benchmark, `ib up --serve`)."""

    def __init__(
        self,
        redis_url: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.port, self.host = port or free_port(), host
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {}), "REDIS_URL": redis_url}
        self.log_path = (log_dir or settings.data_dir() / "logs") / f"gateway-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> GatewayProcess:
        self.proc = spawn_logged(
            [sys.executable, "-m", "ops.cli", "serve", "--host", self.host, "--port", str(self.port)],
            self.log_path,
            env=self.env,
            cwd=settings.REPO_ROOT,
        )
        wait_http(self.proc, f"{self.url}/health", "ib serve", self.log_path, timeout)
        return self

    def stop(self, timeout: float = 30) -> None:
        terminate(self.proc, timeout)  # uvicorn's graceful shutdown lets open requests finish

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
