"""Each backend's TTFT through the fleet against its engine's own prefill, in one run.

    python -m bench.ttft_prefill [--backends onnx,llamacpp,pytorch] [--prompts 8] [--rounds 4]
                                 [--threads 2]

The same chat prompts (about 50 tokens with the chat template; each starts with a tag
unique to its round, so no engine is served from a prompt an earlier round left behind;
both sides get the same tags, so the same token counts), one at a time:

* in-process: the engine's own library with nothing of ours around it
  (bench.inprocess.first_token_loop): onnxruntime-genai's Generator, llama-cpp-python's
  ``Llama``, transformers' ``generate``; the time to the first generated token;
* fleet: `ib worker --backend B --threads T`, a job submitted through ``Client`` with
  ``stream=True``; TTFT from the submit to the first text at the client: the decision,
  Redis, Celery, the engine's batch formation and the stream included.

Both sides are loaded once per backend and run prompt by prompt: each prompt through one
side, then right away through the other, the first side alternating from prompt to
prompt (and round to round). The added time is the median of these paired differences
(target: under 20 ms). Pairs seconds apart, not whole runs minutes apart, because this
machine's speed drifts by tens of percent over minutes: the earlier version of this bench
compared round p50s of a fresh worker and a fresh ``Llama`` run one after the other, and
its eight llama.cpp rounds spread from +12 to +51 ms. The side not running is idle (the
worker blocks on its queue, the in-process engine has no thread of its own), except that
the engines' thread pools (ONNX Runtime's, PyTorch's, ggml's) may spin briefly after their work, which slows
whichever side comes next: every measurement starts after a short pause (``QUIET_S``)
in which they go quiet. Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import inprocess
from bench.gateway import ClientArm, PeerSetup, peer_setup, tagged
from bench.report import save
from ops.local.processes import WorkerProcess
from ops.measure import percentile

console = Console()
# Before each measurement: the other side's thread pools (OpenMP in PyTorch, ONNX Runtime's
# and ggml's spinning workers) stop spinning well within this, so neither side starts on a machine
# the other still keeps busy. Without it, the PyTorch pair measured +27 ms (fleet second
# after an in-process prompt half the time); 3 to 7 ms with it (docs/BENCHMARKS.md).
QUIET_S = 0.3
# ~50 tokens each with SmolLM2's chat template (its system turn is ~23)
TEXTS = [
    "Explain in two sentences why the sky looks blue on a clear afternoon in summer.",
    "Give me three short tips for keeping a small vegetable garden healthy this spring.",
    "Write a friendly one-line reminder that the team meeting moved to Thursday at ten.",
    "Summarize what a compiler does for someone who has never written any code before.",
    "Suggest a name for a cafe by the river that sells books, tea and homemade cakes.",
    "List the steps to boil an egg so that the yolk stays soft and the white is firm.",
    "Describe the smell of rain on warm stones after a long dry week in late August.",
    "Tell me what to pack for a two-day hike in the mountains when it might rain.",
]


def fleet_ttft_ms(arm: ClientArm, text: str) -> tuple[float, int]:
    """Submit → the first streamed text at the client (the gateway bench's Client arm),
    and the job's prompt tokens, read after the clock stopped."""
    sample = arm.run(text, 1, True)
    if sample.ttft_s is None:
        raise RuntimeError(f"job {sample.job_id} streamed no text: no first token to time")
    return sample.ttft_s * 1000, arm.client.result(sample.job_id, timeout=300).usage.prompt_tokens


def in_process_ms(first: Callable[[str], None], text: str) -> float:
    t0 = time.perf_counter()
    first(text)
    return (time.perf_counter() - t0) * 1000


def paired_rounds(backend: str, setup: PeerSetup, texts: list[str], args: argparse.Namespace) -> dict[str, list]:
    """Every prompt of every round through both sides back to back; the first side
    alternates by prompt, and a round starts on the other side than the one before."""
    got: dict[str, list] = {"in_process_ms": [], "fleet_ms": [], "prompt_tokens": []}
    worker = WorkerProcess(backend, setup.url, extra_args=[f"--threads={args.threads}"])
    try:
        with console.status(f"starting the {backend} worker and loading it in-process..."):
            worker.start().wait_ready(900)
            first = inprocess.first_token_loop(backend, args.threads)
        # warm both (the first calls allocate; texts that leave nothing to reuse)
        arm = ClientArm(setup.client)
        fleet_ttft_ms(arm, f"[warm] {texts[0]}")
        in_process_ms(first, f"warm-up: {texts[0]}")
        for r in range(args.rounds):
            with console.status(f"{backend}: round {r + 1}/{args.rounds}, {len(texts)} prompts both ways..."):
                for i, text in enumerate(tagged(texts, "", f"{r}")):
                    sides = ["fleet", "in_process"] if (i + r) % 2 == 0 else ["in_process", "fleet"]
                    for side in sides:
                        time.sleep(QUIET_S)
                        if side == "fleet":
                            ms, tokens = fleet_ttft_ms(arm, text)
                            got["prompt_tokens"].append(tokens)
                        else:
                            ms = in_process_ms(first, text)
                        got[f"{side}_ms"].append(ms)
    finally:
        worker.stop()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="onnx,llamacpp,pytorch")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    texts = (TEXTS * (args.prompts // len(TEXTS) + 1))[: args.prompts]
    setup = peer_setup(server=False)
    results: dict[str, dict[str, list]] = {}
    try:
        for backend in args.backends.split(","):
            results[backend] = paired_rounds(backend, setup, texts, args)
            gc.collect()  # the in-process engine is freed before the next backend loads
    finally:
        setup.close()

    table = Table(
        title=f"TTFT through the fleet vs the engine's own first token, {len(texts)} chat prompts x "
        f"{args.rounds} rounds, one at a time, {args.threads} threads"
    )
    columns = ("backend", "prompt tokens p50", "in-process p50", "fleet TTFT p50", "added (median per round)", "added")
    for col in columns:
        table.add_column(col, justify="right")
    summary = {}
    for backend, got in results.items():
        inp, fleet = percentile(got["in_process_ms"], 50), percentile(got["fleet_ms"], 50)
        paired = [f - i for f, i in zip(got["fleet_ms"], got["in_process_ms"])]
        per_round = [percentile(paired[r * len(texts) : (r + 1) * len(texts)], 50) for r in range(args.rounds)]
        summary[backend] = {
            "in_process_p50_ms": inp,
            "fleet_p50_ms": fleet,
            "added_ms_per_round": per_round,
            "added_ms": percentile(paired, 50),
            "pairs": len(paired),
        }
        table.add_row(
            backend,
            f"{percentile(got['prompt_tokens'], 50):.0f}",
            f"{inp:.1f} ms",
            f"{fleet:.1f} ms",
            ", ".join(f"{a:+.0f}" for a in per_round),
            f"{percentile(paired, 50):+.1f} ms",
        )
    console.print(table)
    path = save("ttft_prefill", args, summary=summary, samples=results)
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
