"""The whole OpenAI request through `ib serve`, driven by the official ``openai`` SDK as a
user's script drives OpenAI: structured outputs (the SDK's own ``parse`` with a pydantic
model), tool calls (named and required, plain and streamed, and a round trip of a tool's
result), logprobs, vLLM's sampling extensions, and a batch of all of these answering
what the gateway answers, line by line. The worker is a real llama.cpp worker on the
real GGUF; the grammar is xgrammar's, the JSON grammar llama.cpp's own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path

import llama_cpp
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import ARTIFACTS, start_worker
from core.errors import JobValidationError
from core.registry import ModelRegistry
from ops.local.processes import GatewayProcess

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
KEY = "surface-key"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str
    legs: int


class Continent(str, Enum):
    europe = "Europe"
    asia = "Asia"
    africa = "Africa"
    america = "America"


class City(BaseModel):
    """A small schema with bounded strings (a small model can loop inside an open one)."""

    name: str = Field(max_length=24)
    continent: Continent
    population_millions: int


class Person(BaseModel):
    """A nested schema: an enum, an array of objects, required fields."""

    name: str
    age: int
    favourite: Color
    pets: list[Pet] = Field(max_length=2)


@pytest.fixture(scope="module")
def gateway(redis_url, tmp_path_factory):
    worker = start_worker(redis_url, "llamacpp")
    env = {
        "IB_API_KEYS": KEY,
        "IB_API_KEYS_FILE": str(tmp_path_factory.mktemp("keys") / "none"),
        "IB_GATEWAY_FILES_URL": str(tmp_path_factory.mktemp("files")),
    }
    try:
        with GatewayProcess(redis_url, env=env, log_dir=ARTIFACTS / "logs") as gw:
            yield gw
    finally:
        worker.stop()


@pytest.fixture
def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=180)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_sdks_parse_with_a_nested_pydantic_model_gives_a_valid_object(sdk):
    for prompt in ("Describe a person who owns pets.", "Invent a character for a story."):
        done = sdk.chat.completions.parse(
            model=MODEL, messages=ask(prompt), response_format=Person, temperature=0, max_tokens=200
        )
        person = done.choices[0].message.parsed
        assert isinstance(person, Person) and len(person.pets) <= 2, done.choices[0].message.content
        assert done.choices[0].finish_reason == "stop"


def test_json_mode_and_a_streamed_json_schema_give_json(sdk):
    plain = sdk.chat.completions.create(
        model=MODEL,
        messages=ask('Reply with a JSON object whose key "greeting" says hello.'),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert plain.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(plain.choices[0].message.content), dict)
    schema = {"name": "person", "strict": True, "schema": Person.model_json_schema()}
    chunks = sdk.chat.completions.create(
        model=MODEL,
        messages=ask("A person, please."),
        response_format={"type": "json_schema", "json_schema": schema},
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Person.model_validate_json(text)


def test_vllms_regex_and_choice_extensions_hold_the_answer(sdk):
    phone = sdk.chat.completions.create(
        model=MODEL,
        messages=ask("A phone number?"),
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert len(phone.choices[0].message.content) == 8 and phone.choices[0].message.content[3] == "-"
    verdict = sdk.chat.completions.create(
        model=MODEL,
        messages=ask("Is the sky green?"),
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert verdict.choices[0].message.content in {"yes", "no", "maybe"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_returns_that_functions_call(sdk, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    args = {"model": MODEL, "messages": ask("What is the weather in Paris?"), "tools": [WEATHER, ADD]}
    answer = sdk.chat.completions.create(**args, tool_choice=choice, temperature=0, max_tokens=60, stream=stream)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in answer:
            for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                call = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
                call["name"] += delta_call.function.name or ""
                call["arguments"] += delta_call.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert list(calls) == [0] and finish == "tool_calls"
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        name, arguments = call.function.name, call.function.arguments
    parsed = json.loads(arguments)
    assert name == "get_weather" and set(parsed) == {"city", "unit"} and parsed["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_of_the_offered_functions(sdk, stream):
    answer = sdk.chat.completions.create(
        model=MODEL,
        messages=ask("Add 2 and 3."),
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        stream=stream,
    )
    if stream:
        calls = [
            c for chunk in answer if chunk.choices for c in chunk.choices[0].delta.tool_calls or []
        ]  # sent whole, in one delta
        names = [c.function.name for c in calls]
        arguments = [json.loads(c.function.arguments) for c in calls]
    else:
        calls = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls"
        names = [c.function.name for c in calls]
        arguments = [json.loads(c.function.arguments) for c in calls]
    assert len(names) == 1 and names[0] in ("add", "get_weather")
    expected = {"add": {"a", "b"}, "get_weather": {"city", "unit"}}[names[0]]
    assert set(arguments[0]) == expected


def test_a_tool_result_goes_back_in_the_history_and_auto_is_refused_naming_the_template(sdk):
    first = sdk.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Oslo?"),
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ask("Weather in Oslo?"),
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12, "unit": "celsius"}'},
    ]
    second = sdk.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=30)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=MODEL, messages=ask("Weather?"), tools=[WEATHER])  # auto, the default
    assert exc.value.body["param"] == "tool_choice" and "template" in exc.value.message


def test_chat_logprobs_are_the_models_distribution_with_the_alternatives_asked_for(sdk):
    answer = sdk.chat.completions.create(
        model=MODEL, messages=ask("Name a colour."), temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the token taken is the likeliest, and the alternatives come best first
        assert entry.top_logprobs[0].token == entry.token and math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1.0 + 1e-6
    assert "".join(e.token for e in content).startswith(answer.choices[0].message.content.rstrip())


def test_n_answers_come_as_n_choices_each_seeded_and_counted(sdk):
    args = {"model": MODEL, "messages": ask("Write a line about the sea."), "max_tokens": 12, "seed": 11}
    answer = sdk.chat.completions.create(**args, n=3, temperature=1.0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content for c in answer.choices]
    assert len(set(texts)) > 1  # sampled, each from its own seed
    assert answer.usage.completion_tokens == sum(
        len(c.logprobs.content)
        for c in sdk.chat.completions.create(**args, n=3, temperature=1.0, logprobs=True).choices
    )
    again = sdk.chat.completions.create(**args, n=3, temperature=1.0)
    assert [c.message.content for c in again.choices] == texts  # seeds seed, seed + 1, seed + 2
    greedy = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=0)
    assert len(greedy.choices) == 2 and greedy.choices[0].text == greedy.choices[1].text


def test_streamed_logprobs_and_n_answers_add_up_to_the_plain_answer(sdk):
    args = {"model": MODEL, "messages": ask("Name two colours."), "max_tokens": 10, "temperature": 0}
    plain = sdk.chat.completions.create(**args, n=2, logprobs=True, top_logprobs=2)
    texts: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    finishes: dict[int, str] = {}
    for chunk in sdk.chat.completions.create(**args, n=2, logprobs=True, top_logprobs=2, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            logprobs.setdefault(c.index, []).extend(c.logprobs.content if c.logprobs and c.logprobs.content else [])
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    for choice in plain.choices:
        assert texts[choice.index] == choice.message.content and finishes[choice.index] == choice.finish_reason
        assert [t.token for t in logprobs[choice.index]] == [t.token for t in choice.logprobs.content]


def test_completion_logprobs_come_in_openais_legacy_shape(sdk):
    answer = sdk.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(alternatives) <= 2 for alternatives in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_sampling_extensions_change_what_is_generated(sdk):
    base = {"model": MODEL, "messages": ask("Say hi."), "temperature": 0}
    ignore = sdk.chat.completions.create(**base, max_tokens=24, extra_body={"ignore_eos": True})
    assert ignore.usage.completion_tokens == 24 and ignore.choices[0].finish_reason == "length"
    short = sdk.chat.completions.create(**base, max_tokens=64)
    assert short.choices[0].finish_reason == "stop"
    floor = sdk.chat.completions.create(
        **base, max_tokens=64, extra_body={"min_tokens": short.usage.completion_tokens + 3}
    )
    assert floor.usage.completion_tokens >= short.usage.completion_tokens + 3
    penalized = sdk.chat.completions.create(
        **base, max_tokens=24, presence_penalty=2.0, frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5}
    )
    assert penalized.choices[0].message.content != short.choices[0].message.content
    sampled = sdk.chat.completions.create(
        model=MODEL, messages=ask("Say hi."), max_tokens=8, seed=7, extra_body={"top_k": 5, "min_p": 0.05}
    )
    again = sdk.chat.completions.create(
        model=MODEL, messages=ask("Say hi."), max_tokens=8, seed=7, extra_body={"top_k": 5, "min_p": 0.05}
    )
    assert sampled.choices[0].message.content == again.choices[0].message.content  # seeded
    stop = sdk.chat.completions.create(
        **base,
        max_tokens=24,
        stop=[short.choices[0].message.content[2:4]],
        extra_body={"include_stop_str_in_output": True},
    )
    assert stop.choices[0].message.content.endswith(short.choices[0].message.content[2:4])


def test_logit_bias_moves_the_first_token(sdk, gateway):
    base = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 1}
    plain = sdk.completions.create(**base, logprobs=1)
    taken = plain.choices[0].logprobs.tokens[0]
    # The token's id, through the engine's tokenizer: llama.cpp's own, in-process.
    path = ModelRegistry.from_config().get(MODEL).artifact_path("gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
    (token_id,) = llm.tokenize(taken.encode(), add_bos=False, special=False)
    moved = sdk.completions.create(**base, logprobs=1, logit_bias={str(token_id): -100})
    assert moved.choices[0].logprobs.tokens[0] != taken
    boosted = sdk.completions.create(**{**base, "prompt": "Hello"}, logit_bias={str(token_id): 100})
    assert boosted.choices[0].text == taken


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"seed": 2**64}, "seed", "less than or equal"),
        ({"backend": "onnx", "logit_bias": {"5": 1}}, "logit_bias", "onnx does not serve logit_bias"),
        ({"backend": "onnx", "extra_body": {"min_p": 0.1}}, "min_p", "serve min_p: pytorch, vllm, llamacpp"),
        ({"n": 17}, "n", "less than or equal to 16"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field_and_who_serves_it(sdk, extra, param, words):
    extra = dict(extra)
    body = extra.pop("extra_body", {})
    if "backend" in extra:
        body["backend"] = extra.pop("backend")
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, extra_body=body, **extra)
    assert exc.value.body["param"] == param and words in exc.value.message, exc.value.message


def test_a_batch_of_all_of_these_answers_what_the_gateway_answers_line_by_line(sdk, tmp_path):
    bodies = [
        {
            "messages": ask("A person."),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": Person.model_json_schema()},
            },
        },
        {
            "messages": ask("Weather in Rome?"),
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        {
            "messages": ask("Add 1 and 2."),
            "tools": [WEATHER, ADD],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        {"messages": ask("Name a colour."), "logprobs": True, "top_logprobs": 2},
        {"messages": ask("Is water wet?"), "structured_outputs": {"choice": ["yes", "no"]}},
        {"messages": ask("Say hi."), "presence_penalty": 1.0, "min_tokens": 4, "ignore_eos": True},
    ]
    bodies = [
        {"model": MODEL, "temperature": 0, "max_tokens": 200 if i in (0, 2) else 60, **b} for i, b in enumerate(bodies)
    ]
    # The same bodies as they are (extra_body: the SDK sends the fields unchanged).
    direct = [
        sdk.chat.completions.create(model=MODEL, messages=b["messages"], extra_body=b).model_dump() for b in bodies
    ]
    lines = [
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
        for i, b in enumerate(bodies)
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    upload = sdk.files.create(file=path.open("rb"), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies), batch
    records = {r["custom_id"]: r for r in map(json.loads, sdk.files.content(batch.output_file_id).text.splitlines())}
    # Each line is served as its request is at the gateway: the same fields, read the
    # same way. Not the same bytes: the lines decode together in one llama.cpp batch,
    # whose sums round differently from a lone stream's (near ties flip; measured in
    # test_llamacpp_engine), so what is compared is what each field promises.
    answers = [records[f"c{i}"]["response"]["body"]["choices"][0] for i in range(len(bodies))]
    finishes = ["stop", "tool_calls", "tool_calls", "stop", "stop", "length"]
    assert [a["finish_reason"] for a in answers] == [d["choices"][0]["finish_reason"] for d in direct] == finishes
    Person.model_validate_json(answers[0]["message"]["content"])
    (named,) = answers[1]["message"]["tool_calls"]
    assert named["function"]["name"] == "get_weather" and set(json.loads(named["function"]["arguments"])) == {
        "city",
        "unit",
    }
    (required,) = answers[2]["message"]["tool_calls"]
    assert required["function"]["name"] in ("add", "get_weather") and answers[2]["message"]["content"] is None
    content = answers[3]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    assert answers[4]["message"]["content"] in ("yes", "no")
    assert records["c5"]["response"]["body"]["usage"]["completion_tokens"] == 60  # ignore_eos: to max_tokens
    assert direct[5]["usage"]["completion_tokens"] == 60


LM_EVAL_DATA = Path(__file__).parent.parent / "data" / "lm_eval"


def reference_accuracy(hf_dir: Path, docs: list[dict]) -> tuple[float, list[int]]:
    """The task run on the same GGUF in-process through llama-cpp-python, scored as
    lm-evaluation-harness scores it: the continuation's summed logprob, encoded as the
    context plus continuation minus the context's tokens, with the same tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    llm = llama_cpp.Llama(
        model_path=str(ModelRegistry.from_config().get(MODEL).artifact_path("gguf")),
        n_ctx=256,
        logits_all=True,
        verbose=False,
    )
    picks = []
    for doc in docs:
        scores = []
        for choice in doc["choices"]:
            context = tok(doc["question"], add_special_tokens=False)["input_ids"]
            whole = tok(doc["question"] + choice, add_special_tokens=False)["input_ids"]
            llm.reset()
            llm.eval(whole)
            rows = np.array(llm.scores[: len(whole)], dtype=np.float64)
            rows -= rows.max(axis=1, keepdims=True)
            logprobs = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
            scores.append(sum(logprobs[i - 1, whole[i]] for i in range(len(context), len(whole))))
        picks.append(int(np.argmax(scores)))
    llm.close()
    return float(np.mean([p == d["answer"] for p, d in zip(picks, docs, strict=True)])), picks


def test_lm_evaluation_harness_runs_a_loglikelihood_task_with_llama_cpps_accuracy(
    gateway, hf_dir, tmp_path, monkeypatch
):
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = LM_EVAL_DATA / "facts.jsonl"
    (tmp_path / "ib_facts.yaml").write_text(
        (LM_EVAL_DATA / "ib_facts.yaml").read_text().replace("DATA_FILE", str(data))
    )
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{gateway.url}/v1/completions",
            "model": MODEL,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(hf_dir),
            "tokenized_requests": True,
            "num_concurrent": 2,
            "max_retries": 1,
        },
        tasks=["ib_facts"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        num_fewshot=0,
        batch_size=1,
    )
    ours = out["results"]["ib_facts"]["acc,none"]
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    theirs, picks = reference_accuracy(hf_dir, docs)
    assert ours == pytest.approx(theirs, abs=1 / len(docs) + 1e-9), (ours, theirs, picks)
    assert ours >= 0.5  # the task is easy: a broken logprob (an offset, a wrong row) scores near chance


def test_langchains_structured_output_in_its_three_methods_and_a_bound_tools_round_trip(gateway):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{gateway.url}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=200, max_retries=0
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Tell me about Paris.")
        assert isinstance(city, City) and city.continent in Continent, method
    anything = llm.with_structured_output(None, method="json_mode").invoke(
        'Reply with a JSON object whose key "greeting" says hello.'
    )
    assert isinstance(anything, dict)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"12 C and windy in {city}"

    question = HumanMessage("What is the weather in Oslo?")
    asked = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.invoke([question, asked, result])
    assert isinstance(answer.content, str) and answer.content


def test_the_python_client_reads_a_body_as_the_gateway_does(sdk, client):
    body = {
        "model": MODEL,
        "messages": ask('Reply with a JSON object whose key "greeting" says hello.'),
        "response_format": {"type": "json_object"},
        "temperature": 0,
        "max_tokens": 200,
    }
    ours = client.create(body).result(timeout=120)
    theirs = sdk.chat.completions.create(**body)
    assert ours.text == theirs.choices[0].message.content and isinstance(json.loads(ours.text), dict)
    completion = client.create({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    assert completion.result(timeout=120).usage.completion_tokens == 4  # a prompt: /v1/completions' reading
    with pytest.raises(JobValidationError, match="seed"):
        client.create({"model": MODEL, "prompt": "Hi", "seed": -1})


def guidellm_binary() -> str:
    """guidellm from its own venv (scripts/guidellm.sh: made once, cached)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "guidellm.sh"
    out = subprocess.run([str(script), sys.executable], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_guidellm_benchmarks_the_gateway_with_no_errored_request(gateway, hf_dir, tmp_path):
    """guidellm sends ignore_eos with every request and stream_options' usage (vLLM's
    extensions): at concurrency 1 and 8, on synthetic prompts made with a local tokenizer."""
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": gateway.url,
                "model": MODEL,
                "api_key": KEY,
                "request_format": "/v1/chat/completions",
            },
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(hf_dir)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": 16}],
            "constraints": [{"kind": "max_requests", "count": 16}],
            "outputs": [{"kind": "json", "path": str(tmp_path / "report.json")}],
        },
        "benchmarks": [{"profile.streams": 1}, {"profile.streams": 8}],
    }
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run(
        [guidellm_binary(), "run", "--scenario", str(path), "--disable-progress"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["benchmarks"]) == 2  # concurrency 1, then 8
    for bench in report["benchmarks"]:
        totals = bench["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == 16, totals
        # ignore_eos served: every request generated exactly its 16 output tokens
        tokens = bench["metrics"]["output_token_count"]["successful"]
        assert tokens["min"] == tokens["max"] == 16, tokens
