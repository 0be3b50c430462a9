"""Each backend's TTFT through the fleet against its engine's own prefill, in one run.

    python -m bench.ttft_prefill [--backends onnx,llamacpp,pytorch] [--prompts 8] [--rounds 2]
                                 [--threads 2]

The same chat prompts (about 50 tokens with the chat template; each starts with a tag
unique to its round, so no engine is served from a prompt an earlier round left behind;
both sides get the same tags, so the same token counts), one at a time:

* in-process: the engine's own library with nothing of ours around it (bench.inprocess
  .first_token_ms): onnxruntime-genai's Generator, llama-cpp-python's ``Llama``,
  transformers' ``generate``; the time to the first generated token;
* fleet: `ib worker --backend B --threads T`, a job submitted through ``Client`` with
  ``stream=True``; TTFT from the submit to the first text at the client: the decision,
  Redis, Celery, the engine's batch formation and the stream included.

Only one engine is alive at a time; which side goes first alternates by round. This
machine's speed drifts by tens of percent over minutes, so the added time is taken round
by round (fleet TTFT p50 minus in-process p50 of the same round, one side right after
the other), and reported as the median over the rounds (target: under 20 ms). Prints a table
and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import inprocess
from bench.gateway import ClientArm, alternating, peer_setup, tagged
from bench.report import percentile, save
from ops.localfleet import WorkerProcess

console = Console()
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
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for backend in args.backends.split(","):
            rounds: list[dict[str, float]] = [{} for _ in range(args.rounds)]
            got: dict[str, list] = {"in_process_ms": [], "fleet_ms": [], "prompt_tokens": [], "rounds": rounds}

            def fleet_side(r: int, backend: str = backend, got: dict = got) -> None:
                worker = WorkerProcess(backend, setup.url, extra_args=[f"--threads={args.threads}"])
                try:
                    with console.status(f"starting the {backend} worker..."):
                        worker.start().wait_ready(900)
                    arm = ClientArm(setup.client)
                    arm.run(f"[warm{r}] {texts[0]}", 2, True)
                    mine = []
                    with console.status(f"round {r + 1}: {backend} through the fleet..."):
                        for text in tagged(texts, "", f"{r}"):
                            t0 = time.perf_counter()
                            handle = setup.client.submit(
                                model=inprocess.MODEL,
                                messages=[{"role": "user", "content": text}],
                                sampling={"max_tokens": 1},
                                stream=True,
                            )
                            next(iter(handle.stream(timeout=300)))
                            mine.append((time.perf_counter() - t0) * 1000)
                            got["prompt_tokens"].append(handle.result(timeout=300).usage.prompt_tokens)
                    got["fleet_ms"] += mine
                    got["rounds"][r]["fleet_p50_ms"] = percentile(mine, 50)
                finally:
                    worker.stop()

            def peer_side(r: int, backend: str = backend, got: dict = got) -> None:
                with console.status(f"round {r + 1}: {backend} in-process..."):
                    mine = inprocess.first_token_ms(backend, tagged(texts, "", f"{r}"), args.threads)
                got["in_process_ms"] += mine
                got["rounds"][r]["in_process_p50_ms"] = percentile(mine, 50)

            alternating(args.rounds, fleet_side, peer_side)
            results[backend] = got
    finally:
        setup.close()

    table = Table(
        title=f"TTFT through the fleet vs the engine's own first token, {len(texts)} chat prompts x "
        f"{args.rounds} rounds, one at a time, {args.threads} threads"
    )
    columns = ("backend", "prompt tokens p50", "in-process p50", "fleet TTFT p50", "added (per round)", "added")
    for col in columns:
        table.add_column(col, justify="right")
    summary = {}
    for backend, got in results.items():
        inp, fleet = percentile(got["in_process_ms"], 50), percentile(got["fleet_ms"], 50)
        added = [r["fleet_p50_ms"] - r["in_process_p50_ms"] for r in got["rounds"]]
        summary[backend] = {
            "in_process_p50_ms": inp,
            "fleet_p50_ms": fleet,
            "added_ms_per_round": added,
            "added_ms": percentile(added, 50),
        }
        table.add_row(
            backend,
            f"{percentile(got['prompt_tokens'], 50):.0f}",
            f"{inp:.1f} ms",
            f"{fleet:.1f} ms",
            ", ".join(f"{a:+.0f}" for a in added),
            f"{percentile(added, 50):+.1f} ms",
        )
    console.print(table)
    path = save("ttft_prefill", args, summary=summary, samples=results)
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
