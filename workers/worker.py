"""Worker start-up: detect hardware, load one engine, heartbeat, consume the queues.

A worker serves one model. It consumes that model's shared queue on its backend
(``ib.<backend>`` for the registry's default model, ``ib.<backend>@<model>`` for any
other) and its own queue ``<shared>.<worker_id>`` (for prefix-affinity routing). Celery runs tasks in a thread
pool sized to what the engine wants in flight, so many jobs can share one batch; the
engine is loaded once, here, before the first job is taken.

Services that share the worker's process but belong to another layer (the batch feeder,
which routes lines with the dispatcher's tree) are handed in by the caller as
``sidecars``: the serving side never imports the submitting side.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from celery import Celery
from celery.app import trace as celery_trace
from celery.signals import worker_ready, worker_shutting_down

from dispatcher import broker_transport, connection, settings
from dispatcher.celery_app import BrokerNotConfigured, get_app, own_queue_for, queue_for, queued
from dispatcher.fleet import WorkerInfo
from dispatcher.jobs import UnsupportedByBackendError
from dispatcher.registry import ModelRegistry, backend_spec
from dispatcher.store import keys
from dispatcher.store.dead_letters import DeadLetters
from dispatcher.store.hints import PrefixHints
from dispatcher.store.jobstore import JobStore
from dispatcher.store.streams import StreamPublisher
from workers import group, hardware, metrics, reaper, reconnect, tasks
from workers.cancel_watch import CancelWatcher
from workers.dead_letter import consumer_class
from workers.engines import create_engine
from workers.health import ConsumeGate, HealthMonitor
from workers.heartbeat import Heartbeat
from workers.inflight import InflightLedger
from workers.models.prepare import prepare

log = logging.getLogger(__name__)


class Sidecar(Protocol):
    def stop(self) -> None: ...


# Called with (broker URL, worker id) once the engine is loaded; stopped when the worker exits.
SidecarFactory = Callable[[str, str], Sidecar]


def default_worker_id(backend: str, kind: str) -> str:
    return f"{backend}-{kind}-{socket.gethostname()}-{os.getpid()}"


def run_worker(
    backend: str,
    model: str,
    *,
    threads: int | None = None,
    concurrency: int | None = None,
    worker_id: str | None = None,
    use_gpu: bool | None = None,
    fmt: str | None = None,
    endpoint: str | None = None,
    loglevel: str = "INFO",
    metrics_port: int | None = None,
    sidecars: Sequence[SidecarFactory] = (),
) -> None:
    """Blocks until the worker is shut down (SIGTERM / SIGINT: warm shutdown)."""
    url = connection.redis_url()
    if url is None:
        raise BrokerNotConfigured("no broker: set REDIS_URL, or start the embedded one with `ib broker`")
    app = get_app(url)
    cfg = settings.fleet_config()
    client = connection.redis_client(url, resilient=True)
    store = JobStore(client, ttl_s=cfg.celery.result_expires_s)
    spec = ModelRegistry.from_config().get(model)
    bspec = backend_spec(backend)

    # Celery logs each task's return value at INFO; results hold generated text, which
    # stays out of the logs like the prompts do.
    celery_trace.LOG_SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"
    hw = hardware.detect(use_gpu)
    # The engine runs where the heartbeat says the worker is (`--cpu` on a GPU host too).
    engine_spec = bspec.for_model(
        spec,
        device="cuda" if hw.kind == "gpu" else "cpu",
        format=fmt or next((f for f in bspec.formats if f in spec.formats()), bspec.formats[0]),
        **({"endpoint": endpoint} if endpoint else {}),
    )
    if backend in spec.unsupported:
        raise UnsupportedByBackendError(f"{spec.name} cannot run on {backend}: {spec.unsupported[backend]}")
    if engine_spec.format in spec.artifacts:  # a Hub artifact is downloaded now, never during a job
        prepare(spec, engine_spec.format)
    worker_id = worker_id or default_worker_id(backend, hw.kind)
    threads = threads or hw.cpu_cores
    cancels = CancelWatcher(store.cancelled, announcements=store.cancel_announcements()).start()
    engine = create_engine(backend, spec, engine_spec, threads, cancel_source=cancels.cancelled)
    engine.load()
    concurrency = concurrency or engine.capacity

    queues = [queue_for(backend, spec.queue_model)]
    own_queue = None
    if connection.is_redis_broker(app.conf.broker_url):
        # Its own queue, for prefix-affinity sends (swept to the shared one if it dies), read
        # first at each priority: a job sent here for its prefix must not wait behind the
        # whole shared queue. With RabbitMQ a durable queue per worker would outlive it,
        # so jobs use the shared queue.
        own_queue = own_queue_for(backend, worker_id, spec.queue_model)
        queues.insert(0, own_queue)
    # Flower and `celery inspect` show node names: say the backend, hardware and model there too.
    nodename = f"{worker_id}@{backend}-{hw.kind}-{spec.name}.{socket.gethostname()}"
    worker_metrics = metrics.WorkerMetrics(backend, worker_id, spec.name)
    metrics_port = cfg.metrics.port if metrics_port is None else metrics_port
    own_port = None  # under `ib up` (multiprocess mode) the host's one endpoint serves them
    if metrics_port and not metrics.multiprocess_mode():
        own_port = metrics.serve(metrics_port)
        log.info("metrics on :%d/metrics", own_port)
    gpu_reader = hardware.NvmlHealthReader.open() if hw.kind == "gpu" else None
    monitor = HealthMonitor(cfg.health, gpu_reader)
    info = WorkerInfo(
        worker_id=worker_id,
        backend=backend,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        hardware=hw,
        models=[spec.name],
        queues=queues,
        capacity=concurrency,
        started_at=time.time(),
        status="starting",
        metrics_port=own_port,
    )
    if own_queue is not None:
        client.hset(keys.WORKER_QUEUES, worker_id, own_queue)  # swept to the shared queue if this worker dies
    # A block this worker confirmed within a 60th of the TTL (a minute by default) is not
    # written again: a job's blocks are confirmed as it starts and as it finishes.
    hints = PrefixHints(
        client, cfg.prefix.hint_ttl_s, cfg.prefix.max_worker_blocks, refresh_s=cfg.prefix.hint_ttl_s / 60
    )
    hints.drop_worker(worker_id)  # a restarted worker holds no KV state, whatever hints said
    reaper.recover_own(client, app, worker_id)  # a previous process with this id died holding jobs
    letters = DeadLetters(client)
    runtime = tasks.Runtime(
        engine=engine,
        store=store,
        redis=client,
        worker_id=worker_id,
        cancels=cancels,
        streams=StreamPublisher(client, ttl_s=cfg.celery.result_expires_s),
        time_limit_s=cfg.celery.job_time_limit_s,
        hints=hints,
        metrics=worker_metrics,
        dead_letters=letters,
        inflight=InflightLedger(client, worker_id),
    )
    # The Redis transport writes each taken message's record with its unacked write; the
    # ledger's thread still removes them, and records them on any other broker.
    broker_transport.record_taken(runtime.inflight.record)
    tasks.register(app, runtime, show_text=cfg.flower.show_text)
    group.register(app, runtime)
    app.conf.worker_consumer = consumer_class(letters)  # undecodable messages are kept, not dropped
    reconnect.install(app, runtime)
    beat = Heartbeat(
        client,
        info,
        in_flight=lambda: engine.in_flight,
        interval_s=cfg.heartbeat.interval_s,
        ttl_s=cfg.heartbeat.ttl_s,
        on_beat=lambda: _on_beat(),
        engine_stats=engine.stats,
        health=monitor.check,
    ).start()
    # an unacked message that no live worker holds, this old, was lost between two records
    untracked_after_s = 2 * cfg.heartbeat.ttl_s
    gate = ConsumeGate(
        lambda q: _control(app, "cancel_consumer", q, nodename),
        lambda q: _control(app, "add_consumer", q, nodename),
        queues,
    )
    ready = False

    def _on_beat() -> None:
        # its own queue's depth: the autoscaler counts it (KEDA's list scaler cannot, the
        # names change with every pod)
        own_depth = queued(client, own_queue, cfg.priorities.steps()) if own_queue else None
        worker_metrics.sample(engine.in_flight, concurrency, beat.info.health, own_depth)
        if ready:
            try:
                gate.update(beat.info.health)
            except Exception:  # tried again at the next beat
                log.warning("could not change consuming after a health change", exc_info=True)
        reaper.reap(client, app, worker_id, untracked_after_s, grace_s=cfg.heartbeat.ttl_s, link_up_s=beat.link_up_s())

    started = [make(url, worker_id) for make in sidecars]

    @worker_ready.connect(weak=False)
    def _ready(**_: object) -> None:
        nonlocal ready
        ready = True  # the consuming gate acts from the next beat (not here: this thread runs the consumer)
        beat.set_status("ready")
        reaper.reap(client, app, worker_id, untracked_after_s, grace_s=cfg.heartbeat.ttl_s, link_up_s=beat.link_up_s())
        log.info("worker %s ready: %s, queues %s, concurrency %d", worker_id, engine.describe(), queues, concurrency)

    @worker_shutting_down.connect(weak=False)
    def _draining(**_: object) -> None:
        beat.set_status("draining")

    try:
        app.worker_main(
            argv=[
                "worker",
                f"--hostname={nodename}",
                f"--queues={','.join(queues)}",
                "--pool=threads",
                f"--concurrency={concurrency}",
                f"--loglevel={loglevel}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    finally:
        for sidecar in started:
            sidecar.stop()
        runtime.inflight.close()  # its last removals land before the heartbeat drops the hash
        beat.stop()
        reaper.leave(client, worker_id)
        if runtime.streams is not None:
            runtime.streams.close()  # what is still queued (end entries, their TTLs) is written
        engine.close()
        cancels.stop()
        if gpu_reader is not None:
            gpu_reader.close()


def _control(app: Celery, command: str, queue: str, nodename: str) -> None:
    """A remote-control command to this worker itself, run by its consumer thread."""
    replies = app.control.broadcast(command, arguments={"queue": queue}, destination=[nodename], reply=True, timeout=5)
    if not replies:
        raise RuntimeError(f"{command} {queue}: no reply from {nodename}")
