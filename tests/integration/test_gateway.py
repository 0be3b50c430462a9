"""The OpenAI-compatible gateway as a user meets it: a broker, a real llama.cpp worker and
`ib serve` as processes, driven with the official ``openai`` package (and once with curl)
exactly as an existing script would drive OpenAI."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ARTIFACTS, start_worker, unavailable, wait_for
from core.store import keys
from ops.local.processes import GatewayProcess

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
KEY_A, KEY_B = "test-key-alpha", "test-key-bravo"
ASK = [{"role": "user", "content": "Name a river in Germany."}]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# A system prompt the operator shares across API keys (prefix.shared_system_prompts).
SHARED_SYSTEM = "You are the fleet's public helpdesk assistant. " * 8


@pytest.fixture(scope="module")
def worker(redis_url):
    w = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"])
    yield w
    w.stop()


def gateway_env(tmp_path, **extra: str) -> dict[str, str]:
    return {
        "IB_API_KEYS": f"{KEY_A},{KEY_B}",
        "IB_API_KEYS_FILE": str(tmp_path / "no-keys-file"),
        "IB_GATEWAY_FILES_URL": str(tmp_path / "files"),
        "IB_GATEWAY_MAX_FILE_BYTES": str(1 << 20),
        "IB_PREFIX_SHARED_SYSTEM_PROMPTS": json.dumps([hashlib.sha256(SHARED_SYSTEM.encode()).hexdigest()]),
        **extra,
    }


@pytest.fixture(scope="module")
def gateway(redis_url, worker, tmp_path_factory):
    gw = GatewayProcess(redis_url, env=gateway_env(tmp_path_factory.mktemp("gw")), log_dir=ARTIFACTS / "logs")
    with gw:
        yield gw


@pytest.fixture
def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture
def sdk_b(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_B, max_retries=0, timeout=120)


def test_models_lists_the_registry_with_the_backends_that_have_live_workers(sdk):
    models = {m.id: m for m in sdk.models.list()}
    assert MODEL in models and "smollm2-135m-draft" in models
    assert models[MODEL].model_extra["backends"] == {"llamacpp": 1}
    assert models["smollm2-135m-draft"].model_extra["backends"] == {}
    capabilities = models[MODEL].model_extra["capabilities"]
    assert {"json_schema", "logprobs", "n", "echo"} <= set(capabilities)  # what its live llama.cpp worker serves
    assert models[MODEL].model_extra["capabilities_by_backend"] == {"llamacpp": capabilities}
    assert models["smollm2-135m-draft"].model_extra["capabilities"] == []
    assert sdk.models.retrieve(MODEL).id == MODEL


def test_chat_greedy_equals_the_fleets_own_client_and_says_how_it_was_routed(sdk, client):
    own = client.submit(model=MODEL, messages=ASK, sampling={"max_tokens": 24}).result(timeout=120)
    raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    answer = raw.parse()
    assert answer.choices[0].message.content == own.text and own.text
    assert answer.choices[0].finish_reason == own.finish_reason
    assert answer.usage.prompt_tokens == own.usage.prompt_tokens
    assert answer.usage.completion_tokens == own.usage.completion_tokens
    assert raw.headers["x-ib-backend"] == "llamacpp"
    assert "latency target < 100 ms? no" in raw.headers["x-ib-decision-path"]
    record = client.record(raw.headers["x-ib-job-id"])  # the answer came from that fleet job
    assert record["status"] == "completed" and record["backend"] == "llamacpp"


def test_a_streamed_chat_is_the_same_answer_in_chunks_with_usage_last(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # deltas, not one blob
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_text_completions_plain_and_streamed(sdk, client):
    prompt = "The capital of France is"
    own = client.submit(model=MODEL, prompt=prompt, sampling={"max_tokens": 12}).result(timeout=120)
    done = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text == own.text
    streamed = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == own.text


def test_a_batch_through_files_and_batches_with_a_bad_line_in_the_error_file(sdk, tmp_path):
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0},
        }
        for i, q in enumerate(["Say hi.", "Name a colour.", "What is 2+2?"])
    ]
    path = tmp_path / "requests.jsonl"
    text = "\n".join(json.dumps(x) for x in lines[:2]) + "\n{not json\n" + json.dumps(lines[2]) + "\n"
    path.write_text(text)
    uploaded = sdk.files.create(file=path.open("rb"), purpose="batch")
    assert (uploaded.bytes, uploaded.purpose, uploaded.filename) == (len(text.encode()), "batch", "requests.jsonl")
    assert sdk.files.content(uploaded.id).content == text.encode()
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "t"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "t"}

    batch = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status not in ACTIVE and b, 180, "the batch")
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    assert batch.input_file_id == uploaded.id and batch.completed_at >= batch.created_at
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in out] == ["q0", "q1", "q2"]  # one record per line, in input order
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in out)
    errors = [json.loads(x) for x in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json"
    assert "line 3" in errors[0]["error"]["message"]
    meta = sdk.files.retrieve(batch.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(sdk.files.content(batch.output_file_id).content)
    assert batch.id in [b.id for b in sdk.batches.list(limit=100)]


def test_uploaded_files_expire_in_redis_and_on_disk(sdk, gateway, redis_url, tmp_path):
    """Uploads never expired: their records stayed in Redis and their bytes on disk."""
    from core.connection import redis_client
    from gateway.files import FileStore

    path = tmp_path / "small.jsonl"
    path.write_text('{"custom_id": "a", "body": {}}\n')
    short = sdk.files.create(
        file=path.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    default = sdk.files.create(file=path.open("rb"), purpose="batch")
    assert short.expires_at == short.created_at + 3600
    assert default.expires_at == default.created_at + 30 * 86400  # gateway.file_expiry_s
    r = redis_client(redis_url)
    assert 3590 < r.ttl(keys.file(short.id)) <= 3600
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        sdk.files.create(file=path.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60})

    store = FileStore(r, gateway.env["IB_GATEWAY_FILES_URL"], 1 << 20)
    on_disk = list(Path(gateway.env["IB_GATEWAY_FILES_URL"]).rglob(short.id))
    assert len(on_disk) == 1
    assert store.prune(time.time() + 3601) >= 1  # what the gateway's minute sweep does, an hour on
    assert not on_disk[0].exists()
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(short.id)
    assert sdk.files.retrieve(default.id).id == default.id  # a month to go


def test_a_tenant_sees_no_cached_tokens_for_another_tenants_prompt(sdk, sdk_b):
    """cached_tokens told key B that key A had just sent the same prompt (one shared
    prefix cache). Now each key's cached state is its own, except a system prompt the
    operator marked shared: B reuses that much of A's state, and nothing after it."""

    def cached(client: openai.OpenAI, messages: list[dict]) -> tuple[int, int]:
        usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    private = [
        {"role": "system", "content": f"Case {uuid.uuid4().hex}: you are a careful assistant. " * 6},
        {"role": "user", "content": "Say hi."},
    ]
    assert cached(sdk, private)[0] == 0
    again, total = cached(sdk, private)
    assert again >= total - 16  # A's own repeat: the whole prompt but its tail, from A's cache
    assert cached(sdk_b, private)[0] == 0  # B learns nothing of A's prompt

    shared = [
        {"role": "system", "content": SHARED_SYSTEM},
        {"role": "user", "content": f"Ticket {uuid.uuid4().hex}: my order is late, what now?"},
    ]
    cached(sdk, shared)
    own, total = cached(sdk, shared)
    from_a, _ = cached(sdk_b, shared)
    assert own >= total - 16
    assert 32 <= from_a < total - 20  # the shared system prompt only: not B's-and-A's user message


def test_a_cancelled_batch_stops_and_accounts_for_every_line(sdk, tmp_path):
    path = tmp_path / "long.jsonl"
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 200, "temperature": 0}
    path.write_text(
        "".join(
            json.dumps({"custom_id": f"n{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
            for i in range(30)
        )
    )
    uploaded = sdk.files.create(file=path.open("rb"), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status not in ACTIVE and b, 120, "the cancel")
    assert batch.status == "cancelled"
    counts = batch.request_counts
    assert counts.total == 30 and counts.completed + counts.failed == 30 and counts.failed >= 20
    errors = [json.loads(x) for x in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == counts.failed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_no_key_or_a_wrong_key_is_401(gateway):
    for key in (None, "not-a-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(f"{gateway.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=ASK)


def test_another_key_sees_none_of_this_keys_files_or_batches(sdk, sdk_b, tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"custom_id": "x", "model": MODEL, "prompt": "Hi", "max_tokens": 2}) + "\n")
    uploaded = sdk.files.create(file=path.open("rb"), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "in_progress"
    with pytest.raises(openai.NotFoundError):
        sdk_b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):  # nor make a batch of it
        sdk_b.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.id not in [b.id for b in sdk_b.batches.list()]
    assert uploaded.id not in [f.id for f in sdk_b.files.list()]
    assert sdk.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)


def test_bad_requests_get_openais_errors_naming_the_field(sdk, gateway):
    with pytest.raises(openai.NotFoundError, match="unknown model") as missing:
        sdk.chat.completions.create(model="no-such-model", messages=ASK)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=MODEL, messages=ASK, functions=[{"name": "f"}])  # the legacy form of tools
    assert exc.value.body["param"] == "functions" and exc.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=MODEL, messages=ASK, n=17)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=MODEL, messages=ASK, extra_body={"backend": "nope"})
    assert exc.value.body["param"] == "backend" and "'llamacpp'" in exc.value.message  # the backends it knows
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    deep = '{"model": "m", "messages": ' + "[" * 100 + "]" * 100 + "}"
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=deep, headers=headers)
    assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{oops", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = b"x" * ((1 << 20) + (2 << 20))  # over max_file_bytes (1 MiB here) and the form's slack
    r = httpx.post(
        f"{gateway.url}/v1/files", headers={"Authorization": f"Bearer {KEY_A}"}, files={"file": ("big.jsonl", big)}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_client_that_hangs_up_mid_stream_cancels_its_job(gateway, client):
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        job_id = r.headers["x-ib-job-id"]
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # leaving the block closes the connection mid-answer
    result = wait_for(lambda: client.store.final(job_id), 60, "the abandoned job to end")
    status, payload = result
    assert status == "cancelled" and payload["finish_reason"] == "cancelled"
    assert 3 <= payload["usage"]["completion_tokens"] < 400


def test_a_client_that_gives_up_on_a_plain_request_cancels_its_job(gateway, client):
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 400, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    before = {k.decode() for k in client.redis.scan_iter("ib:job:*")}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=2)

    def new_jobs() -> set[str]:  # not the lines of an earlier test's batch, fed meanwhile
        keys = {k.decode() for k in client.redis.scan_iter("ib:job:*")}
        return {k for k in keys - before if not k.startswith("ib:job:batch_")}

    new = wait_for(new_jobs, 10, "the job's record")
    (job_id,) = [k.removeprefix("ib:job:") for k in new]
    status, payload = wait_for(lambda: client.store.final(job_id), 60, "the abandoned job to end")
    assert status == "cancelled" and payload["usage"]["completion_tokens"] < 400


def test_a_client_that_hangs_up_while_its_job_is_still_queued_cancels_it(gateway, client):
    """Nothing is sent while a job waits in the queue, so only listening notices the hang-up."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True, "backend": "onnx"}  # no onnx worker
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        job_id = r.headers["x-ib-job-id"]
        assert client.status(job_id) == "queued"
    wait_for(lambda: client.store.cancelled({job_id: None}), 10, "the queued job's cancel flag")


def test_curl_reads_the_stream_as_server_sent_events(gateway):
    if shutil.which("curl") is None:
        unavailable("curl is not installed")
    body = json.dumps({"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0, "stream": True})
    out = subprocess.run(
        ["curl", "-sN", f"{gateway.url}/v1/chat/completions", "-H", f"Authorization: Bearer {KEY_A}",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_request_metrics_are_served_behind_the_key(gateway, sdk):
    sdk.models.list()
    assert httpx.get(f"{gateway.url}/metrics").status_code == 401
    text = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    assert 'ib_gateway_requests_total{method="GET",route="/v1/models",status="200"}' in text
    assert 'ib_gateway_requests_total{method="GET",route="/v1/models",status="401"}' in text
    assert "ib_gateway_request_seconds_bucket" in text
    assert "Name a river" not in gateway.log_path.read_text()  # no prompts in the log


def test_a_key_over_its_queue_limit_gets_429_and_no_live_worker_503(redis_url, worker, tmp_path):
    env = gateway_env(tmp_path, IB_GATEWAY_MAX_INFLIGHT_PER_KEY="1", IB_DECISION_NO_WORKER_POLICY="reject")
    with GatewayProcess(redis_url, env=env, log_dir=ARTIFACTS / "logs") as gw:
        sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_A, max_retries=0)
        with pytest.raises(openai.InternalServerError) as exc:  # policy reject, no onnx worker: 503
            sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"backend": "onnx"})
        assert exc.value.status_code == 503 and exc.value.code == "no_live_worker"
        long = sdk.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=300, temperature=0, stream=True)
        try:
            next(iter(long))  # the first request is being answered
            with pytest.raises(openai.RateLimitError) as exc:
                sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert exc.value.response.headers["retry-after"] == "2"
            other = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_B, max_retries=0)
            assert other.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices  # its own limit
        finally:
            long.close()
        # the slot comes back when the first request ends (here: its client left)
        wait_for(lambda: _answers(sdk), 60, "the key's slot to be free again")


def _answers(sdk: openai.OpenAI) -> bool:
    try:
        return bool(sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices)
    except openai.RateLimitError:
        time.sleep(0.5)
        return False


def test_without_keys_it_refuses_to_listen_beyond_loopback(redis_url, tmp_path):
    import os
    import sys

    env = {**os.environ, "REDIS_URL": redis_url, "IB_API_KEYS": "", "IB_API_KEYS_FILE": str(tmp_path / "none")}
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "no API keys" in out.stdout and "Traceback" not in out.stderr


def test_an_unmodified_openai_sdk_script_runs_against_the_gateway(gateway):
    import os
    import sys

    from core.settings import REPO_ROOT

    env = {**os.environ, "OPENAI_BASE_URL": f"{gateway.url}/v1", "OPENAI_API_KEY": KEY_B}
    script = REPO_ROOT / "examples" / "openai_quickstart.py"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "chat: " in out.stdout and "stream: " in out.stdout
    assert "structured: name=" in out.stdout and "tool call: get_weather({" in out.stdout
    assert "completed, 3/3 completed" in out.stdout and "  q2: " in out.stdout


def test_two_replicas_share_everything_through_redis_and_the_file_store(redis_url, gateway, tmp_path):
    """What a Kubernetes Service in front of several gateways relies on: no state in a process."""
    env = gateway_env(tmp_path)
    env["IB_GATEWAY_FILES_URL"] = gateway.env["IB_GATEWAY_FILES_URL"]  # the shared volume
    with GatewayProcess(redis_url, env=env, log_dir=ARTIFACTS / "logs") as other:
        one = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0, timeout=120)
        two = openai.OpenAI(base_url=f"{other.url}/v1", api_key=KEY_A, max_retries=0, timeout=120)
        path = tmp_path / "r.jsonl"
        path.write_text(json.dumps({"custom_id": "r", "model": MODEL, "prompt": "Hi", "max_tokens": 3}) + "\n")
        uploaded = one.files.create(file=path.open("rb"), purpose="batch")
        batch = two.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        done = wait_for(lambda: (b := one.batches.retrieve(batch.id)).status not in ACTIVE and b, 120, "the batch")
        assert done.status == "completed", done.errors
        assert json.loads(two.files.content(done.output_file_id).text)["custom_id"] == "r"
        assert uploaded.id in [f.id for f in two.files.list()]


def test_a_keys_usage_ends_after_its_files_and_is_never_made_anew_negative(redis_url, tmp_path):
    """The usage hash expired with the owner's last file; the prune that came after it
    wrote it again with negative counts and no expiry: a key with no end, worth extra quota."""
    import io

    from core.connection import redis_client
    from gateway.errors import APIError
    from gateway.files import USAGE_OUTLIVES_S, FileStore

    owner, r = f"usage-{uuid.uuid4().hex[:8]}", redis_client(redis_url)
    store = FileStore(r, str(tmp_path / "files"), 1 << 20, max_files_per_key=2, max_bytes_per_key=100)

    def upload() -> dict:
        return store.save(owner, "a.jsonl", "batch", io.BytesIO(b"x" * 10), 3600)

    first, _ = upload(), upload()
    usage = keys.owner_file_usage(owner)
    assert 3600 + USAGE_OUTLIVES_S - 10 < r.ttl(usage) <= 3600 + USAGE_OUTLIVES_S + 1  # outlives the prune
    store.delete(owner, first["id"])
    assert r.hgetall(usage) == {b"files": b"1", b"bytes": b"10"}
    r.delete(usage)  # as if it had ended: no gateway pruned for a day after the last expiry
    assert store.prune(time.time() + 3601) == 1
    assert not r.exists(usage)  # not made anew, negative and without an expiry
    upload(), upload()
    with pytest.raises(APIError):  # the quota is whole: no negative count lends a third file
        upload()
    assert store.prune(time.time() + 3601) == 2
    assert not r.exists(usage)  # the last file's share given back: the usage goes with it


def test_files_live_in_any_fsspec_store(redis_url):
    """The file store is fsspec all the way: here its in-memory filesystem, as s3:// would be."""
    import io

    import redis

    from dispatcher.batch.input import read_lines
    from gateway.files import FileStore, FileTooLarge

    store = FileStore(redis.Redis.from_url(redis_url), "memory://ib-test-files", max_bytes=64)
    record = store.save("tenant-a", "../../etc/passwd", "batch", io.BytesIO(b'{"a": 1}\n{"b": 2}\n'), 3600)
    assert record["filename"] == "passwd" and record["path"].startswith("/ib-test-files/tenant-a/")
    with store.open(store.get("tenant-a", record["id"])) as fh:  # read as a batch's input is
        assert list(read_lines(fh, 1 << 20)) == [b'{"a": 1}\n', b'{"b": 2}\n']
    with pytest.raises(Exception, match="No such File"):
        store.get("tenant-b", record["id"])
    with pytest.raises(FileTooLarge):
        store.save("tenant-a", "big.jsonl", "batch", io.BytesIO(b"x" * 65), 3600)
    assert [r["id"] for r in store.list("tenant-a", None, None, 10)[0]] == [record["id"]]  # nothing half-written
    store.delete("tenant-a", record["id"])
    assert not store.fs.exists(record["path"]) and store.list("tenant-a", None, None, 10) == ([], False)


def test_a_keys_files_and_bytes_are_capped_atomically_and_given_back(redis_url, tmp_path):
    """No per-key quota on files or bytes: one key could fill the store and Redis."""
    import io
    import threading

    from core.connection import redis_client
    from gateway.errors import APIError
    from gateway.files import FileStore

    owner = f"quota-{uuid.uuid4().hex[:8]}"
    store = FileStore(
        redis_client(redis_url), str(tmp_path / "files"), 1 << 20, max_files_per_key=3, max_bytes_per_key=100
    )
    saved, refused = [], []

    def upload(size: int) -> None:
        try:
            saved.append(store.save(owner, "a.jsonl", "batch", io.BytesIO(b"x" * size), 3600))
        except APIError as exc:
            refused.append(exc.code)

    threads = [threading.Thread(target=upload, args=(10,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert (len(saved), refused) == (3, ["file_quota"] * 5)
    assert len(list((tmp_path / "files" / owner).iterdir())) == 3  # the refused bytes were not kept
    store.delete(owner, saved[0]["id"])
    upload(95)  # a file slot is back, but 20 + 95 bytes is over 100
    assert refused[-1] == "file_quota" and len(saved) == 3
    upload(80)
    assert len(saved) == 4
    assert store.prune(time.time() + 3601) >= 3  # expired files give their quota back too
    upload(10)
    assert len(saved) == 5
