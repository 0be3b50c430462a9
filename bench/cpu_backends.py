"""CPU backends side by side, through the fleet, in one run.

    python -m bench.cpu_backends [--model smollm2-135m] [--formats hf,gguf,onnx,onnx-int4]
                                 [--prompts 32] [--max-tokens 64] [--threads 2] [--in-flight 16]

For each backend (PyTorch eager fp32, llama.cpp on the GGUF, ONNX Runtime fp32 and int4)
that can run the model, one `ib worker` is started alone on this machine and given the
same 32 prompts (chat prompts; plain completion prompts for a model without a chat
template), greedy, 64 new tokens:

* single stream: one job at a time; TTFT (from submit, what a client sees) p50/p95, the
  decode rate (tokens after the first / time since the first), median, and the
  one-at-a-time aggregate (all tokens / wall time);
* saturated: ``--in-flight`` client threads each submitting and waiting, aggregate
  generated tok/s, and its ratio to the one-at-a-time aggregate (what batching buys);
* the worker's peak RSS (VmHWM).

llama.cpp also gets a prefix-reuse run: single-stream jobs with a ~500-token system
prompt, alternating one shared by every job (its KV state reused) and one made unique
by a leading nonce (evaluated cold); TTFT p50 of each and their ratio.

Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from core import settings
from core.backends import load_backends
from core.jobs import JobResult
from core.registry import ModelRegistry, ModelSpec
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from ops.measure import percentile
from workers.lifecycle import hardware
from workers.models.prepare import prepare

console = Console()
SUBJECTS = ["the sea", "a city", "winter", "a robot", "coffee", "mountains", "a library", "the moon"]
ASKS = [
    "Write two sentences about {}.",
    "Describe {} in a few words.",
    "Give one fact about {}.",
    "Why do people like {}?",
]
# (label, backend, artifact format served); llama.cpp's label gets the GGUF's quantization
BACKENDS = [
    ("PyTorch eager fp32", "pytorch", "hf"),
    ("llama.cpp", "llamacpp", "gguf"),
    ("ONNX Runtime fp32", "onnx", "onnx"),
    ("ONNX Runtime int4", "onnx", "onnx-int4"),
]
SYSTEM = "You are the assistant of a city library. " + " ".join(
    f"Rule {i}: answer in a friendly tone, keep it short, point readers to the {room} when it helps, "
    "and never guess opening times."
    for i, room in enumerate(
        [
            "reading room",
            "children's corner",
            "map archive",
            "music section",
            "study booths",
            "newspaper desk",
            "print shop",
            "local history shelf",
            "language lab",
            "quiet floor",
        ]
        * 2
    )
)


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(SUBJECTS[(i // len(ASKS)) % len(SUBJECTS)]) for i in range(n)]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


MODEL = "smollm2-135m"


def chat_job(backend: str, text: str, max_tokens: int, system: str | None = None, model: str = MODEL) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return {"model": model, "messages": messages, "sampling": {"max_tokens": max_tokens}, "backend": backend}


def job_for(model: ModelSpec, backend: str, text: str, max_tokens: int) -> dict:
    """A chat job, or for a base model (no chat template) the same text as a prompt."""
    if model.chat:
        return chat_job(backend, text, max_tokens, model=model.name)
    return {"model": model.name, "prompt": text + "\n", "sampling": {"max_tokens": max_tokens}, "backend": backend}


def measure(client: Client, model: ModelSpec, backend: str, texts: list[str], max_tokens: int, in_flight: int) -> dict:
    def run(text: str, timeout: float) -> JobResult:
        return client.submit(job_for(model, backend, text, max_tokens)).result(timeout=timeout)

    run(texts[0], 300)  # warm-up
    t0 = time.perf_counter()
    single = [run(t, 300) for t in texts]
    single_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        saturated = list(pool.map(lambda t: run(t, 900), texts))
    wall = time.perf_counter() - t0
    ttfts = [r.timings.ttft_s * 1000 for r in single]
    one_at_a_time = sum(r.usage.completion_tokens for r in single) / single_wall
    aggregate = sum(r.usage.completion_tokens for r in saturated) / wall
    return {
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "decode_tok_s": statistics.median(r.tokens_per_s for r in single),
        "one_at_a_time_tok_s": one_at_a_time,
        "aggregate_tok_s": aggregate,
        "batching_gain": aggregate / one_at_a_time,
        "single_tokens": sum(r.usage.completion_tokens for r in single),
    }


def measure_prefix_reuse(client: Client, backend: str, texts: list[str], model: str = MODEL) -> dict:
    """TTFT with a shared ~500-token system prompt (reused) vs a unique one (cold), alternating."""
    client.submit(chat_job(backend, texts[0], 1, SYSTEM, model)).result(
        timeout=300
    )  # the shared prefix, evaluated once
    warm, cold = [], []
    for i, t in enumerate(texts[:16]):
        cold.append(
            client.submit(chat_job(backend, t, 1, f"[session {i} {time.time_ns()}] " + SYSTEM, model)).result(
                timeout=300
            )
        )
        warm.append(client.submit(chat_job(backend, t, 1, SYSTEM, model)).result(timeout=300))
    cold_ms = statistics.median(r.timings.ttft_s * 1000 for r in cold)
    warm_ms = statistics.median(r.timings.ttft_s * 1000 for r in warm)
    return {
        "prompt_tokens_median": statistics.median(r.usage.prompt_tokens for r in warm),
        "cached_tokens_median": statistics.median(r.usage.cached_tokens for r in warm),
        "cold_ttft_p50_ms": cold_ms,
        "reused_ttft_p50_ms": warm_ms,
        "speedup": cold_ms / warm_ms,
    }


def gguf_type(spec: ModelSpec) -> str:
    """The GGUF's quantization: the shipped file's, or what the HF → GGUF converter writes."""
    if "gguf" in spec.artifacts:
        return spec.artifacts["gguf"].quantization or ""
    return spec.derive["gguf"].precision or "" if "gguf" in spec.derive else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="a registered model (`ib models add` for your own)")
    ap.add_argument("--formats", default="hf,gguf,onnx,onnx-int4", help="which rows: the formats served")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    spec = ModelRegistry.from_config().get(args.model)
    runnable = spec.runnable_on(load_backends())
    wanted = args.formats.split(",")
    subjects = [
        (f"llama.cpp {gguf_type(spec)}".strip() if b == "llamacpp" else label, b, fmt)
        for label, b, fmt in BACKENDS
        if fmt in wanted and b in runnable and fmt in spec.formats()
    ]
    for _, _, fmt in subjects:
        prepare(spec, fmt)
    texts = prompts(args.prompts)
    broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
    rows: dict[str, dict] = {}
    prefix: dict = {}
    try:
        client = Client(broker.url)
        for label, backend, fmt in subjects:
            extra = [f"--threads={args.threads}"] + ([f"--format={fmt}"] if backend == "onnx" else [])
            worker = WorkerProcess(backend, broker.url, model=spec.name, extra_args=extra).start()
            try:
                worker.wait_ready(timeout=300)
                console.print(f"[bold]{label}[/]: {len(texts)} prompts x {args.max_tokens} tokens ...")
                rows[label] = measure(client, spec, backend, texts, args.max_tokens, args.in_flight)
                if backend == "llamacpp" and spec.chat:
                    prefix = measure_prefix_reuse(client, backend, texts, spec.name)
                rows[label]["peak_rss_mb"] = peak_rss_mb(worker.proc.pid)
            finally:
                worker.stop()
    finally:
        broker.stop()

    base_label = next(iter(rows))
    base = rows[base_label]["aggregate_tok_s"]
    table = Table(
        title=f"CPU backends, {spec.name}: {args.prompts} {'chat' if spec.chat else 'completion'} prompts, "
        f"greedy, {args.max_tokens} new tokens, "
        f"{args.threads} threads, {args.in_flight} in flight"
    )
    for col in (
        "backend",
        "TTFT p50",
        "TTFT p95",
        "decode tok/s (1 stream)",
        "tok/s one at a time",
        f"aggregate tok/s ({args.in_flight} in flight)",
        "vs one at a time",
        f"vs {base_label}",
        "worker peak RSS",
    ):
        table.add_column(col, justify="right")
    for label, r in rows.items():
        table.add_row(
            label,
            f"{r['ttft_p50_ms']:.0f} ms",
            f"{r['ttft_p95_ms']:.0f} ms",
            f"{r['decode_tok_s']:.1f}",
            f"{r['one_at_a_time_tok_s']:.1f}",
            f"{r['aggregate_tok_s']:.1f}",
            f"{r['batching_gain']:.2f}x",
            f"{r['aggregate_tok_s'] / base:.2f}x",
            f"{r['peak_rss_mb']:.0f} MB",
        )
    console.print(table)
    if prefix:
        console.print(
            f"llama.cpp prefix reuse, {prefix['prompt_tokens_median']:.0f}-token prompts "
            f"({prefix['cached_tokens_median']:.0f} from the cache): "
            f"TTFT p50 cold {prefix['cold_ttft_p50_ms']:.0f} ms, "
            f"reused {prefix['reused_ttft_p50_ms']:.0f} ms, {prefix['speedup']:.1f}x"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu_backends-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {
        "bench": "cpu_backends",
        "time": time.time(),
        "args": vars(args),
        "hardware": hardware.detect(False).model_dump(),
        "rows": rows,
        "llamacpp_prefix_reuse": prefix,
    }
    path.write_text(json.dumps(record, indent=2))
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
