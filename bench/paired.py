"""The vLLM worker against AsyncLLM in-process with both engines alive: paired passes.

``bench.vs_peers --backend vllm`` starts each side's engine afresh per round and times one
steady pass on each: a round takes minutes, most of it starting engines, and on these
VMs the machine's speed moves by ±10 % from one minute to the next (the hypervisor's
steal alone took 1-3 CPU s of a ~13 s pass on 2026-12-06), so five rounds cannot
resolve a 3 % difference. Here both engines start once and stay up; the sides then
take turns, pass after pass, with the order alternating pair by pair (fleet first, then
in-process first), so each pair's two passes run seconds apart.

    python -m bench.vs_peers --backend vllm --pairs 12

The same workload and settings as the rounds: the same chat prompts at once, greedy,
``--max-tokens``, the worker's engine arguments and ``--threads`` on both sides, each
engine warmed by one request and one full untimed pass before the first pair, and a
pause of ``SETTLE_S`` before every pass (an engine keeps burning CPU for a while after
its pass ends). What differs from the rounds: the idle side's engine and (for the
fleet) its worker's threads stay alive during the other side's pass. Every pass is
metered over both sides' process trees (bench.cpu_time, ``by_root``), so what the idle
side spent is in the JSON and the summary rather than assumed away. The ratio is the
median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from bench import cpu_time, inprocess
from bench.fleet_overhead import prompts
from bench.gateway import peer_setup
from bench.report import save
from ops.local.processes import WorkerProcess

console = Console()
FLEET, PEER = "fleet vllm worker", "AsyncLLM in-process"
# A pause before each pass: an engine that just finished a pass keeps burning CPU for a
# while after it (measured without it: 0.6-1.0 CPU s of the idle side's VLLM::Worker in
# the other side's next 1.2 s pass).
SETTLE_S = 3.0


def vllm_paired(args: argparse.Namespace, fleet_timed: Callable[..., Callable[[list[str]], dict]]) -> int:
    """``args.pairs`` pairs of steady passes, both engines alive (the module's docstring)."""
    setup = peer_setup(server=False)
    texts = prompts(args.prompts)
    worker = WorkerProcess("vllm", setup.url, extra_args=[f"--threads={args.threads}"])
    pairs: list[dict[str, dict]] = []
    try:
        with console.status("starting the vllm worker..."):
            worker.start().wait_ready(900)
        roots = {worker.pid: "fleet worker", os.getpid(): "bench process (client + in-process engine)"}
        with inprocess.vllm_session(args.max_tokens, args.threads, texts[0]) as peer:
            sides = {FLEET: fleet_timed(setup.client, args.max_tokens, texts[0]), PEER: peer}
            for timed in sides.values():
                timed(texts)  # the first full pass after a start runs slower: untimed on both sides
            for i in range(args.pairs):
                pair: dict[str, dict] = {}
                for name in (FLEET, PEER) if i % 2 == 0 else (PEER, FLEET):
                    time.sleep(SETTLE_S)
                    with console.status(f"pair {i + 1}/{args.pairs}: {name}..."):
                        with cpu_time.metered(roots, by_root=True) as cpu:
                            out = sides[name](texts)
                    pair[name] = out | {
                        "cpu": cpu,
                        "engine_split": cpu_time.engine_split(out["tokens"], out["wall_s"], cpu),
                    }
                pairs.append(pair)
                console.print(f"pair {i + 1}: {pair[FLEET]['tok_s']:.1f} / {pair[PEER]['tok_s']:.1f} tok/s")
    finally:
        worker.stop()
        setup.close()
    return report(args, pairs)


def report(args: argparse.Namespace, pairs: list[dict[str, dict]]) -> int:
    per_pair = [p[FLEET]["tok_s"] / p[PEER]["tok_s"] for p in pairs]
    without_tokenize = [
        p[FLEET]["tok_s"] / (p[PEER]["tokens"] / (p[PEER]["wall_s"] - p[PEER]["tokenize_s"])) for p in pairs
    ]
    unstolen = [per_unstolen_cpu_s(p[FLEET]) / per_unstolen_cpu_s(p[PEER]) for p in pairs]
    table = Table(title=f"vllm: fleet vs {PEER}, both alive, {args.prompts} chat prompts at once, {args.pairs} pairs")
    for col in (
        "pair (first)",
        "tok/s fleet / in-process",
        "ratio",
        "engine cores ratio",
        "tokens per engine CPU s ratio",
        "idle engine's CPU s: in-process's in the fleet pass / fleet's",
    ):
        table.add_column(col)
    for i, p in enumerate(pairs):
        f, q = p[FLEET]["engine_split"], p[PEER]["engine_split"]
        table.add_row(
            f"{i + 1} ({'fleet' if i % 2 == 0 else 'in-process'})",
            f"{p[FLEET]['tok_s']:.1f} / {p[PEER]['tok_s']:.1f}",
            f"{per_pair[i]:.3f}",
            f"{f['engine_cores'] / q['engine_cores']:.3f}",
            f"{f['tokens_per_engine_cpu_s'] / q['tokens_per_engine_cpu_s']:.3f}",
            f"{idle_cpu(p[FLEET]['cpu'], 'bench process', children_only=True):.2f} / "
            f"{idle_cpu(p[PEER]['cpu'], 'fleet worker'):.2f}",
        )
    console.print(table)
    ratio = statistics.median(per_pair)
    low, _, high = statistics.quantiles(per_pair, n=4)
    console.print(
        f"fleet / in-process, median of {len(pairs)} pairs: {ratio:.3f}x (quartiles {low:.3f}-{high:.3f}); "
        f"with the in-process side's tokenizing left out of its clock: {statistics.median(without_tokenize):.3f}x; "
        f"tokens per CPU second the hypervisor did not steal: {statistics.median(unstolen):.3f}x"
    )
    for i, p in enumerate(pairs):
        for name in (FLEET, PEER):
            console.print(f"  pair {i + 1}, {name}: {cpu_time.summary(p[name]['cpu'])}")
    path = save(
        "vs_inprocess_vllm_paired",
        args,
        pairs=pairs,
        ratio=ratio,
        ratio_per_pair=per_pair,
        ratio_without_inprocess_tokenize=statistics.median(without_tokenize),
        ratio_per_unstolen_cpu_s=statistics.median(unstolen),
        ratio_per_unstolen_cpu_s_per_pair=unstolen,
    )
    console.print(f"written to {path}")
    return 0


def idle_cpu(cpu: dict, idle_root: str, children_only: bool = False) -> float:
    """CPU seconds the idle side's processes spent during the other side's pass;
    ``children_only``: its engine's processes, not the root (the bench process is the
    fleet's client too)."""
    return sum(v for k, v in cpu["processes"].items() if k.startswith(idle_root) and (" / " in k or not children_only))


def per_unstolen_cpu_s(side: dict) -> float:
    """Tokens per CPU second the machine had and the hypervisor did not steal: a pass's
    steal moves by up to 2.6 CPU s between the two passes of a pair on these VMs."""
    machine = side["cpu"]["machine"]
    return side["tokens"] / (machine["cores"] * side["wall_s"] - machine["steal_s"])
