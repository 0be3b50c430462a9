"""OpenAI Batch JSONL parsing (per-line errors, both line shapes) and output records."""

from __future__ import annotations

import json

import pytest

from core.errors import ContextOverflowError
from core.jobs import GenerationJob, JobResult, Timings, Usage
from core.records import CHAT_URL, COMPLETIONS_URL, error_record, line_record, output_record
from core.registry import ModelRegistry
from dispatcher.batch.format import LineError, ParsedLine, parse_line

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry.from_config()


def parse(registry, line: str | dict, seen: set[str] | None = None, **defaults):
    raw = json.dumps(line) if isinstance(line, dict) else line
    return parse_line(7, raw, registry, {"priority": "batch", **defaults}, set() if seen is None else seen)


def test_an_openai_batch_chat_line(registry):
    p = parse(
        registry,
        {
            "custom_id": "a",
            "method": "POST",
            "url": CHAT_URL,
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 9,
                "temperature": 0,
            },
        },
    )
    assert isinstance(p, ParsedLine) and p.custom_id == "a" and p.url == CHAT_URL
    assert p.job.messages[0].content == "Hi" and p.job.sampling.max_tokens == 9
    assert p.job.custom_id == "a" and p.job.priority.value == "batch"


def test_a_plain_prompt_line_takes_the_default_model(registry):
    p = parse(registry, {"custom_id": "b", "prompt": "Once upon a time", "stop": "\n"}, model=MODEL)
    assert isinstance(p, ParsedLine) and p.url == COMPLETIONS_URL
    assert p.job.model == MODEL and p.job.prompt == "Once upon a time" and p.job.sampling.stop == ["\n"]


@pytest.mark.parametrize(
    ("line", "code", "words"),
    [
        ("{not json", "invalid_json", "not valid JSON"),
        ("[1, 2]", "invalid_request", "not a JSON object"),
        ({"prompt": "x", "model": MODEL}, "missing_custom_id", "no custom_id"),
        (
            {"custom_id": "c", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}},
            "invalid_url",
            "/v1/embeddings",
        ),
        (
            {"custom_id": "c", "url": CHAT_URL, "body": {"model": MODEL, "prompt": "x"}},
            "invalid_request",
            "needs 'messages'",
        ),
        ({"custom_id": "c", "prompt": "x", "model": "gpt-9"}, "model_not_found", "known models: smollm2-135m"),
        ({"custom_id": "c", "prompt": "x", "model": MODEL, "max_tokens": 0}, "invalid_request", "max_tokens"),
        (
            {"custom_id": "c", "prompt": "x", "model": MODEL, "tools": []},
            "unsupported_parameter",
            "Unsupported parameter: 'tools'",
        ),
        ({"custom_id": "c", "prompt": "x"}, "invalid_request", "no model"),
    ],
)
def test_bad_lines_become_error_records_naming_the_line(registry, line, code, words):
    e = parse(registry, line)
    assert isinstance(e, LineError) and e.code == code and words in e.message and "line 7" in e.message


def test_a_duplicate_custom_id_is_refused(registry):
    seen: set[str] = set()
    assert isinstance(parse(registry, {"custom_id": "d", "prompt": "x", "model": MODEL}, seen), ParsedLine)
    e = parse(registry, {"custom_id": "d", "prompt": "y", "model": MODEL}, seen)
    assert isinstance(e, LineError) and e.code == "duplicate_custom_id"


def test_blank_lines_are_skipped(registry):
    assert parse(registry, "   ") is None


def result(text: str = "Paris.") -> JobResult:
    return JobResult(
        id="j1",
        status="completed",
        model=MODEL,
        text=text,
        token_ids=[1, 2],
        finish_reason="stop",
        usage=Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4),
        timings=Timings(submitted=1.0, started=1.1, first_token=1.2, finished=1.5),
        backend="onnx",
        worker="w",
        path=[],
        attempt=1,
    )


def test_output_records_are_shaped_like_openai_batch_output():
    chat = output_record("a", result(), CHAT_URL)
    assert chat["custom_id"] == "a" and chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Paris.",
    }
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    text = output_record("b", result(), COMPLETIONS_URL)["response"]["body"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Paris."
    err = error_record("c", "invalid_json", "line 3 is not valid JSON")
    assert err["response"] is None and err["error"] == {"code": "invalid_json", "message": "line 3 is not valid JSON"}


def test_batch_lines_get_a_job_id_from_their_batch_and_line(registry):
    p = parse(registry, {"custom_id": "z", "prompt": "Hi"}, model=MODEL, batch_id="batch_abc")
    assert p.job.id == "batch_abc-7" and p.job.batch_line == 7 and p.job.batch_id == "batch_abc"


def test_a_line_with_another_url_than_the_batch_endpoint_is_refused(registry):
    raw = json.dumps({"custom_id": "e", "prompt": "Hi", "model": MODEL})
    err = parse_line(3, raw, registry, {}, set(), endpoint=CHAT_URL)
    assert (
        isinstance(err, LineError) and err.code == "invalid_url" and "differs from the batch's endpoint" in err.message
    )


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("90m", 5400), ("2d", 172800), (" 30s ", 30)])
def test_completion_windows_are_durations(window, seconds):
    from dispatcher.batch.objects import parse_window

    assert parse_window(window) == seconds


@pytest.mark.parametrize("window", ["", "24", "0h", "-1h", "1w", "soon"])
def test_a_bad_completion_window_is_refused(window):
    from dispatcher.batch.objects import BatchInputError, parse_window

    with pytest.raises(BatchInputError, match="completion_window"):
        parse_window(window)


def test_a_batch_record_reads_as_an_openai_batch_object():
    from dispatcher.batch.objects import Batch

    b = Batch.from_record(
        {
            "id": "batch_1",
            "status": "in_progress",
            "created_at": "1700000000.5",
            "expires_at": "1700086400.5",
            "completion_window": "24h",
            "total": "10",
            "completed": "4",
            "failed": "1",
            "backend:llamacpp": "7",
            "metadata": '{"run": "a"}',
            "completion_tokens": "256",
            "in_progress_at": "1700000001",
        }
    )
    assert b.object == "batch" and b.created_at == 1700000000 and b.in_progress_at == 1700000001
    assert b.request_counts.model_dump() == {"total": 10, "completed": 4, "failed": 1}
    assert b.done == 5 and not b.is_final and b.backends == {"llamacpp": 7} and b.metadata == {"run": "a"}


def test_a_batch_lines_outcome_becomes_its_line_record_and_other_jobs_have_none():
    line = GenerationJob(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        batch_id="b1",
        batch_line=3,
        custom_id="c3",
        id="b1-3",
    )
    done = line_record(line, result())
    assert (done.batch_id, done.line, done.kind, done.tokens) == ("b1", 3, "completed", 2)
    assert done.record["custom_id"] == "c3" and done.record["response"]["body"]["object"] == "chat.completion"
    cancelled = line_record(line, result().model_copy(update={"status": "cancelled"}))
    assert cancelled.kind == "failed" and cancelled.record["error"]["code"] == "batch_cancelled"
    assert cancelled.tokens == 2  # generated before the cancel: counted in the batch's usage
    failed = line_record(line, ContextOverflowError("too long"))
    assert failed.kind == "failed" and failed.record["error"] == {"code": "context_overflow", "message": "too long"}
    prompt_line = line.model_copy(update={"messages": None, "prompt": "Hi"})
    assert line_record(prompt_line, result()).record["response"]["body"]["object"] == "text_completion"
    assert line_record(GenerationJob(model=MODEL, prompt="Hi"), result()) is None  # not a batch line


def test_a_byte_order_mark_is_read_past_and_a_line_that_is_not_utf8_is_that_lines_error(registry):
    line = json.dumps({"custom_id": "bom", "prompt": "Hi", "model": MODEL}).encode()
    p = parse_line(1, b"\xef\xbb\xbf" + line + b"\r\n", registry, {}, set())
    assert isinstance(p, ParsedLine) and p.custom_id == "bom"  # a BOM and CRLF, as Windows tools save
    bad = parse_line(2, b'{"custom_id": "x", "prompt": "caf\xe9"}\n', registry, {}, set())  # Latin-1, not UTF-8
    assert isinstance(bad, LineError) and bad.code == "invalid_utf8" and bad.line == 2 and "byte 34" in bad.message
