"""Structured outputs: what a grammar costs, on the engines and against llama-server.

    python -m bench.structured [--prompts 16] [--max-tokens 96] [--rounds 3] [--engines llamacpp,pytorch,onnx]
                               [--no-peer]

1. Constrained against unconstrained, in-process on each engine (the engine alone, no
   fleet): the same chat prompts, greedy, one at a time and all together; the constrained
   arm asks for a nested JSON schema. Reported as generated tokens per second of decoding
   (each job's tokens after the first over the time since its first token, summed over
   jobs) and as tokens per wall second saturated. The constrained answers are shorter
   (the JSON closes), so tokens per second, not time, is what compares.
2. Grammar compile time for the nested schema on the llama.cpp vocabulary: cold (a schema
   never seen: a property of a new name added each time) and cached (the same again).
3. The fleet's llama.cpp worker behind `ib serve` against llama.cpp's own `llama-server`,
   both asked for the same json_schema over HTTP with the openai SDK: the same GGUF,
   threads, slots and KV size, one side alive at a time, the side that goes first
   alternating by round, ``--concurrency`` requests in flight.

Every arm runs ``--rounds`` rounds, order alternating; the median and the spread are
printed and written to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
from rich.console import Console
from rich.table import Table

from bench.fleet_overhead import prompts
from bench.gateway import KV_TOKENS, MODEL, alternating, peer_setup
from bench.report import save
from core.backends import load_backends
from core.jobs import GenerationJob
from core.registry import ModelRegistry
from ops.local.peers import NativeLlamaServer
from ops.local.processes import GatewayProcess, WorkerProcess

console = Console()
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": ["cat", "dog"]},
                    "name": {"type": "string", "maxLength": 12},
                },
                "required": ["kind", "name"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "colour", "pets"],
    "additionalProperties": False,
}


def load_engine(backend: str) -> Any:
    """One engine in-process, as a worker loads it (threads: 2)."""
    spec = ModelRegistry.from_config().get(MODEL)
    config = load_backends()[backend].for_model(spec)
    if backend == "llamacpp":
        from workers.engines.llamacpp.engine import LlamaCppEngine as Engine
    elif backend == "pytorch":
        from workers.engines.pytorch import PyTorchEngine as Engine  # type: ignore[assignment]
    else:
        from workers.engines.onnx import OnnxEngine as Engine  # type: ignore[assignment]
    engine = Engine(spec, config, 2)
    engine.load()
    return engine


def engine_arm(engine: Any, texts: list[str], max_tokens: int, structured: bool, concurrency: int) -> dict:
    """The prompts through the engine, ``concurrency`` at a time: decode tok/s and wall tok/s."""
    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    if structured:
        sampling["structured"] = {"kind": "json_schema", "json_schema": SCHEMA}
    jobs = [GenerationJob(model=MODEL, messages=[{"role": "user", "content": t}], sampling=sampling) for t in texts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(engine.generate, jobs))
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    decode_s = sum(o.finished_at - o.first_token_at for o in outs if o.first_token_at and len(o.token_ids) > 1)
    decode_tokens = sum(len(o.token_ids) - 1 for o in outs if o.first_token_at and len(o.token_ids) > 1)
    valid = sum(1 for o in outs if not structured or _valid_json(o.text))
    return {
        "tok_s": tokens / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "tokens": tokens,
        "valid": valid,
    }


def _valid_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def engines_part(args: argparse.Namespace, texts: list[str]) -> dict:
    """Constrained vs unconstrained on each engine, one at a time (1) and all together."""
    out: dict[str, dict] = {}
    for backend in args.engines.split(","):
        with console.status(f"loading the {backend} engine..."):
            try:
                engine = load_engine(backend)
            except Exception as exc:  # noqa: BLE001 - an engine this host cannot load is reported, not fatal
                console.print(f"[yellow]{backend}: not measured ({type(exc).__name__}: {exc})")
                continue
        try:
            engine_arm(engine, texts[:2], 8, True, 1)  # warm-up: the grammar compiled, the caches touched
            runs: dict[str, list[dict]] = {}
            for r in range(args.rounds):
                order = [("plain", False), ("json_schema", True)]
                for name, structured in order if r % 2 == 0 else order[::-1]:
                    for concurrency in (1, args.slots):
                        with console.status(f"{backend} round {r + 1}: {name}, {concurrency} at a time..."):
                            got = engine_arm(engine, texts, args.max_tokens, structured, concurrency)
                        runs.setdefault(f"{name}@{concurrency}", []).append(got)
            out[backend] = runs
            console.print(f"{backend}: " + json.dumps({k: [round(x["tok_s"], 1) for x in v] for k, v in runs.items()}))
        except Exception as exc:  # noqa: BLE001 - one engine's failure is reported, the rest still measured
            console.print(f"[red]{backend}: failed ({type(exc).__name__}: {str(exc)[:300]})")
        finally:
            engine.close()
    return out


def compile_part(rounds: int) -> dict:
    """The nested schema's compile time on the llama.cpp vocabulary, cold and cached."""
    from core.jobs import StructuredOutput

    engine = load_engine("llamacpp")
    try:
        grammars = engine.grammars
        cold, cached = [], []
        for _ in range(max(3, rounds)):
            extra = {f"note_{secrets.token_hex(4)}": {"type": "string", "maxLength": 8}}
            schema = {**SCHEMA, "properties": {**SCHEMA["properties"], **extra}}  # never seen: a cold compile
            t0 = time.perf_counter()
            grammars.compile(StructuredOutput(kind="json_schema", json_schema=schema))
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            grammars.compile(StructuredOutput(kind="json_schema", json_schema=schema))
            cached.append(time.perf_counter() - t0)
        return {"cold_ms": [c * 1000 for c in cold], "cached_ms": [c * 1000 for c in cached]}
    finally:
        engine.close()


def http_arm(base_url: str, key: str, max_tokens: int) -> Callable[[str], tuple[int, bool]]:
    sdk = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def run(text: str) -> tuple[int, bool]:
        r = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            response_format=response_format,  # type: ignore[arg-type]
        )
        return r.usage.completion_tokens if r.usage else 0, _valid_json(r.choices[0].message.content or "")

    return run


def saturated(run: Callable[[str], tuple[int, bool]], texts: list[str], concurrency: int) -> dict:
    run(texts[0])  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(run, texts))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in got)
    return {"tok_s": tokens / wall, "tokens": tokens, "valid": sum(ok for _, ok in got)}


def peer_part(args: argparse.Namespace, texts: list[str]) -> dict:
    """The fleet's llama.cpp worker behind `ib serve` vs llama-server, both with the schema."""
    setup = peer_setup()
    key = "bench-" + secrets.token_urlsafe(12)
    rounds: dict[str, list[dict]] = {"fleet": [], "llama-server": []}

    def tagged(r: int, side: str) -> list[str]:  # no side is served another's cached prompt
        return [f"[{side[:5]}{r}] {t}" for t in texts]

    def fleet_side(r: int) -> None:
        worker = WorkerProcess("llamacpp", setup.url, extra_args=[f"--threads={args.threads}"])
        gateway = GatewayProcess(setup.url, env={"IB_API_KEYS": key})
        try:
            with console.status(f"round {r + 1}: the fleet (worker + gateway)..."):
                worker.start().wait_ready(300)
                gateway.start()
                run = http_arm(f"{gateway.url}/v1", key, args.max_tokens)
                rounds["fleet"].append(saturated(run, tagged(r, "fleet"), args.concurrency))
        finally:
            gateway.stop()
            worker.stop()

    def peer_side(r: int) -> None:
        assert setup.binary is not None
        server = NativeLlamaServer(setup.binary, setup.gguf, args.threads, args.slots, KV_TOKENS)
        try:
            with console.status(f"round {r + 1}: llama-server..."):
                server.start()
                run = http_arm(f"{server.url}/v1", "none", args.max_tokens)
                rounds["llama-server"].append(saturated(run, tagged(r, "peer"), args.concurrency))
        finally:
            server.stop()

    try:
        alternating(args.rounds, fleet_side, peer_side)
    finally:
        setup.close()
    return rounds


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def report(args: argparse.Namespace, engines: dict, compiled: dict, peer: dict | None) -> None:
    table = Table(title=f"constrained (nested json_schema) vs plain, in-process, greedy, {args.max_tokens} tokens max")
    for col in (
        "engine",
        "arm",
        "decode tok/s, 1 at a time",
        f"wall tok/s, {args.slots} at a time",
        "ratio (decode, 1)",
        "ratio (wall, n)",
    ):
        table.add_column(col)
    ratios: dict[str, dict[str, float]] = {}
    for backend, runs in engines.items():
        plain1 = statistics.median(x["decode_tok_s"] for x in runs["plain@1"])
        plainn = statistics.median(x["tok_s"] for x in runs[f"plain@{args.slots}"])
        for name in ("plain", "json_schema"):
            one = [x["decode_tok_s"] for x in runs[f"{name}@1"]]
            many = [x["tok_s"] for x in runs[f"{name}@{args.slots}"]]
            r1, rn = statistics.median(one) / plain1, statistics.median(many) / plainn
            if name == "json_schema":
                ratios[backend] = {"decode_1": r1, "wall_n": rn}
            table.add_row(backend, name, spread(one), spread(many), f"{r1:.2f}x", f"{rn:.2f}x")
    console.print(table)
    console.print(
        f"grammar compile, nested schema, llama.cpp vocabulary: cold {spread(compiled['cold_ms'])} ms, "
        f"cached {spread(compiled['cached_ms'])} ms"
    )
    if peer:
        fleet = [x["tok_s"] for x in peer["fleet"]]
        theirs = [x["tok_s"] for x in peer["llama-server"]]
        valid = {side: [x["valid"] for x in runs] for side, runs in peer.items()}
        ratio = statistics.median(fleet) / statistics.median(theirs)
        console.print(
            f"json_schema over HTTP, {args.concurrency} in flight: fleet {spread(fleet)} tok/s, "
            f"llama-server {spread(theirs)} tok/s, ratio {ratio:.2f}x (valid JSON of {args.prompts}: {valid})"
        )
    path = save("structured", args, engines=engines, ratios=ratios, compile=compiled, peer=peer)
    console.print(f"written to {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8, help="jobs at once in the saturated arms (llama.cpp's sequences)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight against the servers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="llamacpp,pytorch,onnx")
    ap.add_argument("--no-peer", action="store_true", help="skip the llama-server comparison")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    texts = [f"Describe a person, as JSON. {t}" for t in prompts(args.prompts)]
    engines = engines_part(args, texts)
    compiled = compile_part(args.rounds)
    peer = None if args.no_peer else peer_part(args, texts)
    report(args, engines, compiled, peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
