"""Offline batch jobs, OpenAI Batch JSONL in and out: ``client.batches``.

    batch = client.batches.create("requests.jsonl", completion_window="24h")
    client.batches.retrieve(batch.id).status            # validating → in_progress → completed
    client.batches.write_results(batch.id, "out.jsonl", errors="errors.jsonl")

``create`` streams the file (never holding it whole), validates every line and stages the
valid ones in Redis (dispatcher.batch.staging), writes an error record for each bad one,
and returns: the fleet's batch feeder (dispatcher.batch.feeder, run in every worker)
decides and enqueues the lines with backpressure, and workers record one result per
line. The submitting process may exit at once. Nothing here decides or enqueues, so it
is built from the stores and the registry, not from the client that routes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from core import settings
from core.jobs import Priority
from core.openai_bodies import default_max_tokens
from core.records import CHAT_URL, COMPLETIONS_URL, error_record, line_job_id
from core.registry import ModelRegistry
from core.store.batchstore import BatchStore
from core.store.jobstore import JobStore
from dispatcher.batch.input import NotJsonLinesError
from dispatcher.batch.objects import Batch, BatchInputError, BatchLimitError, UnknownBatchError, parse_window
from dispatcher.batch.staging import BatchInput, InputSource, Staging, input_lines, validation_errors
from dispatcher.routing.prefix import PrefixHasher


class Batches:
    """``client.batches``: create, retrieve, list, cancel, results; shaped like the OpenAI SDK's."""

    def __init__(
        self, store: BatchStore, jobs: JobStore, registry: ModelRegistry, tokens: PrefixHasher | None = None
    ) -> None:
        """Built from the stores (batches, and job records for cancels), the registry and
        the models' tokenizers, which count each line's prompt: a context overflow is that
        line's error at submit."""
        self.store = store
        self.jobs = jobs
        self.registry = registry
        self.tokens = tokens
        self.cfg = settings.fleet_config().batch

    # ------------------------------------------------------------- create

    def create(  # noqa: PLR0913 - keyword arguments as the OpenAI SDK's, and the fleet's beside them
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
        max_active: int = 0,
    ) -> Batch:
        """Validate and stage every line; returns once the batch is ``in_progress`` (or
        ``failed`` at validation, with the reason in ``errors``). ``progress`` is called
        with the number of lines read so far, every chunk. ``owner`` (the gateway's API
        key hash) indexes the batch under that key, for ``list_owned``; ``max_active``: it
        may have at most this many batches validating or running (BatchLimitError)."""
        self._check(endpoint, model, priority)
        window = completion_window or self.cfg.default_completion_window
        window_s = parse_window(window, self.cfg.max_completion_window)
        name, lines = input_lines(input_file, self.cfg.max_line_bytes)

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
        if not self.store.create(batch_id, fields, purge_at, max_active):
            raise BatchLimitError(
                f"this API key has {max_active} batches validating or running: retry later",
                {"max_active": max_active},
            )
        slo = {
            "latency_target_ms": self.cfg.default_latency_target_ms,
            "throughput_target_tok_s": self.cfg.default_throughput_target_tok_s,
        }
        # A line that names no max_tokens gets what a gateway request gets.
        max_tokens = default_max_tokens()
        defaults = {"model": model, "priority": priority, "batch_id": batch_id, "slo": slo, "max_tokens": max_tokens}
        defaults["owner"] = owner  # the gateway's tenant: its lines are salted (core.tenancy)
        self._stage(BatchInput(batch_id, lines, defaults, endpoint, purge_at, progress))
        return self.retrieve(batch_id)

    def _check(self, endpoint: str | None, model: str | None, priority: str) -> None:
        """A batch's own options, refused before anything is stored."""
        if endpoint not in (None, CHAT_URL, COMPLETIONS_URL):
            raise BatchInputError(
                f"endpoint must be {CHAT_URL} or {COMPLETIONS_URL}, not {endpoint!r}", {"endpoint": endpoint}
            )
        if priority not in Priority.__members__:
            raise BatchInputError(
                f"unknown priority {priority!r}; known: {', '.join(Priority.__members__)}", {"priority": priority}
            )
        if model is not None:
            self.registry.get(model)  # an unknown default model

    def _stage(self, batch: BatchInput) -> None:
        """Stage the lines, then end validation: the batch runs, or fails with why."""
        not_text: NotJsonLinesError | None = None
        try:
            total, first_error = Staging(self.store, self.registry, self.tokens, self.cfg).run(batch)
        except NotJsonLinesError as exc:  # a workbook, a zip, ...: refused as a whole
            total, first_error, not_text = 0, None, exc
        except BaseException as exc:
            # Ctrl-C or a broken stream: the batch must not sit in validating forever.
            reason = f"validation stopped: {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
            self.store.fail(batch.batch_id, [{"code": "validation_interrupted", "message": reason}])
            raise
        errors = validation_errors(total, first_error, not_text)
        if self.store.end_validation(batch.batch_id, total, errors) == "cancelling":
            self.drop_unfed(batch.batch_id)

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
