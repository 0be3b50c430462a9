"""The job contract: validation and JSON round trips of results and typed errors."""

from __future__ import annotations

import json

import pytest

from core.errors import ERROR_TYPES, ContextOverflowError, JobError, JobValidationError, UnknownModelError
from core.jobs import GenerationJob, parse_job


def test_minimal_job_gets_defaults():
    job = parse_job({"model": "m", "prompt": "hi"})
    assert job.sampling.max_tokens == 128 and job.sampling.greedy
    assert job.priority.value == "normal"
    assert len(job.id) == 32


@pytest.mark.parametrize(
    "data, field",
    [
        ({"model": "m"}, "exactly one of 'prompt' or 'messages'"),
        ({"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ({"model": "m", "messages": []}, "must not be empty"),
        ({"model": "m", "prompt": "a", "sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
        ({"model": "m", "prompt": "a", "sampling": {"temperature": 3}}, "sampling.temperature"),
        ({"model": "m", "prompt": "a", "sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"model": "m", "prompt": "a", "sampling": {"stop": [""]}}, "stop strings must not be empty"),
        ({"model": "m", "prompt": "a", "slo": {"latency_target_ms": -1}}, "slo.latency_target_ms"),
        ({"model": "m", "prompt": "a", "backend": "tensorrt"}, "backend"),
        ({"model": "m", "prompt": "a", "temperature": 0.5}, "temperature"),  # unknown top-level field
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_invalid_jobs_raise_a_typed_error_naming_the_field(data, field):
    with pytest.raises(JobValidationError) as info:
        parse_job(data)
    assert field in str(info.value)
    assert info.value.details["errors"]


def test_stop_accepts_a_single_string():
    assert parse_job({"model": "m", "prompt": "a", "sampling": {"stop": "\n"}}).sampling.stop == ["\n"]


def test_job_round_trips_through_json():
    job = parse_job({"model": "m", "messages": [{"role": "user", "content": "x"}], "sampling": {"seed": 3}})
    again = GenerationJob.model_validate(json.loads(json.dumps(job.model_dump(mode="json"))))
    assert again == job


@pytest.mark.parametrize("cls", list(ERROR_TYPES.values()))
def test_every_error_type_round_trips_through_json(cls):
    err = cls("something went wrong", {"n": 1})
    data = json.loads(json.dumps(err.to_dict()))  # as the job record stores it
    assert data["code"] == cls.code
    back = JobError.from_dict(data)
    assert type(back) is cls and back.message == err.message and back.details == {"n": 1}


def test_errors_rebuild_from_their_args_as_celery_does():
    # Celery's JSON exception transport stores exc.args and calls cls(*args) on the client.
    err = ContextOverflowError("too long", {"context_length": 2048})
    rebuilt = type(err)(*json.loads(json.dumps(err.args)))
    assert rebuilt.details == {"context_length": 2048} and str(rebuilt) == "too long"


def test_typed_errors_are_also_standard_exceptions():
    assert issubclass(UnknownModelError, LookupError)
    assert issubclass(JobValidationError, ValueError)
