"""What does the fleet add on top of the engine? The same prompts both ways, in one run.

    python -m bench.fleet_overhead [--jobs 64] [--max-tokens 32] [--threads 1]

* in-process: a PyTorchEngine in this process, fed by one thread per job, as a worker's
  task threads feed it;
* fleet: Client.submit → Redis → Celery worker process (same engine, same settings) →
  result back through Redis.

Two modes, each run for both paths back to back: sequential (one job at a time, each
prompt both ways in alternating order: per-job latency, the median paired difference,
and the fleet path itself = end-to-end time minus the time the job spent in the worker)
and saturated (all jobs at once, ``--rounds`` times both ways, which side goes first
alternating round by round: throughput in generated tokens/s and the median of the
per-round ratios, since this machine's speed drifts). Greedy, fixed max tokens, same
prompts, same thread count. Prints a table and writes JSON to bench/results/.
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

from rich.console import Console
from rich.table import Table

from core import connection, settings
from core.backends import load_backends
from core.jobs import GenerationJob
from core.registry import ModelRegistry
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from workers.lifecycle import hardware
from workers.models.prepare import prepare

console = Console()
TOPICS = ["the sea", "a city", "winter", "a robot", "coffee", "mountains", "a library", "the moon"]
ASKS = [
    "Write two sentences about {}.",
    "Describe {} in a few words.",
    "Give one fact about {}.",
    "Write a short poem about {}.",
    "Why do people like {}?",
    "Tell a tiny story about {}.",
    "List three words about {}.",
    "What colour is {}?",
]


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)]) for i in range(n)]


def job(text: str, max_tokens: int) -> dict:
    return {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": text}],
        "sampling": {"max_tokens": max_tokens, "temperature": 0},
        "backend": "pytorch",
    }


def in_process_one(engine, text: str, max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(GenerationJob.model_validate(job(text, max_tokens)))
    return time.perf_counter() - t0, len(out.token_ids)


def fleet_one(client: Client, text: str, max_tokens: int) -> tuple[float, int, dict]:
    t0 = time.perf_counter()
    result = client.submit(job(text, max_tokens)).result(timeout=900)
    received = time.time()
    elapsed = time.perf_counter() - t0
    t = result.timings
    parts = {
        "queue_wait_s": t.started - t.submitted,
        "delivery_s": received - t.finished,
        "worker_s": t.finished - t.started,
    }
    return elapsed, result.usage.completion_tokens, parts


def sequential(engine, client: Client, texts: list[str], max_tokens: int) -> dict:
    """One job at a time, each prompt through both paths back to back (alternating which
    goes first), so drift in machine speed hits both alike."""
    inproc, fleet, parts = [], [], []
    for i, text in enumerate(texts):
        order = [0, 1] if i % 2 == 0 else [1, 0]
        for which in order:
            if which == 0:
                inproc.append(in_process_one(engine, text, max_tokens)[0])
            else:
                elapsed, _, p = fleet_one(client, text, max_tokens)
                fleet.append(elapsed)
                parts.append(p)
    added = [f - i for f, i in zip(fleet, inproc)]
    return {
        "in_process_latencies_s": inproc,
        "fleet_latencies_s": fleet,
        "fleet_parts": parts,
        "median_in_process_ms": statistics.median(inproc) * 1000,
        "median_fleet_ms": statistics.median(fleet) * 1000,
        "median_added_ms": statistics.median(added) * 1000,
        "median_queue_wait_ms": statistics.median(p["queue_wait_s"] for p in parts) * 1000,
        "median_delivery_ms": statistics.median(p["delivery_s"] for p in parts) * 1000,
        "median_outside_worker_ms": statistics.median(f - p["worker_s"] for f, p in zip(fleet, parts)) * 1000,
    }


def saturated_in_process(engine, texts: list[str], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        tokens = sum(n for _, n in pool.map(lambda t: in_process_one(engine, t, max_tokens), texts))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


def saturated_fleet(client: Client, texts: list[str], max_tokens: int) -> dict:
    """All jobs at once, as a batch user sends them: one submit_many, then every result."""
    t0 = time.perf_counter()
    handles = client.submit_many(job(t, max_tokens) for t in texts)
    tokens = sum(h.result(timeout=1800).usage.completion_tokens for h in handles)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="engine threads, both paths")
    ap.add_argument("--rounds", type=int, default=3, help="saturated rounds, each both ways back to back")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    spec = ModelRegistry.from_config().get("smollm2-135m")
    prepare(spec, "hf")
    texts = prompts(args.jobs)
    broker = None
    url = os.environ.get("REDIS_URL") and connection.redis_url()
    if not url:
        broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
        url = broker.url
    worker = WorkerProcess("pytorch", url, extra_args=[f"--threads={args.threads}"]).start()
    try:
        from workers.engines.pytorch import PyTorchEngine

        engine = PyTorchEngine(spec, load_backends()["pytorch"].for_model(spec), threads=args.threads)
        engine.load()
        worker.wait_ready(timeout=300)
        client = Client(url)
        # warm both paths (first calls allocate)
        for text in texts[:2]:
            in_process_one(engine, text, 4)
            fleet_one(client, text, 4)
        console.print(f"[bold]sequential[/]: {len(texts)} jobs x {args.max_tokens} tokens, each both ways ...")
        seq = sequential(engine, client, texts, args.max_tokens)
        rounds = []
        for r in range(args.rounds):
            console.print(f"[bold]saturated[/] round {r + 1}/{args.rounds}: {len(texts)} jobs at once, both ways ...")
            # Alternating which side goes first, round by round: whatever drifts within a
            # round (the CPU's clock, the page cache) does not always favour the same side.
            arms = [
                ("in_process", lambda: saturated_in_process(engine, texts, args.max_tokens)),
                ("fleet", lambda: saturated_fleet(client, texts, args.max_tokens)),
            ]
            pair: dict = {"first": arms[r % 2][0]}
            for name, run in arms if r % 2 == 0 else arms[::-1]:
                pair[name] = run()
            pair["ratio"] = pair["fleet"]["tok_s"] / pair["in_process"]["tok_s"]
            rounds.append(pair)
        sat = {
            "rounds": rounds,
            "in_process": {"tok_s": statistics.median(p["in_process"]["tok_s"] for p in rounds)},
            "fleet": {"tok_s": statistics.median(p["fleet"]["tok_s"] for p in rounds)},
            "ratio": statistics.median(p["ratio"] for p in rounds),
        }
        engine.close()
    finally:
        worker.stop()
        if broker:
            broker.stop()

    summary = {
        "median_latency_ms": {"in_process": seq["median_in_process_ms"], "fleet": seq["median_fleet_ms"]},
        "median_added_latency_ms": seq["median_added_ms"],
        "median_queue_wait_ms": seq["median_queue_wait_ms"],
        "median_result_delivery_ms": seq["median_delivery_ms"],
        "median_fleet_path_ms": seq["median_outside_worker_ms"],
        "throughput_tok_s": {k: sat[k]["tok_s"] for k in ("in_process", "fleet")},
        "throughput_ratio": sat["ratio"],
        "throughput_ratio_per_round": [p["ratio"] for p in sat["rounds"]],
        "first_per_round": [p["first"] for p in sat["rounds"]],
        "targets": {"median_added_latency_ms": "< 5", "median_fleet_path_ms": "< 5", "throughput_ratio": ">= 0.95"},
    }
    results = {"sequential": seq, "saturated": sat}
    table = Table(
        title=f"fleet overhead: {args.jobs} jobs, greedy, {args.max_tokens} new tokens, {args.threads} thread(s)"
    )
    for col in ("measure", "in-process", "fleet", "fleet vs in-process"):
        table.add_column(col, justify="right")
    ml = summary["median_latency_ms"]
    tp = summary["throughput_tok_s"]
    table.add_row(
        "sequential: median job latency",
        f"{ml['in_process']:.1f} ms",
        f"{ml['fleet']:.1f} ms",
        f"{summary['median_added_latency_ms']:+.1f} ms (median of paired differences)",
    )
    table.add_row("  fleet path: end to end − time in the worker", "", f"{summary['median_fleet_path_ms']:.1f} ms", "")
    table.add_row("  fleet path: submit → worker start", "", f"{summary['median_queue_wait_ms']:.1f} ms", "")
    table.add_row("  fleet path: worker done → client has it", "", f"{summary['median_result_delivery_ms']:.1f} ms", "")
    per_round = ", ".join(
        f"{r:.3f} ({first.replace('_', '-')} first)"
        for r, first in zip(summary["throughput_ratio_per_round"], summary["first_per_round"])
    )
    table.add_row(
        f"saturated: throughput (median of {args.rounds} rounds)",
        f"{tp['in_process']:.1f} tok/s",
        f"{tp['fleet']:.1f} tok/s",
        f"{summary['throughput_ratio']:.3f}x (rounds: {per_round})",
    )
    console.print(table)
    hw = hardware.detect(False)
    record = {
        "bench": "fleet_overhead",
        "time": time.time(),
        "args": vars(args),
        "hardware": hw.model_dump(),
        "summary": summary,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fleet_overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
