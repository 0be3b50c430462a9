"""The fleet's Redis must not evict: a start-up check for workers and the gateway.

Under an evicting ``maxmemory-policy`` a full Redis drops keys without an error: a queued
job's message, a job record a client waits on, a batch's staged lines. Even the
``volatile-*`` policies evict the fleet's records, which all carry a TTL. With
``noeviction`` a full Redis refuses writes instead, which the fleet waits out
(core.store.faults) and says so. So a worker or gateway started against an evicting Redis
stops with one line naming the fix, unless the operator allows it on purpose
(``IB_ALLOW_EVICTION=1``, for a Redis that only ever holds what may be lost).
"""

from __future__ import annotations

import logging
import os

import redis

log = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"
OVERRIDE_ENV = "IB_ALLOW_EVICTION"


class EvictingRedisError(RuntimeError):
    """The fleet's Redis may evict keys (an operator's fix, not a bug: one line, no traceback)."""


def memory_policy(client: redis.Redis) -> tuple[str, int] | None:
    """(maxmemory-policy, maxmemory bytes) as the server reports them; None where it hides
    them (some managed services refuse INFO too)."""
    try:
        info = client.info("memory")
    except redis.ResponseError:
        return None
    policy = info.get("maxmemory_policy")
    return (str(policy), int(info.get("maxmemory", 0))) if policy is not None else None


def check(client: redis.Redis, who: str) -> None:
    """Raise EvictingRedisError if the Redis may evict the fleet's keys (``who`` starts)."""
    found = memory_policy(client)
    if found is None:
        log.warning("%s: the Redis does not report its maxmemory-policy; make sure it is noeviction", who)
        return
    policy, limit = found
    if policy == SAFE_POLICY:
        if not limit:
            log.info("%s: Redis has no maxmemory: it grows until the host runs out (docs/operations.md)", who)
        return
    if os.environ.get(OVERRIDE_ENV) == "1":
        log.warning("%s: Redis maxmemory-policy is %s: keys may be evicted (%s=1 allows it)", who, policy, OVERRIDE_ENV)
        return
    raise EvictingRedisError(
        f"the fleet's Redis has maxmemory-policy {policy}: when full it would silently drop queued jobs "
        f"and records. Set it to noeviction (CONFIG SET maxmemory-policy noeviction, or the managed "
        f"service's parameter group), or set {OVERRIDE_ENV}=1 to run anyway"
    )
