"""kombu's Redis transport as the fleet runs it: one Redis client per channel instead of
one per command, and a channel each side may extend for its own needs.

kombu's Redis channel makes a new ``redis.Redis`` for every publish, every ack and every
reserve (``conn_or_acquire``): each one copies redis-py's table of ~170 response
callbacks, 0.1-0.3 ms of Python on the fleet path's hot spots (the client's publish, the
worker's unacked-set write before a job can start, its ack). A ``redis.Redis`` is
thread-safe over its connection pool, so one per channel serves them all; it is made
again whenever the channel's pool is (kombu drops the pool after a connection error).
The consuming connection (BRPOP) and everything else are kombu's own.

Each side adds what only it needs, without this module knowing either:
- the worker's consumer hands the connection it consumes on its own QoS (``consume_with``:
  workers.redelivery.taken records each taken message and counts a group message as its
  jobs), so nothing is kept in module state. On the connection object, not in its
  transport options: `celery inspect stats` (Flower's worker and broker views) sends
  those options as JSON, which a class is not;
- the submitting side installs a subclass whose pushes can be guarded by a script
  (dispatcher.push_guard): a record claim runs in the push itself.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu import Connection
from kombu.transport import TRANSPORT_ALIASES, _transport_cache
from kombu.transport import redis as kombu_redis
from kombu.utils.imports import symbol_by_name


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


QOS_ATTRIBUTE = "ib_qos"  # on a kombu Connection: the QoS class its channels use


def consume_with(conn: Connection, qos: type[kombu_redis.QoS]) -> Connection:
    """Have the channels of ``conn`` (a consuming connection, before it connects) use
    ``qos``; connections of this fleet's transport only, others ignore it."""
    setattr(conn, QOS_ATTRIBUTE, qos)
    return conn


class Channel(SharedClientMixin, kombu_redis.Channel):
    """One client per channel; its QoS class may be the consuming connection's own
    (``consume_with``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        qos = getattr(self.connection.client, QOS_ATTRIBUTE, None)  # kombu: connection is the transport
        if qos is not None:
            self.QoS = qos


class Transport(kombu_redis.Transport):
    Channel = Channel


def install(transport: type[Transport] = Transport) -> None:
    """Resolve kombu's ``redis`` transport name to ``transport`` in this process, unless a
    subclass of it is installed already (the submitting side's, which adds to it).

    Through kombu's own table of transport names, not Celery's ``broker_transport``: with
    that set, kombu writes the class path as the URL scheme (``Connection.as_uri``), and
    readers of the broker URL (Flower's broker view) no longer know the broker. kombu
    caches a name's class at its first use: that entry is dropped, so connections made
    from now on get this class. ``rediss://`` keeps kombu's transport (kombu infers TLS
    from that scheme's name); Sentinel, socket URLs and RabbitMQ are untouched."""
    installed = symbol_by_name(TRANSPORT_ALIASES["redis"])
    if isinstance(installed, type) and issubclass(installed, transport):
        return
    TRANSPORT_ALIASES["redis"] = f"{transport.__module__}:{transport.__qualname__}"
    _transport_cache.pop("redis", None)
