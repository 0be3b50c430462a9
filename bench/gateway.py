"""The HTTP gateway against the Python client and against llama.cpp's own server, one run.

    python -m bench.gateway [--prompts 32] [--max-tokens 64] [--concurrency 16] [--threads 2] [--slots 8]

Three arms, the same 32 chat prompts, greedy, the same max tokens:

* gateway:      `ib serve` → the fleet, driven by the official ``openai`` SDK (streaming);
* client:       the fleet's Python ``Client`` (``stream=True``), no HTTP;
* llama-server: llama.cpp's own C++ server (built once from the llama-cpp-python sdist's
                llama.cpp, the same GGUF, threads and slots), driven by the same SDK.

The fleet arms share one `ib worker --backend llamacpp` (``--threads``; 8 sequences, an
8192-token KV cache), llama-server runs ``-np slots -c 8192``: the same batch width and
cache. All three serve on this machine at once; only the arm being measured is busy.

Measured:
1. added latency of the gateway: one request at a time, gateway and client paired and
   alternating in order, non-streaming; the median of the per-pair differences.
2. TTFT one at a time, streaming, the three arms in rotating order per prompt.
3. saturated: all prompts, ``--concurrency`` in flight, streaming; TTFT p50 and aggregate
   generated tokens/s; ``--rounds`` rounds, the arms' order rotating each round.
Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

from bench.fleet_overhead import prompts
from bench.report import percentile, save
from dispatcher import connection, settings
from dispatcher.client import Client
from dispatcher.registry import ModelRegistry
from ops.broker import EmbeddedBroker
from ops.localfleet import GatewayProcess, NativeLlamaServer, WorkerProcess, llama_server_binary

console = Console()
MODEL = "smollm2-135m"
KV_TOKENS = 8192  # the llama.cpp worker's kv_cache_tokens (config/backends.yaml)


@dataclass
class Sample:
    ttft_s: float | None
    e2e_s: float
    tokens: int


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class SdkArm:
    """An OpenAI-compatible server driven with the official SDK (the gateway, llama-server)."""

    def __init__(self, base_url: str, key: str) -> None:
        self.sdk = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)

    def run(self, text: str, max_tokens: int, stream: bool) -> Sample:
        t0 = time.perf_counter()
        if not stream:
            ask = messages(text)
            r = self.sdk.chat.completions.create(model=MODEL, messages=ask, max_tokens=max_tokens, temperature=0)
            return Sample(None, time.perf_counter() - t0, r.usage.completion_tokens)
        ttft, tokens = None, 0
        chunks = self.sdk.chat.completions.create(
            model=MODEL,
            messages=messages(text),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in chunks:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return Sample(ttft, time.perf_counter() - t0, tokens)


class ClientArm:
    def __init__(self, client: Client) -> None:
        self.client = client

    def run(self, text: str, max_tokens: int, stream: bool) -> Sample:
        t0 = time.perf_counter()
        job = {"model": MODEL, "messages": messages(text), "sampling": {"max_tokens": max_tokens}, "stream": stream}
        handle = self.client.submit(job)
        ttft = None
        if stream:
            for delta in handle.stream(timeout=600):
                if ttft is None and delta:
                    ttft = time.perf_counter() - t0
        result = handle.result(timeout=600)
        return Sample(ttft, time.perf_counter() - t0, result.usage.completion_tokens)


Arm = Callable[[str, int, bool], Sample]


def saturated(run: Arm, texts: list[str], max_tokens: int, concurrency: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(lambda t: run(t, max_tokens, True), texts))
    wall = time.perf_counter() - t0
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    tokens = sum(s.tokens for s in samples)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=32, help="sequential gateway/client pairs for the added latency")
    ap.add_argument("--latency-tokens", type=int, default=16, help="max tokens of those sequential requests")
    ap.add_argument("--ttft-prompts", type=int, default=8, help="one-at-a-time TTFT samples per arm")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    with console.status("llama-server: built once from the llama-cpp-python sdist (cached)..."):
        binary = llama_server_binary()
    gguf = str(ModelRegistry.from_config().get(MODEL).artifact_path("gguf"))
    texts = prompts(args.prompts)
    broker = None
    url = connection.redis_url()
    if url is None:
        broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
        url = broker.url
    key = "bench-" + secrets.token_urlsafe(12)
    worker = WorkerProcess("llamacpp", url, extra_args=[f"--threads={args.threads}"])
    gateway = GatewayProcess(url, env={"IB_API_KEYS": key})
    server = NativeLlamaServer(binary, gguf, args.threads, args.slots, KV_TOKENS)
    try:
        with console.status("starting the llama.cpp worker, the gateway and llama-server..."):
            worker.start().wait_ready(300)
            gateway.start()
            server.start()
        client = Client(url)
        arms: dict[str, Arm] = {
            "gateway": SdkArm(f"{gateway.url}/v1", key).run,
            "client": ClientArm(client).run,
            "llama-server": SdkArm(f"{server.url}/v1", "none").run,
        }
        names = list(arms)
        for run in arms.values():  # warm-up: connections, caches, first-request paths
            run(texts[0], 8, True)
            run(texts[1], 8, False)

        with console.status(f"added latency: {args.pairs} sequential gateway/client pairs..."):
            diffs, gw_e2e, cl_e2e = [], [], []
            for i in range(args.pairs):
                text = texts[i % len(texts)]
                order = ["gateway", "client"] if i % 2 == 0 else ["client", "gateway"]
                got = {name: arms[name](text, args.latency_tokens, False) for name in order}
                if got["gateway"].tokens == got["client"].tokens:  # the same work on both sides
                    diffs.append(got["gateway"].e2e_s - got["client"].e2e_s)
                gw_e2e.append(got["gateway"].e2e_s)
                cl_e2e.append(got["client"].e2e_s)

        with console.status("TTFT one at a time..."):
            one: dict[str, list[float]] = {n: [] for n in names}
            for i in range(args.ttft_prompts):
                for name in names[i % 3 :] + names[: i % 3]:
                    s = arms[name](texts[i], args.max_tokens, True)
                    if s.ttft_s is not None:
                        one[name].append(s.ttft_s)

        rounds: list[dict[str, dict]] = []
        for r in range(args.rounds):
            order = names[r % 3 :] + names[: r % 3]
            this: dict[str, dict] = {}
            for name in order:
                with console.status(f"round {r + 1}: {name}, {len(texts)} prompts, {args.concurrency} in flight..."):
                    this[name] = saturated(arms[name], texts, args.max_tokens, args.concurrency)
            rounds.append(this)
        client.close()
    finally:
        server.stop()
        gateway.stop()
        worker.stop()
        if broker:
            broker.stop()

    summary = {
        name: {
            "ttft_one_p50_ms": statistics.median(one[name]) * 1000,
            "ttft_saturated_p50_ms": statistics.median(x[name]["ttft_p50_s"] for x in rounds) * 1000,
            "tok_s": statistics.median(x[name]["tok_s"] for x in rounds),
            "tok_s_rounds": [round(x[name]["tok_s"], 1) for x in rounds],
            "tokens": [x[name]["tokens"] for x in rounds],
        }
        for name in names
    }
    added = {
        "median_ms": statistics.median(diffs) * 1000 if diffs else None,
        "p90_ms": percentile(diffs, 90) * 1000 if diffs else None,
        "pairs_compared": len(diffs),
        "gateway_e2e_p50_ms": statistics.median(gw_e2e) * 1000,
        "client_e2e_p50_ms": statistics.median(cl_e2e) * 1000,
    }
    table = Table(title=f"gateway vs client vs llama-server: {len(texts)} prompts, greedy, {args.max_tokens} tokens")
    for col in ("arm", "TTFT p50, one at a time", f"TTFT p50, {args.concurrency} in flight", "tok/s (rounds)"):
        table.add_column(col)
    for name in names:
        s = summary[name]
        table.add_row(
            name,
            f"{s['ttft_one_p50_ms']:.0f} ms",
            f"{s['ttft_saturated_p50_ms']:.0f} ms",
            f"{s['tok_s']:.1f} ({', '.join(map(str, s['tok_s_rounds']))})",
        )
    console.print(table)
    base = summary["llama-server"]["tok_s"]
    console.print(
        f"gateway added latency per request: median {added['median_ms']:.1f} ms, p90 {added['p90_ms']:.1f} ms "
        f"({added['pairs_compared']} pairs with equal tokens, {args.latency_tokens} tokens each); "
        f"saturated tok/s vs llama-server: gateway {summary['gateway']['tok_s'] / base:.2f}x, "
        f"client {summary['client']['tok_s'] / base:.2f}x"
    )
    path = save("gateway", args, summary=summary, added_latency=added, rounds=rounds, llama_server=binary)
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
