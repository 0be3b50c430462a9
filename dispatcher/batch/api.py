"""Offline batch jobs, OpenAI Batch JSONL in and out: ``client.batches``.

    batch = client.batches.create("requests.jsonl", completion_window="24h")
    client.batches.retrieve(batch.id).status            # validating → in_progress → completed
    client.batches.write_results(batch.id, "out.jsonl", errors="errors.jsonl")

``create`` streams the file (never holding it whole), validates every line and stages the
valid ones in Redis, writes an error record for each bad one, and returns: the fleet's
batch feeder (dispatcher.batch.feeder, run in every worker) decides and enqueues the
lines with backpressure, and workers record one result per line. The submitting process
may exit at once. Nothing here decides or enqueues, so it needs only the stores and the
registry, not the client that routes.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import redis
from pydantic import BaseModel, Field

from core import settings
from core.errors import ContextOverflowError, JobError
from core.jobs import Priority, check_context
from core.records import CHAT_URL, COMPLETIONS_URL, error_record, line_job_id
from core.registry import ModelRegistry
from core.store.batchstore import FINAL_STATUSES, BatchStore, staged_entry
from core.store.jobstore import JobStore
from dispatcher.batch.format import LineError, ParsedLine, parse_line
from dispatcher.batch.input import LineProblem, NotJsonLinesError, read_lines
from dispatcher.routing.context import might_overflow, serving_window
from dispatcher.routing.prefix import PrefixHasher

WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class UnknownBatchError(JobError, LookupError):
    code = "unknown_batch"


class BatchInputError(JobError, ValueError):
    code = "invalid_batch"


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrors(BaseModel):
    object: str = "list"
    data: list[dict[str, Any]] = Field(default_factory=list)


class Batch(BaseModel):
    """A batch as OpenAI's API describes one, plus what the fleet knows about its run."""

    id: str
    object: str = "batch"
    endpoint: str | None = None
    input_file: str | None = None
    input_file_id: str | None = None  # the gateway's uploaded file it was made from
    completion_window: str
    status: str
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    errors: BatchErrors | None = None
    metadata: dict[str, str] | None = None
    # ours, beyond OpenAI's object:
    model: str | None = None
    priority: str = Priority.batch.value
    completion_tokens: int = 0
    prompt_tokens: int = 0
    owner: str | None = Field(default=None, exclude=True)  # the API key (a hash) that created it
    fed: int = 0  # lines handed to the queues so far
    feed_s: float = 0.0  # time the feeder spent deciding and enqueueing them
    feed_cpu_s: float = 0.0  # CPU time of that
    backends: dict[str, int] = Field(default_factory=dict)  # lines per backend the tree chose

    @property
    def done(self) -> int:
        return self.request_counts.completed + self.request_counts.failed

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @classmethod
    def from_record(cls, h: dict[str, str]) -> Batch:
        def ts(key: str) -> int | None:
            return int(float(h[key])) if key in h else None

        return cls(
            id=h["id"],
            endpoint=h.get("endpoint"),
            input_file=h.get("input_file"),
            input_file_id=h.get("input_file_id"),
            completion_window=h.get("completion_window", "24h"),
            status=h["status"],
            created_at=ts("created_at") or 0,
            in_progress_at=ts("in_progress_at"),
            expires_at=ts("expires_at") or 0,
            completed_at=ts("completed_at"),
            failed_at=ts("failed_at"),
            expired_at=ts("expired_at"),
            cancelling_at=ts("cancelling_at"),
            cancelled_at=ts("cancelled_at"),
            request_counts=RequestCounts(
                total=int(h.get("total", 0)),
                completed=int(h.get("completed", 0)),
                failed=int(h.get("failed", 0)),
            ),
            errors=BatchErrors.model_validate_json(h["errors"]) if "errors" in h else None,
            metadata=json.loads(h["metadata"]) if "metadata" in h else None,
            model=h.get("model"),
            priority=h.get("priority", Priority.batch.value),
            completion_tokens=int(h.get("completion_tokens", 0)),
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            owner=h.get("owner"),
            fed=int(h.get("fed", 0)),
            feed_s=float(h.get("feed_s", 0.0)),
            feed_cpu_s=float(h.get("feed_cpu_s", 0.0)),
            backends={k.split(":", 1)[1]: int(v) for k, v in h.items() if k.startswith("backend:")},
        )


def parse_window(window: str) -> int:
    """'24h' → seconds. OpenAI accepts only 24h; any positive s/m/h/d window is served here."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhd])\s*", window)
    if not m or int(m.group(1)) <= 0:
        raise BatchInputError(f"completion_window {window!r} is not a duration like 24h, 90m or 2d", {"window": window})
    return int(m.group(1)) * WINDOW_UNITS[m.group(2)]


InputSource = str | os.PathLike | IO[bytes] | Iterable[str | bytes | dict]


def _input_lines(source: InputSource, max_line_bytes: int) -> tuple[str | None, Iterator[str | bytes | LineProblem]]:
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


class Batches:
    """``client.batches``: create, retrieve, list, cancel, results; shaped like the OpenAI SDK's."""

    def __init__(
        self, client: redis.Redis, registry: ModelRegistry, jobs: JobStore, tokens: PrefixHasher | None = None
    ) -> None:
        self.registry = registry
        self.jobs = jobs
        self.tokens = tokens  # counts each line's prompt: context overflow is that line's error at submit
        self.store = BatchStore(client)
        self.cfg = settings.fleet_config().batch

    # ------------------------------------------------------------- create

    def create(
        self,
        input_file: InputSource,
        *,
        endpoint: str | None = None,
        completion_window: str | None = None,
        model: str | None = None,
        priority: str = Priority.batch.value,
        metadata: dict[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
        owner: str | None = None,
        input_file_id: str | None = None,
    ) -> Batch:
        """Validate and stage every line; returns once the batch is ``in_progress`` (or
        ``failed`` at validation, with the reason in ``errors``). ``progress`` is called
        with the number of lines read so far, every chunk. ``owner`` (the gateway's API
        key hash) indexes the batch under that key, for ``list_owned``."""
        if endpoint not in (None, CHAT_URL, COMPLETIONS_URL):
            raise BatchInputError(
                f"endpoint must be {CHAT_URL} or {COMPLETIONS_URL}, not {endpoint!r}", {"endpoint": endpoint}
            )
        if priority not in Priority.__members__:
            raise BatchInputError(
                f"unknown priority {priority!r}; known: {', '.join(Priority.__members__)}", {"priority": priority}
            )
        if model is not None:
            self.registry.get(model)  # an unknown default model is refused before anything is stored
        window = completion_window or self.cfg.default_completion_window
        window_s = parse_window(window)
        name, lines = _input_lines(input_file, self.cfg.max_line_bytes)

        batch_id = f"batch_{uuid.uuid4().hex}"
        created = time.time()
        purge_at = int(created + window_s + self.cfg.retention_s)
        fields = {
            "endpoint": endpoint,
            "input_file": name,
            "input_file_id": input_file_id,
            "owner": owner,
            "completion_window": window,
            "model": model,
            "priority": priority,
            "expires_at": created + window_s,
            "metadata": metadata,
        }
        self.store.create(batch_id, fields, purge_at)
        slo = {
            "latency_target_ms": self.cfg.default_latency_target_ms,
            "throughput_target_tok_s": self.cfg.default_throughput_target_tok_s,
        }
        defaults = {"model": model, "priority": priority, "batch_id": batch_id, "slo": slo}
        not_text: NotJsonLinesError | None = None
        try:
            total, first_error = self._validate(batch_id, lines, defaults, endpoint, purge_at, progress)
        except NotJsonLinesError as exc:  # a workbook, a zip, ...: refused as a whole
            total, first_error, not_text = 0, None, exc
        except BaseException as exc:
            # Ctrl-C or a broken stream: the batch must not sit in validating forever.
            reason = (
                f"validation stopped: {type(exc).__name__}: {exc}"
                if str(exc)
                else f"validation stopped: {type(exc).__name__}"
            )
            self.store.fail(batch_id, [{"code": "validation_interrupted", "message": reason}])
            raise
        errors = None
        if not_text is not None:
            errors = [{"code": "invalid_file_format", "message": str(not_text)}]
        elif total == 0:
            errors = [{"code": "empty_file", "message": "the input has no request lines"}]
        elif first_error is not None:
            errors = [
                {
                    "code": "no_valid_lines",
                    "line": first_error.line,
                    "message": f"none of the {total} lines is a valid request; the first: {first_error.message}",
                }
            ]
        if self.store.end_validation(batch_id, total, errors) == "cancelling":
            self.drop_unfed(batch_id)
        return self.retrieve(batch_id)

    def _validate(
        self,
        batch_id: str,
        lines: Iterator[str | bytes | LineProblem],
        defaults: dict[str, Any],
        endpoint: str | None,
        purge_at: int,
        progress: Callable[[int], None] | None,
    ) -> tuple[int, LineError | None]:
        """Stream, parse and stage the lines a chunk at a time. Returns (request lines,
        the first error if no line was valid)."""
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

    # ------------------------------------------------------------- read

    def _record(self, batch_id: str) -> dict[str, str]:
        record = self.store.get(batch_id)
        if not record:
            raise UnknownBatchError(f"unknown batch {batch_id!r} (never created, or expired)", {"batch_id": batch_id})
        return record

    def retrieve(self, batch_id: str) -> Batch:
        return Batch.from_record(self._record(batch_id))

    def list(self, limit: int = 20) -> list[Batch]:
        """Newest first; batches whose records expired are dropped from the index."""
        ids = self.store.ids(limit=limit)
        return self._present(zip(ids, self.store.get_many(ids)))

    def list_owned(self, owner: str, after: str | None = None, limit: int = 20) -> list[Batch]:
        """An owner's batches, newest first, starting after the batch ``after`` (a cursor)."""
        return self._present(self.store.owned(owner, after, limit), owner)

    def _present(self, found: Iterable[tuple[str, dict[str, str]]], owner: str | None = None) -> list[Batch]:
        """The batches whose records still exist; expired ones are dropped from the indexes."""
        batches = []
        for batch_id, record in found:
            if record:
                batches.append(Batch.from_record(record))
            else:
                self.store.forget(batch_id, owner)
        return batches

    def active_owned(self, owner: str) -> int:
        """How many of an owner's batches are still validating or running."""
        return self.store.active_owned(owner)

    def results(self, batch_id: str) -> Iterator[dict[str, Any]]:
        """One record per finished input line, in input order (outputs and errors)."""
        for _, rec in self.store.records(batch_id, int(self._record(batch_id).get("max_line", 0))):
            yield rec

    def write_results(
        self, batch_id: str, output: str | os.PathLike, errors: str | os.PathLike | None = None
    ) -> tuple[int, int]:
        """Write the results as JSONL, atomically (a temporary file renamed into place):
        outputs to ``output``, errors to ``errors`` (or, without it, to ``output`` too).
        Returns (lines written to output, lines written to errors)."""
        out_path, err_path = Path(output), Path(errors) if errors else None
        counts = [0, 0]
        with _atomic(out_path) as out, _atomic(err_path) as err:
            for rec in self.results(batch_id):
                to_err = err is not None and rec.get("error") is not None
                (err if to_err else out).write(json.dumps(rec, ensure_ascii=False) + "\n")
                counts[to_err] += 1
        return counts[0], counts[1]

    # ------------------------------------------------------------- cancel

    def cancel(self, batch_id: str) -> Batch:
        """Pending lines are dropped (an error record ``batch_cancelled`` each), running
        ones aborted by their engines, finished ones kept. ``cancelling`` until the last
        running line has stopped, then ``cancelled``."""
        batch = self.retrieve(batch_id)
        if batch.is_final:
            return batch
        self.store.transition(batch_id, "cancelling", ("validating", "in_progress"))
        record = self.store.get(batch_id)
        self.jobs.request_cancel(batch_id, ttl_s=max(60, int(record["purge_at"]) - int(time.time())))
        if "total" in record:  # validated: everything not fed yet is dropped now
            self.drop_unfed(batch_id)
        return self.retrieve(batch_id)

    def drop_unfed(self, batch_id: str) -> int:
        """A cancelled batch: record ``batch_cancelled`` for every staged line not handed
        to a queue yet (the cancel call, the submitter and the feeder may each do it)."""
        written = self.record_staged(
            batch_id, "batch_cancelled", "the batch was cancelled before this request ran", unfed_only=True
        )
        self.store.set_fields(batch_id, drained_at=time.time())
        return written

    def record_staged(self, batch_id: str, code: str, message: str, unfed_only: bool = False) -> int:
        """Record an error for every staged line (only those never fed, with
        ``unfed_only``) that has no record yet."""
        fed = int(self.store.get(batch_id).get("fed", 0))
        chunk = self.cfg.validate_chunk
        written, index = 0, fed if unfed_only else 0
        while batch := self.store.staged(batch_id, index, index + chunk):
            lines = [(line, index + i < fed) for i, (line, _) in enumerate(batch)]
            ids = {line: json.loads(job)["custom_id"] for line, job in batch}

            def record(line: int, ids: dict[int, str] = ids) -> dict:
                return error_record(ids[line], code, message, line_job_id(batch_id, line))

            written += self.store.record_missing(batch_id, lines, record)
            index += len(batch)
        return written


class _atomic:
    """A text file written under a temporary name and renamed into place on success."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.fh: Any = None

    def __enter__(self) -> Any:
        if self.path is None:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        self.fh = os.fdopen(fd, "w", encoding="utf-8")
        return self.fh

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self.fh is None:
            return
        self.fh.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)
