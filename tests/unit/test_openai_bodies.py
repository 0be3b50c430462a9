"""One reading of an OpenAI body for every door (core.openai_bodies), and the gateway's
pure parts: API keys, JSON depth."""

from __future__ import annotations

import pytest

from core.errors import JobValidationError, UnsupportedParameterError
from core.jobs import GenerationJob
from core.openai_bodies import CHAT_URL, COMPLETIONS_URL, parse_request
from gateway import auth
from gateway.limits import depth

ASK = [{"role": "user", "content": "Hi"}]
MODEL = "smollm2-135m"


def chat(**fields) -> GenerationJob:
    return parse_request(CHAT_URL, {"model": MODEL, "messages": ASK, **fields}).to_job(512)


def completion(**fields) -> GenerationJob:
    return parse_request(COMPLETIONS_URL, {"model": MODEL, "prompt": "Once", **fields}).to_job(512)


def test_a_chat_body_becomes_a_valid_fleet_job_with_openais_defaults():
    job = chat()
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (512, 1.0, 1.0)  # OpenAI's, not greedy
    assert job.priority.value == "interactive" and job.stream is False
    assert job.messages[0].content == "Hi" and s.features() == set()


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
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed) == (7, 0, 0.5, ["\n"], 3)
    assert job.slo.latency_target_ms == 50 and job.backend == "onnx"
    assert job.priority.value == "batch" and job.speculative is False


def test_the_doors_fields_fill_in_but_never_override_the_bodys_targets():
    slo = {"latency_target_ms": 60000, "throughput_target_tok_s": 2000}
    mine = parse_request(CHAT_URL, {"model": MODEL, "messages": ASK, "latency_target_ms": 5}).to_job(9, slo=slo)
    assert mine.slo.latency_target_ms == 5 and mine.sampling.max_tokens == 9
    theirs = parse_request(CHAT_URL, {"model": MODEL, "messages": ASK}).to_job(9, slo=slo, id="x1")
    assert theirs.slo.latency_target_ms == 60000 and theirs.id == "x1"


def test_developer_messages_and_text_parts_are_what_the_fleet_serves():
    job = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        ]
    )
    assert [m.model_dump() for m in job.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]


def test_sampling_fields_and_vllms_extensions_become_features_the_router_checks():
    job = chat(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"42": -100, "7": 3.5},
        top_k=20,
        min_p=0.05,
        min_tokens=3,
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=True,
        top_logprobs=4,
        seed=2**63 - 1,
    )
    s = job.sampling
    assert s.logit_bias == {42: -100.0, 7: 3.5} and s.logprobs == 4 and s.top_k == 20
    assert s.features() == {
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "min_tokens",
        "ignore_eos",
        "include_stop_str_in_output",
        "logprobs",
    }
    assert chat(top_k=-1).sampling.top_k is None  # vLLM's "all tokens"
    assert chat(logprobs=True).sampling.logprobs == 0  # the chosen token's alone
    assert completion(logprobs=2).sampling.logprobs == 2


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}, "json_schema"),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
    ],
)
def test_structured_outputs_are_read_from_openais_field_and_vllms(fields, kind):
    s = chat(**fields).sampling
    assert s.structured is not None and s.structured.kind == kind and s.features() == {kind}
    assert chat(response_format={"type": "text"}).sampling.structured is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tool_choice": "required"}, None),  # without tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages.0"),  # no tool_call_id
        ({"n": 17}, "n"),
        ({"functions": [{"name": "f"}]}, "functions"),  # the legacy form of tools
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"min_tokens": 600}, "min_tokens"),  # above max_tokens (512)
        ({"top_logprobs": 3}, None),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"stream_options": {"include_usage": True}}, None),  # only with stream: true
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ],
)
def test_what_the_fleet_does_not_serve_or_cannot_be_is_refused_naming_the_field(fields, param):
    with pytest.raises(JobValidationError) as exc:
        chat(**fields)
    field = exc.value.details["errors"][0]["field"]
    if param:
        assert field.startswith(param), field
    assert isinstance(exc.value, UnsupportedParameterError) == (param in ("functions", "audio"))


def test_a_named_tool_choice_holds_the_answer_to_that_functions_parameters_and_tells_the_model():
    job = chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert job.tool_calling.mode == "named" and job.tool_calling.name == "get_weather"
    s = job.sampling.structured
    assert s.kind == "json_schema" and s.json_schema == WEATHER["function"]["parameters"]
    assert job.messages[0].role == "system" and '"get_weather"' in job.messages[0].content
    assert '"add"' not in job.messages[0].content  # only the function it must call


def test_required_is_a_list_of_calls_of_the_offered_functions_one_unless_parallel():
    job = chat(
        tools=[WEATHER, ADD], tool_choice="required", messages=[{"role": "system", "content": "Be brief."}, *ASK]
    )
    schema = job.sampling.structured.json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    assert job.messages[0].content.startswith("Be brief.\n\n") and '"add"' in job.messages[0].content
    single = chat(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    assert single.sampling.structured.json_schema["maxItems"] == 1


def test_auto_is_left_to_the_router_and_none_leaves_the_tools_out():
    auto = chat(tools=[WEATHER])  # OpenAI's default with tools
    assert auto.tool_calling.mode == "auto" and auto.sampling.structured is None
    none = chat(tools=[WEATHER], tool_choice="none")
    assert none.tool_calling is None and none.messages[0].content == "Hi"


def test_a_tool_round_trip_in_the_history_is_rendered_for_the_template():
    job = chat(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
        ]
    )
    assert [m.role for m in job.messages] == ["user", "assistant", "tool"]
    assert job.messages[1].content == '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'


def test_fields_at_their_harmless_value_are_accepted():
    job = chat(n=1, presence_penalty=0, frequency_penalty=0, logit_bias={}, logprobs=False, user="u1")
    assert job.sampling.max_tokens == 512 and job.sampling.features() == set()


def test_a_completion_takes_one_prompt():
    assert completion(prompt=["Once"], max_tokens=3).prompt == "Once"
    with pytest.raises(JobValidationError, match="one prompt per request"):
        completion(prompt=["a", "b"])
    with pytest.raises(JobValidationError) as exc:
        completion(logprobs=6)  # OpenAI's limit for text completions is 5
    assert exc.value.details["errors"][0]["field"] == "logprobs"


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


def test_a_schema_is_closed_where_it_does_not_say_otherwise_as_vllm_reads_it():
    from workers.engines.grammar import closed

    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "$defs": {"Open": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["Open"]["additionalProperties"] is True and "additionalProperties" not in schema


def test_echo_with_stream_is_refused_by_the_request_model_so_on_every_door():
    with pytest.raises(UnsupportedParameterError) as exc:
        completion(echo=True, stream=True)
    assert exc.value.details["errors"][0]["field"] == "echo"
    assert completion(echo=True).echo and completion(stream=True).stream
