"""The gateway's ASGI app: FastAPI, because its routes are typed with the same pydantic v2
as the fleet's contract, its dependencies carry auth to every route in one line, and it is
Starlette underneath (streaming responses, multipart, lifespan) served by uvicorn.

    uvicorn --factory gateway.app:create_app      (what `ib serve` runs)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio
from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from core import connection, settings
from core.settings import GatewaySettings
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


def create_app(
    redis_url: str | None = None, cfg: GatewaySettings | None = None, keys: KeyRing | None = None
) -> FastAPI:
    cfg = cfg or settings.fleet_config().gateway
    url = connection.with_password(redis_url) if redis_url else connection.redis_url()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = Client(url, resilient=True)
        aredis = redis.asyncio.Redis.from_url(url)  # waiting: no thread per open request
        app.state.fleet = Fleet(
            client=client,
            aredis=aredis,
            cfg=cfg,
            quota=Quota(client.redis, cfg.max_inflight_per_key, cfg.request_timeout_s),
            files=FileStore(client.redis, files_url(cfg.files_url), cfg.max_file_bytes),
        )
        try:
            yield
        finally:
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
    async def health() -> dict[str, str]:
        """For load balancers and probes: the process answers (no fleet state, no auth)."""
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False, dependencies=[Depends(authenticate)])
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(LimitBody, max_body_bytes=cfg.max_body_bytes, max_file_bytes=cfg.max_file_bytes)
    app.add_middleware(Observe, metrics=RequestMetrics(metrics_registry))
    return app
