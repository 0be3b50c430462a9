"""Request bodies with limits: how many bytes (checked while they arrive, so a huge body is
refused without being held) and how deeply nested the JSON may be."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError

MULTIPART_SLACK = 1 << 20  # the form's own bytes around an uploaded file


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes", "request_too_large")


class LimitBody:
    """ASGI middleware: counts the bytes of every request body as they arrive and stops
    one past its limit (uploads to /v1/files have the file limit, the rest the body limit)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_file_bytes: int) -> None:
        self.app, self.max_body, self.max_file = app, max_body_bytes, max_file_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["path"].rstrip("/") == "/v1/files" and scope["method"] == "POST"
        limit = self.max_file + MULTIPART_SLACK if upload else self.max_body
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await BodyTooLarge(limit).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


def depth(value: Any, limit: int) -> int:
    """How deeply ``value`` nests (iteratively: a hostile body cannot overflow the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            todo.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 naming what is wrong with it."""
    raw = await request.body()
    limit = request.app.state.cfg.max_json_depth
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"JSON nested deeper than {limit} levels", "invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    except ValueError as exc:  # an integer past Python's digit limit (4300): no model reads one
        raise APIError(400, f"request body has a number too long to read: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_json")
    if depth(data, limit) > limit:
        raise APIError(400, f"JSON nested deeper than {limit} levels", "invalid_json")
    return data
