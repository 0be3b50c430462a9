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
MAX_EXPIRY_S = 30 * 86400  # OpenAI's upper bound on expires_after (its lower one: gateway.min_file_expiry_s)


def files_url(configured: str) -> str:
    return configured or str(settings.data_dir() / "files")


def file_object(record: dict[str, Any]) -> dict[str, Any]:
    expires = record.get("expires_at")
    return {
        "id": record["id"],
        "object": "file",
        "bytes": int(record["bytes"]),
        "created_at": int(float(record["created_at"])),
        "filename": record["filename"],
        "purpose": record["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": int(float(expires)) if expires else None,
    }


def expiry_seconds(anchor: object, seconds: object, default_s: int, min_s: int = 3600) -> int:
    """OpenAI's ``expires_after`` (anchor ``created_at``, ``min_s``, OpenAI's 1 hour by
    default, to 30 days) or the default (``gateway.file_expiry_s``); a 400 naming the
    field otherwise."""
    if anchor is None and seconds is None:
        return default_s
    if anchor != "created_at":
        raise APIError(400, "expires_after[anchor] must be created_at", "invalid_expires_after", "expires_after")
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not min_s <= value <= MAX_EXPIRY_S:
        raise APIError(
            400,
            f"expires_after[seconds] must be between {min_s} and {MAX_EXPIRY_S}",
            "invalid_expires_after",
            "expires_after",
        )
    return value


class FileTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"file larger than {limit} bytes (gateway.max_file_bytes)", "file_too_large", "file")


class QuotaExceeded(APIError):
    def __init__(self, what: str) -> None:
        super().__init__(400, f"this API key's files would exceed {what}: delete some first", "file_quota", "file")


# Record an upload only if its owner stays within its quota (files, bytes): the check and
# the record in one step, so concurrent uploads cannot exceed it. KEYS: the file, the
# owner's index, the expiry index, the owner's usage. ARGV: id, created, expires_at, expiry
# entry, size, max files, max bytes, then the record's field/value pairs.
_SAVE = """
local files = tonumber(redis.call('HGET', KEYS[4], 'files') or '0')
local used = tonumber(redis.call('HGET', KEYS[4], 'bytes') or '0')
if files + 1 > tonumber(ARGV[6]) then return 0 end
if used + tonumber(ARGV[5]) > tonumber(ARGV[7]) then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('EXPIREAT', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[4], 'files', 1)
redis.call('HINCRBY', KEYS[4], 'bytes', ARGV[5])
-- the index goes with the owner's last file; the usage a while after (ARGV[8],
-- USAGE_OUTLIVES_S), so the prune that gives each file's share back still finds it
for i, at in pairs({[2] = ARGV[3] + 1, [4] = ARGV[3] + tonumber(ARGV[8])}) do
  redis.call('EXPIREAT', KEYS[i], at, 'GT')
  redis.call('EXPIREAT', KEYS[i], at, 'NX')
end
return 1
"""

# A file's record, index entry and share of its owner's usage go together. A usage hash
# that has ended already (every file of the owner expired, and no gateway pruned for
# USAGE_OUTLIVES_S) is not written again: HINCRBY would make it anew, negative and
# without an expiry, and the negative count would be extra quota.
_FORGET = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 1 then
  local files = redis.call('HINCRBY', KEYS[3], 'files', -1)
  redis.call('HINCRBY', KEYS[3], 'bytes', -tonumber(ARGV[2]))
  if files <= 0 then redis.call('DEL', KEYS[3]) end
end
return 1
"""
USAGE_OUTLIVES_S = 86400  # how long a key's usage outlives its last file's expiry, for the prune to give it back


def expiry_entry(file_id: str, owner: str, size: int, path: str) -> str:
    """A file's member of the expiry index: what pruning it needs once its record is gone."""
    return f"{file_id}|{owner}|{size}|{path}"


class FileStore:
    def __init__(
        self, client: redis.Redis, url: str, max_bytes: int, max_files_per_key: int = 0, max_bytes_per_key: int = 0
    ) -> None:
        """``max_bytes``: one file; ``max_files_per_key``, ``max_bytes_per_key``: all of a
        key's files together (0: no limit)."""
        self.r = client
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.max_bytes = max_bytes
        self.max_files_per_key = max_files_per_key or 2**62
        self.max_bytes_per_key = max_bytes_per_key or 2**62
        self._save = client.register_script(_SAVE)
        self._forget_script = client.register_script(_FORGET)

    def save(self, owner: str, filename: str, purpose: str, src: IO[bytes], expires_s: int) -> dict[str, Any]:
        """Copy an upload into the store a chunk at a time, then record it; it is deleted
        ``expires_s`` after (its record expires in Redis, ``prune`` removes its bytes)."""
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
        created = time.time()
        record = {
            "id": file_id,
            "owner": owner,
            "filename": PurePath(filename or "upload.jsonl").name[:255],
            "purpose": purpose,
            "bytes": size,
            "created_at": created,
            "expires_at": int(created + expires_s),
            "path": path,
        }
        entry = expiry_entry(file_id, owner, size, path)
        saved = self._save(
            keys=[keys.file(file_id), keys.owner_files(owner), keys.FILE_EXPIRY, keys.owner_file_usage(owner)],
            args=[
                file_id,
                created,
                record["expires_at"],
                entry,
                size,
                self.max_files_per_key,
                self.max_bytes_per_key,
                USAGE_OUTLIVES_S,
            ]
            + [x for k, v in record.items() for x in (k, v)],
        )
        if saved != 1:
            self.fs.rm(path)
            limit = f"{self.max_files_per_key} files" if saved == 0 else f"{self.max_bytes_per_key} bytes"
            raise QuotaExceeded(limit + " (gateway.max_files_per_key / max_file_bytes_per_key)")
        return record

    def prune(self, now: float, limit: int = 100) -> int:
        """Delete the bytes of files past their expiry (their records expired by
        themselves); returns how many. Gateway replicas may prune at once: each entry
        is removed by one of them, and that one deletes the bytes."""
        due = self.r.zrangebyscore(keys.FILE_EXPIRY, "-inf", now, start=0, num=limit)
        pruned = 0
        for entry in due:
            if not self.r.zrem(keys.FILE_EXPIRY, entry):
                continue  # another replica took it
            file_id, owner, size, path = entry.decode().split("|", 3)
            self._forget(file_id, owner, int(size))  # the record expired already, unless clocks differ a little
            if self.fs.exists(path):
                self.fs.rm(path)
            pruned += 1
        return pruned

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
        if self.r.zrem(keys.FILE_EXPIRY, expiry_entry(file_id, owner, int(record["bytes"]), record["path"])):
            self._forget(file_id, owner, int(record["bytes"]))  # not pruned meanwhile

    def _forget(self, file_id: str, owner: str, size: int) -> None:
        """A file's record and index entry go, and its owner's usage gives it back."""
        self._forget_script(
            keys=[keys.file(file_id), keys.owner_files(owner), keys.owner_file_usage(owner)], args=[file_id, size]
        )
