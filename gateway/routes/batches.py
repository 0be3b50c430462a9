"""``/v1/batches``: create from an uploaded file, retrieve, list, cancel, as OpenAI's.

The batch runs in the fleet exactly as `ib batch submit` does (durable, fed with
backpressure by the workers' feeder); the gateway only validates and stages the file,
then answers from the batch record. The object has OpenAI's fields and statuses, with the
output and error files named once the batch has ended.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from pydantic import Field

from core.openai_bodies import Strict, validate
from core.records import CHAT_URL, COMPLETIONS_URL
from dispatcher.batch.objects import Batch, BatchLimitError
from gateway.auth import authenticate
from gateway.errors import APIError
from gateway.limits import read_json
from gateway.result_files import error_file_id, output_file_id, owned_batch
from gateway.state import fleet_of

router = APIRouter()
OPENAI_FIELDS = (
    "id",
    "object",
    "endpoint",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "metadata",
    "model",
)


class BatchCreate(Strict):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def batch_object(batch: Batch) -> dict[str, Any]:
    body = batch.model_dump(mode="json", include=set(OPENAI_FIELDS))
    ended = batch.is_final
    body["output_file_id"] = output_file_id(batch.id) if ended and batch.request_counts.completed else None
    body["error_file_id"] = error_file_id(batch.id) if ended and batch.request_counts.failed else None
    body["usage"] = {
        "input_tokens": batch.prompt_tokens,
        "output_tokens": batch.completion_tokens,
        "total_tokens": batch.prompt_tokens + batch.completion_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    return body


@router.post("/v1/batches")
async def create(request: Request, tenant: str = Depends(authenticate)) -> dict[str, Any]:
    fleet = fleet_of(request)
    req = validate(BatchCreate, await read_json(request))
    if req.endpoint not in (CHAT_URL, COMPLETIONS_URL):
        raise APIError(
            400, f"endpoint must be {CHAT_URL} or {COMPLETIONS_URL}, not {req.endpoint}", "invalid_endpoint", "endpoint"
        )
    record = await anyio.to_thread.run_sync(fleet.files.get, tenant, req.input_file_id)
    if record["purpose"] != "batch":
        raise APIError(400, f"file {req.input_file_id} was not uploaded with purpose=batch", "invalid_file")
    batches = fleet.client.batches

    def stage() -> Batch:
        with fleet.files.open(record) as fh:
            return batches.create(
                fh,
                endpoint=req.endpoint,
                completion_window=req.completion_window,
                metadata=req.metadata,
                owner=tenant,
                input_file_id=req.input_file_id,
                max_active=fleet.cfg.max_active_batches_per_key,  # checked and taken in one step
            )

    # Validating and staging a file (up to 200 MB) holds a thread for seconds: it takes a
    # slot of the gateway's own small pool for it, not one of the pool interactive submits use.
    try:
        return batch_object(await anyio.to_thread.run_sync(stage, limiter=fleet.batch_staging))
    except BatchLimitError as exc:
        raise APIError(429, exc.message, "batch_limit", headers={"Retry-After": str(fleet.cfg.retry_after_s)}) from None


@router.get("/v1/batches/{batch_id}")
async def retrieve(batch_id: str, request: Request, tenant: str = Depends(authenticate)) -> dict[str, Any]:
    batches = fleet_of(request).client.batches
    return batch_object(await anyio.to_thread.run_sync(owned_batch, batches, tenant, batch_id))


@router.get("/v1/batches")
async def list_batches(
    request: Request, tenant: str = Depends(authenticate), after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", "invalid_limit", "limit")
    batches = fleet_of(request).client.batches
    found = await anyio.to_thread.run_sync(batches.list_owned, tenant, after, limit + 1)
    data = [batch_object(b) for b in found[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(found) > limit,
    }


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel(batch_id: str, request: Request, tenant: str = Depends(authenticate)) -> dict[str, Any]:
    batches = fleet_of(request).client.batches

    def run() -> Batch:
        owned_batch(batches, tenant, batch_id)
        return batches.cancel(batch_id)

    return batch_object(await anyio.to_thread.run_sync(run))
