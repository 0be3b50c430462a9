"""The one Celery app and its queue topology.

JSON only (never pickle); acks late and rejected-on-worker-lost, so a job whose worker
dies goes back to the queue. One shared queue per backend and model, and one per worker
for jobs sent to it for the prompt prefix it holds:

    ib.<backend>                  the registry's default model (a one-model fleet's queues
                                  keep their names whatever else is registered)
    ib.<backend>@<model>          any other model: a worker takes only jobs for the model it loaded
    <shared queue>.<worker id>    a worker's own queue
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import redis
from celery import Celery
from kombu import Queue

from core import connection, settings, transport
from core.jobs import BACKENDS

# redis:// brokers: one Redis client per kombu channel. At import, before this process
# makes any kombu connection (core.transport).
transport.install()

GENERATE_TASK = "ib.generate"
GENERATE_GROUP_TASK = "ib.generate_group"  # several jobs of one queue in one message (dispatcher.grouping)
GROUP_HEADER = "ib_jobs"
"""The message header listing the job ids of a group message (ib.generate_group): the
worker's broker bookkeeping counts and records each job without parsing the body."""
QUEUE_PREFIX = "ib."
AMQP_MAX_PRIORITY = 9
PRIORITY_SEP = ":"  # kombu's Redis transport: queue name, separator, priority step


def group_members(headers: dict[str, Any] | None) -> list[str] | None:
    """The job ids a message carries as a group, from its headers (None: one job, or
    not ours)."""
    members = (headers or {}).get(GROUP_HEADER)
    return [m for m in members if isinstance(m, str)] if isinstance(members, list) else None


class BrokerNotConfigured(RuntimeError):
    pass


MODEL_SEP = "@"


def queue_for(backend: str, model: str | None = None) -> str:
    """The shared queue of a backend for a model (None: the registry's default model)."""
    return f"{QUEUE_PREFIX}{backend}" + (f"{MODEL_SEP}{model}" if model else "")


def own_queue_for(backend: str, worker_id: str, model: str | None = None) -> str:
    """A worker's own queue (prefix-affinity sends; swept to its shared queue if it dies)."""
    return own_queue_of(queue_for(backend, model), worker_id)


def own_queue_of(shared: str, worker_id: str) -> str:
    """The own queue of a worker that consumes ``shared``."""
    return f"{shared}.{worker_id}"


def priority_queue_names(queue: str, steps: list[int]) -> list[str]:
    """The Redis lists a queue is kept in, one per priority step (kombu: ``<queue>:<step>``,
    the first step under the plain name)."""
    return [queue if pri == 0 else f"{queue}{PRIORITY_SEP}{pri}" for pri in steps]


def queued(client: redis.Redis, queue: str, steps: list[int]) -> int:
    """Messages waiting in a queue on the Redis transport, all priority steps (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for name in priority_queue_names(queue, steps):
        pipe.llen(name)
    return sum(pipe.execute())


def create_app(broker_url: str) -> Celery:
    cfg = settings.fleet_config()
    steps = cfg.priorities.steps()
    broker = connection.broker_url(broker_url)
    app = Celery("inference_backend", broker=broker, backend=broker_url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        # The thread pool cannot enforce Celery's time limits: the engine enforces
        # job_time_limit_s itself (workers.engines.base.Engine.generate).
        result_expires=cfg.celery.result_expires_s,
        worker_prefetch_multiplier=cfg.celery.prefetch_multiplier,
        worker_hijack_root_logger=False,
        # Job status lives in our own record (core.store.jobstore), so Celery's STARTED
        # state and task events stay off the hot path; Flower switches events on for as
        # long as it watches (its enable_events control command).
        task_track_started=False,
        # One store of outcomes: the job record (written once, read by Client.result).
        # Celery's result backend would hold a second copy of every result for a day.
        task_ignore_result=True,
        worker_send_task_events=False,
        task_send_sent_event=False,
        broker_connection_retry_on_startup=True,
        # A full Redis (OOM) or a read-only replica mid-failover answers the consumer with an
        # error reply, which kombu counts as a channel error: retried as a lost connection
        # would be (reconnect, restore), never "Unrecoverable error" and a dead worker.
        # Redis only: RabbitMQ's channel errors (a consumer_timeout) keep Celery's own
        # handling, whose requeue and redelivery its tests follow.
        broker_channel_error_retry=connection.is_redis_broker(broker),
        # A broker restart leaves running jobs running: their outcome is written to the
        # job record (which rides out the restart) and a second delivery would find it.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport_options={
            "visibility_timeout": cfg.celery.visibility_timeout_s,
            "queue_order_strategy": "priority",
            "priority_steps": steps,
            "sep": PRIORITY_SEP,
        },
        result_backend_transport_options={"visibility_timeout": cfg.celery.visibility_timeout_s},
        task_queues=[Queue(queue_for(b), routing_key=queue_for(b)) for b in BACKENDS],
        task_default_queue=queue_for("pytorch"),
        task_create_missing_queues=True,
        timezone="UTC",
    )
    if broker.startswith("sentinel://"):
        # Redis Sentinel: BROKER_URL=sentinel://host:26379;sentinel://host2:26379, the
        # monitored master's name from IB_SENTINEL_MASTER
        app.conf.broker_transport_options["master_name"] = os.environ.get("IB_SENTINEL_MASTER", "mymaster")
    if not connection.is_redis_broker(broker):
        # RabbitMQ: priorities are per-queue (x-max-priority), higher first; unacked
        # messages go back to the queue when a consumer's connection closes, so the
        # Redis transport's visibility timeout and priority steps do not apply.
        app.conf.update(
            task_queue_max_priority=AMQP_MAX_PRIORITY,
            task_default_priority=AMQP_MAX_PRIORITY - steps[-1],
            broker_transport_options={},
        )
    return app


def message_priority(app: Celery, level: int) -> int:
    """Our levels (config ``priorities``: lower is served first, the Redis transport's
    order) as the broker wants them: RabbitMQ serves higher numbers first."""
    if connection.is_redis_broker(app.conf.broker_url):
        return level
    return AMQP_MAX_PRIORITY - level


@cache
def app_for(broker_url: str) -> Celery:
    return create_app(broker_url)


def get_app(broker_url: str | None = None) -> Celery:
    url = broker_url or connection.redis_url()
    if not url:
        raise BrokerNotConfigured("no broker configured: set REDIS_URL (e.g. redis://127.0.0.1:6379/0) or use `ib up`")
    return app_for(url)
