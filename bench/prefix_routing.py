"""Prefix-affinity routing vs the shared queue (round-robin), in one run.

    python -m bench.prefix_routing [--prompts 8] [--questions 16] [--max-tokens 16]
                                   [--threads 1] [--pairs 2] [--prefix-cache-mb MB]

Two llama.cpp workers. ``--prompts`` distinct ~500-token system prompts, ``--questions``
short questions each, sent in rounds: round k sends question k of every prompt at once
(interleaved), waits for them, then the next round. Arm 1: prefix affinity (the
dispatcher looks up which worker holds each prompt's leading KV blocks). Arm 2: the
shared queue, whichever worker is free (``prefix.enabled`` off). Workers are restarted
between arms, so both start cold. ``--pairs`` pairs of arms run, which arm goes first
alternating pair by pair; each measure is the median over the pairs.

Each worker's prefix state cache is the configured default (``prefix_cache_mb`` in
config/backends.yaml, 256 MB: room for all 8 prompts' states, ~11.5 MB each), unless
``--prefix-cache-mb`` sets it. A smaller cache (70 MB holds about 6 of them) is the case
routing is for, and gives the shared queue no chance to catch up: say so when quoting it.
The same case at the default cache is more prompts: ``--prompts 24 --questions 4`` (more
states than one worker holds, half of them fit in each).

Reports TTFT p50/p95 and mean (from submission), p50/p90 after round 0 (where the
shared queue's remaining misses show), aggregate generated tok/s, the prefix hit rate
(jobs after round 0 whose prompt came from a worker's cache), and the dispatch cost of
the lookup (tokenize + hash + one Redis round trip for the hints and the live workers'
loads) p50. Table + JSON (bench/results/).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from bench import report
from core import settings
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from ops.measure import percentile

console = Console()
MODEL = "smollm2-135m"
DOMAINS = [
    "a bicycle shop",
    "a public library",
    "a train operator",
    "a dental clinic",
    "a bakery",
    "a city museum",
    "a software help desk",
    "a garden centre",
    "a hotel",
    "a pharmacy",
    "a ski school",
    "a car rental desk",
]
QUESTIONS = [
    "When do you open?",
    "How much does it cost?",
    "Can I book ahead?",
    "Where are you?",
    "Do you take cards?",
    "Is there parking?",
    "Can I bring a dog?",
    "Who do I call?",
    "Are you open on Sunday?",
    "Is it busy now?",
    "Do you have gift cards?",
    "Can I cancel?",
    "Is there a discount?",
    "Do you speak French?",
    "How long does it take?",
    "What do I need to bring?",
]


def system_prompt(i: int) -> str:
    d = DOMAINS[i % len(DOMAINS)]
    rules = (
        f"You are the assistant of {d}. Answer questions about {d}: opening hours, prices, bookings, location, "
        f"payment, accessibility, policies and contacts. Be brief, friendly and exact; never invent facts about {d}; "
        "when unsure, say so and give the phone number on the website. "
    )
    return f"[{i}] " + rules * 6  # ~500 tokens


def chat(i: int, q: str, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "backend": "llamacpp",
        "sampling": {"max_tokens": max_tokens},
        "messages": [{"role": "system", "content": system_prompt(i)}, {"role": "user", "content": q}],
    }


def run_arm(url: str, env: dict[str, str], affinity: bool, args: argparse.Namespace) -> dict:
    workers = [
        WorkerProcess("llamacpp", url, extra_args=[f"--threads={args.threads}"], env=env).start() for _ in range(2)
    ]
    try:
        for w in workers:
            w.wait_ready(timeout=300)
        with Client(url) as client:
            if not affinity:
                client.router.affinity = False  # the shared queue only
            lookup_ms: list[float] = []
            results = []
            if affinity:  # load the tokenizer once, before anything is timed
                client.router.tokens.hashes(client._parse(chat(0, "warm-up", 1), {}), client.registry.get(MODEL))
            t0 = time.perf_counter()
            for k in range(args.questions):
                jobs = [chat(i, QUESTIONS[k % len(QUESTIONS)], args.max_tokens) for i in range(args.prompts)]
                if affinity:  # the lookup's cost, measured on its own (the submit does the same)
                    hasher, hints = client.router.tokens, client.fleet.hints
                    assert hints is not None
                    live = [w.worker_id for w in client.workers().live(backend="llamacpp")]
                    for j in jobs:
                        parsed = client._parse(j, {})
                        t = time.perf_counter()
                        hints.lookup_for(hasher.hashes(parsed, client.registry.get(MODEL)), live)
                        lookup_ms.append((time.perf_counter() - t) * 1000)
                handles = client.submit_many(jobs)
                results += [(k, h.result(timeout=900)) for h in handles]
            wall = time.perf_counter() - t0
            time.sleep(1.5)
            stats = {w.worker_id: w.engine_stats for w in client.workers(max_age_s=0).workers}
    finally:
        for w in workers:
            w.stop(timeout=120)
    later = [r for k, r in results if k > 0]
    ttfts = [r.timings.ttft_s * 1000 for _, r in results]
    return {
        "jobs": len(results),
        "wall_s": wall,
        "tok_s": sum(r.usage.completion_tokens for _, r in results) / wall,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "ttft_p50_after_round0_ms": percentile([r.timings.ttft_s * 1000 for r in later], 50),
        "ttft_p90_after_round0_ms": percentile([r.timings.ttft_s * 1000 for r in later], 90),
        "ttft_mean_ms": statistics.fmean(ttfts),
        "hit_rate_after_round0": sum(r.usage.cached_tokens > 0 for r in later) / max(1, len(later)),
        "prompt_tokens_p50": statistics.median(r.usage.prompt_tokens for _, r in results),
        "jobs_per_worker": {w: sum(r.worker == w for _, r in results) for w in stats},
        "engine_prefix_hits": sum(s.get("prefix_hits", 0) for s in stats.values()),
        "engine_prefix_misses": sum(s.get("prefix_misses", 0) for s in stats.values()),
        "lookup_ms_p50": statistics.median(lookup_ms) if lookup_ms else None,
        "lookup_ms_p95": percentile(lookup_ms, 95) if lookup_ms else None,
    }


def median_run(runs: list[dict]) -> dict:
    """One arm's measures, each the median over its runs (jobs per worker: the first run's)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in runs if r.get(key) is not None]
            out[key] = statistics.median(values) if values else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefix-cache-mb", type=int, default=None, help="default: the configured one (256)")
    ap.add_argument("--pairs", type=int, default=2, help="pairs of arms, the first arm alternating")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    cfg_dir = Path(tempfile.mkdtemp(prefix="ib-bench-config-"))
    shutil.copytree(settings.config_dir(), cfg_dir, dirs_exist_ok=True)
    backends = yaml.safe_load((cfg_dir / "backends.yaml").read_text())
    if args.prefix_cache_mb is None:
        args.prefix_cache_mb = backends["backends"]["llamacpp"]["prefix_cache_mb"]
    backends["backends"]["llamacpp"]["prefix_cache_mb"] = args.prefix_cache_mb
    (cfg_dir / "backends.yaml").write_text(yaml.safe_dump(backends))
    env = {"IB_CONFIG_DIR": str(cfg_dir)}

    broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
    arms = (("prefix affinity", True), ("shared queue (round-robin)", False))
    runs: dict[str, list[dict]] = {label: [] for label, _ in arms}
    try:
        for pair in range(args.pairs):
            for label, on in arms if pair % 2 == 0 else arms[::-1]:
                broker_client = Client(broker.url)
                broker_client.redis.flushdb()
                broker_client.close()
                console.print(
                    f"[bold]{label}[/] (pair {pair + 1}/{args.pairs}): "
                    f"{args.prompts} prompts x {args.questions} questions ..."
                )
                runs[label].append(run_arm(broker.url, env, on, args))
    finally:
        broker.stop()
        shutil.rmtree(cfg_dir, ignore_errors=True)

    rows = {label: median_run(r) for label, r in runs.items()}
    aff, rr = rows["prefix affinity"], rows["shared queue (round-robin)"]
    table = Table(
        title=f"Prefix routing: 2 llama.cpp workers, {args.prompts} system prompts x {args.questions} questions, "
        f"{args.max_tokens} new tokens, prefix cache {args.prefix_cache_mb} MB per worker"
    )
    for col in (
        "routing",
        "jobs",
        "TTFT p50",
        "TTFT p95",
        "TTFT p50 after round 0",
        "TTFT p90 after round 0",
        "TTFT mean",
        "tok/s",
        "hit rate after round 0",
        "jobs per worker",
    ):
        table.add_column(col, justify="right")
    for label, r in rows.items():
        table.add_row(
            label,
            str(int(r["jobs"])),
            f"{r['ttft_p50_ms']:.0f} ms",
            f"{r['ttft_p95_ms']:.0f} ms",
            f"{r['ttft_p50_after_round0_ms']:.0f} ms",
            f"{r['ttft_p90_after_round0_ms']:.0f} ms",
            f"{r['ttft_mean_ms']:.0f} ms",
            f"{r['tok_s']:.1f}",
            f"{r['hit_rate_after_round0'] * 100:.0f}%",
            " / ".join(str(v) for v in r["jobs_per_worker"].values()),
        )
    console.print(table)
    ratio = rr["ttft_p50_ms"] / aff["ttft_p50_ms"]
    console.print(
        f"TTFT p50: affinity {ratio:.2f}x better (mean {rr['ttft_mean_ms'] / aff['ttft_mean_ms']:.2f}x); "
        f"tok/s {aff['tok_s'] / rr['tok_s']:.2f}x; "
        "lookup (tokenize + hash + one round trip) "
        f"p50 {aff['lookup_ms_p50']:.2f} ms, p95 {aff['lookup_ms_p95']:.2f} ms"
    )
    per_pair = [
        r["ttft_p50_ms"] / a["ttft_p50_ms"] for a, r in zip(runs["prefix affinity"], runs["shared queue (round-robin)"])
    ]
    console.print(
        "TTFT p50 ratio per pair (affinity first, then shared first, ...): " + ", ".join(f"{x:.2f}x" for x in per_pair)
    )
    path = report.save("prefix_routing", args, rows=rows, runs=runs, ttft_p50_ratio=ratio, ratio_per_pair=per_pair)
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
