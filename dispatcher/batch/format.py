"""OpenAI Batch JSONL in: one input line → one GenerationJob or one error.

Input lines are OpenAI Batch requests (``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {...}}``) or, for convenience, plain
``{"custom_id", "prompt" | "messages", ...}`` lines. Validation is per line: a bad line
becomes an error record naming the line and the reason, and the others run. What comes
out (a line's output or error record) is core.records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from core.errors import UnknownModelError
from core.jobs import GenerationJob
from core.records import CHAT_URL, COMPLETIONS_URL, line_job_id
from core.registry import ModelRegistry
from dispatcher.batch.input import LineProblem

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "stop", "seed")
# OpenAI body fields that change nothing here and are accepted silently.
IGNORED_FIELDS = {"n", "stream", "user", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty"}


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
    if isinstance(raw, LineProblem):  # the reader could not get this line's text
        return LineError(line_no, None, raw.code, f"line {line_no} {raw.message}")
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        message = f"line {line_no} is not UTF-8 (byte {exc.start + 1}); save the file as UTF-8"
        return LineError(line_no, None, "invalid_utf8", message)
    text = text.removeprefix("\ufeff")  # a byte-order mark (Windows editors, Excel's "UTF-8 CSV")
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = _json_hint(text, isinstance(raw, bytes))
        message = f"line {line_no} is not valid JSON: {exc.msg} (column {exc.colno}){hint}"
        return LineError(line_no, None, "invalid_json", message)
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting deeper than the parser goes
        reason = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        return LineError(line_no, None, "invalid_json", f"line {line_no} is not valid JSON: {reason}")
    if not isinstance(data, dict):
        return LineError(line_no, None, "invalid_request", f"line {line_no} is not a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, None, "missing_custom_id", f"line {line_no} has no custom_id (a non-empty string)")
    if custom_id in seen:
        return LineError(
            line_no,
            custom_id,
            "duplicate_custom_id",
            f"line {line_no}: custom_id {custom_id!r} appeared on an earlier line",
        )
    seen.add(custom_id)

    if "body" in data:  # the OpenAI Batch shape
        url, body = data.get("url"), data["body"]
        if data.get("method", "POST") != "POST" or url not in (CHAT_URL, COMPLETIONS_URL):
            return LineError(
                line_no,
                custom_id,
                "invalid_url",
                f"line {line_no}: only POST {CHAT_URL} and {COMPLETIONS_URL} are served "
                f"(got {data.get('method', 'POST')} {url})",
            )
        if not isinstance(body, dict):
            return LineError(line_no, custom_id, "invalid_request", f"line {line_no}: body must be a JSON object")
    else:  # the plain shape
        body = {k: v for k, v in data.items() if k != "custom_id"}
        url = CHAT_URL if "messages" in body else COMPLETIONS_URL
    if endpoint and url != endpoint:
        return LineError(
            line_no, custom_id, "invalid_url", f"line {line_no}: url {url} differs from the batch's endpoint {endpoint}"
        )
    if (url == CHAT_URL) != ("messages" in body):
        need = "messages" if url == CHAT_URL else "prompt"
        return LineError(line_no, custom_id, "invalid_request", f"line {line_no}: {url} needs {need!r}")

    unknown = set(body) - {"model", "messages", "prompt", *SAMPLING_FIELDS, *IGNORED_FIELDS}
    if unknown:
        return LineError(
            line_no, custom_id, "invalid_request", f"line {line_no}: unknown field(s) {', '.join(sorted(unknown))}"
        )
    model = body.get("model") or defaults.get("model")
    if not model:
        return LineError(
            line_no, custom_id, "invalid_request", f"line {line_no}: no model (set one per line or --model)"
        )
    try:
        registry.get(model)
        job = GenerationJob(
            model=model,
            messages=body.get("messages"),
            prompt=body.get("prompt"),
            sampling={k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None},
            custom_id=custom_id,
            **batch_ids(defaults.get("batch_id"), line_no),
            **{k: v for k, v in defaults.items() if k != "model"},
        )
    except UnknownModelError as exc:
        return LineError(line_no, custom_id, "model_not_found", f"line {line_no}: {exc.message}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return LineError(line_no, custom_id, "invalid_request", f"line {line_no}: {where}: {first['msg']}")
    try:
        payload = job.model_dump_json(exclude_none=True)
    except PydanticSerializationError:  # json.loads lets "\ud800" through; no UTF-8 can carry it
        message = f"line {line_no}: a string holds a lone surrogate escape (like \\ud800), which is not text"
        return LineError(line_no, custom_id, "invalid_text", message)
    return ParsedLine(line_no, custom_id, url, job, payload)


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
