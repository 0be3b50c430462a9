"""kombu's Redis transport, with one Redis client per channel instead of one per command.

kombu's Redis channel makes a new ``redis.Redis`` for every publish, every ack and every
reserve (``conn_or_acquire``): each one copies redis-py's table of ~170 response
callbacks, 0.1-0.3 ms of Python on the fleet path's hot spots (the client's publish, the
worker's unacked-set write before a job can start, its ack). A ``redis.Redis`` is
thread-safe over its connection pool, so one per channel serves them all; it is made
again whenever the channel's pool is (kombu drops the pool after a connection error).
The consuming connection (BRPOP) and everything else are kombu's own.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class SharedClientMixin:
    """Overrides the one factory kombu calls for a pooled (not the polling) client."""

    _shared_client: redis.Redis | None = None
    pool: Any  # kombu's Channel.pool

    def _create_client(self, asynchronous: bool = False) -> redis.Redis:
        if asynchronous:  # the polling client: a dedicated connection, kombu's own
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        client = self._shared_client
        if client is None or client.connection_pool is not self.pool:
            client = self._shared_client = super()._create_client()  # type: ignore[misc]
        return client


class Channel(SharedClientMixin, kombu_redis.Channel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


def transport_for(broker_url: str) -> str | None:
    """The transport class path for Celery's ``broker_transport``; None: kombu's own choice.
    Plain ``redis://`` only: for ``rediss://`` kombu infers TLS settings from the scheme
    name, and Sentinel and socket URLs have their own channel classes."""
    return f"{__name__}:Transport" if broker_url.startswith("redis://") else None
