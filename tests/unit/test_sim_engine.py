"""The capacity benchmarks' simulated engine (bench.sim_engine) keeps the Engine contract
the worker relies on: max_tokens honoured, streamed deltas that add up to the text, a
continuous batch no wider than its capacity, cancels and time limits, and close()
failing what it still holds rather than leaving callers waiting."""

from __future__ import annotations

import threading
import time

import pytest

from bench.sim_engine import SimulatedEngine
from core.backends import BackendSpec
from core.errors import EngineError, JobTimeoutError
from core.jobs import GenerationJob, SamplingParams
from core.registry import ModelSpec

SPEC = ModelSpec(name="m", display_name="m", family="llama", hf_native=True, context_length=4096)
CONFIG = BackendSpec(display_name="sim", formats=["gguf"], gpu="optional", batching="continuous", kv_cache="paged")


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setenv("IB_SIM_PREFILL_S", "0.01")
    monkeypatch.setenv("IB_SIM_TOKEN_S", "0.005")
    monkeypatch.setenv("IB_SIM_CAPACITY", "4")
    cancelled: set[str] = set()
    e = SimulatedEngine(SPEC, CONFIG, threads=1, cancel_source=lambda ids: cancelled.intersection(ids))
    e.cancelled_ids = cancelled  # type: ignore[attr-defined]
    e.load()
    yield e
    e.close()


def job(tokens: int | None = 6, **kw: object) -> GenerationJob:
    sampling = {} if tokens is None else {"max_tokens": tokens}
    messages = [{"role": "user", "content": "Hello there, sea."}]
    return GenerationJob(model="m", messages=messages, sampling=sampling, **kw)


def test_a_job_gets_its_max_tokens_and_its_stream_adds_up_to_the_text(engine):
    deltas: list[str] = []
    out = engine.generate(job(6), timeout=10, on_text=deltas.append)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert "".join(deltas) == out.text and out.text.startswith(" the sea")
    assert out.prompt_tokens == len(b"Hello there, sea.") // 4 and out.first_token_at <= out.finished_at
    assert len(engine.generate(job(None), timeout=10).token_ids) == SamplingParams().max_tokens  # the default
    assert engine.in_flight == 0


def test_the_batch_never_holds_more_than_its_capacity(engine):
    widest = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal widest
        while not stop.is_set():
            widest = max(widest, engine.in_flight)
            time.sleep(0.001)

    outs: list[object] = []
    threads = [threading.Thread(target=lambda: outs.append(engine.generate(job(20), timeout=30))) for _ in range(10)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert len(outs) == 10 and widest == 10  # every job was in flight (queued in the engine) at once...
    # ...but decoded four at a time: three rounds of 20 steps, not one
    assert engine.steps >= 3 * 20 and time.monotonic() - t0 >= 3 * 20 * 0.005


def test_a_cancelled_job_ends_at_the_next_step(engine):
    one = job(4000)
    engine.cancelled_ids.add(one.id)
    out = engine.generate(one, timeout=10)
    assert out.finish_reason == "cancelled" and len(out.token_ids) < 10


def test_a_time_limit_raises_and_close_fails_what_is_left(engine):
    with pytest.raises(JobTimeoutError):
        engine.generate(job(4000), timeout=0.1)
    held = engine.start(job(4000))
    engine.close()
    with pytest.raises(EngineError):
        held.future.result(timeout=5)
