"""``POST /v1/chat/completions`` and ``POST /v1/completions``, plain and streamed.

A request becomes one fleet job (core.openai_bodies, as a batch line does), submitted through the client (the tree,
prefix affinity and priorities all apply), then answered from the job record or, with
``stream: true``, from the job's token stream as server-sent events. A client that hangs up
cancels its job; one that waits past ``gateway.request_timeout_s`` gets a 504 and its job is
cancelled too. The decision path comes back in ``x-ib-decision-path``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from core.errors import JobError
from core.jobs import GenerationJob, JobResult, result_of
from core.openai_bodies import Request as OpenAIRequest
from core.openai_bodies import parse_request
from core.records import CHAT_URL, COMPLETIONS_URL, response_body
from core.store.jobstore import wait_async
from core.store.streams import StreamRestartedError, read_stream_async
from core.tenancy import scoped
from dispatcher.client import JobHandle
from gateway.auth import authenticate
from gateway.errors import STORE_FAULTS, APIError, store_fault
from gateway.limits import read_json
from gateway.state import Fleet, fleet_of
from gateway.streaming import Chunks, sse

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, tenant: str = Depends(authenticate)) -> Response:
    return await answer(request, tenant, CHAT_URL)


@router.post("/v1/completions")
async def completions(request: Request, tenant: str = Depends(authenticate)) -> Response:
    return await answer(request, tenant, COMPLETIONS_URL)


def decision_headers(handle: JobHandle) -> dict[str, str]:
    path = "; ".join(f"{s.check} {s.answer}" for s in handle.path)
    return {
        "x-ib-job-id": handle.id,
        "x-ib-backend": handle.backend or "",
        # headers are latin-1: anything else is escaped, never dropped
        "x-ib-decision-path": path.encode("ascii", "backslashreplace").decode(),
    }


class QueueFull(APIError):
    def __init__(self, limit: int, retry_after_s: int) -> None:
        message = f"this API key has {limit} requests queued or running: retry later"
        super().__init__(429, message, "queue_full", headers={"Retry-After": str(retry_after_s)})


def submit_within_quota(fleet: Fleet, tenant: str, job: GenerationJob) -> JobHandle:
    """Take a slot of the key's queue limit, then submit; one thread hop for both."""
    if not fleet.quota.acquire(tenant, job.id):
        raise QueueFull(fleet.cfg.max_inflight_per_key, fleet.cfg.retry_after_s)
    try:
        return fleet.client.submit(job)
    except BaseException:
        fleet.quota.release(tenant, job.id)
        raise


def request_job(
    body: dict[str, Any], url: str, default_max_tokens: int, tenant: str
) -> tuple[OpenAIRequest, GenerationJob]:
    """The body read as every door reads it (a 400 naming the field if it is refused), as
    the tenant's (core.tenancy: its cached prompt state is its own)."""
    req = parse_request(url, body)
    return req, scoped(req.to_job(default_max_tokens, id=uuid.uuid4().hex), tenant)


async def answer(request: Request, tenant: str, url: str) -> Response:
    fleet = fleet_of(request)
    req, job = request_job(await read_json(request), url, fleet.cfg.default_max_tokens, tenant)
    handle = await anyio.to_thread.run_sync(submit_within_quota, fleet, tenant, job)
    if req.stream:
        chunks = Chunks(url, handle.id, req.model, req.include_usage, tools=job.tool_calling is not None)
        return StreamingResponse(
            stream_events(fleet, tenant, handle, chunks),
            media_type="text/event-stream",
            headers={**decision_headers(handle), "cache-control": "no-cache"},
        )
    try:
        with fleet.resending_if_lost(handle):
            result = await wait_or_cancel(request, fleet, handle.id)
    finally:
        fleet.release(tenant, handle.id)
    return JSONResponse(response_body(result, url), headers=decision_headers(handle))


async def until_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_or_cancel(request: Request, fleet: Fleet, job_id: str) -> JobResult:
    waiting = asyncio.ensure_future(wait_async(fleet.aredis, job_id, fleet.cfg.request_timeout_s))
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiting.done():
            waiting.cancel()
            fleet.cancel(job_id)  # the client left: nobody will read the answer
    if not waiting.done() or waiting.cancelled():
        raise APIError(499, "client closed the request", "client_closed")
    final = waiting.result()  # a Redis fault raises here: errors.CatchAll answers 503
    if final is None:
        fleet.cancel(job_id)
        raise APIError(504, f"no answer within {fleet.cfg.request_timeout_s:g} s; the job was cancelled", "timeout")
    return result_of(*final)  # a failed job's JobError is answered by errors.install's handler


async def stream_events(fleet: Fleet, tenant: str, handle: JobHandle, chunks: Chunks) -> AsyncIterator[str]:
    ended = False
    deadline = time.monotonic() + fleet.cfg.request_timeout_s
    try:
        with fleet.resending_if_lost(handle):
            async for event in relay(fleet, handle, chunks, deadline):
                if event is None:
                    ended = True
                else:
                    yield event
    finally:
        if not ended:  # the client left (or the deadline passed, or Redis): stop generating for nobody
            fleet.cancel(handle.id)
        fleet.release(tenant, handle.id)


async def relay(fleet: Fleet, handle: JobHandle, chunks: Chunks, deadline: float) -> AsyncIterator[str | None]:
    """The stream's events; None once the job has ended (nothing left to cancel)."""
    try:
        if first := chunks.start():
            yield first
        try:
            async for delta in read_stream_async(fleet.aredis, handle.id):
                if delta is not None and (chunk := chunks.delta(delta)):
                    yield chunk
                elif time.monotonic() > deadline:
                    yield sse(APIError(504, "no end of the answer in time; the job was cancelled", "timeout").body())
                    return
        except StreamRestartedError as exc:  # redelivered, and the new text differs from what was sent
            yield None  # the job goes on: its result holds the new text
            yield sse(APIError.from_job_error(exc).body())
            return
        final = await wait_async(fleet.aredis, handle.id, timeout=30)
        yield None
        if final is None:
            yield sse(APIError(500, "the stream ended but the job has no outcome", "server_error").body())
            return
        try:
            result = result_of(*final)
        except JobError as exc:
            yield sse(APIError.from_job_error(exc).body())
            return
        yield chunks.finish(result)
    except STORE_FAULTS as exc:  # Redis went away mid-stream: say so, never hang
        log.warning("stream of job %s ended by %s", handle.id, type(exc).__name__)
        yield sse(store_fault(exc, fleet.cfg.retry_after_s).body())
