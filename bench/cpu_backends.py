"""CPU backends side by side, through the fleet, in one run.

    python bench/cpu_backends.py [--prompts 32] [--max-tokens 64] [--threads 2] [--in-flight 16]

For each backend (PyTorch eager fp32, ONNX Runtime fp32 and int4; llama.cpp joins when
its engine lands) one `ib worker` is started alone on this machine and given the same
32 chat prompts, greedy, 64 new tokens:

* single stream: one job at a time; TTFT (from submit, what a client sees) p50/p95 and
  the decode rate (tokens after the first / time since the first), median;
* saturated: ``--in-flight`` client threads each submitting and waiting, aggregate
  generated tok/s;
* the worker's peak RSS (VmHWM).

Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from dispatcher import settings  # noqa: E402
from dispatcher.broker import EmbeddedBroker  # noqa: E402
from dispatcher.client import Client  # noqa: E402
from dispatcher.localfleet import WorkerProcess  # noqa: E402
from dispatcher.registry import ModelRegistry  # noqa: E402
from workers import hardware  # noqa: E402
from workers.model_prep import prepare  # noqa: E402

console = Console()
SUBJECTS = ["the sea", "a city", "winter", "a robot", "coffee", "mountains", "a library", "the moon"]
ASKS = ["Write two sentences about {}.", "Describe {} in a few words.", "Give one fact about {}.", "Why do people like {}?"]
# (label, backend, artifact format served)
BACKENDS = [("PyTorch eager fp32", "pytorch", "hf"), ("ONNX Runtime fp32", "onnx", "onnx"), ("ONNX Runtime int4", "onnx", "onnx-int4")]


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(SUBJECTS[(i // len(ASKS)) % len(SUBJECTS)]) for i in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(client: Client, backend: str, texts: list[str], max_tokens: int, in_flight: int) -> dict:
    def job(text: str) -> dict:
        return {"model": "smollm2-135m", "messages": [{"role": "user", "content": text}],
                "sampling": {"max_tokens": max_tokens}, "backend": backend}  # fmt: skip

    client.submit(job(texts[0])).result(timeout=300)  # warm-up
    single = [client.submit(job(t)).result(timeout=300) for t in texts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        saturated = list(pool.map(lambda t: client.submit(job(t)).result(timeout=900), texts))
    wall = time.perf_counter() - t0
    ttfts = [r.timings.ttft_s * 1000 for r in single]
    return {
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p95_ms": pct(ttfts, 0.95),
        "decode_tok_s": statistics.median(r.tokens_per_s for r in single),
        "aggregate_tok_s": sum(r.usage.completion_tokens for r in saturated) / wall,
        "single_tokens": sum(r.usage.completion_tokens for r in single),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    spec = ModelRegistry.from_config().get("smollm2-135m")
    for _, _, fmt in BACKENDS:
        prepare(spec, fmt)
    texts = prompts(args.prompts)
    broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
    rows = {}
    try:
        client = Client(broker.url)
        for label, backend, fmt in BACKENDS:
            extra = [f"--threads={args.threads}"] + ([f"--format={fmt}"] if backend == "onnx" else [])
            worker = WorkerProcess(backend, broker.url, extra_args=extra).start()
            try:
                worker.wait_ready(timeout=300)
                console.print(f"[bold]{label}[/]: {len(texts)} prompts x {args.max_tokens} tokens ...")
                rows[label] = measure(client, backend, texts, args.max_tokens, args.in_flight)
                rows[label]["peak_rss_mb"] = peak_rss_mb(worker.proc.pid)
            finally:
                worker.stop()
    finally:
        broker.stop()

    base = rows["PyTorch eager fp32"]["aggregate_tok_s"]
    table = Table(title=f"CPU backends: {args.prompts} chat prompts, greedy, {args.max_tokens} new tokens, "
                        f"{args.threads} threads, {args.in_flight} in flight")  # fmt: skip
    for col in ("backend", "TTFT p50", "TTFT p95", "decode tok/s (1 stream)", f"aggregate tok/s ({args.in_flight} in flight)",
                "vs PyTorch", "worker peak RSS"):  # fmt: skip
        table.add_column(col, justify="right")
    for label, r in rows.items():
        table.add_row(label, f"{r['ttft_p50_ms']:.0f} ms", f"{r['ttft_p95_ms']:.0f} ms", f"{r['decode_tok_s']:.1f}",
                      f"{r['aggregate_tok_s']:.1f}", f"{r['aggregate_tok_s'] / base:.2f}x", f"{r['peak_rss_mb']:.0f} MB")  # fmt: skip
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu_backends-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {"bench": "cpu_backends", "time": time.time(), "args": vars(args),
              "hardware": hardware.detect(False).model_dump(), "rows": rows}  # fmt: skip
    path.write_text(json.dumps(record, indent=2))
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
