"""The TGI backend against a real OpenAI-compatible server started here on loopback
(llama-cpp-python's server with the SmolLM2 GGUF, standing in for a TGI container):
results and usage, jobs in flight together, a server that goes away mid-job, and a
request the server refuses."""

from __future__ import annotations

import json
import time

import pytest

from conftest import ARTIFACTS, start_worker
from core.errors import ContextOverflowError, EngineError, UnsupportedByBackendError
from ops.local.peers import LlamaCppServer

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(registry):
    s = LlamaCppServer(str(registry.get(MODEL).artifact_path("gguf")), MODEL, log_dir=ARTIFACTS / "logs").start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def tgi_worker(redis_url, server):
    worker = start_worker(redis_url, "tgi", extra_args=[f"--endpoint={server.url}"])
    yield worker
    worker.stop()


def tgi_job(text: str, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "sampling": {"max_tokens": max_tokens},
        "backend": "tgi",
    }


def test_results_and_usage_come_from_the_server(client, tgi_worker):
    r = client.submit(tgi_job("What is the capital of France?", 32)).result(timeout=120)
    assert r.backend == "tgi" and r.worker == tgi_worker.worker_id and r.status == "completed"
    assert "Paris" in r.text and r.finish_reason == "stop"
    # llama.cpp's server sends no usage in its stream: completion tokens are counted from it
    assert 0 < r.usage.completion_tokens <= 32
    cut = client.submit(tgi_job("Write a long story about a whale.", 5)).result(timeout=120)
    assert cut.finish_reason == "length" and cut.usage.completion_tokens == 5
    stopped = client.submit(
        {**tgi_job("Count from 1 to 10 with commas.", 60), "sampling": {"max_tokens": 60, "stop": ["5"]}}
    )
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
    # Fits the model's 2048-token window (the submit-time check lets it through) but not the
    # server's 1024-token context. llama-cpp-python's server reports that inside the stream,
    # after answering 200: the worker fails the job at once, naming the server.
    too_long = client.submit(tgi_job("lorem ipsum dolor sit amet " * 110, 8))  # about 1100 tokens
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="127.0.0.1") as err:  # not retried
        too_long.result(timeout=120)
    assert "ended the stream without finishing the job" in str(err.value) and time.monotonic() - t0 < 30
    assert client.submit(tgi_job("Say hello.", 4)).result(timeout=120).status == "completed"


def test_streaming_passes_the_servers_deltas_through(client, tgi_worker):
    handle = client.submit({**tgi_job("Name four seasons.", 32), "stream": True})
    deltas = list(handle.stream(timeout=120))
    result = handle.result(timeout=60)
    assert len(deltas) > 3 and "".join(deltas) == result.text


@pytest.fixture(scope="module")
def refusing_worker(redis_url, hf_dir):
    """A TGI worker in front of vLLM's own OpenAI server (512-token context), which refuses
    an over-long request with HTTP 400 before streaming, as TGI itself does (422)."""
    from ops.local.peers import VllmOpenAIServer

    server = VllmOpenAIServer(hf_dir, MODEL, max_model_len=512, log_dir=ARTIFACTS / "logs").start()
    worker = start_worker(redis_url, "tgi", extra_args=[f"--endpoint={server.url}"])
    yield worker
    worker.stop()
    server.kill()


@pytest.mark.timeout(1500)  # its fixture starts vLLM's OpenAI server: up to 900 s on a loaded machine
def test_a_servers_4xx_refusal_is_a_typed_error_at_once_not_a_retry(client, tgi_worker, refusing_worker):
    tgi_worker.stop()  # jobs for the tgi backend go to the worker in front of vLLM's server
    job = {**tgi_job("lorem ipsum dolor sit amet " * 60, 8)}  # about 600 tokens: over 512, under 2048
    t0 = time.monotonic()
    with pytest.raises(ContextOverflowError, match=r"refused the job \(HTTP 400\)") as err:
        client.submit(job).result(timeout=120)
    assert err.value.details["status_code"] == 400 and "maximum context length" in str(err.value)
    assert time.monotonic() - t0 < 30  # the 4xx branch: no retries
    ok = client.submit(tgi_job("Say hello.", 4)).result(timeout=120)
    assert ok.status == "completed" and ok.worker == refusing_worker.worker_id


def test_openais_own_fields_pass_through_to_the_server(client, tgi_worker):
    job = tgi_job('Reply with a JSON object whose key "city" names a city in France.', 120)
    job["sampling"] |= {"structured": {"kind": "json_object"}, "presence_penalty": 0.5, "logit_bias": {"30": -5}}
    r = client.submit(job).result(timeout=120)
    assert r.finish_reason == "stop" and isinstance(json.loads(r.text), dict), r.text
    ids = {"model": MODEL, "prompt_ids": [504, 3575, 282], "sampling": {"max_tokens": 4}, "backend": "tgi"}
    assert client.submit(ids).result(timeout=120).usage.prompt_tokens == 3  # a prompt given as token ids


def test_what_the_server_may_not_know_is_refused_before_it_is_sent(client, tgi_worker):
    job = tgi_job("hi", 8)
    job["sampling"]["min_p"] = 0.1  # vLLM's extension: not sent to a server that may not know it
    with pytest.raises(UnsupportedByBackendError, match="tgi does not serve min_p"):
        client.submit(job)
