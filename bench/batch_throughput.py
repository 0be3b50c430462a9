"""Offline batch throughput: `ib batch` through a fleet of CPU workers vs the same requests
run in-process on one engine, in one run.

    python -m bench.batch_throughput [--requests 512] [--max-tokens 64] [--engine onnx-int4]
                                     [--workers 2] [--worker-threads 1] [--threads 2]
                                     [--in-process-requests 128] [--in-flight 16]

Arms, same chat requests, greedy, ``--max-tokens`` new tokens each:
1. in-process, one request at a time: the plain loop a script would run (``--threads``);
2. in-process with the engine's own batching, ``--in-flight`` requests at once;
3. the fleet: ``--workers`` `ib worker` processes of the same engine (``--worker-threads``
   each), the requests as one batch through ``client.batches.create`` (the decision tree
   per line, the workers' feeder, one result per line), results written to a file.

The in-process arms run ``--in-process-requests`` of the requests (the rate is the same;
pass 512 for all). Reports aggregate generated tok/s and the fleet's ratio to each
in-process arm, and the batch bookkeeping (validation + staging, the feeder's deciding
and enqueueing, writing the results file, and what recording a line adds to each job's
finish, measured apart) as a share of the fleet's wall time: wall time, and CPU time
(the feeder runs in a busy worker, where its wall time is mostly waiting for the GIL).
Table + JSON (bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import report
from core import settings
from core.backends import load_backends
from core.jobs import GenerationJob
from core.records import line_job_id
from core.registry import ModelRegistry
from core.store.jobstore import LineRecord
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from workers.engines import create_engine
from workers.models.prepare import prepare

console = Console()
MODEL = "smollm2-135m"
ENGINES = {
    "onnx-int4": ("onnx", "onnx-int4"),
    "onnx": ("onnx", "onnx"),
    "llamacpp": ("llamacpp", "gguf"),
    "pytorch": ("pytorch", "hf"),
}
TOPICS = [
    "rivers",
    "bridges",
    "owls",
    "tea",
    "glaciers",
    "chess",
    "bees",
    "lanterns",
    "deserts",
    "violins",
    "comets",
    "maps",
]
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


def questions(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)]) for i in range(n)]


def in_process(backend: str, fmt: str, texts: list[str], max_tokens: int, threads: int, in_flight: int) -> dict:
    spec = ModelRegistry.from_config().get(MODEL)
    config = load_backends()[backend].for_model(spec, device="cpu", format=fmt)
    engine = create_engine(backend, spec, config, threads)
    engine.load()
    jobs = [
        GenerationJob(model=MODEL, messages=[{"role": "user", "content": t}], sampling={"max_tokens": max_tokens})
        for t in texts
    ]
    try:
        engine.generate(jobs[0].model_copy(update={"sampling": jobs[0].sampling.model_copy(update={"max_tokens": 4})}))
        console.print(f"in-process {backend} ({fmt}): {len(jobs)} requests one at a time ...")
        t0 = time.perf_counter()
        single = [engine.generate(j) for j in jobs]
        single_wall = time.perf_counter() - t0
        console.print(f"in-process {backend} ({fmt}): {len(jobs)} requests, {in_flight} in flight ...")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=in_flight) as pool:
            batched = list(pool.map(engine.generate, jobs))
        batched_wall = time.perf_counter() - t0
    finally:
        engine.close()

    def tokens(outs: list) -> int:
        return sum(len(o.token_ids) for o in outs)

    return {
        "one_at_a_time": {
            "requests": len(single),
            "tokens": tokens(single),
            "wall_s": single_wall,
            "tok_s": tokens(single) / single_wall,
        },
        "batched": {
            "requests": len(batched),
            "tokens": tokens(batched),
            "wall_s": batched_wall,
            "tok_s": tokens(batched) / batched_wall,
        },
    }


def fleet(url: str, backend: str, fmt: str, texts: list[str], max_tokens: int, workers: int, threads: int) -> dict:
    extra = [f"--threads={threads}"] + ([f"--format={fmt}"] if backend == "onnx" else [])
    procs = [WorkerProcess(backend, url, extra_args=extra).start() for _ in range(workers)]
    try:
        for p in procs:
            p.wait_ready(timeout=600)
        with Client(url) as client:
            warm = client.batches.create(
                [
                    {"custom_id": f"w{i}", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
                    for i in range(2 * workers)
                ],
                model=MODEL,
            )
            _wait(client, warm.id)
            lines = [
                {
                    "custom_id": f"q{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": t}],
                        "max_tokens": max_tokens,
                        "temperature": 0,
                    },
                }
                for i, t in enumerate(texts)
            ]
            console.print(f"fleet: {len(lines)} requests as one batch → {workers} {backend} worker(s) ...")
            t0, cpu0 = time.perf_counter(), time.process_time()
            batch = client.batches.create(lines)
            create_s, create_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            batch = _wait(client, batch.id)
            t1, cpu1 = time.perf_counter(), time.process_time()
            with tempfile.TemporaryDirectory() as tmp:
                n_out, n_err = client.batches.write_results(
                    batch.id, Path(tmp) / "out.jsonl", Path(tmp) / "errors.jsonl"
                )
            results_s, results_cpu_s = time.perf_counter() - t1, time.process_time() - cpu1
            wall = time.perf_counter() - t0
            records = list(client.batches.results(batch.id))
            per_worker = Counter(
                client.record(r["response"]["request_id"]).get("worker", "?") for r in records if r["response"]
            )
            queue_waits = []
            for r in records[:: max(1, len(records) // 64)]:
                if r["response"]:
                    res = client.result(r["response"]["request_id"], timeout=5)
                    queue_waits.append(res.timings.queue_wait_s)
    finally:
        for p in procs:
            p.stop(timeout=120)
    with Client(url) as client:
        record_s = line_record_cost(client) * len(texts)
    bookkeeping = create_s + batch.feed_s + results_s + record_s
    bookkeeping_cpu = create_cpu_s + batch.feed_cpu_s + results_cpu_s + record_s
    return {
        "requests": len(texts),
        "status": batch.status,
        "outputs": n_out,
        "errors": n_err,
        "tokens": batch.completion_tokens,
        "wall_s": wall,
        "tok_s": batch.completion_tokens / wall,
        "backends": batch.backends,
        "per_worker": dict(per_worker),
        "create_s": create_s,
        "create_cpu_s": create_cpu_s,
        "feed_s": batch.feed_s,
        "feed_cpu_s": batch.feed_cpu_s,
        "results_s": results_s,
        "results_cpu_s": results_cpu_s,
        "line_records_s": record_s,
        "bookkeeping_s": bookkeeping,
        "bookkeeping_share": bookkeeping / wall,
        "bookkeeping_cpu_s": bookkeeping_cpu,
        "bookkeeping_cpu_share": bookkeeping_cpu / wall,
        "queue_wait_p50_s": statistics.median(queue_waits) if queue_waits else None,
    }


def line_record_cost(client: Client, n: int = 300) -> float:
    """What recording a batch line adds to a job's finish (the same script, one more
    HSETNX and counters): median with the line record minus median without, in seconds."""
    batch = client.batches.create(
        [{"custom_id": f"x{i}", "prompt": "x", "max_tokens": 1} for i in range(n)], model=MODEL
    )
    payload = {"text": "x" * 300, "token_ids": list(range(64))}
    record = {
        "custom_id": "x",
        "response": {"status_code": 200, "body": {"choices": [{"text": "x" * 300}]}},
        "error": None,
    }
    plain, lined = [], []
    for i in range(n):
        t = time.perf_counter()
        client.store.finish(f"bench-plain-{batch.id}-{i}", "completed", payload)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        line = LineRecord(batch.id, i + 1, record, "completed", 64)
        client.store.finish(line_job_id(batch.id, i + 1), "completed", payload, line=line)
        lined.append(time.perf_counter() - t)
    client.batches.cancel(batch.id)
    return max(0.0, statistics.median(lined) - statistics.median(plain))


def _wait(client: Client, batch_id: str, timeout: float = 7200):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.is_final:
            return batch
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} not done after {timeout} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="onnx-int4", help="the engine of both arms")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="threads of the in-process engine")
    ap.add_argument("--in-process-requests", type=int, default=128)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    backend, fmt = ENGINES[args.engine]
    spec = ModelRegistry.from_config().get(MODEL)
    if fmt != "gguf":
        prepare(spec, fmt)
    texts = questions(args.requests)
    broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
    try:
        local = in_process(
            backend, fmt, texts[: args.in_process_requests], args.max_tokens, args.threads, args.in_flight
        )
        fleet_row = fleet(broker.url, backend, fmt, texts, args.max_tokens, args.workers, args.worker_threads)
    finally:
        broker.stop()

    ratio_single = fleet_row["tok_s"] / local["one_at_a_time"]["tok_s"]
    ratio_batched = fleet_row["tok_s"] / local["batched"]["tok_s"]
    table = Table(
        title=f"Offline batch: {args.requests} chat requests, greedy, {args.max_tokens} new tokens, "
        f"engine {args.engine}"
    )
    for col in ("arm", "requests", "tokens", "wall", "tok/s", "fleet ÷ arm"):
        table.add_column(col, justify="right")
    s, b = local["one_at_a_time"], local["batched"]
    table.add_row(
        f"in-process, one at a time ({args.threads} threads)",
        str(s["requests"]),
        str(s["tokens"]),
        f"{s['wall_s']:.1f} s",
        f"{s['tok_s']:.1f}",
        f"{ratio_single:.2f}x",
    )
    table.add_row(
        f"in-process, {args.in_flight} in flight ({args.threads} threads)",
        str(b["requests"]),
        str(b["tokens"]),
        f"{b['wall_s']:.1f} s",
        f"{b['tok_s']:.1f}",
        f"{ratio_batched:.2f}x",
    )
    table.add_row(
        f"fleet: ib batch, {args.workers} workers x {args.worker_threads} thread(s)",
        str(fleet_row["requests"]),
        str(fleet_row["tokens"]),
        f"{fleet_row['wall_s']:.1f} s",
        f"{fleet_row['tok_s']:.1f}",
        "1.00x",
    )
    console.print(table)
    f = fleet_row
    console.print(
        "batch bookkeeping, wall (CPU): "
        f"validate+stage {f['create_s'] * 1000:.0f} ({f['create_cpu_s'] * 1000:.0f}) ms, "
        f"feeder {f['feed_s'] * 1000:.0f} ({f['feed_cpu_s'] * 1000:.0f}) ms, results file {f['results_s'] * 1000:.0f} "
        f"({f['results_cpu_s'] * 1000:.0f}) ms, line records in the workers {f['line_records_s'] * 1000:.0f} ms "
        f"= {f['bookkeeping_share'] * 100:.2f}% ({f['bookkeeping_cpu_share'] * 100:.2f}%) of the fleet's wall time; "
        f"lines per backend {f['backends']}, per worker {list(f['per_worker'].values())}"
    )
    path = report.save(
        "batch_throughput",
        args,
        in_process=local,
        fleet=fleet_row,
        ratio_vs_one_at_a_time=ratio_single,
        ratio_vs_batched=ratio_batched,
    )
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
