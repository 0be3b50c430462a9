"""Worker start-up: detect hardware, load one engine, heartbeat, consume the queues.

A worker serves one model. It consumes that model's shared queue on its backend
(``ib.<backend>`` for the registry's default model, ``ib.<backend>@<model>`` for any
other) and its own queue ``<shared>.<worker_id>`` (for prefix-affinity routing). Celery runs tasks in a thread
pool sized to what the engine wants in flight, so many jobs can share one batch; the
engine is loaded once, here, before the first job is taken.

This module wires the three folders beside it: running/ (the tasks), lifecycle/ (the
heartbeat, health, metrics) and redelivery/ (what the worker holds, the reaper, the
restore after a reconnect, dead letters). What a started worker holds is one ``Worker``, each start-up step
one method of it.

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
from dataclasses import dataclass
from typing import Protocol

from celery import Celery
from celery.app import trace as celery_trace
from celery.signals import worker_ready, worker_shutting_down

from core import connection, settings
from core.backends import BackendSpec, backend_spec
from core.celery_app import BrokerNotConfigured, get_app, own_queue_for, queue_for, queued
from core.errors import UnsupportedByBackendError
from core.fleet import WorkerInfo
from core.registry import ModelRegistry, ModelSpec
from core.store import keys, memory_policy
from core.store.dead_letters import DeadLetters
from core.store.hints import PrefixHints
from core.store.jobstore import JobStore
from core.store.streams import StreamPublisher
from workers.engines import create_engine
from workers.engines.base import Engine
from workers.lifecycle import hardware, metrics
from workers.lifecycle.health import ConsumeGate, HealthMonitor
from workers.lifecycle.heartbeat import Heartbeat
from workers.models.prepare import prepare
from workers.redelivery import reaper, reconnect, taken
from workers.redelivery.dead_letter import consumer_class
from workers.redelivery.inflight import InflightLedger
from workers.redelivery.taken import recording_consumer
from workers.running import group, outage, tasks
from workers.running.cancel_watch import CancelWatcher

log = logging.getLogger(__name__)


class Sidecar(Protocol):
    def stop(self) -> None: ...


# Called with (broker URL, worker id) once the engine is loaded; stopped when the worker exits.
SidecarFactory = Callable[[str, str], Sidecar]


@dataclass
class WorkerOptions:
    """What `ib worker` asks for; None: the engine's or the config's default."""

    backend: str
    model: str
    threads: int | None = None  # engine threads (default: the cores this process may use)
    concurrency: int | None = None  # jobs in flight (default: what the engine wants)
    worker_id: str | None = None  # stable id (default: backend-kind-host-pid)
    use_gpu: bool | None = None  # False: the CPU even on a GPU host
    fmt: str | None = None  # the artifact format to serve
    endpoint: str | None = None  # tgi: the server's URL
    loglevel: str = "INFO"
    metrics_port: int | None = None  # default: metrics.port; 0: off


def default_worker_id(backend: str, kind: str) -> str:
    return f"{backend}-{kind}-{socket.gethostname()}-{os.getpid()}"


def run_worker(options: WorkerOptions, sidecars: Sequence[SidecarFactory] = ()) -> None:
    """Blocks until the worker is shut down (SIGTERM / SIGINT: warm shutdown)."""
    url = connection.redis_url()
    if url is None:
        raise BrokerNotConfigured("no broker: set REDIS_URL, or start the embedded one with `ib broker`")
    worker = Worker(options, url)
    memory_policy.check(worker.redis, f"worker {worker.worker_id}")  # before minutes of engine loading
    worker.load_engine()
    worker.announce()
    worker.register_tasks()
    worker.start_heartbeat()
    started = [make(url, worker.worker_id) for make in sidecars]
    try:
        worker.consume()
    finally:
        for sidecar in started:
            sidecar.stop()
        worker.close()


class Worker:
    """A worker process's parts, made by its start-up steps in order."""

    engine: Engine
    runtime: tasks.Runtime
    beat: Heartbeat

    def __init__(self, options: WorkerOptions, url: str) -> None:
        self.options = options
        self.app: Celery = get_app(url)
        self.cfg = settings.fleet_config()
        self.redis = connection.redis_client(url, resilient=True)
        outage.watch(self.redis)  # a full Redis is logged with its memory numbers
        taken.watch(self.redis)
        self.store = JobStore(self.redis, ttl_s=self.cfg.celery.result_expires_s)
        self.spec: ModelSpec = ModelRegistry.from_config().get(options.model)
        # Celery logs each task's return value at INFO; results hold generated text, which
        # stays out of the logs like the prompts do.
        celery_trace.LOG_SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"
        self.hw = hardware.detect(options.use_gpu)
        self.worker_id = options.worker_id or default_worker_id(options.backend, self.hw.kind)
        self.gpu_reader: hardware.NvmlHealthReader | None = None
        self.ready = False

    # ------------------------------------------------------------- start-up steps

    def load_engine(self) -> None:
        """The engine, loaded once, where the heartbeat says the worker is (`--cpu` on a
        GPU host too); a Hub artifact is downloaded now, never during a job."""
        backend, spec = self.options.backend, self.spec
        engine_spec = self._engine_spec(backend_spec(backend))
        if backend in spec.unsupported:
            raise UnsupportedByBackendError(f"{spec.name} cannot run on {backend}: {spec.unsupported[backend]}")
        if engine_spec.format in spec.artifacts:
            prepare(spec, engine_spec.format)
        threads = self.options.threads or self.hw.cpu_cores
        self.cancels = CancelWatcher(self.store.cancelled, announcements=self.store.cancel_announcements()).start()
        self.engine = create_engine(backend, spec, engine_spec, threads, cancel_source=self.cancels.cancelled)
        self.engine.load()
        self.concurrency = self.options.concurrency or self.engine.capacity

    def _engine_spec(self, bspec: BackendSpec) -> BackendSpec:
        formats = self.spec.formats()
        return bspec.for_model(
            self.spec,
            device="cuda" if self.hw.kind == "gpu" else "cpu",
            format=self.options.fmt or next((f for f in bspec.formats if f in formats), bspec.formats[0]),
            **({"endpoint": self.options.endpoint} if self.options.endpoint else {}),
        )

    def announce(self) -> None:
        """Its queues, metrics and heartbeat facts; a restarted worker's leftovers cleared."""
        backend, spec = self.options.backend, self.spec
        self.queues = [queue_for(backend, spec.queue_model)]
        self.own_queue: str | None = None
        if connection.is_redis_broker(self.app.conf.broker_url):
            # Its own queue, for prefix-affinity sends (swept to the shared one if it dies), read
            # first at each priority: a job sent here for its prefix must not wait behind the
            # whole shared queue. With RabbitMQ a durable queue per worker would outlive it,
            # so jobs use the shared queue.
            self.own_queue = own_queue_for(backend, self.worker_id, spec.queue_model)
            self.queues.insert(0, self.own_queue)
            self.redis.hset(keys.WORKER_QUEUES, self.worker_id, self.own_queue)  # swept if this worker dies
        # Flower and `celery inspect` show node names: say the backend, hardware and model there too.
        self.nodename = f"{self.worker_id}@{backend}-{self.hw.kind}-{spec.name}.{socket.gethostname()}"
        self.metrics = metrics.WorkerMetrics(backend, self.worker_id, spec.name)
        port = self.cfg.metrics.port if self.options.metrics_port is None else self.options.metrics_port
        own_port = None  # under `ib up` (multiprocess mode) the host's one endpoint serves them
        if port and not metrics.multiprocess_mode():
            own_port = metrics.serve(port)
            log.info("metrics on :%d/metrics", own_port)
        self.info = WorkerInfo(
            worker_id=self.worker_id,
            backend=backend,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            hardware=self.hw,
            models=[spec.name],
            queues=self.queues,
            capacity=self.concurrency,
            started_at=time.time(),
            status="starting",
            metrics_port=own_port,
        )

    def register_tasks(self) -> None:
        """The Runtime the tasks share, the tasks, and the broker bookkeeping around them."""
        cfg, client = self.cfg, self.redis
        # A block this worker confirmed within a 60th of the TTL (a minute by default) is not
        # written again: a job's blocks are confirmed as it starts and as it finishes.
        hints = PrefixHints(
            client, cfg.prefix.hint_ttl_s, cfg.prefix.max_worker_blocks, refresh_s=cfg.prefix.hint_ttl_s / 60
        )
        hints.drop_worker(self.worker_id)  # a restarted worker holds no KV state, whatever hints said
        reaper.recover_own(client, self.app, self.worker_id)  # a previous process with this id died holding jobs
        letters = DeadLetters(client)
        self.runtime = tasks.Runtime(
            engine=self.engine,
            store=self.store,
            redis=client,
            worker_id=self.worker_id,
            cancels=self.cancels,
            streams=StreamPublisher(client, ttl_s=cfg.celery.result_expires_s),
            time_limit_s=cfg.celery.job_time_limit_s,
            hints=hints,
            metrics=self.metrics,
            dead_letters=letters,
            inflight=InflightLedger(client, self.worker_id),
        )
        tasks.register(self.app, self.runtime, show_text=cfg.flower.show_text)
        group.register(self.app, self.runtime)
        consumer = consumer_class(letters)  # undecodable messages are kept, not dropped
        if connection.is_redis_broker(self.app.conf.broker_url):
            # The Redis transport writes each taken message's record with its unacked write; the
            # ledger's thread still removes them, and records them on any other broker.
            consumer = recording_consumer(consumer, self.runtime.inflight.record)
        self.app.conf.worker_consumer = consumer
        reconnect.install(self.app, self.redis, self.runtime.inflight)

    def start_heartbeat(self) -> None:
        """The heartbeat, the health gate it drives, and the reaper it runs each beat."""
        if self.hw.kind == "gpu":
            self.gpu_reader = hardware.NvmlHealthReader.open()
        monitor = HealthMonitor(self.cfg.health, self.gpu_reader)
        engine = self.engine
        self.beat = Heartbeat(
            self.redis,
            self.info,
            self.cfg.heartbeat,
            in_flight=lambda: engine.in_flight,
            on_beat=self._on_beat,
            engine_stats=engine.stats,
            health=monitor.check,
        ).start()
        self.gate = ConsumeGate(
            lambda q: _control(self.app, "cancel_consumer", q, self.nodename),
            lambda q: _control(self.app, "add_consumer", q, self.nodename),
            self.queues,
        )

    def consume(self) -> None:
        """Celery's worker, in this thread, until shut down."""
        worker_ready.connect(self._on_ready, weak=False)
        worker_shutting_down.connect(self._on_draining, weak=False)
        self.app.worker_main(
            argv=[
                "worker",
                f"--hostname={self.nodename}",
                f"--queues={','.join(self.queues)}",
                "--pool=threads",
                f"--concurrency={self.concurrency}",
                f"--loglevel={self.options.loglevel}",
                "--without-gossip",
                "--without-mingle",
            ]
        )

    def close(self) -> None:
        """Everything started, stopped in order: what is still queued to Redis lands first."""
        self.runtime.inflight.close()  # its last removals land before the heartbeat drops the hash
        self.beat.stop()
        reaper.leave(self.redis, self.worker_id)
        if self.runtime.streams is not None:
            self.runtime.streams.close()  # what is still queued (end entries, their TTLs) is written
        self.engine.close()
        self.cancels.stop()
        if self.gpu_reader is not None:
            self.gpu_reader.close()

    # ------------------------------------------------------------- while it runs

    def _reap(self) -> None:
        # an unacked message that no live worker holds, this old, was lost between two records
        untracked_after_s = 2 * self.cfg.heartbeat.ttl_s
        ttl = self.cfg.heartbeat.ttl_s
        reaper.reap(
            self.redis, self.app, self.worker_id, untracked_after_s, grace_s=ttl, link_up_s=self.beat.link_up_s()
        )
        self.beat.info.reaper_passes += 1  # published with the next beat

    def _on_beat(self) -> None:
        # its own queue's depth: the autoscaler counts it (KEDA's list scaler cannot, the
        # names change with every pod)
        steps = self.cfg.priorities.steps()
        own_depth = queued(self.redis, self.own_queue, steps) if self.own_queue else None
        self.metrics.sample(self.engine.in_flight, self.concurrency, self.beat.info.health, own_depth)
        if self.ready:
            try:
                self.gate.update(self.beat.info.health)
            except Exception:  # tried again at the next beat
                log.warning("could not change consuming after a health change", exc_info=True)
            self._hand_over_own_queue()
        self._reap()

    def _hand_over_own_queue(self) -> None:
        """Unhealthy past ``health.own_queue_grace_s``: what prefix affinity sent to this
        worker's own queue goes to the shared queue (the reaper does it only for dead
        workers; a live one that stopped consuming would strand it)."""
        grace = self.cfg.health.own_queue_grace_s
        if self.own_queue and not self.gate.consuming and self.gate.stopped_for() >= grace:
            why = f"unhealthy for {self.gate.stopped_for():.0f} s"
            reaper.move_own_queue(self.redis, self.worker_id, self.own_queue, self.cfg.priorities.steps(), why)

    def _on_ready(self, **_: object) -> None:
        self.ready = True  # the consuming gate acts from the next beat (not here: this thread runs the consumer)
        self.beat.set_status("ready")
        self._reap()
        log.info(
            "worker %s ready: %s, queues %s, concurrency %d",
            self.worker_id,
            self.engine.describe(),
            self.queues,
            self.concurrency,
        )

    def _on_draining(self, **_: object) -> None:
        self.beat.set_status("draining")


def _control(app: Celery, command: str, queue: str, nodename: str) -> None:
    """A remote-control command to this worker itself, run by its consumer thread."""
    replies = app.control.broadcast(command, arguments={"queue": queue}, destination=[nodename], reply=True, timeout=5)
    if not replies:
        raise RuntimeError(f"{command} {queue}: no reply from {nodename}")
