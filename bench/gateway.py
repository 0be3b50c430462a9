"""The HTTP gateway against the Python client and against llama.cpp's own server, one run.

    python -m bench.gateway [--prompts 32] [--max-tokens 64] [--concurrency 16] [--threads 2] [--slots 8]

Three arms, the same 32 chat prompts, greedy, the same max tokens:

* gateway:      `ib serve` → the fleet, driven by the official ``openai`` SDK (streaming);
* client:       the fleet's Python ``Client`` (``stream=True``), no HTTP;
* llama-server: llama.cpp's own C++ server (built once from the llama-cpp-python sdist's
                llama.cpp, the same GGUF, threads and slots), driven by the same SDK.

The fleet arms share one `ib worker --backend llamacpp` (``--threads``; 8 sequences, an
8192-token KV cache), llama-server runs ``-np slots -c 8192``: the same batch width and
cache. Only one engine is alive at a time (ggml's threads spin for a while after work, which
would slow whatever runs next on two cores): each round starts the fleet side (worker +
gateway) and the peer side in turn, the side that goes first alternating by round.
Every request's user message starts with a tag unique to its arm, round and prompt (same
length everywhere), so no arm is served from a prefix another arm left in the KV cache;
what all requests share (the chat template's system turn) is cached for every arm alike.

Measured:
1. added latency of the gateway: one request at a time, non-streaming, the gateway through
   the SDK, the gateway over plain httpx, and the client, in rotating order. For each
   request, its time at the caller minus the time the fleet spent on its job (the job
   record's submitted → finished): the path outside the job. The gateway's added latency
   is the median of that for the gateway minus the median for the client, which leaves
   the engine's own variance out.
2. TTFT one at a time, streaming (on the fleet side gateway and client alternate).
3. saturated: all prompts, ``--concurrency`` in flight, streaming; TTFT p50 and aggregate
   generated tokens/s, in each of ``--rounds`` rounds.
Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

from bench.fleet_overhead import prompts
from bench.report import save
from core import connection, settings
from core.registry import ModelRegistry
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.peers import NativeLlamaServer, llama_server_binary
from ops.local.processes import GatewayProcess, WorkerProcess
from ops.measure import percentile

console = Console()
MODEL = "smollm2-135m"
KV_TOKENS = 8192  # the llama.cpp worker's kv_cache_tokens (config/backends.yaml)


@dataclass
class Sample:
    ttft_s: float | None
    e2e_s: float
    tokens: int
    job_id: str | None = None  # the fleet job behind it (the fleet arms)


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def tagged(texts: list[str], arm: str, phase: str) -> list[str]:
    """The prompts with a tag of one length, unique to this arm and phase, in front. Arms
    served by different engines get the same ``arm`` (""): the same prompts, so the same
    answers and the same work; arms that share one engine get their own."""
    return [f"[{arm[:2]}{phase}{i:03d}] {t}" for i, t in enumerate(texts)]


class SdkArm:
    """An OpenAI-compatible server driven with the official SDK (the gateway, llama-server)."""

    def __init__(self, base_url: str, key: str) -> None:
        self.sdk = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)

    def run(self, text: str, max_tokens: int, stream: bool) -> Sample:
        t0 = time.perf_counter()
        if not stream:
            ask = messages(text)
            raw = self.sdk.chat.completions.with_raw_response.create(
                model=MODEL, messages=ask, max_tokens=max_tokens, temperature=0
            )
            r = raw.parse()
            return Sample(None, time.perf_counter() - t0, r.usage.completion_tokens, raw.headers.get("x-ib-job-id"))
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


class HttpArm:
    """The gateway over plain HTTP (httpx, no SDK): what the gateway itself adds, without
    the SDK's own request building and response parsing."""

    def __init__(self, base_url: str, key: str) -> None:
        self.url = f"{base_url}/chat/completions"
        self.http = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=600)

    def run(self, text: str, max_tokens: int, stream: bool) -> Sample:
        t0 = time.perf_counter()
        body = {"model": MODEL, "messages": messages(text), "max_tokens": max_tokens, "temperature": 0}
        r = self.http.post(self.url, json=body)
        r.raise_for_status()
        return Sample(None, time.perf_counter() - t0, r.json()["usage"]["completion_tokens"], r.headers["x-ib-job-id"])


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
        return Sample(ttft, time.perf_counter() - t0, result.usage.completion_tokens, handle.id)


Arm = Callable[[str, int, bool], Sample]


def saturated(run: Arm, texts: list[str], max_tokens: int, concurrency: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(lambda t: run(t, max_tokens, True), texts))
    wall = time.perf_counter() - t0
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    tokens = sum(s.tokens for s in samples)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts)}


def peer_args(doc: str | None) -> argparse.ArgumentParser:
    """The workload both llama-server benchmarks share (this one and bench.vs_peers)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ttft-prompts", type=int, default=8, help="one-at-a-time TTFT samples per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return ap


@dataclass
class PeerSetup:
    binary: str | None  # llama-server (None: not needed)
    gguf: str
    url: str  # the broker
    broker: EmbeddedBroker | None  # started here when no REDIS_URL is set
    client: Client

    def close(self) -> None:
        self.client.close()
        if self.broker:
            self.broker.stop()


def peer_setup(server: bool = True) -> PeerSetup:
    """The broker and client of the fleet side, and (``server``) the llama-server binary."""
    binary = None
    if server:
        with console.status("llama-server: built once from the llama-cpp-python sdist (cached)..."):
            binary = llama_server_binary()
    gguf = str(ModelRegistry.from_config().get(MODEL).artifact_path("gguf"))
    broker = None
    url = connection.redis_url()
    if url is None:
        broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "bench-broker").start(announce=False)
        url = broker.url
    return PeerSetup(binary, gguf, url, broker, Client(url))


@contextmanager
def llama_server(setup: PeerSetup, args: argparse.Namespace) -> Iterator[NativeLlamaServer]:
    """llama-server with the benchmark's threads, slots and KV size, stopped afterwards."""
    assert setup.binary is not None, "peer_setup(server=True) builds llama-server"
    server = NativeLlamaServer(setup.binary, setup.gguf, args.threads, args.slots, KV_TOKENS)
    try:
        with console.status("starting llama-server..."):
            server.start()
        yield server
    finally:
        server.stop()


def alternating(rounds: int, fleet_side: Callable[[int], None], peer_side: Callable[[int], None]) -> None:
    """Each round runs both sides, one engine alive at a time; which goes first alternates."""
    for r in range(rounds):
        for side in (fleet_side, peer_side) if r % 2 == 0 else (peer_side, fleet_side):
            side(r)


def time_outside(
    arms: dict[str, Arm], client: Client, texts: list[str], tag: str, pairs: int, outside: dict[str, list[float]]
) -> None:
    """Each arm's time outside the job (end to end minus the job's own), ``pairs`` requests
    of 16 tokens each, one at a time, the order rotating."""
    for i in range(pairs):
        trio = ["gateway", "gateway-http", "client"]
        for name in trio[i % 3 :] + trio[: i % 3]:
            got = arms[name](tagged([texts[i % len(texts)]], name, f"{tag}{i:02d}")[0], 16, False)
            _, payload = client.store.final(got.job_id or "") or ("", {})
            t = payload["timings"]
            outside[name].append(got.e2e_s - (t["finished"] - t["submitted"]))


def report_run(
    args: argparse.Namespace,
    texts: list[str],
    one: dict[str, list[float]],
    outside: dict[str, list[float]],
    rounds: list[dict[str, dict]],
    binary: str | None,
) -> None:
    """The run's table and added latency, printed and saved."""
    names = list(one)
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
    p50 = {name: statistics.median(v) * 1000 for name, v in outside.items()}
    added = {
        "median_ms": p50["gateway"] - p50["client"],  # through the openai SDK: what a user sees
        "median_http_ms": p50["gateway-http"] - p50["client"],  # the gateway itself (plain httpx)
        **{f"{name}_outside_job_p50_ms": v for name, v in p50.items()},
        **{f"{name}_outside_job_p90_ms": percentile(v, 90) * 1000 for name, v in outside.items()},
        "requests_each": len(outside["client"]),
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
        f"gateway added latency per request at the median: {added['median_ms']:.1f} ms through the openai SDK, "
        f"{added['median_http_ms']:.1f} ms over plain HTTP (time outside the job, p50: SDK "
        f"{p50['gateway']:.1f}, HTTP {p50['gateway-http']:.1f}, client {p50['client']:.1f} ms; "
        f"{added['requests_each']} requests each, 16 tokens); "
        f"saturated tok/s vs llama-server: gateway {summary['gateway']['tok_s'] / base:.2f}x, "
        f"client {summary['client']['tok_s'] / base:.2f}x"
    )
    path = save("gateway", args, summary=summary, added_latency=added, rounds=rounds, llama_server=binary)
    console.print(f"written to {path}")


def main() -> int:
    ap = peer_args(__doc__)
    ap.add_argument("--pairs", type=int, default=16, help="sequential gateway/client pairs per round (16 tokens)")
    args = ap.parse_args()
    setup = peer_setup()
    binary, url, client = setup.binary, setup.url, setup.client
    texts = prompts(args.prompts)
    key = "bench-" + secrets.token_urlsafe(12)
    one: dict[str, list[float]] = {"gateway": [], "client": [], "llama-server": []}
    outside: dict[str, list[float]] = {"gateway": [], "gateway-http": [], "client": []}
    rounds: list[dict[str, dict]] = [{} for _ in range(args.rounds)]

    def measure(arms: dict[str, Arm], r: int) -> None:
        """One side's arms in round ``r``: TTFT one at a time, then saturated."""
        for run in arms.values():  # warm-up: connections, the template's cached turn
            run(f"[warm{r}] {texts[0]}", 8, True)
        names = list(arms)
        for i in range(args.ttft_prompts):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                got = arms[name](tagged([texts[i]], name, f"T{r}")[0], args.max_tokens, True)
                if got.ttft_s is not None:
                    one[name].append(got.ttft_s)
        for name in names if r % 2 == 0 else names[::-1]:
            with console.status(f"round {r + 1}: {name}, {len(texts)} prompts, {args.concurrency} in flight..."):
                rounds[r][name] = saturated(arms[name], tagged(texts, name, f"R{r}"), args.max_tokens, args.concurrency)

    def fleet_side(r: int) -> None:
        worker = WorkerProcess("llamacpp", url, extra_args=[f"--threads={args.threads}"])
        gateway = GatewayProcess(url, env={"IB_API_KEYS": key})
        try:
            with console.status("starting the llama.cpp worker and the gateway..."):
                worker.start().wait_ready(300)
                gateway.start()
            arms: dict[str, Arm] = {"gateway": SdkArm(f"{gateway.url}/v1", key).run, "client": ClientArm(client).run}
            measure(arms, r)
            arms["gateway-http"] = HttpArm(f"{gateway.url}/v1", key).run
            with console.status(f"added latency: {args.pairs} sequential gateway/client rounds..."):
                time_outside(arms, client, texts, f"L{r}", args.pairs, outside)
        finally:
            gateway.stop()
            worker.stop()

    def peer_side(r: int) -> None:
        with llama_server(setup, args) as server:
            measure({"llama-server": SdkArm(f"{server.url}/v1", "none").run}, r)

    try:
        alternating(args.rounds, fleet_side, peer_side)
    finally:
        setup.close()

    report_run(args, texts, one, outside, rounds, binary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
