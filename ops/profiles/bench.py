"""`ib bench profiles`: the reference workload on each backend, into the ProfileBook.

Per backend, pinned to it (``backend=``), greedy, the same prompts and ``max_tokens``:
- single stream: one job at a time after a warm-up job; TTFT p50/p95 (submit → first
  token, through the whole fleet path) and tokens per second end to end;
- saturated: ``saturate`` jobs submitted at once; generated tokens over the wall time;
- memory: on CPU the kernel's peak RSS (VmHWM) of the worker and the engine's helpers,
  as its heartbeat reports it; on GPU the largest device memory used the heartbeat saw.
Backends are measured one after another, so they do not share the machine's cores.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from datetime import date

from core.fleet import WorkerInfo
from dispatcher.client import Client
from dispatcher.routing.profiles import LLAMA2_7B, BackendProfile, configured_concurrency, estimate_memory
from ops.measure import percentile

# Open-ended asks, so every backend generates up to max_tokens most of the time.
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a bicycle gear system works.",
    "Describe a busy market in a coastal town in the morning.",
    "Write a letter to a friend about learning to bake bread.",
    "Explain why the sky is blue to a ten-year-old, in detail.",
    "Describe the life cycle of a butterfly.",
    "Write a short speech welcoming new students to a school.",
    "Describe how to plan a hiking trip in the mountains.",
]


def hardware_label(w: WorkerInfo) -> str:
    hw = w.hardware
    if hw.gpus:
        return ", ".join(f"{g.name} ({g.memory_total_mb // 1024} GiB)" for g in hw.gpus)
    return f"{hw.cpu_model or 'CPU'}, {hw.cpu_cores} cores, {hw.ram_gb:g} GiB"


class MemoryWatch:
    """Reads a worker's heartbeat memory while a run goes on; keeps the largest (on CPU the
    heartbeat carries the kernel's peak, so no sample can miss it)."""

    def __init__(self, client: Client, worker_id: str, interval_s: float = 0.5) -> None:
        self.client, self.worker_id, self.interval_s = client, worker_id, interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        w = next((w for w in self.client.workers().workers if w.worker_id == self.worker_id), None)
        facts = w.health.facts if w else None
        if facts is not None:
            gpu = sum(g.memory_used_mb for g in facts.gpus)
            host = facts.peak_rss_mb if facts.peak_rss_mb is not None else facts.rss_mb  # the kernel's peak
            self.peak_mb = max(self.peak_mb, gpu if facts.gpus else host)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def measure_backend(
    client: Client,
    backend: str,
    model: str = "smollm2-135m",
    max_tokens: int = 64,
    saturate: int = 32,
    command: str = "ib bench profiles",
    progress: Callable[[str], None] = lambda _: None,
) -> BackendProfile:
    workers = client.workers().live(backend=backend, model=model)
    if not workers:
        raise RuntimeError(
            f"no live {backend} worker serves {model}: start one (`ib worker --backend {backend}`) or use --start"
        )
    worker = workers[0]

    def job(prompt: str) -> dict:
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "backend": backend,
            "sampling": {"max_tokens": max_tokens},
            "speculative": False,
        }

    client.submit(job(PROMPTS[0])).result(timeout=600)  # warm-up: first-call costs stay out
    with MemoryWatch(client, worker.worker_id) as memory:
        singles = []
        for i, prompt in enumerate(PROMPTS):
            progress(f"{backend}: single stream {i + 1}/{len(PROMPTS)}")
            singles.append(client.submit(job(prompt)).result(timeout=600))
        progress(f"{backend}: {saturate} jobs at once")
        handles = client.submit_many(job(PROMPTS[i % len(PROMPTS)]) for i in range(saturate))
        burst = [h.result(timeout=1800) for h in handles]
    ttfts = [r.timings.ttft_s * 1000 for r in singles if r.timings.ttft_s is not None]
    single_rates = [r.usage.completion_tokens / (r.timings.finished - r.timings.submitted) for r in singles]
    wall = max(r.timings.finished for r in burst) - min(r.timings.submitted for r in burst)
    kind = worker.hardware.kind
    return BackendProfile(
        backend=backend,
        hardware_kind=kind,
        hardware=hardware_label(worker),
        model=model,
        measured_at=date.today().isoformat(),
        command=command,
        jobs=len(singles),
        max_tokens=max_tokens,
        mean_completion_tokens=round(statistics.mean(r.usage.completion_tokens for r in singles + burst), 1),
        ttft_p50_ms=round(statistics.median(ttfts), 1),
        ttft_p95_ms=round(percentile(ttfts, 95), 1),
        single_stream_tok_s=round(statistics.median(single_rates), 1),
        saturated_tok_s=round(sum(r.usage.completion_tokens for r in burst) / wall, 1),
        saturated_jobs=saturate,
        memory_mb=round(memory.peak_mb, 0),
        memory_kind="gpu" if kind == "gpu" else "rss",
        estimate_7b=estimate_memory(LLAMA2_7B, backend, kind, configured_concurrency(backend)),
    )
