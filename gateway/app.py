"""The gateway's ASGI app: FastAPI, because its routes are typed with the same pydantic v2
as the fleet's contract, its dependencies carry auth to every route in one line, and it is
Starlette underneath (streaming responses, multipart, lifespan) served by uvicorn.

    uvicorn --factory gateway.app:create_app      (what `ib serve` runs)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from core import connection, settings
from core.settings import GatewaySettings
from core.store import memory_policy
from dispatcher.client import Client
from gateway import errors
from gateway.auth import KeyRing, authenticate
from gateway.files import FileStore, files_url
from gateway.limits import LimitBody
from gateway.observe import Observe, RequestMetrics
from gateway.quota import Quota
from gateway.routes import batches as batch_routes
from gateway.routes import completions
from gateway.routes import files as file_routes
from gateway.routes import models as model_routes
from gateway.state import Fleet

log = logging.getLogger(__name__)


PRUNE_EVERY_S = 60.0


async def prune_files(fleet: Fleet) -> None:
    """Expired uploads' bytes are deleted here (their records expire in Redis by
    themselves): every gateway replica looks each minute, one deletes each file."""
    while True:
        try:
            pruned = await anyio.to_thread.run_sync(fleet.files.prune, time.time())
            if pruned:
                log.info("deleted %d expired file(s)", pruned)
        except errors.STORE_FAULTS as exc:
            log.warning("expired files not pruned this time: %s", type(exc).__name__)
        await asyncio.sleep(PRUNE_EVERY_S)


def create_app(
    redis_url: str | None = None, cfg: GatewaySettings | None = None, keys: KeyRing | None = None
) -> FastAPI:
    cfg = cfg or settings.fleet_config().gateway
    url = connection.with_password(redis_url) if redis_url else connection.redis_url()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Both ride out a Redis blip for gateway.redis_wait_s, then a request gets its 503.
        client = Client(url, retry_s=cfg.redis_wait_s)
        memory_policy.check(client.redis, "gateway")
        aredis = connection.async_redis_client(url, cfg.redis_wait_s)  # waiting: no thread per open request
        app.state.fleet = Fleet(
            client=client,
            aredis=aredis,
            cfg=cfg,
            quota=Quota(client.redis, cfg.max_inflight_per_key, cfg.request_timeout_s),
            files=FileStore(
                client.redis,
                files_url(cfg.files_url),
                cfg.max_file_bytes,
                cfg.max_files_per_key,
                cfg.max_file_bytes_per_key,
            ),
            batch_staging=anyio.CapacityLimiter(cfg.batch_stagings),
        )
        pruning = asyncio.create_task(prune_files(app.state.fleet))
        try:
            yield
        finally:
            pruning.cancel()
            await aredis.aclose()
            client.close()

    # No /docs or /openapi.json: nothing answers without auth except /health.
    app = FastAPI(title="InferenceBackend gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cfg = cfg
    app.state.keys = keys if keys is not None else KeyRing.load()
    metrics_registry = CollectorRegistry()
    errors.install(app)
    for module in (completions, model_routes, file_routes, batch_routes):
        app.include_router(module.router)

    @app.get("/health", include_in_schema=False)
    @app.get("/health/live", include_in_schema=False)
    async def live() -> dict[str, str]:
        """Liveness: the process and its event loop answer (no fleet state, no auth). It
        stays 200 through a Redis outage: restarting the gateway would not end one."""
        return {"status": "ok"}

    @app.get("/health/ready", include_in_schema=False)
    async def ready() -> Response:
        """Readiness: the fleet's Redis answers within a second; otherwise a 503, so a load
        balancer sends requests to a replica that can serve them."""
        fleet = app.state.fleet
        try:
            with anyio.fail_after(1.0):
                await fleet.aredis.ping()
        except (TimeoutError, *errors.STORE_FAULTS) as exc:
            body = {"status": "unavailable", "reason": f"the fleet's Redis does not answer ({type(exc).__name__})"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(cfg.retry_after_s)})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", include_in_schema=False, dependencies=[Depends(authenticate)])
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(errors.CatchAll, retry_after_s=cfg.retry_after_s)
    app.add_middleware(LimitBody, max_body_bytes=cfg.max_body_bytes, max_file_bytes=cfg.max_file_bytes)
    app.add_middleware(Observe, metrics=RequestMetrics(metrics_registry))
    return app
