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
from kombu.transport import TRANSPORT_ALIASES
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


def install() -> None:
    """Resolve kombu's ``redis`` transport name to this module's Transport, in this process.

    Through kombu's own table of transport names, not Celery's ``broker_transport``: with
    that set, kombu writes the class path as the URL scheme (``Connection.as_uri``), and
    readers of the broker URL (Flower's broker view) no longer know the broker. ``rediss://``
    keeps kombu's transport (kombu infers TLS from that scheme's name); Sentinel, socket
    URLs and RabbitMQ are untouched."""
    TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"
