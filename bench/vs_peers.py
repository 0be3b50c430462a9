"""The fleet against the engine's own server, side by side in one run: the llama.cpp worker
against llama.cpp's `llama-server`.

    python -m bench.vs_peers [--prompts 32] [--max-tokens 64] [--concurrency 16] [--threads 2]
                             [--slots 8] [--ttft-prompts 8] [--rounds 2]

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
starts with a tag of one length unique to its side, phase and round, so neither side is
served from a prompt it saw in an earlier phase; what all prompts share (the chat
template's system turn) each side may reuse alike. The ratios are fleet / llama-server
of the medians over rounds. Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.table import Table

from bench.fleet_overhead import prompts
from bench.gateway import Arm, ClientArm, SdkArm, alternating, llama_server, peer_args, peer_setup, saturated, tagged
from bench.report import save
from ops.localfleet import WorkerProcess

console = Console()
FLEET, PEER = "fleet llama.cpp worker", "llama-server"


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
        one = one_at_a_time(run, tagged(texts[: args.ttft_prompts], name, f"T{r}"), args.max_tokens)
    with console.status(f"round {r + 1}: {name}, {len(texts)} prompts, {args.concurrency} in flight..."):
        sat = saturated(run, tagged(texts, name, f"R{r}"), args.max_tokens, args.concurrency)
    return {**one, "saturated": sat}


def summarize(rounds: list[dict], name: str) -> dict:
    mine = [x[name] for x in rounds]
    return {
        "ttft_p50_ms": statistics.median(v for x in mine for v in x["ttft_ms"]),
        "stream_tok_s": statistics.median(v for x in mine for v in x["stream_tok_s"]),
        "saturated_tok_s": statistics.median(x["saturated"]["tok_s"] for x in mine),
        "saturated_tok_s_rounds": [round(x["saturated"]["tok_s"], 1) for x in mine],
    }


def main() -> int:
    args = peer_args(__doc__).parse_args()
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
