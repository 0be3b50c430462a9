"""OpenAI Batch JSONL in: one input line → one GenerationJob or one error.

Input lines are OpenAI Batch requests (``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {...}}``) or, for convenience, plain
``{"custom_id", "prompt" | "messages", ...}`` lines. A body is read by
core.openai_bodies, as the gateway reads it: the same fields, defaults and refusals (a
line is never streamed; its answer goes to the output file). Validation is per line: a bad line
becomes an error record naming the line and the reason, and the others run. What comes
out (a line's output or error record) is core.records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticSerializationError

from core.errors import JobValidationError, UnknownModelError, UnsupportedParameterError
from core.jobs import GenerationJob, Priority
from core.openai_bodies import default_max_tokens, endpoint_of, parse_request
from core.records import CHAT_URL, COMPLETIONS_URL, line_job_id
from core.registry import ModelRegistry
from core.tenancy import scoped
from dispatcher.batch.input import LineProblem


@dataclass(frozen=True)
class LineError:
    line: int  # 1-based line number in the input file
    custom_id: str | None
    code: str
    message: str


@dataclass(frozen=True)
class ParsedLine:
    line: int
    custom_id: str
    url: str
    job: GenerationJob
    payload: str  # the job as staged (JSON)


class _Refused(Exception):
    """A line's error, raised by the step that found it (parse_line returns it)."""

    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


def parse_line(
    line_no: int,
    raw: str | bytes | LineProblem,
    registry: ModelRegistry,
    defaults: dict[str, Any],
    seen: set[str],
    endpoint: str | None = None,
) -> ParsedLine | LineError | None:
    """One input line. ``defaults`` fill in what a line leaves out (model, priority,
    batch_id, slo); ``seen`` collects custom_ids so a duplicate is refused; ``endpoint``,
    if given, is the one url every line must use. Blank lines give None."""
    try:
        text = _text(line_no, raw)
        if not text.strip():
            return None
        data = _object(line_no, text, isinstance(raw, bytes))
        custom_id = _custom_id(line_no, data, seen)
        url, body = _request(line_no, custom_id, data, endpoint)
        job = _job(line_no, (custom_id, url, body), registry, defaults)
        return ParsedLine(line_no, custom_id, url, job, _payload(line_no, custom_id, job))
    except _Refused as refused:
        return refused.error


def _text(line_no: int, raw: str | bytes | LineProblem) -> str:
    """The line as text, without a byte-order mark (Windows editors, Excel's "UTF-8 CSV")."""
    if isinstance(raw, LineProblem):  # the reader could not get this line's text
        raise _Refused(LineError(line_no, None, raw.code, f"line {line_no} {raw.message}"))
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        message = f"line {line_no} is not UTF-8 (byte {exc.start + 1}); save the file as UTF-8"
        raise _Refused(LineError(line_no, None, "invalid_utf8", message)) from None
    return text.removeprefix("\ufeff")


def _object(line_no: int, text: str, from_file: bool) -> dict[str, Any]:
    """The line's JSON object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        message = f"line {line_no} is not valid JSON: {exc.msg} (column {exc.colno}){_json_hint(text, from_file)}"
        raise _Refused(LineError(line_no, None, "invalid_json", message)) from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting deeper than the parser goes
        reason = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise _Refused(
            LineError(line_no, None, "invalid_json", f"line {line_no} is not valid JSON: {reason}")
        ) from None
    if not isinstance(data, dict):
        raise _Refused(LineError(line_no, None, "invalid_request", f"line {line_no} is not a JSON object"))
    return data


def _custom_id(line_no: int, data: dict[str, Any], seen: set[str]) -> str:
    """The line's custom_id, new in this file (added to ``seen``)."""
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        message = f"line {line_no} has no custom_id (a non-empty string)"
        raise _Refused(LineError(line_no, None, "missing_custom_id", message))
    if custom_id in seen:
        message = f"line {line_no}: custom_id {custom_id!r} appeared on an earlier line"
        raise _Refused(LineError(line_no, custom_id, "duplicate_custom_id", message))
    seen.add(custom_id)
    return custom_id


def _request(line_no: int, custom_id: str, data: dict[str, Any], endpoint: str | None) -> tuple[str, dict[str, Any]]:
    """(url, body): the OpenAI Batch shape, or the plain one (the body's fields beside the
    custom_id); the body itself is read by core.openai_bodies, as the gateway reads it."""

    def refuse(code: str, message: str) -> _Refused:
        return _Refused(LineError(line_no, custom_id, code, f"line {line_no}{message}"))

    if "body" in data:  # the OpenAI Batch shape
        url, body = data.get("url"), data["body"]
        if data.get("method", "POST") != "POST" or url not in (CHAT_URL, COMPLETIONS_URL):
            raise refuse(
                "invalid_url",
                f": only POST {CHAT_URL} and {COMPLETIONS_URL} are served (got {data.get('method', 'POST')} {url})",
            )
        if not isinstance(body, dict):
            raise refuse("invalid_request", ": body must be a JSON object")
    else:  # the plain shape
        body = {k: v for k, v in data.items() if k != "custom_id"}
        url = endpoint_of(body)
    if endpoint and url != endpoint:
        raise refuse("invalid_url", f": url {url} differs from the batch's endpoint {endpoint}")
    if (url == CHAT_URL) != ("messages" in body):
        raise refuse("invalid_request", f": {url} needs {'messages' if url == CHAT_URL else 'prompt'!r}")
    return url, body


def _job(
    line_no: int, parsed: tuple[str, str, dict[str, Any]], registry: ModelRegistry, defaults: dict[str, Any]
) -> GenerationJob:
    """The line's job, its model registered. ``parsed``: (custom_id, url, body)."""
    custom_id, url, body = parsed
    model = body.get("model") or defaults.get("model")
    if not model:
        message = f"line {line_no}: no model (set one per line or --model)"
        raise _Refused(LineError(line_no, custom_id, "invalid_request", message))
    try:
        registry.get(model)
        request = parse_request(url, {**body, "model": model})
        fields = {"custom_id": custom_id, "stream": False, **batch_ids(defaults.get("batch_id"), line_no)}
        fields.update({k: defaults[k] for k in ("batch_id", "slo") if defaults.get(k) is not None})
        priority = Priority(defaults.get("priority") or Priority.batch)
        job = request.to_job(defaults.get("max_tokens") or default_max_tokens(), priority, **fields)
        return scoped(job, defaults.get("owner"))  # a gateway tenant's batch shares no cache with others
    except UnknownModelError as exc:
        raise _Refused(LineError(line_no, custom_id, "model_not_found", f"line {line_no}: {exc.message}")) from None
    except JobValidationError as exc:
        code = "unsupported_parameter" if isinstance(exc, UnsupportedParameterError) else "invalid_request"
        raise _Refused(LineError(line_no, custom_id, code, f"line {line_no}: {exc.message}")) from None


def _payload(line_no: int, custom_id: str, job: GenerationJob) -> str:
    """The job as staged (JSON)."""
    try:
        return job.model_dump_json(exclude_none=True)
    except PydanticSerializationError:  # json.loads lets "\ud800" through; no UTF-8 can carry it
        message = f"line {line_no}: a string holds a lone surrogate escape (like \\ud800), which is not text"
        raise _Refused(LineError(line_no, custom_id, "invalid_text", message)) from None


def _json_hint(text: str, from_file: bool) -> str:
    """Why a line people produce fails to parse, where the cause is recognizable. Only a
    file's last line lacks its newline."""
    stripped = text.strip()
    if from_file and not text.endswith("\n"):
        return "; the file ends inside this line (a truncated upload?)"
    if stripped.startswith('"') and stripped.endswith('"') and '""' in stripped:
        return "; it looks like a spreadsheet cell (a quoted CSV field): export the column as plain text, not CSV"
    if "\x00" in text:
        return "; it holds NUL bytes (UTF-16 without a byte-order mark?): save the file as UTF-8"
    return ""


def batch_ids(batch_id: str | None, line: int) -> dict[str, Any]:
    return {"id": line_job_id(batch_id, line), "batch_line": line} if batch_id else {}
