"""What CPU spent beside a CPU engine costs it: vLLM in-process, passes alternating quiet
and beside a contender process that burns a fixed budget of CPU.

The vLLM worker trails AsyncLLM in-process by ~5 % on 2 cores while its own processes
(the worker's Celery threads, Redis, the client) spend only ~0.4 CPU s a pass more than
vLLM's own front end (docs/BENCHMARKS.md). This measures the exchange rate on the same
engine, with nothing of the fleet in it: the contender spends its CPU the way the worker
does, ``--intake-jobs`` bursts of ``--intake-ms`` as the jobs arrive, then a burst of
``--tick-ms`` every ``--tick-every-ms`` (finishing jobs, heartbeats) to the pass's end
(bench.burner).
The engine's OpenMP threads own both cores; one taken off its core stalls its partner at
the next barrier, so a CPU second spent beside the engine costs it more than a second.

Both kinds of pass use one AsyncLLM (the worker's engine arguments, every prompt at
once, as bench.inprocess runs it), alternate pair by pair, and pause 3 s before each.

    python -m bench.contention --pairs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import psutil
from rich.console import Console
from rich.table import Table

from bench import cpu_time, inprocess
from bench.fleet_overhead import prompts
from bench.report import save

console = Console()
QUIET, CONTENDED = "quiet", "contended"
SETTLE_S = 3.0


def contended_pass(timed, texts: list[str], args: argparse.Namespace) -> tuple[dict, float]:
    """One pass beside a fresh contender (bench.burner); its CPU seconds during the pass."""
    command = [sys.executable, "-m", "bench.burner"]
    command += [str(x) for x in (args.intake_jobs, args.intake_ms, args.tick_ms, args.tick_every_ms)]
    contender = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert contender.stdin is not None and contender.stdout is not None
        contender.stdout.readline()  # started: its interpreter's start-up is behind it
        proc = psutil.Process(contender.pid)
        start = sum(proc.cpu_times()[:2])
        contender.stdin.write("go\n")
        contender.stdin.flush()
        out = timed(texts)
        spent = sum(proc.cpu_times()[:2]) - start
    finally:
        contender.kill()
        contender.wait()
    return out, spent


def run(args: argparse.Namespace) -> int:
    texts = prompts(args.prompts)
    roots = {os.getpid(): "bench process (in-process engine)"}
    pairs: list[dict[str, dict]] = []
    with inprocess.vllm_session(args.max_tokens, args.threads, texts[0]) as timed:
        timed(texts)  # the first full pass after a start runs slower: untimed
        for i in range(args.pairs):
            pair: dict[str, dict] = {}
            for kind in (QUIET, CONTENDED) if i % 2 == 0 else (CONTENDED, QUIET):
                time.sleep(SETTLE_S)
                with console.status(f"pair {i + 1}/{args.pairs}: {kind}..."):
                    with cpu_time.metered(roots) as cpu:
                        if kind == QUIET:
                            out, spent = timed(texts), 0.0
                        else:
                            out, spent = contended_pass(timed, texts, args)
                pair[kind] = out | {"cpu": cpu, "contender_cpu_s": round(spent, 3)}
            pairs.append(pair)
            console.print(f"pair {i + 1}: {pair[QUIET]['tok_s']:.1f} quiet / {pair[CONTENDED]['tok_s']:.1f} contended")
    return report(args, pairs)


def engine_cpu(side: dict) -> float:
    """CPU seconds of the engine's processes (vLLM names them VLLM::...)."""
    return sum(v for k, v in side["cpu"]["processes"].items() if "VLLM::" in k)


def report(args: argparse.Namespace, pairs: list[dict[str, dict]]) -> int:
    table = Table(title=f"vLLM in-process, {args.prompts} prompts at once: quiet vs beside a contender")
    for col in ("pair", "tok/s quiet / contended", "ratio", "contender CPU s", "engine CPU s quiet / contended"):
        table.add_column(col)
    ratios, spent, extra_engine, extra_wall = [], [], [], []
    for i, p in enumerate(pairs):
        q, c = p[QUIET], p[CONTENDED]
        ratios.append(c["tok_s"] / q["tok_s"])
        spent.append(c["contender_cpu_s"])
        extra_engine.append(engine_cpu(c) - engine_cpu(q))
        extra_wall.append(c["wall_s"] - q["wall_s"])
        table.add_row(
            str(i + 1),
            f"{q['tok_s']:.1f} / {c['tok_s']:.1f}",
            f"{ratios[-1]:.3f}",
            f"{spent[-1]:.2f}",
            f"{engine_cpu(q):.2f} / {engine_cpu(c):.2f}",
        )
    console.print(table)
    cost = statistics.median(extra_engine) / statistics.median(spent)
    console.print(
        f"contended / quiet, median of {len(pairs)} pairs: {statistics.median(ratios):.3f}x; the contender spent "
        f"{statistics.median(spent):.2f} CPU s a pass, the engine {statistics.median(extra_engine):+.2f} CPU s "
        f"({cost:.1f} engine CPU s per contender CPU s) and the pass {statistics.median(extra_wall):+.2f} s of wall"
    )
    path = save(
        "contention_vllm",
        args,
        pairs=pairs,
        ratio=statistics.median(ratios),
        contender_cpu_s=statistics.median(spent),
        extra_engine_cpu_s=statistics.median(extra_engine),
        extra_wall_s=statistics.median(extra_wall),
    )
    console.print(f"written to {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--intake-jobs", type=int, default=64, help="bursts as the jobs arrive (one per job)")
    ap.add_argument("--intake-ms", type=float, default=4.0, help="CPU of each intake burst")
    ap.add_argument("--tick-ms", type=float, default=2.0, help="CPU of each later burst")
    ap.add_argument("--tick-every-ms", type=float, default=60.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
