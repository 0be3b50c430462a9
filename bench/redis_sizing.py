"""What the fleet keeps in Redis, per unit of work: the sizing table of docs/operations.md.

    python -m bench.redis_sizing [--n 1000] [--prompt-chars 400] [--answer-tokens 128]

On a Redis database of its own (``--url``, flushed before and after), through the fleet's
own code, no worker running: ``--n`` interactive jobs submitted and left queued (message +
job record), the same jobs then finished with an answer of ``--answer-tokens`` tokens
(the record with its result, the message gone as an ack would take it), and a batch of
``--n`` lines staged (its staged input, as it waits to be fed). Each row is the
``used_memory`` delta divided by ``--n``: Redis's own accounting, overheads included.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench import report
from core.jobs import JobResult, Timings, Usage
from dispatcher.client import Client

console = Console()
MODEL = "smollm2-135m"


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def answer(job_id: str, tokens: int) -> dict[str, Any]:
    """A completed job's result as a worker records it (``tokens`` tokens of text)."""
    now = time.time()
    result = JobResult(
        id=job_id,
        status="completed",
        model=MODEL,
        backend="llamacpp",
        worker="llamacpp-cpu-host-1234",
        text="word " * tokens,
        token_ids=list(range(tokens)),
        finish_reason="length",
        usage=Usage(prompt_tokens=100, completion_tokens=tokens),
        timings=Timings(submitted=now, started=now, first_token=now, finished=now),
    )
    return result.model_dump(mode="json")


def measure(url: str, n: int, prompt_chars: int, answer_tokens: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    r.flushdb()
    try:
        with Client(url) as client:
            prompt = ("x" * (prompt_chars - 1)) + "?"
            base = used(r)
            handles = [
                client.submit(model=MODEL, messages=[{"role": "user", "content": f"{i} {prompt}"}], backend="llamacpp")
                for i in range(n)
            ]
            queued = used(r)
            for key in r.scan_iter("ib.llamacpp*"):  # the messages go as acks would take them
                r.delete(key)
            for h in handles:
                client.store.finish(h.id, "completed", answer(h.id, answer_tokens))
            finished = used(r)
            lines = [
                {"custom_id": f"l{i}", "messages": [{"role": "user", "content": f"{i} {prompt}"}]} for i in range(n)
            ]
            before_batch = used(r)
            client.batches.create(lines, model=MODEL)
            staged = used(r)
        return {
            "queued_job_bytes": (queued - base) / n,
            "finished_job_bytes": (finished - base) / n,
            "staged_batch_line_bytes": (staged - before_batch) / n,
        }
    finally:
        r.flushdb()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="redis://127.0.0.1:6379/3")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    out = measure(args.url, args.n, args.prompt_chars, args.answer_tokens)
    table = Table(title=f"Redis bytes per unit ({args.prompt_chars}-char prompt, {args.answer_tokens}-token answer)")
    table.add_column("unit")
    table.add_column("bytes", justify="right")
    for name, value in out.items():
        table.add_row(name, f"{value:,.0f}")
    console.print(table)
    console.print(f"saved {report.save('redis-sizing', args, **out)}")


if __name__ == "__main__":
    main()
