"""Worker health: facts at each heartbeat, thresholds from config, and the gate.

A worker whose facts cross a threshold (GPU memory nearly full, too hot, uncorrected ECC
errors or a critical Xid event; on CPU, host RAM or its own memory) stops taking new
jobs: it cancels its queue consumers, says why in its heartbeat (``ib workers``), and the
dispatcher does not count it live. Jobs already running finish. When the facts are back
within bounds it consumes again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from core.fleet import GPUHealth, Health, HealthFacts
from core.settings import HealthSettings

log = logging.getLogger(__name__)


def evaluate(facts: HealthFacts, limits: HealthSettings) -> list[str]:
    """Why the worker should not take jobs (empty: healthy). Pure, for the unit tests."""
    reasons = []
    if limits.max_ram_frac and facts.ram_used_frac > limits.max_ram_frac:
        reasons.append(f"host RAM {facts.ram_used_frac:.0%} used > {limits.max_ram_frac:.0%}")
    if limits.max_rss_mb and facts.rss_mb > limits.max_rss_mb:
        reasons.append(f"worker memory {facts.rss_mb:.0f} MB > {limits.max_rss_mb:.0f} MB")
    for g in facts.gpus:
        if (
            limits.max_gpu_mem_frac
            and g.memory_total_mb
            and g.memory_used_mb / g.memory_total_mb > limits.max_gpu_mem_frac
        ):
            reasons.append(
                f"GPU {g.index} memory {g.memory_used_mb}/{g.memory_total_mb} MiB > {limits.max_gpu_mem_frac:.1%}"
            )
        if g.temperature_c is not None and g.temperature_c > limits.max_gpu_temp_c:
            reasons.append(f"GPU {g.index} at {g.temperature_c} C > {limits.max_gpu_temp_c:g} C")
        if g.ecc_uncorrected is not None and g.ecc_uncorrected > limits.max_ecc_uncorrected:
            reasons.append(f"GPU {g.index}: {g.ecc_uncorrected} uncorrected ECC error(s)")
        if limits.xid_fatal and g.xid_errors:
            reasons.append(f"GPU {g.index}: Xid error(s) {', '.join(map(str, sorted(set(g.xid_errors))))}")
    return reasons


def process_family(proc: psutil.Process | None = None) -> list[psutil.Process]:
    """This process and its children (vLLM's engine core, a spawned helper). Finding the
    children reads every process's /proc entry: done once per beat, for both figures."""
    proc = proc or psutil.Process()
    return [proc, *proc.children(recursive=True)]


def process_rss_mb(family: list[psutil.Process] | None = None) -> float:
    """Resident memory of this process and its children (``process_family``)."""
    total = 0
    for p in family if family is not None else process_family():
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def process_peak_rss_mb(family: list[psutil.Process] | None = None) -> float | None:
    """The kernel's high-water mark (VmHWM) of this process and its children, summed (an
    upper bound when their peaks came at different times); None where /proc has no VmHWM."""
    total, found = 0, False
    for p in family if family is not None else process_family():
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
                found = True
    return total / 2**20 if found else None


class HealthMonitor:
    """Reads the facts each beat; GPU facts through a long-lived NVML session."""

    def __init__(self, limits: HealthSettings, gpu_reader: Callable[[], list[GPUHealth]] | None = None) -> None:
        self.limits = limits
        self.gpu_reader = gpu_reader
        self._proc = psutil.Process()
        self._proc.cpu_percent()  # the first call only starts the interval

    def facts(self) -> HealthFacts:
        family = process_family(self._proc)
        return HealthFacts(
            cpu_percent=self._proc.cpu_percent(),
            ram_used_frac=psutil.virtual_memory().percent / 100,
            rss_mb=round(process_rss_mb(family), 1),
            peak_rss_mb=_rounded(process_peak_rss_mb(family)),
            gpus=self.gpu_reader() if self.gpu_reader else [],
        )

    def check(self) -> Health:
        facts = self.facts()
        reasons = evaluate(facts, self.limits)
        return Health(ok=not reasons, reasons=reasons, facts=facts)


class ConsumeGate:
    """Stops and restarts consuming on the worker's queues as health changes.

    Celery's remote control (cancel_consumer / add_consumer, addressed to this worker's
    node name) is used because it runs the change inside the consumer's own thread."""

    def __init__(self, cancel: Callable[[str], None], add: Callable[[str], None], queues: list[str]) -> None:
        self.cancel, self.add, self.queues = cancel, add, queues
        self.consuming = True
        self.stopped_at: float | None = None  # when it stopped consuming (monotonic)

    def stopped_for(self) -> float:
        """Seconds since it stopped consuming (0 while consuming)."""
        return 0.0 if self.stopped_at is None else time.monotonic() - self.stopped_at

    def update(self, health: Health) -> bool:
        """Apply one health reading; returns True when consuming changed."""
        if health.ok == self.consuming:
            return False
        for q in self.queues:
            (self.add if health.ok else self.cancel)(q)
        self.consuming = health.ok
        self.stopped_at = None if health.ok else time.monotonic()
        if health.ok:
            log.warning("worker healthy again: consuming %s", ", ".join(self.queues))
        else:
            log.warning("worker unhealthy, not taking new jobs: %s", "; ".join(health.reasons))
        return True


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
