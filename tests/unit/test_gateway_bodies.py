"""The gateway's pure parts: OpenAI bodies → fleet jobs, API keys, JSON depth."""

from __future__ import annotations

import pytest

from core.jobs import parse_job
from gateway import auth
from gateway.bodies import ChatCompletionRequest, CompletionRequest, parse
from gateway.errors import APIError
from gateway.limits import depth

ASK = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> dict:
    return parse(ChatCompletionRequest, {"model": "smollm2-135m", "messages": ASK, **fields}).to_job(512)


def test_a_chat_body_becomes_a_valid_fleet_job_with_openais_defaults():
    job = chat()
    assert job["sampling"] == {"max_tokens": 512, "temperature": 1.0, "top_p": 1.0}  # OpenAI's, not greedy
    assert job["priority"] == "interactive" and job["stream"] is False
    parsed = parse_job({**job, "id": "j1"})
    assert parsed.messages[0].content == "Hi" and parsed.sampling.max_tokens == 512


def test_max_completion_tokens_wins_and_sampling_and_routing_fields_carry_over():
    job = chat(
        max_tokens=5,
        max_completion_tokens=7,
        temperature=0,
        top_p=0.5,
        stop="\n",
        seed=3,
        latency_target_ms=50,
        backend="onnx",
        priority="batch",
        speculative=False,
    )
    assert job["sampling"] == {"max_tokens": 7, "temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 3}
    assert job["slo"]["latency_target_ms"] == 50 and job["backend"] == "onnx"
    assert job["priority"] == "batch" and job["speculative"] is False


def test_developer_messages_and_text_parts_are_what_the_fleet_serves():
    job = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        ]
    )
    assert job["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"n": 2}, "n"),
        ({"logit_bias": {"42": 1}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"stream_options": {"include_usage": True}}, None),  # only with stream: true
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ],
)
def test_what_the_fleet_does_not_serve_is_refused_naming_the_field(fields, param):
    with pytest.raises(APIError) as exc:
        chat(**fields)
    assert exc.value.status == 400
    if param:
        assert (exc.value.param or "").startswith(param)


def test_fields_at_their_harmless_value_are_accepted():
    job = chat(n=1, presence_penalty=0, frequency_penalty=0, logit_bias={}, logprobs=False, user="u1")
    assert job["sampling"]["max_tokens"] == 512


def test_a_completion_takes_one_prompt():
    body = {"model": "smollm2-135m", "prompt": ["Once"], "max_tokens": 3}
    assert parse(CompletionRequest, body).to_job(512)["prompt"] == "Once"
    with pytest.raises(APIError, match="one prompt per request"):
        parse(CompletionRequest, {**body, "prompt": ["a", "b"]}).to_job(512)


def test_keys_are_compared_by_hash_and_the_keys_file_holds_only_digests(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.KEYS_FILE_ENV, str(tmp_path / "keys"))
    monkeypatch.setenv(auth.KEYS_ENV, "env-key")
    key, path = auth.add_key("ci")
    assert key not in path.read_text() and auth.digest(key) in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    ring = auth.KeyRing.load()
    assert len(ring.digests) == 2 and not ring.open
    assert ring.tenant(key) == auth.digest(key)[:16]
    assert ring.tenant("env-key") == auth.digest("env-key")[:16] != ring.tenant(key)
    assert ring.tenant("env-ke") is None and ring.tenant(None) is None
    monkeypatch.setenv(auth.KEYS_ENV, "")
    monkeypatch.setenv(auth.KEYS_FILE_ENV, str(tmp_path / "absent"))
    assert auth.KeyRing.load().open


def test_json_depth_is_measured_without_recursion():
    assert depth({"a": [1, {"b": 2}]}, 32) == 3
    deep: list = []
    for _ in range(100_000):  # deeper than Python's recursion limit
        deep = [deep]
    assert depth(deep, 32) > 32
