"""The fleet against what a user would run instead, side by side in one run: the llama.cpp
worker against llama.cpp's `llama-server`, the ONNX and vLLM workers against their engines'
own in-process loops (bench.inprocess).

    python -m bench.vs_peers [--backend llamacpp|onnx|vllm] [--prompts 32] [--max-tokens 64]
                             [--concurrency 16] [--threads 2] [--slots 8] [--ttft-prompts 8]
                             [--rounds 2] [--pairs N (vllm)]

``--backend onnx`` / ``vllm`` (throughput of a batch): ``--prompts`` chat prompts (vLLM: 64
unless given), greedy, ``--max-tokens``, all sent at once through ``Client.submit_many`` to
`ib worker --backend B --threads T`, against onnxruntime-genai's own batched Generator
(batches of the engine's batch_size) or one AsyncLLM with the worker's engine arguments,
in this process. Generated tok/s from the first submit to the last result, per round,
``--rounds`` rounds (default 3 here) with the side that goes first alternating; the ratio
is the median of the per-round ratios. For ONNX it also counts the batches the worker
formed (jobs whose first token came within 5 ms of each other share one). Each side
times two passes on its freshly started engine: a first pass over prompts of its own
(the first full batch after a start runs slower: vLLM on CPU ~8 % in-process, more in
the fleet, whose jobs arrive over ~0.4 s), then the steady pass over the prompts; both
ratios are printed, the steady one first (``--no-first-pass``: one pass, as before).
Each pass also records where the CPU went (bench.cpu_time: CPU seconds per process of
each side, Redis, the machine's busy / steal / idle), and each round's steady ratio is
split into the engine's cores (fleet / in-process: what the fleet's own processes and
arrivals take from the engine) times its tokens per CPU second (the machine's speed of
the moment, which moves by ±10 % between passes on these VMs). ``--backend vllm --pairs N``
instead starts both engines once and times N pairs of passes, the sides taking turns
(bench.paired): the rounds' minutes between the two sides' passes let the machine's
speed drift more than the difference measured.

``--backend llamacpp`` (the default):
Both sides serve the same GGUF (SmolLM2-135M-Instruct, the package's quantization) with
the same threads and batch width: `ib worker --backend llamacpp --threads T` (``max_seqs``
8, an 8192-token shared KV pool) driven through the fleet's Python ``Client`` streaming,
and `llama-server -t T -tb T -np S -c 8192` (built once from the llama.cpp source that
the llama-cpp-python sdist vendors, the same portable flags as the wheel:
scripts/llama_server.sh) driven by the official ``openai`` SDK, streaming. Each side
keeps its own defaults otherwise (llama-server: flash attention auto, a KV stream per
slot, prompt reuse per slot; the worker: config/backends.yaml).

Measured per side and round, greedy, ``--max-tokens`` new tokens, the same chat prompts:
1. one at a time (``--ttft-prompts``): TTFT p50, and one-stream decode tok/s = (tokens −
   1) / (end − first token), median;
2. saturated: all ``--prompts`` with ``--concurrency`` in flight: generated tok/s.
Only one engine is alive at a time (ggml's threads spin after work and would slow the
other on two cores); which side goes first alternates by round. Every user message
starts with a tag unique to its phase and round, so neither side is served from a prompt
it saw in an earlier phase; what all prompts share (the chat template's system turn) each
side may reuse alike. Both sides get the same tags, hence the same prompts and (greedy)
the same answers: with a tag per side the answers differed in length, and tok/s compared
unequal work (1348-1499 against 1476-1595 tokens a round on 2026-12-02). The ratios are
fleet / llama-server of the medians over rounds. Prints a table and writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from bench import cpu_time, inprocess, paired
from bench.fleet_overhead import prompts
from bench.gateway import (
    Arm,
    ClientArm,
    PeerSetup,
    SdkArm,
    alternating,
    llama_server,
    peer_args,
    peer_setup,
    saturated,
    tagged,
)
from bench.report import save
from core.registry import ModelRegistry
from dispatcher.client import Client
from ops.local.processes import WorkerProcess
from workers.models.prepare import prepare

console = Console()
FLEET, PEER = "fleet llama.cpp worker", "llama-server"
WORKER_ROLE = "worker process (Celery + engine front end)"


def one_at_a_time(run: Arm, texts: list[str], max_tokens: int) -> dict:
    samples = [run(t, max_tokens, True) for t in texts]
    timed = [s for s in samples if s.ttft_s is not None]
    return {
        "ttft_ms": [s.ttft_s * 1000 for s in timed],
        "stream_tok_s": [(s.tokens - 1) / (s.e2e_s - s.ttft_s) for s in timed if s.tokens > 1 and s.e2e_s > s.ttft_s],
    }


def measure(name: str, run: Arm, texts: list[str], r: int, args: argparse.Namespace) -> dict:
    run(f"[warm{r}] {texts[0]}", 8, True)  # connections, the template's shared turn
    with console.status(f"round {r + 1}: {name}, one at a time..."):
        one = one_at_a_time(run, tagged(texts[: args.ttft_prompts], "", f"T{r}"), args.max_tokens)
    with console.status(f"round {r + 1}: {name}, {len(texts)} prompts, {args.concurrency} in flight..."):
        sat = saturated(run, tagged(texts, "", f"R{r}"), args.max_tokens, args.concurrency)
    return {**one, "saturated": sat}


def summarize(rounds: list[dict], name: str) -> dict:
    mine = [x[name] for x in rounds]
    return {
        "ttft_p50_ms": statistics.median(v for x in mine for v in x["ttft_ms"]),
        "stream_tok_s": statistics.median(v for x in mine for v in x["stream_tok_s"]),
        "saturated_tok_s": statistics.median(x["saturated"]["tok_s"] for x in mine),
        "saturated_tok_s_rounds": [round(x["saturated"]["tok_s"], 1) for x in mine],
    }


def batches_formed(first_tokens: list[float], within_s: float = 0.005) -> list[int]:
    """Sizes of the batches a batching engine formed: jobs whose first token came within
    ``within_s`` of the previous one's decoded in the same first step."""
    sizes: list[int] = []
    last = None
    for t in sorted(first_tokens):
        if last is not None and t - last <= within_s:
            sizes[-1] += 1
        else:
            sizes.append(1)
        last = t
    return sizes


def fleet_timed(client: Client, max_tokens: int, warm_text: str) -> Callable[[list[str]], dict]:
    """``timed(batch)``: every prompt at once through ``Client.submit_many``, as a batch
    user sends them; tok/s to the last result. One short job warms the worker first."""

    def jobs(batch: list[str], tokens: int) -> list[dict]:
        return [
            {"model": inprocess.MODEL, "messages": [{"role": "user", "content": t}], "sampling": {"max_tokens": tokens}}
            for t in batch
        ]

    def timed(batch: list[str]) -> dict:
        t0 = time.perf_counter()
        results = [h.result(timeout=1800) for h in client.submit_many(jobs(batch, max_tokens))]
        wall = time.perf_counter() - t0
        firsts = [r.timings.first_token for r in results if r.timings.first_token is not None]
        return inprocess.result(sum(r.usage.completion_tokens for r in results), wall, batches=batches_formed(firsts))

    client.submit(jobs([warm_text], 4)[0]).result(timeout=600)
    return timed


def fleet_batch(
    client: Client, texts: list[str], max_tokens: int, worker_pid: int, first_pass: list[str] | None = None
) -> dict:
    """``fleet_timed``'s pass; with ``first_pass``, a timed pass over those prompts first
    (inprocess.passes). CPU time is metered for this process (the client) and the
    worker's process tree."""
    timed = fleet_timed(client, max_tokens, texts[0])
    roots = {os.getpid(): "bench process (client)", worker_pid: WORKER_ROLE}
    return inprocess.passes(timed, texts, first_pass, roots)


def engine_split_table(rounds: list[dict[str, dict]], fleet_name: str, peer_name: str) -> Table:
    """Each round's steady ratio split in two (bench.cpu_time.engine_split): the engine's
    cores, fleet / in-process (what the fleet's own processes and its job arrivals cost
    the engine), times its tokens per CPU second, fleet / in-process (the machine's speed
    of the moment on each side). Adds the split to each side's result for the JSON."""
    table = Table(title="steady ratio = engine cores ratio x tokens per engine CPU-second ratio")
    for col in ("round", "engine cores: fleet / in-process", "ratio", "tokens per engine CPU s", "ratio"):
        table.add_column(col)
    for r, x in enumerate(rounds):
        for n in (fleet_name, peer_name):
            x[n]["engine_split"] = cpu_time.engine_split(x[n]["tokens"], x[n]["wall_s"], x[n]["cpu"])
        f, p = x[fleet_name]["engine_split"], x[peer_name]["engine_split"]
        table.add_row(
            str(r + 1),
            f"{f['engine_cores']:.3f} / {p['engine_cores']:.3f}",
            f"{f['engine_cores'] / p['engine_cores']:.3f}",
            f"{f['tokens_per_engine_cpu_s']:.1f} / {p['tokens_per_engine_cpu_s']:.1f}",
            f"{f['tokens_per_engine_cpu_s'] / p['tokens_per_engine_cpu_s']:.3f}",
        )
    return table


def vs_inprocess(args: argparse.Namespace) -> int:
    backend = args.backend
    # Both sides load the same files: the fp32 ONNX export, or the HF folder for vLLM
    # (made once from the GGUF; a no-op when present).
    prepare(ModelRegistry.from_config().get(inprocess.MODEL), "onnx" if backend == "onnx" else "hf")
    setup: PeerSetup = peer_setup(server=False)
    texts = prompts(args.prompts)
    # Each side's first full pass after its engine starts, on prompts of their own (only
    # the chat template's system turn is shared with the timed pass, on both sides alike).
    first_pass = tagged(texts, "", "first") if args.first_pass else None
    rounds: list[dict[str, dict]] = [{} for _ in range(args.rounds)]
    peer_name = {"onnx": "onnxruntime-genai batched Generator", "vllm": "AsyncLLM in-process"}[backend]
    fleet_name = f"fleet {backend} worker"

    def fleet_side(r: int) -> None:
        worker = WorkerProcess(backend, setup.url, extra_args=[f"--threads={args.threads}"])
        try:
            with console.status(f"starting the {backend} worker..."):
                worker.start().wait_ready(900)
            with console.status(f"round {r + 1}: {fleet_name}, {len(texts)} jobs at once..."):
                rounds[r][fleet_name] = fleet_batch(setup.client, texts, args.max_tokens, worker.pid, first_pass)
        finally:
            worker.stop()

    def peer_side(r: int) -> None:
        run = inprocess.onnx_batched if backend == "onnx" else inprocess.vllm_async
        with console.status(f"round {r + 1}: {peer_name}, {len(texts)} prompts..."):
            rounds[r][peer_name] = run(texts, args.max_tokens, args.threads, first_pass=first_pass)

    try:
        alternating(args.rounds, fleet_side, peer_side)
    finally:
        setup.close()
    per_round = [x[fleet_name]["tok_s"] / x[peer_name]["tok_s"] for x in rounds]
    ratio = statistics.median(per_round)
    first_ratios = (
        [x[fleet_name]["first_pass"]["tok_s"] / x[peer_name]["first_pass"]["tok_s"] for x in rounds]
        if first_pass
        else []
    )
    table = Table(
        title=f"{backend}: fleet vs {peer_name}, {len(texts)} chat prompts at once, greedy, "
        f"{args.max_tokens} tokens, {args.threads} threads"
    )
    for col in ("side", "tok/s per round", "median", "tokens"):
        table.add_column(col)
    for name in (fleet_name, peer_name):
        mine = [x[name] for x in rounds]
        table.add_row(
            name,
            ", ".join(f"{m['tok_s']:.1f}" for m in mine),
            f"{statistics.median(m['tok_s'] for m in mine):.1f}",
            ", ".join(str(m["tokens"]) for m in mine),
        )
    table.add_row("fleet / in-process", ", ".join(f"{x:.2f}x" for x in per_round), f"{ratio:.2f}x", "")
    if first_ratios:
        table.add_row(
            "first pass after start: fleet / in-process",
            ", ".join(f"{x:.2f}x" for x in first_ratios),
            f"{statistics.median(first_ratios):.2f}x",
            "",
        )
    console.print(table)
    console.print("CPU seconds in each steady pass (bench.cpu_time):")
    for r, x in enumerate(rounds):
        for name in (fleet_name, peer_name):
            console.print(f"  round {r + 1}, {name}: {cpu_time.summary(x[name]['cpu'])}")
    split = engine_split_table(rounds, fleet_name, peer_name)
    console.print(split)
    if backend == "onnx":
        console.print(
            "batches the worker formed, per round: " + "; ".join(str(x[fleet_name]["batches"]) for x in rounds)
        )
    path = save(
        f"vs_inprocess_{backend}",
        args,
        rounds=rounds,
        ratio=ratio,
        ratio_per_round=per_round,
        first_pass_ratio=statistics.median(first_ratios) if first_ratios else None,
        first_pass_ratio_per_round=first_ratios,
    )
    console.print(f"written to {path}")
    return 0


def main() -> int:
    ap = peer_args(__doc__)
    ap.add_argument("--backend", choices=("llamacpp", "onnx", "vllm"), default="llamacpp")
    ap.add_argument(
        "--no-first-pass",
        dest="first_pass",
        action="store_false",
        help="onnx/vllm: time the one pass right after the engine starts (the default times a second, steady pass "
        "and reports the first beside it)",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="vllm: both engines alive, this many pairs of steady passes, order alternating (bench.paired) "
        "instead of rounds with engines started afresh",
    )
    args = ap.parse_args()
    if args.backend == "vllm" and args.pairs:
        if "--prompts" not in sys.argv:
            args.prompts = 64
        return paired.vllm_paired(args, fleet_timed)
    if args.backend != "llamacpp":
        if "--rounds" not in sys.argv:
            args.rounds = 3
        if args.backend == "vllm" and "--prompts" not in sys.argv:
            args.prompts = 64
        return vs_inprocess(args)
    setup = peer_setup()
    texts = prompts(args.prompts)
    rounds: list[dict[str, dict]] = [{} for _ in range(args.rounds)]

    def fleet_side(r: int) -> None:
        worker = WorkerProcess("llamacpp", setup.url, extra_args=[f"--threads={args.threads}"])
        try:
            with console.status("starting the llama.cpp worker..."):
                worker.start().wait_ready(300)
            rounds[r][FLEET] = measure("fleet", ClientArm(setup.client).run, texts, r, args)
        finally:
            worker.stop()

    def peer_side(r: int) -> None:
        with llama_server(setup, args) as server:
            rounds[r][PEER] = measure("peer", SdkArm(f"{server.url}/v1", "none").run, texts, r, args)

    try:
        alternating(args.rounds, fleet_side, peer_side)
    finally:
        setup.close()

    summary = {name: summarize(rounds, name) for name in (FLEET, PEER)}
    f, p = summary[FLEET], summary[PEER]
    ratios = {
        "saturated_tok_s": f["saturated_tok_s"] / p["saturated_tok_s"],
        "stream_tok_s": f["stream_tok_s"] / p["stream_tok_s"],
        "ttft_p50_added_ms": f["ttft_p50_ms"] - p["ttft_p50_ms"],
    }
    table = Table(
        title=f"llama.cpp: fleet vs llama-server, {len(texts)} chat prompts, greedy, {args.max_tokens} tokens, "
        f"{args.threads} threads, {args.slots} sequences"
    )
    columns = (
        "side",
        "TTFT p50 (one at a time)",
        "one-stream tok/s",
        f"saturated tok/s ({args.concurrency} in flight)",
    )
    for col in columns:
        table.add_column(col)
    for name, s in summary.items():
        table.add_row(
            name,
            f"{s['ttft_p50_ms']:.0f} ms",
            f"{s['stream_tok_s']:.1f}",
            f"{s['saturated_tok_s']:.1f} ({', '.join(map(str, s['saturated_tok_s_rounds']))})",
        )
    table.add_row(
        "fleet / llama-server",
        f"{ratios['ttft_p50_added_ms']:+.0f} ms",
        f"{ratios['stream_tok_s']:.2f}x",
        f"{ratios['saturated_tok_s']:.2f}x",
    )
    console.print(table)
    path = save("vs_peers", args, summary=summary, ratios=ratios, rounds=rounds, llama_server=setup.binary)
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
