"""Where things live and how the fleet is tuned: YAML config, data directory, Redis URL.

Config files come from ``IB_CONFIG_DIR`` (default: the repository's ``config/``); single
values can be overridden from the environment so that containers need no edited files.
Secrets (Redis password) only ever come from the environment.
"""

from __future__ import annotations

import os
from urllib.parse import quote
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


def config_dir() -> Path:
    return Path(os.environ.get("IB_CONFIG_DIR") or REPO_ROOT / "config")


def data_dir() -> Path:
    """Prepared models, the embedded broker's files: ``IB_DATA_DIR`` or ~/.local/share."""
    root = os.environ.get("IB_DATA_DIR") or Path.home() / ".local" / "share" / "inference-backend"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=None)
def load_yaml(name: str) -> dict[str, Any]:
    path = config_dir() / name
    with path.open() as fh:
        return yaml.safe_load(fh) or {}


def fleet_config() -> dict[str, Any]:
    """fleet.yaml, overridden by the site file ``IB_CONFIG_FILE``, overridden by
    ``IB_<SECTION>_<KEY>`` environment variables (dispatcher.fleet_settings)."""
    from dispatcher.fleet_settings import load

    return load(config_dir() / "fleet.yaml")


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
    from dispatcher.broker import announced_url  # late: broker imports this module

    return announced_url()


def broker_url(redis: str) -> str:
    """Where Celery's messages go: ``BROKER_URL`` when set (``amqp://`` for RabbitMQ,
    ``sentinel://`` for Redis Sentinel), else the Redis that holds everything else."""
    return os.environ.get("BROKER_URL") or redis


def is_redis_broker(url: str) -> bool:
    """The Redis transport (plain, TLS, socket or Sentinel): the fleet's redelivery
    bookkeeping (in-flight tags, own-queue sweeps) works on its lists directly."""
    return url.split("://", 1)[0] in ("redis", "rediss", "sentinel", "redis+socket")


def redis_client(url: str, resilient: bool = False) -> "redis.Redis":
    """A Redis client; ``resilient`` ones (workers, the batch feeder) retry a lost
    connection with backoff for about ``redis.retry_s`` seconds, so a broker restart
    (append-only persistence keeps the data) pauses them instead of failing jobs."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
    from redis.retry import Retry

    if not resilient:
        return redis.Redis.from_url(url)
    budget = float(fleet_config()["redis"]["retry_s"])
    cap = 2.0
    retries = max(1, int(budget / cap) + 4)  # the first few back off faster than the cap
    retry = Retry(ExponentialBackoff(cap=cap, base=0.1), retries)
    return redis.Redis.from_url(url, retry=retry, retry_on_error=[RedisConnectionError, RedisTimeoutError],
                                health_check_interval=30)  # fmt: skip
