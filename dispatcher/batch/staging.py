"""Staging a batch: its input streamed line by line (never whole), each line parsed and
validated, the valid ones staged in Redis a chunk at a time, an error record for each bad
one. Prompts that might not fit their model's context window are counted with the
model's tokenizer here, so an overflow is that line's error at submit."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from core.errors import ContextOverflowError
from core.jobs import check_context
from core.records import error_record, line_job_id
from core.registry import ModelRegistry
from core.settings import BatchSettings
from core.store.batchstore import BatchStore, staged_entry
from dispatcher.batch.format import LineError, ParsedLine, parse_line
from dispatcher.batch.input import LineProblem, read_lines
from dispatcher.batch.objects import BatchInputError
from dispatcher.routing.context import might_overflow, serving_window
from dispatcher.routing.prefix import PrefixHasher

InputSource = str | os.PathLike | IO[bytes] | Iterable[str | bytes | dict]


def input_lines(source: InputSource, max_line_bytes: int) -> tuple[str | None, Iterator[str | bytes | LineProblem]]:
    """The input as lines, streamed: a path or an open binary file is read line by line
    (gzip and UTF-16 too, dispatcher.batch.input), never whole."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise BatchInputError(f"no such input file: {path}", {"path": str(path)})

        def read() -> Iterator[bytes | LineProblem]:
            with path.open("rb") as fh:
                yield from read_lines(fh, max_line_bytes)

        return path.name, read()
    if hasattr(source, "read"):
        name = getattr(source, "name", None)
        return (Path(name).name if isinstance(name, str) else None), read_lines(source, max_line_bytes)  # type: ignore[arg-type]
    return None, (json.dumps(x) if isinstance(x, dict) else x for x in source)  # type: ignore[union-attr]


@dataclass
class BatchInput:
    """One batch's input as staging takes it."""

    batch_id: str
    lines: Iterator[str | bytes | LineProblem]
    defaults: dict[str, Any]  # what a line leaves out: model, priority, batch_id, slo
    endpoint: str | None  # the one url every line must use (None: either)
    purge_at: int  # when the staged lines expire
    progress: Callable[[int], None] | None  # told the lines read so far, each chunk


class Staging:
    """One batch's lines, read, validated and staged (``run``)."""

    def __init__(
        self, store: BatchStore, registry: ModelRegistry, tokens: PrefixHasher | None, cfg: BatchSettings
    ) -> None:
        self.store = store
        self.registry = registry
        self.tokens = tokens  # counts each line's prompt: context overflow is that line's error at submit
        self.cfg = cfg

    def run(self, batch: BatchInput) -> tuple[int, LineError | None]:
        """Stream, parse and stage the lines a chunk at a time. Returns (request lines,
        the first error if no line was valid)."""
        batch_id, lines, defaults, endpoint = batch.batch_id, batch.lines, batch.defaults, batch.endpoint
        purge_at, progress = batch.purge_at, batch.progress
        chunk = self.cfg.validate_chunk
        seen: set[str] = set()
        pending: list[ParsedLine] = []  # valid so far: counted against the context window at staging
        errors: list[tuple[int, dict]] = []
        total = valid = 0
        first_error: LineError | None = None
        line_no = 0

        def refuse(error: LineError) -> None:
            nonlocal first_error
            first_error = first_error or error
            record = error_record(error.custom_id, error.code, error.message, line_job_id(batch_id, error.line))
            errors.append((error.line, record))

        def stage() -> str:
            nonlocal pending, errors, valid
            for error in self._overflows(pending):
                refuse(error)
            refused = {line for line, _ in errors}
            entries = [staged_entry(p.line, p.payload) for p in pending if p.line not in refused]
            valid += len(entries)
            status = self.store.stage(batch_id, entries, errors, line_no, purge_at)
            pending, errors = [], []
            if progress:
                progress(line_no)
            return status

        for line_no, raw in enumerate(lines, 1):
            parsed = parse_line(line_no, raw, self.registry, defaults, seen, endpoint)
            if parsed is None:
                continue
            total += 1
            if isinstance(parsed, LineError):
                refuse(parsed)
            else:
                pending.append(parsed)
            if len(pending) + len(errors) >= chunk and stage() == "cancelling":
                break  # cancelled while validating: the lines read so far are the batch
        stage()
        return total, (first_error if valid == 0 else None)

    def _overflows(self, parsed: list[ParsedLine]) -> list[LineError]:
        """The lines whose prompt and max_tokens do not fit in their model's context window,
        counted with the model's tokenizer (a batch per model), as their errors."""
        if self.tokens is None or not parsed:
            return []
        errors = []
        by_model: dict[str, list[ParsedLine]] = {}
        for p in parsed:
            by_model.setdefault(p.job.model, []).append(p)
        for name, candidates in by_model.items():
            model = self.registry.get(name)
            window = serving_window(model)
            # messages for a model without a chat template are refused line by line when decided
            lines = [p for p in candidates if might_overflow(p.job, window) and (model.chat or p.job.messages is None)]
            counts = self.tokens.count_many([p.job for p in lines], model) if lines else None
            for p, n in zip(lines, counts or []):
                try:
                    check_context(p.job, n, window)
                except ContextOverflowError as exc:
                    errors.append(LineError(p.line, p.custom_id, exc.code, f"line {p.line}: {exc.message}"))
        return errors


def validation_errors(total: int, first_error: LineError | None, not_text: Exception | None) -> list[dict] | None:
    """Why a whole batch failed at validation (None: it did not): a file that is not JSON
    Lines, an empty one, or one with no valid line."""
    if not_text is not None:
        return [{"code": "invalid_file_format", "message": str(not_text)}]
    if total == 0:
        return [{"code": "empty_file", "message": "the input has no request lines"}]
    if first_error is not None:
        return [
            {
                "code": "no_valid_lines",
                "line": first_error.line,
                "message": f"none of the {total} lines is a valid request; the first: {first_error.message}",
            }
        ]
    return None
