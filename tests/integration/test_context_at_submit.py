"""Context overflow is refused at submit with the model's own tokenizer: a single job gets
ContextOverflowError and nothing is enqueued; a batch line gets its error record at
validation, with its line number (a real Redis, the real tokenizer; no worker)."""

from __future__ import annotations

import json

import pytest
import redis

from conftest import own_database
from core.errors import ContextOverflowError
from core.jobs import GenerationJob
from core.store import keys
from dispatcher.client import Client
from dispatcher.routing.context import might_overflow

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
LONG = "The quick brown fox jumps over the lazy dog. " * 300  # about 3000 tokens, window 2048


@pytest.fixture
def client(redis_url, hf_dir):  # hf_dir: the tokenizer is prepared
    with own_database(redis_url, 9) as url, Client(url) as c:
        yield c


def queued(r: redis.Redis) -> int:
    return sum(r.llen(k) for k in r.scan_iter("ib.*") if r.type(k) == b"list")


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": LONG, "sampling": {"max_tokens": 16}},
        {"messages": [{"role": "user", "content": LONG}], "sampling": {"max_tokens": 16}},
        {"prompt": "Hi there.", "sampling": {"max_tokens": 2100}},  # the prompt fits; the answer cannot
    ],
)
def test_a_job_that_cannot_fit_is_refused_at_submit_and_nothing_is_enqueued(client, fields):
    job = GenerationJob(model=MODEL, backend="llamacpp", **fields)
    with pytest.raises(ContextOverflowError, match="context window is 2048 tokens") as err:
        client.submit(job)
    assert err.value.details["context_length"] == 2048 and err.value.details["prompt_tokens"] > 0
    assert not client.redis.exists(keys.job(job.id)) and queued(client.redis) == 0


def test_a_job_at_the_edge_is_counted_exactly_not_refused(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 150  # ~1500 tokens, > 2048 bytes
    job = GenerationJob(model=MODEL, prompt=prompt, sampling={"max_tokens": 400}, backend="llamacpp")
    assert might_overflow(job, 2048)  # the byte bound alone cannot clear it: it is tokenized
    handle = client.submit(job)
    assert client.redis.exists(keys.job(handle.id)) and queued(client.redis) == 1


def test_batch_lines_that_cannot_fit_get_their_error_record_at_validation(client):
    lines = [
        {"custom_id": "ok", "prompt": "Say hi.", "max_tokens": 8},
        {"custom_id": "long-prompt", "prompt": LONG, "max_tokens": 8},
        {"custom_id": "ok-2", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        {"custom_id": "long-answer", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4000},
    ]
    batch = client.batches.create(lines, model=MODEL)
    assert batch.status == "in_progress" and batch.request_counts.failed == 2
    assert client.redis.llen(keys.batch_lines(batch.id)) == 2
    records = list(client.batches.results(batch.id))
    assert [(r["custom_id"], r["error"]["code"]) for r in records] == [
        ("long-prompt", "context_overflow"),
        ("long-answer", "context_overflow"),
    ]
    assert records[0]["error"]["message"].startswith("line 2: this model's context window is 2048 tokens")
    assert "line 4:" in records[1]["error"]["message"]
    json.dumps(records)  # the records are plain JSON
