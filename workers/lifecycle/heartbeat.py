"""The worker's heartbeat: its WorkerInfo in Redis every few seconds, with a TTL.

The same thread also reaps dead workers (workers.redelivery.reaper), so a fleet with at least one
live worker redelivers a dead worker's jobs within about one heartbeat TTL, instead of
waiting for the broker's visibility timeout (hours, to cover the longest job).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from core.fleet import Health, WorkerInfo
from core.settings import HeartbeatSettings
from core.store import keys
from core.store.faults import WAIT_OUT, Episode

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        client: redis.Redis,
        info: WorkerInfo,
        timing: HeartbeatSettings,
        in_flight: Callable[[], int],
        on_beat: Callable[[], None] | None = None,
        engine_stats: Callable[[], dict[str, Any]] | None = None,
        health: Callable[[], Health] | None = None,
    ) -> None:
        self.r = client
        self.info = info
        self.in_flight = in_flight
        self.interval_s = timing.interval_s  # a beat this often
        self.ttl_s = timing.ttl_s  # the worker counts as dead this long after its last beat
        self.on_beat = on_beat
        self.engine_stats = engine_stats
        self.health = health
        self._stop = threading.Event()
        self._fault = Episode(log, "heartbeat", client)  # logged once per Redis fault
        self._link_down = False
        self._link_up_at: float | None = None  # monotonic time of the reconnection after an outage
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._beat = client.register_script(self._BEAT)
        self._shape: tuple[Any, ...] | None = None  # as of the last beat that reached Redis

    # The beat, and a bump of the fleet epoch when the worker's shape changed or its key
    # had expired (a first beat, a worker back after an outage): clients holding a view
    # without it, or with its old shape, then read the fleet again (dispatcher.client).
    _BEAT = """
    if ARGV[3] == '1' or redis.call('EXISTS', KEYS[1]) == 0 then redis.call('INCR', KEYS[3]) end
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    redis.call('SADD', KEYS[2], ARGV[4])
    return 1
    """

    def beat(self) -> None:
        self.info.in_flight = self.in_flight()
        if self.engine_stats:
            self.info.engine_stats = self.engine_stats()
        if self.health:
            self.info.health = self.health()
        self.info.last_beat = time.time()
        shape = self.info.shape()
        self._beat(
            keys=[keys.worker(self.info.worker_id), keys.WORKERS, keys.FLEET_EPOCH],
            args=[self.info.model_dump_json(), int(self.ttl_s * 1000), int(shape != self._shape), self.info.worker_id],
        )
        self._shape = shape

    def set_status(self, status: str) -> None:
        self.info.status = status  # type: ignore[assignment]
        self.beat()

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def link_up_s(self) -> float | None:
        """Seconds since the heartbeat reached Redis again after failing; None if it never
        failed (0 while it fails). The reaper judges no peer dead until this is a TTL."""
        if self._link_down:
            return 0.0
        return None if self._link_up_at is None else time.monotonic() - self._link_up_at

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except WAIT_OUT as exc:  # a Redis blip, failover or full Redis must not kill the heartbeat
                self._link_down = True
                self._fault.failed(exc, "the heartbeat")
                continue
            except Exception:
                self._link_down = True
                log.warning("heartbeat failed", exc_info=True)
                continue
            self._fault.succeeded()
            if self._link_down:
                self._link_down, self._link_up_at = False, time.monotonic()
            try:
                if self.on_beat:
                    self.on_beat()
            except Exception:
                log.warning("after-beat work failed", exc_info=True)

    def stop(self) -> None:
        """Graceful exit: the worker leaves the fleet at once (its jobs were finished or
        handed back by Celery's warm shutdown)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        try:
            pipe = self.r.pipeline()
            pipe.delete(keys.worker(self.info.worker_id), keys.inflight(self.info.worker_id))
            pipe.srem(keys.WORKERS, self.info.worker_id)
            pipe.incr(keys.FLEET_EPOCH)  # views that hold it are stale now
            pipe.execute()
        except redis.RedisError:
            log.warning("could not remove heartbeat", exc_info=True)
