"""Engine base: context checks and the time limit, with a scheduler that never answers."""

from __future__ import annotations

import pytest

from core.backends import BackendSpec
from core.errors import ContextOverflowError, JobTimeoutError
from core.jobs import GenerationJob
from core.registry import ModelSpec
from workers.engines.base import Engine
from workers.engines.request import EngineRequest

SPEC = ModelSpec(name="m", display_name="m", family="llama", hf_native=True, context_length=32)
CONFIG = BackendSpec(display_name="test", formats=["hf"], gpu="optional", batching="static", kv_cache="none")


class SilentEngine(Engine[BackendSpec]):
    """Accepts requests and never finishes them: what a stuck engine looks like."""

    backend = "test"

    def load(self) -> None:
        self.requests: list[EngineRequest] = []

    def encode(self, job: GenerationJob) -> list[int]:
        return list(range(len(job.prompt or "")))

    def submit(self, request: EngineRequest) -> None:
        self.requests.append(request)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_time_limit_raises_timeout_and_marks_the_request_aborted():
    engine = SilentEngine(SPEC, CONFIG, threads=1)
    engine.load()
    with pytest.raises(JobTimeoutError):
        engine.generate(GenerationJob(model="m", prompt="abc", sampling={"max_tokens": 4}), timeout=0.05)
    assert engine.requests[0].aborted
    assert engine.in_flight == 0


def test_context_overflow_counts_prompt_plus_max_tokens():
    engine = SilentEngine(SPEC, CONFIG, threads=1)
    engine.load()
    with pytest.raises(ContextOverflowError) as info:
        engine.generate(GenerationJob(model="m", prompt="x" * 30, sampling={"max_tokens": 3}))
    assert info.value.details == {"context_length": 32, "prompt_tokens": 30, "max_tokens": 3}
    assert not engine.requests  # refused before it reached the scheduler


def test_deliver_drops_eos_and_cuts_at_the_first_stop_string():
    engine = SilentEngine(SPEC, CONFIG, threads=1)
    engine.eos_ids = [25]
    job = GenerationJob(model="m", prompt="x", sampling={"stop": ["d", "c"]})
    req = EngineRequest(job_id=job.id, prompt_ids=[1, 2], sampling=job.sampling, tokens=[0, 1, 2, 3, 25])
    req.finish_reason = "stop"
    engine.deliver(req)
    out = req.future.result(timeout=1)
    assert out.text == "ab" and out.token_ids == [0, 1, 2, 3, 25] and out.prompt_tokens == 2
