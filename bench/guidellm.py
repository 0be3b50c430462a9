"""guidellm, the standard serving benchmark, against `ib serve` and against llama-server.

    python -m bench.guidellm [--rounds 3] [--requests 32] [--prompt-tokens 128] [--output-tokens 64]

The same tool measures both sides: guidellm (its own venv, scripts/guidellm.sh) runs its
``concurrent`` profile at 1 and 8 streams on synthetic prompts made with the model's own
tokenizer, sending ``ignore_eos`` so every request generates exactly ``--output-tokens``
(vLLM's extension, which the fleet serves). Fleet side: a llama.cpp worker behind `ib
serve`; peer side: llama.cpp's own `llama-server` with the same GGUF, threads, slots and
KV size. One side alive at a time, the side that goes first alternating by round. Reported
per side and concurrency: output tokens per second, TTFT p50 and requests errored, the
median and the spread of the rounds, written to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.gateway import KV_TOKENS, MODEL, alternating, peer_setup
from bench.report import save
from core import settings
from core.registry import ModelRegistry
from ops.local.peers import NativeLlamaServer
from ops.local.processes import GatewayProcess, WorkerProcess

console = Console()
STREAMS = (1, 8)


def guidellm_binary() -> str:
    out = subprocess.run(
        [str(settings.REPO_ROOT / "scripts" / "guidellm.sh"), sys.executable], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"installing guidellm failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def scenario(target: str, key: str | None, tokenizer: Path, args: argparse.Namespace, report: Path) -> dict:
    backend: dict[str, Any] = {
        "kind": "openai_http",
        "target": target,
        "model": MODEL,
        "request_format": "/v1/chat/completions",
    }
    if key:
        backend["api_key"] = key
    return {
        "spec": {
            "backend": backend,
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [
                {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
            ],
            "constraints": [{"kind": "max_requests", "count": args.requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        },
        "benchmarks": [{"profile.streams": n} for n in STREAMS],
    }


def run_guidellm(binary: str, spec: dict, workdir: Path) -> list[dict]:
    """One guidellm run (every concurrency of the scenario): per benchmark, its figures."""
    path = workdir / "scenario.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(workdir / "hf")}
    out = subprocess.run(
        [binary, "run", "--scenario", str(path), "--disable-progress"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    if out.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    report = json.loads(Path(spec["spec"]["outputs"][0]["path"]).read_text())
    return figures(report)


def figures(report: dict) -> list[dict]:
    """Per benchmark of a guidellm JSON report (in the scenario's order, STREAMS): output
    tok/s (guidellm's own, over the benchmark), TTFT p50, requests errored."""
    rows = []
    for streams, bench in zip(STREAMS, report["benchmarks"], strict=True):
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        rows.append(
            {
                "streams": streams,
                "output_tok_s": metrics["output_tokens_per_second"]["successful"]["mean"],
                "ttft_p50_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
                "errored": totals["errored"],
                "successful": totals["successful"],
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    with console.status("guidellm: its own venv, made once..."):
        binary = guidellm_binary()
    from workers.models.prepare import prepare  # the model's HF folder: its tokenizer

    tokenizer = prepare(ModelRegistry.from_config().get(MODEL), "hf")
    setup = peer_setup()
    key = "bench-" + secrets.token_urlsafe(12)
    results: dict[str, list[list[dict]]] = {"fleet": [], "llama-server": []}
    work = Path(tempfile.mkdtemp(prefix="ib-guidellm-"))

    def fleet_side(r: int) -> None:
        worker = WorkerProcess("llamacpp", setup.url, extra_args=[f"--threads={args.threads}"])
        gateway = GatewayProcess(setup.url, env={"IB_API_KEYS": key})
        try:
            with console.status(f"round {r + 1}: guidellm against ib serve..."):
                worker.start().wait_ready(300)
                gateway.start()
                spec = scenario(gateway.url, key, tokenizer, args, work / f"fleet-{r}.json")
                results["fleet"].append(run_guidellm(binary, spec, work))
        finally:
            gateway.stop()
            worker.stop()

    def peer_side(r: int) -> None:
        assert setup.binary is not None
        server = NativeLlamaServer(setup.binary, setup.gguf, args.threads, args.slots, KV_TOKENS)
        try:
            with console.status(f"round {r + 1}: guidellm against llama-server..."):
                server.start()
                spec = scenario(server.url, None, tokenizer, args, work / f"peer-{r}.json")
                results["llama-server"].append(run_guidellm(binary, spec, work))
        finally:
            server.stop()

    try:
        alternating(args.rounds, fleet_side, peer_side)
    finally:
        setup.close()
    table = Table(title=f"guidellm, {args.prompt_tokens} prompt / {args.output_tokens} output tokens, ignore_eos")
    for col in ("side", "streams", "output tok/s (rounds)", "TTFT p50 ms", "errored", "ratio"):
        table.add_column(col)
    for i, streams in enumerate(STREAMS):
        peer = statistics.median(rnd[i]["output_tok_s"] for rnd in results["llama-server"])
        for side, rounds in results.items():
            tok = [rnd[i]["output_tok_s"] for rnd in rounds]
            ttft = statistics.median(rnd[i]["ttft_p50_ms"] for rnd in rounds)
            errored = sum(rnd[i]["errored"] or 0 for rnd in rounds)
            rounds_text = ", ".join(f"{t:.1f}" for t in tok)
            ratio = statistics.median(tok) / peer
            table.add_row(
                side,
                str(streams),
                f"{statistics.median(tok):.1f} ({rounds_text})",
                f"{ttft:.0f}",
                str(errored),
                f"{ratio:.2f}x",
            )
    console.print(table)
    path = save("guidellm", args, results=results)
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
