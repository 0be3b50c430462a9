"""OpenAI Batch JSONL out: what a finished batch line records.

Output lines follow OpenAI's batch output format (``id``, ``custom_id``, ``response:
{status_code, request_id, body}``, ``error``), with the body shaped like a chat
completion or a text completion, so existing batch scripts read it unchanged. Workers
write a line's record with its job's outcome (``line_record``); the submitting side
writes error records for lines that never ran.
"""

from __future__ import annotations

import time
from typing import Any

from core.errors import JobError
from core.jobs import Choice, GenerationJob, JobResult, TokenLogprob, ToolCall, Usage
from core.store.jobstore import LineRecord

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


def line_job_id(batch_id: str, line: int) -> str:
    """A batch line's job id: the same on every feed, so a line is never enqueued twice."""
    return f"{batch_id}-{line}"


def usage_body(usage: Usage) -> dict[str, Any]:
    """Usage as OpenAI reports it (cached prompt tokens in ``prompt_tokens_details``)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(result: JobResult) -> str:
    """The finish reason OpenAI reports for a job's (first) answer."""
    return choice_finish(answers(result)[0])


def tool_calls_body(calls: list[ToolCall] | None) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls or []
    ]


def answers(result: JobResult) -> list[Choice]:
    """The job's answers: its n choices, or the one it has."""
    if result.choices:
        return result.choices
    one = Choice(
        index=0,
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        logprobs=result.logprobs,
        tool_calls=result.tool_calls,
    )
    return [one]


def choice_finish(choice: Choice) -> str:
    """OpenAI has no ``cancelled``: a cancelled answer simply stopped. An answer read as
    tool calls finished to call them."""
    if choice.tool_calls:
        return "tool_calls"
    return "stop" if choice.finish_reason == "cancelled" else choice.finish_reason


def chat_message(choice: Choice) -> dict[str, Any]:
    """The assistant's message: its text, or the tool calls it made."""
    if choice.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": tool_calls_body(choice.tool_calls)}
    return {"role": "assistant", "content": choice.text}


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs``: one entry per generated token, as OpenAI's."""
    if logprobs is None:
        return None
    return {"content": [t.model_dump() for t in logprobs], "refusal": None}


def completion_logprobs(result: JobResult, choice: Choice) -> dict[str, Any] | None:
    """A text completion choice's ``logprobs``: OpenAI's legacy shape (parallel lists, the
    alternatives as token → logprob, each token's character offset in the text). An echo
    starts with the prompt's tokens, the first without a logprob (nothing precedes it)."""
    if choice.logprobs is None and result.prompt_logprobs is None:
        return None
    prompt = result.prompt_logprobs or []
    entries: list[TokenLogprob | None] = [*prompt, *(choice.logprobs or [])]
    texts = ["" if t is None else t.token for t in entries]
    if prompt and result.echo_text is not None:
        # The first prompt token has no entry: its text is what the others leave of the prompt.
        rest = "".join(texts[1 : len(prompt)])
        texts[0] = result.echo_text[: max(0, len(result.echo_text) - len(rest))]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if t is None else t.logprob for t in entries],
        "top_logprobs": [None if t is None else {a.token: a.logprob for a in t.top_logprobs} for t in entries],
        "text_offset": offsets,
    }


def response_body(result: JobResult, url: str, created: int | None = None) -> dict[str, Any]:
    """A JobResult as the body of an OpenAI chat completion or text completion."""
    common = {
        "id": f"{'chatcmpl' if url == CHAT_URL else 'cmpl'}-{result.id}",
        "created": created or int(result.timings.finished),
        "model": result.model,
        "usage": usage_body(result.usage),
    }
    if url == CHAT_URL:
        choices = [
            {
                "index": c.index,
                "message": chat_message(c),
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": choice_finish(c),
            }
            for c in answers(result)
        ]
        return {**common, "object": "chat.completion", "choices": choices}
    choices = [
        {
            "index": c.index,
            "text": (result.echo_text or "") + c.text,
            "logprobs": completion_logprobs(result, c),
            "finish_reason": choice_finish(c),
        }
        for c in answers(result)
    ]
    return {**common, "object": "text_completion", "choices": choices}


def output_record(custom_id: str, result: JobResult, url: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{result.id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": result.id, "body": response_body(result, url)},
        "error": None,
    }


def error_record(custom_id: str | None, code: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    return {
        "id": f"batch_req_{request_id or int(time.time() * 1e6)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def job_error_record(custom_id: str, job_id: str, error: JobError) -> dict[str, Any]:
    """A line whose job failed in the fleet (context overflow, engine failure, ...)."""
    return error_record(custom_id, error.code, error.message, job_id)


def line_record(job: GenerationJob, outcome: JobResult | JobError) -> LineRecord | None:
    """The batch line a job answers, with its output (or error) record; None for a job
    that is not a batch line. Workers write it with the job's final outcome."""
    if job.batch_id is None or job.batch_line is None or job.custom_id is None:
        return None
    if isinstance(outcome, JobError):
        return LineRecord(job.batch_id, job.batch_line, job_error_record(job.custom_id, job.id, outcome), "failed")
    tokens, prompt = outcome.usage.completion_tokens, outcome.usage.prompt_tokens
    if outcome.status == "cancelled":
        message = f"cancelled with the batch after {tokens} generated token(s)"
        record = error_record(job.custom_id, "batch_cancelled", message, job.id)
        return LineRecord(job.batch_id, job.batch_line, record, "failed", tokens, prompt)
    record = output_record(job.custom_id, outcome, CHAT_URL if job.messages else COMPLETIONS_URL)
    return LineRecord(job.batch_id, job.batch_line, record, "completed", tokens, prompt)
