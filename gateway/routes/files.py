"""``/v1/files``: upload (multipart, ``purpose=batch``), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from gateway import result_files
from gateway.auth import authenticate
from gateway.errors import APIError
from gateway.files import expiry_seconds, file_object
from gateway.state import fleet_of

router = APIRouter()


@router.post("/v1/files")
async def upload(request: Request, tenant: str = Depends(authenticate)) -> dict[str, Any]:
    fleet = fleet_of(request)
    # Starlette spools the part to a temporary file past 1 MiB (LimitBody bounds it); it is
    # then copied to the store a chunk at a time: never whole in memory.
    async with request.form(max_files=1, max_fields=8) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        expires_s = expiry_seconds(
            form.get("expires_after[anchor]"),
            form.get("expires_after[seconds]"),
            fleet.cfg.file_expiry_s,
            fleet.cfg.min_file_expiry_s,
        )
        if not isinstance(upload, UploadFile):
            raise APIError(400, "multipart field 'file' is missing", "missing_file", "file")
        if not isinstance(purpose, str):
            raise APIError(
                400, "multipart field 'purpose' is missing (use purpose=batch)", "missing_purpose", "purpose"
            )
        record = await anyio.to_thread.run_sync(
            fleet.files.save, tenant, upload.filename or "", purpose, upload.file, expires_s
        )
    return file_object(record)


@router.get("/v1/files")
async def list_files(
    request: Request,
    tenant: str = Depends(authenticate),
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 100,
) -> dict[str, Any]:
    if not 1 <= limit <= 10000:
        raise APIError(400, "limit must be between 1 and 10000", "invalid_limit", "limit")
    records, more = await anyio.to_thread.run_sync(fleet_of(request).files.list, tenant, purpose, after, limit)
    data = [file_object(r) for r in records]
    return {
        "object": "list",
        "data": data,
        "has_more": more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/v1/files/{file_id}")
async def retrieve(file_id: str, request: Request, tenant: str = Depends(authenticate)) -> dict[str, Any]:
    fleet = fleet_of(request)
    if result_files.parse_id(file_id):
        record = await anyio.to_thread.run_sync(result_files.file_record, fleet.client.batches, tenant, file_id)
    else:
        record = await anyio.to_thread.run_sync(fleet.files.get, tenant, file_id)
    return file_object(record)


@router.get("/v1/files/{file_id}/content")
async def content(file_id: str, request: Request, tenant: str = Depends(authenticate)) -> StreamingResponse:
    fleet = fleet_of(request)
    if result_files.parse_id(file_id):
        batch, errors = await anyio.to_thread.run_sync(result_files.ended_batch, fleet.client.batches, tenant, file_id)
        body = result_files.lines(fleet.client.batches, batch.id, errors)
    else:
        body = fleet.files.read(await anyio.to_thread.run_sync(fleet.files.get, tenant, file_id))
    return StreamingResponse(body, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete(file_id: str, request: Request, tenant: str = Depends(authenticate)) -> dict[str, Any]:
    if result_files.parse_id(file_id):
        raise APIError(400, "a batch's output files go with the batch; they cannot be deleted", "invalid_request")
    await anyio.to_thread.run_sync(fleet_of(request).files.delete, tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
