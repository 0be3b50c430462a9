"""Engine base: context checks and the time limit, with a scheduler that never answers."""

from __future__ import annotations

import pytest

from dispatcher.jobs import ContextOverflowError, GenerationJob, JobTimeoutError
from dispatcher.registry import ModelSpec
from workers.engines.base import Engine, EngineRequest

SPEC = ModelSpec(name="m", display_name="m", family="llama", hf_native=True, context_length=32)


class SilentEngine(Engine):
    """Accepts requests and never finishes them: what a stuck engine looks like."""

    backend = "test"

    def load(self) -> None:
        self.requests: list[EngineRequest] = []

    def encode(self, job: GenerationJob) -> list[int]:
        return list(range(len(job.prompt or "")))

    def submit(self, request: EngineRequest) -> None:
        self.requests.append(request)


def test_time_limit_raises_timeout_and_marks_the_request_aborted():
    engine = SilentEngine(SPEC, {}, threads=1)
    engine.load()
    with pytest.raises(JobTimeoutError):
        engine.generate(GenerationJob(model="m", prompt="abc", sampling={"max_tokens": 4}), timeout=0.05)
    assert engine.requests[0].aborted
    assert engine.in_flight == 0


def test_context_overflow_counts_prompt_plus_max_tokens():
    engine = SilentEngine(SPEC, {}, threads=1)
    engine.load()
    with pytest.raises(ContextOverflowError) as info:
        engine.generate(GenerationJob(model="m", prompt="x" * 30, sampling={"max_tokens": 3}))
    assert info.value.details == {"context_length": 32, "prompt_tokens": 30, "max_tokens": 3}
    assert not engine.requests  # refused before it reached the scheduler
