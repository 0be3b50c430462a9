"""``GET /v1/models``: the registry's models, each with the backends that have live
workers for it now (an extension field, ``backends``; OpenAI's own fields come first)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request

from core.backends import load_backends
from core.errors import UnknownModelError
from core.fleet import FleetView
from core.registry import ModelSpec
from gateway.auth import authenticate
from gateway.errors import APIError
from gateway.state import fleet_of

router = APIRouter()


def model_object(spec: ModelSpec, fleet: FleetView) -> dict[str, Any]:
    live: dict[str, int] = {}
    for w in fleet.live(model=spec.name):
        live[w.backend] = live.get(w.backend, 0) + 1
    specs = load_backends()
    serves = {b: sorted(specs[b].SERVES) for b in live}
    return {
        "id": spec.name,
        "object": "model",
        "created": 0,
        "owned_by": "inference-backend",
        "backends": live,  # backend → live workers serving it
        # the request features those backends serve (json_schema, tools via it, logprobs,
        # n, ...), all together and by backend (docs/gateway.md has the table)
        "capabilities": sorted({f for fs in serves.values() for f in fs}),
        "capabilities_by_backend": serves,
        "context_length": spec.context_length,
        "chat": spec.chat,
    }


@router.get("/v1/models")
async def list_models(request: Request, _: str = Depends(authenticate)) -> dict[str, Any]:
    client = fleet_of(request).client
    fleet = await anyio.to_thread.run_sync(client.workers)
    return {"object": "list", "data": [model_object(client.registry.get(n), fleet) for n in client.registry.names()]}


@router.get("/v1/models/{model_id:path}")  # ids may hold a slash (org/name)
async def retrieve_model(model_id: str, request: Request, _: str = Depends(authenticate)) -> dict[str, Any]:
    client = fleet_of(request).client
    try:
        spec = client.registry.get(model_id)
    except UnknownModelError as exc:
        raise APIError(404, exc.message, "model_not_found", "model") from None
    return model_object(spec, await anyio.to_thread.run_sync(client.workers))
