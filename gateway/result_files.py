"""A batch's output and error files, as the Files API shows them: made from its line
records when they are read (the routes of files and batches both serve them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from dispatcher.batch.api import Batches
from dispatcher.batch.objects import Batch, UnknownBatchError
from gateway.errors import APIError
from gateway.files import BATCH_FILE


def output_file_id(batch_id: str) -> str:
    return f"file-{batch_id}-output"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id}-errors"


def owned_batch(batches: Batches, owner: str, batch_id: str, what: str = "batch") -> Batch:
    """The owner's batch; another key's batch answers exactly as a missing one."""
    try:
        batch = batches.retrieve(batch_id)
    except UnknownBatchError:
        batch = None
    if batch is None or batch.owner != owner:
        raise APIError(404, f"No such {what}: {batch_id}", f"{what}_not_found")
    return batch


def parse_id(file_id: str) -> tuple[str, bool] | None:
    """(batch id, the errors file?) for a batch's file id, None for an uploaded file."""
    m = BATCH_FILE.match(file_id)
    return (m.group(1), m.group(2) == "errors") if m else None


def lines(batches: Batches, batch_id: str, errors: bool) -> Iterator[bytes]:
    for record in batches.results(batch_id):
        if (record.get("error") is not None) == errors:
            yield (json.dumps(record, ensure_ascii=False) + "\n").encode()


def ended_batch(batches: Batches, owner: str, file_id: str) -> tuple[Batch, bool]:
    """The owner's ended batch a batch file names, and whether it is the errors file; 404
    while it runs (OpenAI names the files only once a batch has ended)."""
    batch_id, errors = parse_id(file_id) or ("", False)
    batch = owned_batch(batches, owner, batch_id, "file")
    if not batch.is_final:
        raise APIError(404, f"No such File object: {file_id} (the batch has not ended)", "file_not_found")
    return batch, errors


def file_record(batches: Batches, owner: str, file_id: str) -> dict[str, Any]:
    """What gateway.files.file_object shows, for a batch's output or errors file."""
    batch, errors = ended_batch(batches, owner, file_id)
    return {
        "id": file_id,
        "bytes": sum(len(line) for line in lines(batches, batch.id, errors)),
        "created_at": batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at or 0,
        "filename": f"{batch.id}_{'errors' if errors else 'output'}.jsonl",
        "purpose": "batch_output",
    }
