"""The foundation on a real GPU: hardware facts, the tree's GPU branch, the PyTorch
worker on CUDA, greedy parity with transformers on the same device, and batched speed.

    python -m bench.gpu_check [--out DIR] [--jobs 64] [--max-tokens 32]

Run on a lent GPU machine (never in CI). It starts its own embedded Valkey and one
`ib worker --backend pytorch` process, and exits non-zero if a check fails. Prints a
summary and writes gpu_check.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from core import settings
from core.registry import ModelRegistry
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from ops.measure import percentile
from workers.lifecycle import hardware
from workers.models.prepare import prepare

T = TypeVar("T")

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about cats.",
    "What is 7 plus 5?",
    "Give me a word that rhymes with star.",
    "What does a GPU do?",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about the sea.",
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def timed(run: Callable[[str], T]) -> tuple[list[T], list[float]]:
    """``run`` on each prompt, one at a time: the results and each call's wall seconds."""
    results, walls = [], []
    for prompt in PROMPTS:
        t0 = time.perf_counter()
        results.append(run(prompt))
        walls.append(time.perf_counter() - t0)
    return results, walls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    checks: dict[str, bool] = {}
    report: dict = {"checks": checks}

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hw = hardware.detect()
    report["hardware"] = hw.model_dump()
    checks["hardware reports a GPU"] = hw.kind == "gpu" and bool(hw.gpus)
    hf_dir = prepare(ModelRegistry.from_config().get("smollm2-135m"), "hf")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()

    def reference(text: str, n: int) -> list[int]:
        ids = tok(
            tok.apply_chat_template(chat(text), tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
            return_tensors="pt",
        )["input_ids"].to(device)
        with torch.inference_mode():
            out = ref_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
        return out[0, ids.shape[1] :].tolist()

    broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "gpu-check-broker").start(announce=False)
    worker = WorkerProcess("pytorch", broker.url, extra_args=["--threads=4"]).start()
    try:
        t0 = time.monotonic()
        worker.wait_ready(timeout=300)
        report["worker_start_s"] = time.monotonic() - t0
        client = Client(broker.url)
        (info,) = client.workers().live()
        report["heartbeat_hardware"] = info.hardware.model_dump()
        checks["heartbeat carries the GPU"] = info.hardware.kind == "gpu" and bool(info.hardware.gpus)

        sel = client.explain(model="smollm2-135m", messages=chat("hi"))
        report["default_path"] = [s.render() for s in sel.path]
        checks["tree: GPU yes → TGI → live fallback pytorch"] = (
            sel.path[1].answer == "yes" and sel.tree_choice == "tgi" and sel.backend == "pytorch"
        )

        one = client.submit(model="smollm2-135m", messages=chat("warm up"), sampling={"max_tokens": 4})
        one.result(timeout=300)  # the first job on a fresh worker pays CUDA's lazy set-up
        seq, seq_walls = timed(
            lambda p: client.submit(
                model="smollm2-135m", messages=chat(p), sampling={"max_tokens": args.max_tokens}
            ).result(timeout=300)
        )
        reference(PROMPTS[0], 4)  # likewise for the in-process side
        refs, ref_walls = timed(lambda p: reference(p, args.max_tokens))
        seq_tokens = sum(r.usage.completion_tokens for r in seq)
        report["one_in_flight"] = {
            "jobs": len(PROMPTS),
            "fleet_ttft_p50_ms": percentile([r.timings.ttft_s * 1000 for r in seq], 50),
            "fleet_tok_s": seq_tokens / sum(seq_walls),
            "fleet_job_p50_ms": percentile([w * 1000 for w in seq_walls], 50),
            "transformers_generate_tok_s": sum(len(r) for r in refs) / sum(ref_walls),
            "transformers_generate_job_p50_ms": percentile([w * 1000 for w in ref_walls], 50),
        }
        report["sequential_matches"] = sum(r.token_ids == e for r, e in zip(seq, refs))
        checks["greedy one at a time == transformers on the same device"] = report["sequential_matches"] == len(PROMPTS)
        report["sample"] = {"prompt": PROMPTS[0], "text": seq[0].text}

        batched = client.submit_many(
            {"model": "smollm2-135m", "messages": chat(p), "sampling": {"max_tokens": args.max_tokens}} for p in PROMPTS
        )
        report["batched_matches"] = sum(h.result(timeout=300).token_ids == e for h, e in zip(batched, refs))

        texts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.jobs)]
        t0 = time.perf_counter()
        handles = client.submit_many(
            {"model": "smollm2-135m", "messages": chat(t), "sampling": {"max_tokens": args.max_tokens}} for t in texts
        )
        results = [h.result(timeout=600) for h in handles]
        wall = time.perf_counter() - t0
        tokens = sum(r.usage.completion_tokens for r in results)
        report["saturated"] = {
            "jobs": args.jobs,
            "tokens": tokens,
            "wall_s": wall,
            "tok_s": tokens / wall,
            "ttft_p50_ms": percentile([r.timings.ttft_s * 1000 for r in results], 50),
            "queue_wait_p50_ms": percentile([r.timings.queue_wait_s * 1000 for r in results], 50),
        }
        checks[f"{args.jobs} concurrent jobs complete"] = all(r.status == "completed" for r in results)
    finally:
        worker.stop()
        broker.stop()
        report["worker_log_tail"] = worker.log_tail(15)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "worker_log_tail"}, indent=2, default=str))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
