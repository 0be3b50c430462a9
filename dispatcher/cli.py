"""`ib`: the command line of InferenceBackend (typer + rich).

Broker: ``REDIS_URL`` (any Redis or Valkey; ``REDIS_PASSWORD`` and ``rediss://`` for TLS),
else an embedded Valkey started by ``ib broker``.
"""

from __future__ import annotations

import json
import logging
import signal
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dispatcher import ops_cli, settings
from dispatcher.batch_cli import batch_app
from dispatcher.bench_cli import bench_app
from dispatcher.fleet import describe_health
from dispatcher.jobs import BACKENDS, JobError, JobResult

app = typer.Typer(help="InferenceBackend: one job queue in front of five LLM engines.", no_args_is_help=True)
models_app = typer.Typer(help="The ModelRegistry: list models, prepare derived formats.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(batch_app, name="batch")
app.add_typer(bench_app, name="bench")
app.command()(ops_cli.up)
app.command()(ops_cli.flower)
console = Console()

ModelOpt = Annotated[str, typer.Option("--model", help="registered model name")]
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", help="raw completion prompt")]
MessageOpt = Annotated[Optional[list[str]], typer.Option("--message", "-m", help="chat message 'role: text' (repeatable); a bare text is a user message")]
MaxTokOpt = Annotated[int, typer.Option("--max-tokens")]
TempOpt = Annotated[float, typer.Option("--temperature")]
LatencyOpt = Annotated[Optional[float], typer.Option("--latency-ms", help="latency target (ms)")]
ThroughputOpt = Annotated[Optional[float], typer.Option("--throughput", help="throughput target (tok/s)")]
HardwareOpt = Annotated[Optional[str], typer.Option("--hardware", help="hint: gpu | cpu")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", help=f"override the tree: {', '.join(BACKENDS)}")]


def _job(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend) -> dict:
    job: dict = {
        "model": model,
        "sampling": {"max_tokens": max_tokens, "temperature": temperature},
        "slo": {"latency_target_ms": latency_ms, "throughput_target_tok_s": throughput},
        "hardware": hardware,
        "backend": backend,
    }
    if message:
        job["messages"] = [_message(m) for m in message]
    else:
        job["prompt"] = prompt
    return job


def _message(text: str) -> dict:
    role, sep, content = text.partition(":")
    if sep and role.strip() in ("system", "user", "assistant"):
        return {"role": role.strip(), "content": content.strip()}
    return {"role": "user", "content": text}


def _client():
    from dispatcher.client import Client

    url = settings.redis_url()
    if not url:
        console.print("[red]no broker:[/] set REDIS_URL, or start the embedded one with `ib broker`")
        raise typer.Exit(2)
    return Client(url)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM (kill, a supervisor) unwinds like Ctrl-C, so what a command started stops too."""
    signal.signal(signal.SIGTERM, _interrupt)


def _fail(exc: JobError) -> None:
    console.print(f"[red]{type(exc).__name__}:[/] {exc}")
    raise typer.Exit(1)


@app.command()
def explain(
    model: ModelOpt = "smollm2-135m",
    prompt: PromptOpt = "Hello",
    message: MessageOpt = None,
    max_tokens: MaxTokOpt = 128,
    temperature: TempOpt = 0.0,
    latency_ms: LatencyOpt = None,
    throughput: ThroughputOpt = None,
    hardware: HardwareOpt = None,
    backend: BackendOpt = None,
) -> None:
    """Show where a job would go and why, without running it."""
    try:
        sel = _client().explain(_job(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend))
    except JobError as exc:
        _fail(exc)
    table = Table(title=f"decision for {model}: {sel.backend} on queue {sel.queue}")
    table.add_column("step")
    table.add_column("answer")
    table.add_column("why")
    for step in sel.path:
        table.add_row(step.check, step.answer, step.detail)
    console.print(table)
    console.print(f"engine config: {json.dumps(sel.config)}")


@app.command()
def submit(
    model: ModelOpt = "smollm2-135m",
    prompt: PromptOpt = None,
    message: MessageOpt = None,
    max_tokens: MaxTokOpt = 128,
    temperature: TempOpt = 0.0,
    latency_ms: LatencyOpt = None,
    throughput: ThroughputOpt = None,
    hardware: HardwareOpt = None,
    backend: BackendOpt = None,
    wait: Annotated[bool, typer.Option(help="wait and print the answer")] = True,
    stream: Annotated[bool, typer.Option(help="print the answer as it is generated")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 300,
) -> None:
    """Submit one job; prints its id (and, with --wait, its answer)."""
    client = _client()
    try:
        job = {**_job(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend), "stream": stream}
        handle = client.submit(job)
        console.print(f"job [bold]{handle.id}[/] → {handle.backend} ({handle.selection.queue})")
        if stream:
            try:
                for delta in handle.stream(timeout=timeout):
                    print(delta, end="", flush=True)
            except TimeoutError as exc:
                console.print(f"\n[red]{exc}[/]; the job goes on: `ib result {handle.id}`")
                raise typer.Exit(1) from None
            print()
        if wait:
            print_results([handle.result(timeout=timeout)])
    except JobError as exc:
        _fail(exc)


@app.command()
def result(job_id: str, timeout: float = 300) -> None:
    """Wait for a job and print its result."""
    try:
        print_results([_client().result(job_id, timeout=timeout)])
    except JobError as exc:
        _fail(exc)


@app.command()
def status(job_id: str) -> None:
    """A job's record: status, backend, worker, attempts."""
    record = _client().record(job_id)
    if not record:
        console.print(f"[red]unknown job {job_id}[/]")
        raise typer.Exit(1)
    for key in ("status", "model", "backend", "queue", "worker", "attempts"):
        if key in record:
            console.print(f"{key:>9}: {record[key]}")


@app.command()
def cancel(job_id: str) -> None:
    """Cancel a job: it stops at the next decoding step with the tokens so far."""
    _client().cancel(job_id)
    console.print(f"cancel requested for {job_id}")


@app.command()
def workers() -> None:
    """The live fleet, from worker heartbeats."""
    fleet = _client().workers()
    table = Table(title=f"{len(fleet.workers)} live worker(s)")
    for col in ("worker", "backend", "hardware", "models", "status", "health", "load", "queues"):
        table.add_column(col)
    for w in fleet.workers:
        hw = ", ".join(f"{g.name} {g.memory_total_mb // 1024} GiB" for g in w.hardware.gpus) or f"CPU {w.hardware.cpu_cores} cores, {w.hardware.ram_gb} GiB"
        table.add_row(w.worker_id, w.backend, hw, ", ".join(w.models), w.status, describe_health(w.health),
                      f"{w.in_flight}/{w.capacity}", ", ".join(w.queues))  # fmt: skip
    console.print(table)


@app.command()
def worker(
    backend: Annotated[str, typer.Option(help=f"one of {', '.join(BACKENDS)}")],
    model: ModelOpt = "smollm2-135m",
    threads: Annotated[Optional[int], typer.Option(help="engine threads (default: the cores this process may use)")] = None,
    concurrency: Annotated[Optional[int], typer.Option(help="jobs in flight (default: what the engine wants)")] = None,
    worker_id: Annotated[Optional[str], typer.Option(help="stable id (default: backend-kind-host-pid)")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="run on the CPU even if a GPU is present")] = False,
    fmt: Annotated[Optional[str], typer.Option("--format", help="artifact format to serve, e.g. onnx-int4")] = None,
    endpoint: Annotated[Optional[str], typer.Option(help="tgi: the server's URL (OpenAI-compatible API), or IB_TGI_ENDPOINT")] = None,
    loglevel: str = "INFO",
    metrics_port: Annotated[Optional[int], typer.Option(help="serve Prometheus /metrics here (default: metrics.port; 0: off)")] = None,
) -> None:
    """Start a worker: load one engine, heartbeat, consume ib.<backend>."""
    from workers.engines.base import ModelArtifactError
    from workers.worker import run_worker

    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.redis_url():
        console.print("[red]no broker:[/] set REDIS_URL, or start the embedded one with `ib broker`")
        raise typer.Exit(2)
    try:
        run_worker(backend, model, threads=threads, concurrency=concurrency, worker_id=worker_id,
                   use_gpu=False if cpu else None, fmt=fmt, endpoint=endpoint, loglevel=loglevel,
                   metrics_port=metrics_port)  # fmt: skip
    except (FileNotFoundError, ModelArtifactError, NotImplementedError, JobError) as exc:
        console.print(f"[red]worker not started:[/] {exc}")
        raise typer.Exit(2) from None


@app.command()
def broker(port: int = 16379) -> None:
    """Run the embedded Valkey broker (append-only, in the data directory) until Ctrl-C."""
    import time

    from dispatcher.broker import EmbeddedBroker

    stop_on_sigterm()
    try:
        with EmbeddedBroker(port=port) as b:
            console.print(f"embedded Valkey at {b.url} (data: {b.data_dir}); Ctrl-C stops it")
            while b.running:
                time.sleep(1)
    except KeyboardInterrupt:
        pass  # the with-block has stopped the server


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(help="how many demo prompts to run")] = 12,
    max_tokens: MaxTokOpt = 48,
) -> None:
    """Start a broker (unless REDIS_URL is set), a PyTorch and an ONNX worker, run real prompts, stop everything."""
    from dispatcher.demo import run_demo

    stop_on_sigterm()
    raise typer.Exit(run_demo(prompts, max_tokens))


@models_app.command("list")
def models_list() -> None:
    """Registered models and their formats."""
    from dispatcher.registry import ModelRegistry

    table = Table(title="models")
    for col in ("model", "family", "HF native", "context", "formats", "drafts"):
        table.add_column(col)
    for spec in ModelRegistry.from_config().models.values():
        formats = ", ".join(f"{f} ({how})" for f, how in spec.formats().items())
        drafts = ", ".join(spec.drafts) or (f"(a draft for {spec.draft_of})" if spec.draft_of else "-")
        table.add_row(spec.name, spec.family, "yes" if spec.hf_native else "no", str(spec.context_length), formats, drafts)
    console.print(table)


@models_app.command("prepare")
def models_prepare(
    name: str,
    fmt: Annotated[str, typer.Option("--format", help="format to derive")] = "hf",
    force: bool = False,
) -> None:
    """Derive a format (e.g. HF safetensors from the shipped GGUF) into the data directory."""
    from dispatcher.registry import ModelRegistry
    from workers.model_prep import prepare

    try:
        spec = ModelRegistry.from_config().get(name)
    except JobError as exc:
        _fail(exc)
    with console.status(f"preparing {name} ({fmt})..."):
        path = prepare(spec, fmt, force=force)
    console.print(f"{name} {fmt}: {path}")
    if spec.draft_of and fmt == "hf":  # a draft is checked against its target once it exists
        _check_drafts(spec.draft_of, only=name)


@models_app.command("check-draft")
def models_check_draft(model: str, draft: Annotated[Optional[str], typer.Option(help="one draft (default: all registered)")] = None) -> None:
    """Check that a model's registered drafts share its vocabulary and architecture family."""
    _check_drafts(model, only=draft)


def _check_drafts(model: str, only: str | None = None) -> None:
    from dispatcher.drafts import IncompatibleDraftError, check_draft
    from dispatcher.registry import ModelRegistry
    from workers.model_prep import prepare

    registry = ModelRegistry.from_config()
    try:
        target = registry.get(model)
        drafts = [registry.get(only)] if only else registry.drafts_for(model)
        if not drafts:
            console.print(f"{model} has no registered draft")
            return
        prepare(target, "hf")
        for d in drafts:
            prepare(d, "hf")
            c = check_draft(target, d)
            console.print(f"draft {c.draft} for {c.target}: compatible ({c.vocab_size} tokens, family {c.family}, "
                          f"{c.draft_layers} of {c.target_layers} layers)")  # fmt: skip
    except IncompatibleDraftError as exc:
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
    except JobError as exc:
        _fail(exc)


def print_results(results: list[JobResult], prompts: list[str] | None = None) -> None:
    """One block per job: readable at any terminal width."""
    for i, r in enumerate(results, 1):
        ttft = r.timings.ttft_s
        path = " → ".join(f"{s.check} {s.answer}" for s in r.path if s.check != "formats")
        if prompts:
            console.print(f"[bold][{i}][/] {prompts[i - 1]}")
        console.print(f"    [green]{escape(r.text.strip())}[/]")
        console.print(
            f"    {r.backend} on {r.worker} · queue wait {r.timings.queue_wait_s * 1000:.0f} ms · "
            f"TTFT {'-' if ttft is None else f'{ttft * 1000:.0f} ms'} · {r.tokens_per_s:.1f} tok/s · "
            f"{r.finish_reason} ({r.usage.completion_tokens} tokens"
            f"{f', {r.usage.cached_tokens} prompt tokens from the prefix cache' if r.usage.cached_tokens else ''})",
            highlight=False,
        )
        console.print(f"    [dim]path: {escape(path)}[/]")


if __name__ == "__main__":
    app()
