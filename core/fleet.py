"""The live fleet, read from worker heartbeats in Redis.

Each worker writes ``ib:worker:<id>`` (JSON, with a TTL) every few seconds and adds its id
to ``ib:workers``. A worker whose key has expired is dead: the dispatcher stops routing to
it and a live worker redelivers the jobs it held (see workers.redelivery.reaper).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

import redis
from pydantic import BaseModel, Field

from core.store import keys


class GPUInfo(BaseModel):
    index: int
    name: str
    memory_total_mb: int
    memory_used_mb: int | None = None


class HardwareInfo(BaseModel):
    kind: Literal["gpu", "cpu"]
    gpus: list[GPUInfo] = Field(default_factory=list)
    cpu_cores: int
    ram_gb: float
    cpu_model: str = ""


class GPUHealth(BaseModel):
    """One GPU as NVML saw it at the last beat (None: the driver does not say)."""

    index: int
    memory_used_mb: int
    memory_total_mb: int
    utilization_pct: int | None = None
    temperature_c: int | None = None
    ecc_uncorrected: int | None = None  # volatile (since the driver loaded) uncorrected ECC errors
    xid_errors: list[int] = Field(default_factory=list)  # critical Xid events seen since the worker started


class HealthFacts(BaseModel):
    cpu_percent: float
    ram_used_frac: float
    rss_mb: float  # the worker and its children (vLLM's engine core): the engine's memory
    # the kernel's peak of the same processes (VmHWM, summed): what a benchmark reports,
    # since a heartbeat's sample can miss the peak between two beats
    peak_rss_mb: float | None = None
    gpus: list[GPUHealth] = Field(default_factory=list)


class Health(BaseModel):
    """A worker that is not ok stops consuming and the dispatcher does not count it live."""

    ok: bool = True
    reasons: list[str] = Field(default_factory=list)
    facts: HealthFacts | None = None

    def describe(self) -> str:
        """One line for `ib workers`: the verdict, its reasons, and the facts behind it."""
        if not self.ok:
            return "UNHEALTHY: " + "; ".join(self.reasons)
        if self.facts is None:
            return "ok"
        f = self.facts
        gpus = "".join(
            f", GPU{g.index} {g.memory_used_mb}/{g.memory_total_mb} MiB"
            + (f" {g.temperature_c} C" if g.temperature_c is not None else "")
            for g in f.gpus
        )
        return f"ok (rss {f.rss_mb:.0f} MB, RAM {f.ram_used_frac:.0%}{gpus})"


class WorkerInfo(BaseModel):
    worker_id: str
    backend: str
    hostname: str
    pid: int
    hardware: HardwareInfo
    models: list[str]
    queues: list[str]
    in_flight: int = 0
    capacity: int = 1
    started_at: float
    last_beat: float = Field(default_factory=time.time)
    status: Literal["starting", "ready", "draining"] = "ready"
    # The engine's own counters (running sequences seen, prefix cache hits, ...), as of
    # the last beat: what the engine did, not what the queue saw.
    engine_stats: dict[str, Any] = Field(default_factory=dict)
    health: Health = Field(default_factory=Health)
    metrics_port: int | None = None  # its own /metrics (None: served by `ib up`, or off)
    # Passes of its reaper so far (as of the last beat): an operator or a test sees that
    # dead peers are being looked for, not only that nobody was reaped.
    reaper_passes: int = 0

    @property
    def load(self) -> float:
        return self.in_flight / max(1, self.capacity)

    def shape(self) -> tuple[Any, ...]:
        """What the dispatcher's decision reads of a worker (FleetView.live, its health
        verdict, its capacity): a beat that changes it bumps the fleet epoch. Load and
        the engine's counters are not in it; the decision reads live load from Redis."""
        return (
            self.backend,
            tuple(self.models),
            tuple(self.queues),
            self.hardware.kind,
            self.status,
            self.health.ok,
            self.capacity,
        )


class FleetView(BaseModel):
    """A snapshot of the live workers; the decision tree reads only this."""

    workers: list[WorkerInfo] = Field(default_factory=list)
    # The fleet epoch this view was read at (keys.FLEET_EPOCH): while it is unchanged and
    # every worker in the view still beats, a decision on the view is one on a fresh read.
    epoch: int = 0

    def live(self, backend: str | None = None, model: str | None = None, gpu: bool | None = None) -> list[WorkerInfo]:
        return [
            w
            for w in self.workers
            if w.status == "ready"
            and w.health.ok
            and (backend is None or w.backend == backend)
            and (model is None or model in w.models)
            and (gpu is None or (w.hardware.kind == "gpu") == gpu)
        ]

    def with_in_flight(self, loads: Mapping[str, int]) -> FleetView:
        """This view with the given workers' jobs in flight replaced (a live reading)."""
        return self.model_copy(
            update={
                "workers": [
                    w.model_copy(update={"in_flight": loads[w.worker_id]}) if w.worker_id in loads else w
                    for w in self.workers
                ]
            }
        )

    def premise(self) -> tuple[list[str], str]:
        """What must still hold for a decision on this view to be one on a fresh read, as
        keys and an argument for a script (store.jobstore.CLAIM_AND_PUSH): the epoch's
        key, then every worker's heartbeat key; the epoch it was read at."""
        return [keys.FLEET_EPOCH, *(keys.worker(w.worker_id) for w in self.workers)], str(self.epoch)

    def unhealthy(self, backend: str, model: str) -> list[WorkerInfo]:
        """Workers that would serve but said they are unhealthy (for the decision's path)."""
        return [w for w in self.workers if not w.health.ok and w.backend == backend and model in w.models]


# The fleet epoch, the member list and every member's heartbeat in one round trip (a
# submit that decides on a fresh view pays it; two round trips were ~0.7 ms of the path).
_READ_FLEET = """
local out = {redis.call('GET', KEYS[2]) or '0'}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local beat = redis.call('GET', ARGV[1] .. id)
  if beat then out[#out + 1] = beat end
end
return out
"""


def read_fleet(client: redis.Redis) -> FleetView:
    """All live workers (a member whose heartbeat expired is dead, and left out)."""
    epoch, *raw = client.eval(_READ_FLEET, 2, keys.WORKERS, keys.FLEET_EPOCH, keys.worker(""))
    workers = sorted((WorkerInfo.model_validate_json(r) for r in raw), key=lambda w: w.worker_id)
    return FleetView(workers=workers, epoch=int(epoch))
