"""Errors no route answered leave in OpenAI's shape (gateway.errors.CatchAll)."""

from __future__ import annotations

import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway import errors


def app_raising(exc: Exception) -> TestClient:
    app = FastAPI()
    errors.install(app)
    app.add_middleware(errors.CatchAll, retry_after_s=3)

    @app.get("/boom")
    async def boom() -> None:
        raise exc

    return TestClient(app, raise_server_exceptions=False)


def test_a_bug_is_a_500_with_a_request_id_and_no_traceback(caplog):
    r = app_raising(RuntimeError("secret internals at 0xdeadbeef")).get("/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_error"
    request_id = r.headers["x-request-id"]
    assert request_id in error["message"] and "0xdeadbeef" not in r.text and "Traceback" not in r.text
    assert any(request_id in rec.getMessage() and rec.exc_info for rec in caplog.records)  # the log has it


def test_redis_faults_are_503s_with_retry_after():
    for exc, words in [
        (redis.ConnectionError("Error 111 connecting to 10.0.0.5:6379"), "unreachable"),
        (redis.exceptions.OutOfMemoryError("OOM command not allowed"), "full"),
        (redis.ReadOnlyError("You can't write against a read only replica."), "read-only"),
    ]:
        r = app_raising(exc).get("/boom")
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "service_unavailable" and words in r.json()["error"]["message"]
        assert "10.0.0.5" not in r.text  # no address leaks to a client
