"""The fleet end to end: real Redis, a real `ib worker --backend pytorch` process, SmolLM2."""

from __future__ import annotations

import json
import time

import pytest

from conftest import without_tokenizer
from core.errors import (
    ContextOverflowError,
    JobCancelledError,
    JobValidationError,
    UnknownBackendError,
    UnknownJobError,
    UnknownModelError,
)
from core.store import keys

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about cats.",
    "What is 7 plus 5?",
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_worker_heartbeat_shows_backend_and_hardware(client, pytorch_worker):
    (w,) = [w for w in client.workers().live() if w.worker_id == pytorch_worker.worker_id]
    assert w.backend == "pytorch" and w.models == [MODEL]
    assert w.hardware.kind == "cpu" and w.hardware.cpu_cores >= 1 and w.hardware.ram_gb > 0
    assert "ib.pytorch" in w.queues and f"ib.pytorch.{w.worker_id}" in w.queues


def test_greedy_through_the_fleet_equals_transformers_directly(client, pytorch_worker, reference):
    for text in PROMPTS:
        result = client.submit(model=MODEL, messages=chat(text), sampling={"max_tokens": 24}).result(timeout=300)
        expected = reference(chat(text), 24)
        assert result.token_ids == expected, text
        assert result.backend == "pytorch" and result.worker == pytorch_worker.worker_id
        assert result.usage.completion_tokens == len(expected)
        assert result.finish_reason == ("stop" if expected[-1] == 2 else "length")
        assert (
            result.timings.submitted <= result.timings.started <= result.timings.first_token <= result.timings.finished
        )
        # the decision path went through the tree to llama.cpp, then fell back to the live pytorch worker
        checks = [s.check for s in result.path]
        assert "GPU available?" in checks and result.path[-1].answer == "fallback pytorch"


def test_eight_concurrent_jobs_all_complete(client, pytorch_worker, reference):
    texts = [
        f"Give me a word that rhymes with {w}." for w in ["cat", "dog", "sun", "tree", "blue", "cake", "rain", "star"]
    ]
    handles = client.submit_many({"model": MODEL, "messages": chat(t), "sampling": {"max_tokens": 16}} for t in texts)
    results = [h.result(timeout=600) for h in handles]
    assert [r.id for r in results] == [h.id for h in handles]
    assert all(r.status == "completed" and r.usage.completion_tokens > 0 for r in results)
    # they shared batches: more than one job saw its first token at the same instant
    assert len({r.timings.first_token for r in results}) < len(results)
    # batched (left-padded) greedy decoding still gives each job its own answer
    for text, r in zip(texts, results):
        assert r.token_ids == reference(chat(text), 16), text


def test_a_short_job_is_answered_before_its_batch_ends(client, pytorch_worker):
    short, long = client.submit_many(
        [
            {"model": MODEL, "messages": chat("Say hi."), "sampling": {"max_tokens": 3}},
            {
                "model": MODEL,
                "messages": chat("Write a very long story about a dragon."),
                "sampling": {"max_tokens": 64},
            },
        ]
    )
    s, r = short.result(timeout=300), long.result(timeout=300)
    assert s.timings.first_token == r.timings.first_token  # the same batch
    assert s.usage.completion_tokens <= 3 and r.usage.completion_tokens == 64
    assert s.timings.finished < r.timings.finished - 1.0


def test_stop_string_ends_the_job_and_is_not_returned(client, pytorch_worker):
    r = client.submit(
        model=MODEL,
        messages=chat("Count from 1 to 20, separated by commas."),
        sampling={"max_tokens": 60, "stop": ["5"]},
    ).result(timeout=300)
    assert r.finish_reason == "stop"
    assert "5" not in r.text and r.text.strip()


def test_cancel_stops_a_long_generation_early(client, pytorch_worker):
    handle = client.submit(
        model=MODEL, messages=chat("Write a very long story about a dragon."), sampling={"max_tokens": 1500}
    )
    deadline = time.monotonic() + 120
    while handle.status() != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)
    t0 = time.monotonic()
    handle.cancel()
    result = handle.result(timeout=120)
    assert result.status == "cancelled" and result.finish_reason == "cancelled"
    assert 0 < result.usage.completion_tokens < 1500
    assert result.text  # the tokens so far are kept
    assert time.monotonic() - t0 < 10
    assert handle.status() == "cancelled"
    with pytest.raises(JobCancelledError) as info:
        handle.result(timeout=10, raise_on_cancel=True)
    assert info.value.details["result"]["token_ids"] == result.token_ids


def test_a_job_cancelled_while_queued_never_runs(client, pytorch_worker):
    client.cancel("cancelled-before-pickup")
    handle = client.submit(
        id="cancelled-before-pickup", model=MODEL, messages=chat("Hello"), sampling={"max_tokens": 50}
    )
    result = handle.result(timeout=60)
    assert result.status == "cancelled" and result.token_ids == [] and result.text == ""
    assert result.usage.prompt_tokens > 0 and result.timings.first_token is None


def test_unknown_model_is_refused_at_submit_and_nothing_is_enqueued(client, pytorch_worker):
    with pytest.raises(UnknownModelError, match="known models: smollm2-135m"):
        client.submit(id="never-enqueued-1", model="llama-9000", prompt="hi")
    assert not client.redis.exists(keys.job("never-enqueued-1"))


def test_bad_parameters_are_refused_at_submit(client, pytorch_worker):
    with pytest.raises(JobValidationError, match="sampling.temperature"):
        client.submit(id="never-enqueued-2", model=MODEL, prompt="hi", sampling={"temperature": 9})
    with pytest.raises(UnknownBackendError, match="known backends: pytorch, vllm, tgi, llamacpp, onnx"):
        client.submit(id="never-enqueued-3", model=MODEL, prompt="hi", backend="tensorrt")
    assert not client.redis.exists(keys.job("never-enqueued-2"), keys.job("never-enqueued-3"))


def test_context_overflow_is_a_typed_error_and_the_worker_keeps_serving(client, pytorch_worker):
    long_prompt = "lorem ipsum dolor sit amet " * 500  # ~2500 tokens > 2048
    without_tokenizer(client)  # the worker's own check, the last guard, is what is tested here
    handle = client.submit(model=MODEL, prompt=long_prompt, sampling={"max_tokens": 8})
    with pytest.raises(ContextOverflowError, match="context window is 2048 tokens"):
        handle.result(timeout=120)
    assert handle.status() == "failed"
    after = client.submit(model=MODEL, messages=chat("Say hello."), sampling={"max_tokens": 8}).result(timeout=120)
    assert after.status == "completed"


def test_result_of_an_unknown_job_id_is_a_clear_error(client):
    with pytest.raises(UnknownJobError, match="never submitted"):
        client.result("no-such-job", timeout=5)


def test_resubmitting_a_job_id_does_not_run_it_twice(client, pytorch_worker):
    job = {"id": "idempotent-1", "model": MODEL, "messages": chat("Say yes."), "sampling": {"max_tokens": 4}}
    first = client.submit(job).result(timeout=120)
    second = client.submit(job).result(timeout=120)
    assert first == second
    twice = client.submit_many([{**job, "id": "idempotent-2"}, {**job, "id": "idempotent-2"}])
    assert [h.result(timeout=120).id for h in twice] == ["idempotent-2", "idempotent-2"]
    assert client.record("idempotent-1")["attempts"] == "1"
    assert client.record("idempotent-2")["attempts"] == "1"


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}


def test_structured_outputs_logprobs_and_sampling_extensions_in_the_fleets_logits_processor(client, pytorch_worker):
    jobs = [
        {
            "model": MODEL,
            "messages": chat(f"Describe user number {i} as JSON."),
            "backend": "pytorch",
            "sampling": {"max_tokens": 80, "structured": {"kind": "json_schema", "json_schema": PERSON}},
        }
        for i in range(50)
    ]
    jobs[0]["sampling"]["logprobs"] = 2  # one row of the batch reads logprobs, the others not
    results = [h.result(timeout=300) for h in client.submit_many(jobs)]
    for r in results:
        value = json.loads(r.text)
        assert set(value) == set(PERSON["properties"]) and value["role"] in ("admin", "user", "guest"), r.text
    first = results[0]
    assert len(first.logprobs) == first.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in first.logprobs)
    assert results[1].logprobs is None
    plain = {"model": MODEL, "messages": chat("Say hi."), "backend": "pytorch", "sampling": {"max_tokens": 16}}
    base = client.submit(plain).result(timeout=120)
    floor = {**plain, "sampling": {"max_tokens": 16, "ignore_eos": True}}
    assert client.submit(floor).result(timeout=120).usage.completion_tokens == 16
    first_token = base.token_ids[0]
    moved = {**plain, "sampling": {"max_tokens": 4, "logit_bias": {str(first_token): -100}}}
    assert client.submit(moved).result(timeout=120).token_ids[0] != first_token
    penalized = {**plain, "sampling": {"max_tokens": 16, "repetition_penalty": 1.8, "frequency_penalty": 1.5}}
    assert client.submit(penalized).result(timeout=120).token_ids != base.token_ids
