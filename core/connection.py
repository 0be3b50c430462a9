"""Where the fleet's Redis and broker are, and clients for them.

``REDIS_URL`` names the Redis (or Valkey) that holds job records, fleet state, hints and
batches; ``BROKER_URL``, when set, a separate broker for Celery's messages (RabbitMQ,
Sentinel). Without ``REDIS_URL``, an embedded broker started by `ib broker` / `ib up`
(ops.local.broker) announces its port in the data directory, and that is used. Secrets come
from the environment only: ``REDIS_PASSWORD`` is added to any URL that has none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from core import settings


def with_password(url: str) -> str:
    """Add ``REDIS_PASSWORD`` (secrets come from the environment) to a URL that has none."""
    password = os.environ.get("REDIS_PASSWORD")
    scheme, _, rest = url.partition("://")
    if not password or "@" in rest.split("/", 1)[0]:
        return url
    return f"{scheme}://:{quote(password, safe='')}@{rest}"


def redis_url() -> str | None:
    """The broker / result store: ``REDIS_URL``, else an embedded broker started by `ib broker`.

    TLS: use a ``rediss://`` URL (certificate options as query parameters, e.g.
    ``?ssl_cert_reqs=required``). None means nothing is configured or running.
    """
    url = os.environ.get("REDIS_URL")
    if url:
        return with_password(url)
    return announced_url()


def broker_url(redis: str) -> str:
    """Where Celery's messages go: ``BROKER_URL`` when set (``amqp://`` for RabbitMQ,
    ``sentinel://`` for Redis Sentinel), else the Redis that holds everything else."""
    return os.environ.get("BROKER_URL") or redis


def is_redis_broker(url: str) -> bool:
    """The Redis transport (plain, TLS, socket or Sentinel): the fleet's redelivery
    bookkeeping (in-flight tags, own-queue sweeps) works on its lists directly."""
    return url.split("://", 1)[0] in ("redis", "rediss", "sentinel", "redis+socket")


def redis_client(url: str, resilient: bool = False, retry_s: float | None = None) -> redis.Redis:
    """A Redis client; ``resilient`` ones (workers, the batch feeder) retry a lost
    connection with backoff for about ``redis.retry_s`` seconds, so a broker restart
    (append-only persistence keeps the data) pauses them instead of failing jobs.
    ``retry_s`` sets that budget: the gateway's is short (``gateway.redis_wait_s``), since
    an HTTP client would rather have a 503 with Retry-After than a minute of silence."""
    if not resilient and retry_s is None:
        return redis.Redis.from_url(url)
    return redis.Redis.from_url(url, **_retrying(settings.fleet_config().redis.retry_s if retry_s is None else retry_s))


def async_redis_client(url: str, retry_s: float) -> redis.asyncio.Redis:
    """An asyncio client that rides out a lost connection for about ``retry_s`` seconds."""
    return redis.asyncio.Redis.from_url(url, **_retrying(retry_s, asyncio=True))


def _retrying(budget: float, asyncio: bool = False) -> dict[str, Any]:
    """A client's options to retry a lost connection with backoff for about ``budget`` s."""
    cap = min(2.0, max(budget / 4, 0.1))
    retries, waited = 0, 0.0
    while waited < budget:  # the back-off's sleeps (0.1 s doubling to the cap) fill the budget
        waited += min(cap, 0.1 * 2**retries)
        retries += 1
    backoff = ExponentialBackoff(cap=cap, base=0.1)
    return {
        "retry": AsyncRetry(backoff, retries) if asyncio else Retry(backoff, retries),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "health_check_interval": 30,
        "socket_connect_timeout": min(5.0, max(budget, 1.0)),
    }


# ---------------------------------------------------------------- the embedded broker's announcement


def broker_state_file() -> Path:
    """Where a running embedded broker (ops.local.broker) announces its port to later ``ib`` commands."""
    return settings.data_dir() / "broker" / "embedded.json"


def local_url(port: int) -> str:
    """The URL of a Redis on loopback at ``port``, with the password if one is set."""
    return with_password(f"redis://127.0.0.1:{port}/0")


def announced_url() -> str | None:
    """The URL of an embedded broker started by `ib broker` / `ib up`, if it answers."""
    path = broker_state_file()
    if not path.exists():
        return None
    url = local_url(json.loads(path.read_text())["port"])
    return url if pings(url) else None


def pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except redis.RedisError:
        return False
