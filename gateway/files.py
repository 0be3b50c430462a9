"""Uploaded files, through fsspec: a directory in the data dir by default, any fsspec URL
(``s3://bucket/prefix``) for several gateway hosts. Metadata (owner, name, size) lives in
Redis beside the fleet's other records; the bytes live in the file store.

A batch's output and error files are files too, but nothing is stored for them: their ids
(``file-<batch id>-output`` / ``-errors``) name the batch, and their content is produced
from the batch's line records when it is asked for.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import PurePath
from typing import IO, Any

import fsspec
import redis

from core import settings
from core.store import keys
from gateway.errors import APIError

CHUNK = 1 << 20
BATCH_FILE = re.compile(r"^file-(batch_[0-9a-f]+)-(output|errors)$")
PURPOSES = ("batch",)


def files_url(configured: str) -> str:
    return configured or str(settings.data_dir() / "files")


def file_object(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": record["id"],
        "object": "file",
        "bytes": int(record["bytes"]),
        "created_at": int(float(record["created_at"])),
        "filename": record["filename"],
        "purpose": record["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


class FileTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"file larger than {limit} bytes (gateway.max_file_bytes)", "file_too_large", "file")


class FileStore:
    def __init__(self, client: redis.Redis, url: str, max_bytes: int) -> None:
        self.r = client
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.max_bytes = max_bytes

    def save(self, owner: str, filename: str, purpose: str, src: IO[bytes]) -> dict[str, Any]:
        """Copy an upload into the store a chunk at a time, then record it."""
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}", "invalid_purpose")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        path = f"{self.root}/{owner}/{file_id}"
        self.fs.makedirs(f"{self.root}/{owner}", exist_ok=True)
        size = 0
        try:
            with self.fs.open(path, "wb") as out:
                while chunk := src.read(CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise FileTooLarge(self.max_bytes)
                    out.write(chunk)
        except BaseException:
            if self.fs.exists(path):  # nothing half-written stays behind
                self.fs.rm(path)
            raise
        record = {
            "id": file_id,
            "owner": owner,
            "filename": PurePath(filename or "upload.jsonl").name[:255],
            "purpose": purpose,
            "bytes": size,
            "created_at": time.time(),
            "path": path,
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.file(file_id), mapping=record)
        pipe.zadd(keys.owner_files(owner), {file_id: record["created_at"]})
        pipe.execute()
        return record

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        """The owner's file; another key's file is as unknown as a missing one."""
        raw = self.r.hgetall(keys.file(file_id))
        record = {k.decode(): v.decode() for k, v in raw.items()}
        if not record or record.get("owner") != owner:
            raise APIError(404, f"No such File object: {file_id}", "file_not_found", "file_id")
        return record

    def list(self, owner: str, purpose: str | None, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, after the file ``after``; (files, more follow)."""
        index = keys.owner_files(owner)
        start = 0
        if after:
            rank = self.r.zrevrank(index, after)
            start = 0 if rank is None else rank + 1
        found: list[dict] = []
        while len(found) <= limit:
            ids = [i.decode() for i in self.r.zrevrange(index, start, start + limit)]
            if not ids:
                break
            start += len(ids)
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(keys.file(i))
            for i, raw in zip(ids, pipe.execute()):
                record = {k.decode(): v.decode() for k, v in raw.items()}
                if not record:
                    self.r.zrem(index, i)
                elif purpose is None or record["purpose"] == purpose:
                    found.append(record)
        return found[:limit], len(found) > limit

    def read(self, record: dict[str, Any]) -> Iterator[bytes]:
        with self.fs.open(record["path"], "rb") as fh:
            while chunk := fh.read(CHUNK):
                yield chunk

    def open(self, record: dict[str, Any]) -> IO[bytes]:
        """The stored file, open for reading (a batch's input, read line by line)."""
        return self.fs.open(record["path"], "rb")

    def delete(self, owner: str, file_id: str) -> None:
        record = self.get(owner, file_id)
        if self.fs.exists(record["path"]):
            self.fs.rm(record["path"])
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.file(file_id))
        pipe.zrem(keys.owner_files(owner), file_id)
        pipe.execute()
