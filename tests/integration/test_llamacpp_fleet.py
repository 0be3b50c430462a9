"""The llama.cpp worker as a real Celery worker process on real Redis: the CPU branch of
the tree with an ONNX worker beside it, jobs in flight together, prefix reuse reported in
usage, typed errors, and refusing a bad GGUF at start."""

from __future__ import annotations

import pytest

from conftest import ib, start_worker, start_worker_with_artifact, without_tokenizer
from core.errors import ContextOverflowError

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
SYSTEM = "You answer questions about the Rhine river for a travel agency. " + " ".join(
    f"Fact {i}: the Rhine flows through {country} and boats carry {cargo} on it."
    for i, (country, cargo) in enumerate(
        [
            ("Switzerland", "grain"),
            ("Liechtenstein", "wine"),
            ("Austria", "coal"),
            ("Germany", "steel"),
            ("France", "cars"),
            ("the Netherlands", "tulips"),
        ]
        * 3
    )
)


def chat(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def cpu_fleet(redis_url, onnx_dir):
    """One llama.cpp and one ONNX worker, one thread each (two cores, no oversubscription)."""
    llama = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"])
    onnx = start_worker(redis_url, "onnx", extra_args=["--threads=1"])
    yield {"llamacpp": llama, "onnx": onnx}
    llama.stop()
    onnx.stop()


def test_the_cpu_branch_sends_tight_latency_to_onnx_and_the_rest_to_llamacpp(client, cpu_fleet):
    fast = client.submit(model=MODEL, messages=chat("Hi"), sampling={"max_tokens": 4}, slo={"latency_target_ms": 50})
    loose = client.submit(model=MODEL, messages=chat("Hi"), sampling={"max_tokens": 4}, slo={"latency_target_ms": 500})
    assert fast.selection.tree_choice == "onnx" and fast.backend == "onnx"
    assert loose.selection.tree_choice == "llamacpp" and loose.backend == "llamacpp"
    checks = [step.check for step in loose.selection.path]
    assert checks[checks.index("GPU available?") + 1] == "latency target < 100 ms?"
    assert fast.result(timeout=60).worker == cpu_fleet["onnx"].worker_id
    r = loose.result(timeout=60)
    assert r.worker == cpu_fleet["llamacpp"].worker_id and r.status == "completed" and r.text


def test_jobs_decode_together_and_each_gets_its_own_result(client, cpu_fleet):
    prompts = ["Name a river in Germany.", "What is 2 plus 2?", "Say hello in French.", "Name a fruit that is red."]
    handles = client.submit_many(
        {"model": MODEL, "messages": chat(p), "sampling": {"max_tokens": 24}, "backend": "llamacpp"} for p in prompts
    )
    results = [h.result(timeout=120) for h in handles]
    assert all(r.worker == cpu_fleet["llamacpp"].worker_id and r.usage.completion_tokens > 0 for r in results)
    # continuous batching: the jobs' decoding overlapped in time
    spans = sorted((r.timings.first_token, r.timings.finished) for r in results)
    assert any(b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert "4" in results[1].text and "Bonjour" in results[2].text  # each job got its own answer


def test_a_repeated_system_prompt_is_reported_as_cached(client, cpu_fleet):
    first = client.submit(
        model=MODEL,
        messages=chat("Which countries does it cross?", SYSTEM),
        sampling={"max_tokens": 8},
        backend="llamacpp",
    ).result(timeout=120)
    second = client.submit(
        model=MODEL, messages=chat("What do boats carry?", SYSTEM), sampling={"max_tokens": 8}, backend="llamacpp"
    ).result(timeout=120)
    assert first.usage.prompt_tokens > 300 and first.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 100
    assert second.usage.cached_tokens < second.usage.prompt_tokens


def test_context_overflow_is_typed_and_the_worker_keeps_serving(client, cpu_fleet):
    without_tokenizer(client)  # the worker's own check, the last guard, is what is tested here
    handle = client.submit(
        model=MODEL, prompt="lorem ipsum dolor sit amet " * 500, sampling={"max_tokens": 8}, backend="llamacpp"
    )
    with pytest.raises(ContextOverflowError, match="context window is 2048"):
        handle.result(timeout=60)
    ok = client.submit(model=MODEL, messages=chat("Say hello."), sampling={"max_tokens": 4}, backend="llamacpp")
    assert ok.result(timeout=60).status == "completed"


@pytest.mark.parametrize("kind", ["missing", "not-gguf"])
def test_a_worker_with_a_bad_gguf_refuses_to_start(tmp_path, redis_url, kind):
    path = tmp_path / "model.gguf"
    if kind == "not-gguf":
        path.write_text("this is a text file, not a model\n")
    out = start_worker_with_artifact(tmp_path, redis_url, "llamacpp", "gguf", path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "worker not started" in out.stdout
    assert ("not found" if kind == "missing" else "is not a GGUF file") in out.stdout


def test_streaming_sends_the_answer_as_it_is_generated(client, cpu_fleet):
    handle = client.submit(
        model=MODEL, messages=chat("Name four seasons."), sampling={"max_tokens": 32}, backend="llamacpp", stream=True
    )
    deltas = list(handle.stream(timeout=120))
    result = handle.result(timeout=60)
    assert len(deltas) > 3 and "".join(deltas) == result.text
    plain = client.submit(model=MODEL, messages=chat("Hi"), sampling={"max_tokens": 2}, backend="llamacpp")
    with pytest.raises(ValueError, match="stream=True"):
        plain.stream()
    assert plain.result(timeout=60).status == "completed"


def test_ib_submit_stream_prints_the_answer_as_it_comes(client, redis_url, cpu_fleet):
    out = ib(
        "submit",
        "--backend",
        "llamacpp",
        "-m",
        "Name four seasons.",
        "--max-tokens",
        "24",
        "--stream",
        "--no-wait",
        redis_url=redis_url,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, _, streamed = out.stdout.partition("\n")
    assert first.startswith("job ") and "llamacpp" in first
    job_id = first.split()[1]
    text = client.result(job_id, timeout=60).text
    assert text and streamed.rstrip("\n") == text
