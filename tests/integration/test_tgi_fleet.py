"""The TGI backend against a real OpenAI-compatible server started here on loopback
(llama-cpp-python's server with the SmolLM2 GGUF, standing in for a TGI container):
results and usage, jobs in flight together, a server that goes away mid-job, and a
request the server refuses."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ARTIFACTS, start_worker
from dispatcher.jobs import ContextOverflowError, EngineError, JobError

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m llama_cpp.server` on a fixed loopback port, restartable."""

    def __init__(self, gguf: str, port: int) -> None:
        self.gguf, self.port = gguf, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        log = (ARTIFACTS / "logs" / f"llama-server-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", self.gguf, "--model_alias", MODEL, "--host", "127.0.0.1",
             "--port", str(self.port), "--n_ctx", "1024", "--n_threads", "1", "--interrupt_requests", "False"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError(f"llama_cpp.server on {self.port} did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(registry):
    (ARTIFACTS / "logs").mkdir(parents=True, exist_ok=True)
    s = Server(str(registry.get(MODEL).artifact_path("gguf")), free_port()).start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def tgi_worker(redis_url, server):
    worker = start_worker(redis_url, "tgi", extra_args=[f"--endpoint={server.url}"])
    yield worker
    worker.stop()


def tgi_job(text: str, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "sampling": {"max_tokens": max_tokens}, "backend": "tgi"}


def test_results_and_usage_come_from_the_server(client, tgi_worker):
    r = client.submit(tgi_job("What is the capital of France?", 32)).result(timeout=120)
    assert r.backend == "tgi" and r.worker == tgi_worker.worker_id and r.status == "completed"
    assert "Paris" in r.text and r.finish_reason == "stop"
    # llama.cpp's server sends no usage in its stream: completion tokens are counted from it
    assert 0 < r.usage.completion_tokens <= 32
    cut = client.submit(tgi_job("Write a long story about a whale.", 5)).result(timeout=120)
    assert cut.finish_reason == "length" and cut.usage.completion_tokens == 5
    stopped = client.submit({**tgi_job("Count from 1 to 10 with commas.", 60), "sampling": {"max_tokens": 60, "stop": ["5"]}})
    s = stopped.result(timeout=120)
    assert s.finish_reason == "stop" and "5" not in s.text and "4" in s.text


def test_many_jobs_in_flight_all_complete(client, tgi_worker):
    handles = client.submit_many(tgi_job(f"Name an animal that starts with {c}.", 12) for c in "ABCDEF")
    results = [h.result(timeout=300) for h in handles]
    assert all(r.status == "completed" and r.text for r in results)
    overlapping = sorted((r.timings.started, r.timings.finished) for r in results)
    assert any(b < a_end for (_, a_end), (b, _) in zip(overlapping, overlapping[1:]))  # all sent at once


def test_a_server_that_goes_away_mid_job_is_retried_and_nothing_is_lost(client, tgi_worker, server):
    handle = client.submit(tgi_job("Write a long story about a lighthouse.", 300))
    deadline = time.monotonic() + 60
    while client.status(handle.id) != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    server.kill()  # mid-generation
    time.sleep(1.0)
    server.start()
    r = handle.result(timeout=300)
    assert r.status == "completed" and r.usage.completion_tokens > 0 and r.attempt == 1  # retried inside the worker


def test_a_job_the_server_cannot_run_fails_typed_at_once_and_the_worker_keeps_serving(client, tgi_worker):
    too_long = client.submit(tgi_job("lorem ipsum dolor sit amet " * 400, 8))  # > the server's 1024-token context
    t0 = time.monotonic()
    with pytest.raises(JobError, match="127.0.0.1") as err:  # names the server; not retried
        too_long.result(timeout=120)
    assert isinstance(err.value, (EngineError, ContextOverflowError)) and time.monotonic() - t0 < 30
    assert client.submit(tgi_job("Say hello.", 4)).result(timeout=120).status == "completed"
