"""The submitting side's parts, made once per process from the config and the broker URL:
what the client facade (dispatcher.client), the batch feeder and the lost-line sweep
share, each handed the parts it uses instead of reaching through a client."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery

from core import connection, settings
from core.backends import load_backends
from core.celery_app import BrokerNotConfigured, get_app
from core.registry import LiveRegistry, ModelRegistry
from core.store.batchstore import BatchStore
from core.store.hints import PrefixHints
from core.store.jobstore import JobStore
from dispatcher.batch.api import Batches
from dispatcher.batch.lost_lines import LostLines
from dispatcher.fleet_state import FleetState
from dispatcher.messages import Publisher
from dispatcher.push_guard import install_guarded
from dispatcher.router import Router
from dispatcher.routing import profiles
from dispatcher.routing.prefix import PrefixHasher
from dispatcher.sender import Sender


@dataclass
class DispatchParts:
    redis: redis.Redis
    app: Celery
    registry: ModelRegistry
    store: JobStore  # job records: claims, outcomes, cancels
    fleet: FleetState  # the live fleet and what routing reads of it
    router: Router  # pure decisions
    sender: Sender  # claims and publishes
    batches: Batches  # offline batches (client.batches)
    result_timeout_s: float  # how long result() waits unless told
    lost_check_s: float  # how often a waiter looks for a lost message
    lost_jobs: LostLines  # where a sent message may be (dispatcher.batch.lost_lines)

    @classmethod
    def connect(
        cls,
        redis_url: str | None = None,
        registry: ModelRegistry | None = None,
        resilient: bool = False,
        retry_s: float | None = None,
    ) -> DispatchParts:
        """``resilient``: ride out a broker restart (retry with backoff) instead of failing;
        ``retry_s``: for this long (core.connection.redis_client)."""
        # REDIS_PASSWORD applies to a given URL too
        url = connection.with_password(redis_url) if redis_url else connection.redis_url()
        if not url:
            raise BrokerNotConfigured("no broker configured: pass redis_url or set REDIS_URL")
        client = connection.redis_client(url, resilient=resilient, retry_s=retry_s)
        app = get_app(url)
        registry = registry or LiveRegistry()  # picks up `ib models add` while it runs
        cfg = settings.fleet_config()
        store = JobStore(client, ttl_s=cfg.celery.result_expires_s)
        hints = PrefixHints(client, cfg.prefix.hint_ttl_s, cfg.prefix.max_worker_blocks) if cfg.prefix.enabled else None
        # The model's tokenizer counts prompts at submit (context overflow) and hashes their
        # blocks (prefix affinity): one per process, each model's loaded once.
        tokens = PrefixHasher(cfg.prefix.block_tokens, cfg.prefix.max_blocks)
        guarded = install_guarded(app)  # a record's claim and its decision's premise run in the push
        steps, client_cfg = cfg.priorities.steps(), cfg.client
        fleet = FleetState(client, hints, steps, client_cfg.fleet_cache_s, client_cfg.fleet_stale_s, guarded)
        publisher = Publisher(app, cfg.priorities, show_text=cfg.flower.show_text)
        sender = Sender(publisher, store, hints, cfg.celery, fleet.last, guarded)
        policy = cfg.decision
        router = Router(
            registry,
            policy,
            load_backends(),
            tokens,
            profile=profiles.load() if policy.policy == "profile" else None,
            # Prefix affinity sends to workers' own queues, which the reaper sweeps to the shared
            # queue when a worker dies: Redis lists only. With RabbitMQ jobs use the shared queues.
            affinity=hints is not None and connection.is_redis_broker(app.conf.broker_url),
        )
        batches = Batches(BatchStore(client), store, registry, tokens)
        lost = LostLines(client, app, batches.store, steps)
        return cls(
            client, app, registry, store, fleet, router, sender, batches, client_cfg.result_timeout_s,
            client_cfg.lost_check_s, lost,
        )  # fmt: skip
