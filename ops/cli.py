"""`ib`: the command line of InferenceBackend (typer + rich).

Broker: ``REDIS_URL`` (any Redis or Valkey; ``REDIS_PASSWORD`` and ``rediss://`` for TLS),
else an embedded Valkey started by ``ib broker``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated

import typer
from rich.table import Table

from dispatcher import settings
from dispatcher.batch.feeder import BatchFeeder
from dispatcher.client import Client
from dispatcher.jobs import BACKENDS, JobError
from ops import batch_cli, bench_cli, dead_letters_cli, models_cli, serve_cli, up_cli
from ops.broker import EmbeddedBroker
from ops.console import broker_url, console, print_results, stop_on_sigterm
from ops.console import client as _client
from ops.user_errors import run as run_cli

app = typer.Typer(help="InferenceBackend: one job queue in front of five LLM engines.", no_args_is_help=True)
app.add_typer(models_cli.app, name="models")
app.add_typer(batch_cli.app, name="batch")
app.add_typer(dead_letters_cli.app, name="dead-letters")
app.add_typer(bench_cli.app, name="bench")
app.command()(up_cli.up)
app.command()(up_cli.flower)
app.command()(serve_cli.serve)
app.add_typer(serve_cli.keys_app, name="keys")

ModelOpt = Annotated[str, typer.Option("--model", help="registered model name")]
PromptOpt = Annotated[str | None, typer.Option("--prompt", help="raw completion prompt")]
MessageOpt = Annotated[
    list[str] | None,
    typer.Option("--message", "-m", help="chat message 'role: text' (repeatable); a bare text is a user message"),
]
MaxTokOpt = Annotated[int, typer.Option("--max-tokens")]
TempOpt = Annotated[float, typer.Option("--temperature")]
LatencyOpt = Annotated[float | None, typer.Option("--latency-ms", help="latency target (ms)")]
ThroughputOpt = Annotated[float | None, typer.Option("--throughput", help="throughput target (tok/s)")]
HardwareOpt = Annotated[str | None, typer.Option("--hardware", help="hint: gpu | cpu")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help=f"override the tree: {', '.join(BACKENDS)}")]


def _job(
    model: str,
    prompt: str | None,
    message: list[str] | None,
    max_tokens: int,
    temperature: float,
    latency_ms: float | None,
    throughput: float | None,
    hardware: str | None,
    backend: str | None,
) -> dict:
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
    job = _job(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend)
    sel = _client().explain(job)
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
    job = _job(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend)
    handle = client.submit({**job, "stream": stream})
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


@app.command()
def result(job_id: str, timeout: float = 300) -> None:
    """Wait for a job and print its result."""
    print_results([_client().result(job_id, timeout=timeout)])


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
        gpus = ", ".join(f"{g.name} {g.memory_total_mb // 1024} GiB" for g in w.hardware.gpus)
        hw = gpus or f"CPU {w.hardware.cpu_cores} cores, {w.hardware.ram_gb} GiB"
        load = f"{w.in_flight}/{w.capacity}"
        table.add_row(
            w.worker_id, w.backend, hw, ", ".join(w.models), w.status, w.health.describe(), load, ", ".join(w.queues)
        )
    console.print(table)


@app.command()
def worker(
    backend: Annotated[str, typer.Option(help=f"one of {', '.join(BACKENDS)}")],
    model: ModelOpt = "smollm2-135m",
    threads: Annotated[
        int | None, typer.Option(help="engine threads (default: the cores this process may use)")
    ] = None,
    concurrency: Annotated[int | None, typer.Option(help="jobs in flight (default: what the engine wants)")] = None,
    worker_id: Annotated[str | None, typer.Option(help="stable id (default: backend-kind-host-pid)")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="run on the CPU even if a GPU is present")] = False,
    fmt: Annotated[str | None, typer.Option("--format", help="artifact format to serve, e.g. onnx-int4")] = None,
    endpoint: Annotated[
        str | None, typer.Option(help="tgi: the server's URL (OpenAI-compatible API), or IB_TGI_ENDPOINT")
    ] = None,
    loglevel: str = "INFO",
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus /metrics here (default: metrics.port; 0: off)")
    ] = None,
) -> None:
    """Start a worker: load one engine, heartbeat, consume ib.<backend>."""
    from workers.engines.base import ModelArtifactError
    from workers.worker import run_worker

    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker_url()  # without one: a line saying how to get one, exit 2
    try:
        run_worker(
            backend,
            model,
            threads=threads,
            concurrency=concurrency,
            worker_id=worker_id,
            use_gpu=False if cpu else None,
            fmt=fmt,
            endpoint=endpoint,
            loglevel=loglevel,
            metrics_port=metrics_port,
            sidecars=[batch_feeder] if settings.fleet_config().batch.feeder_in_workers else [],
        )
    except (FileNotFoundError, ModelArtifactError, NotImplementedError, JobError) as exc:
        console.print(f"[red]worker not started:[/] {exc}")
        raise typer.Exit(2) from None


def batch_feeder(url: str, worker_id: str) -> BatchFeeder:
    """Every worker process runs a batch feeder (one at a time holds the lease), so
    batches move on whichever workers are alive."""
    return BatchFeeder(Client(url, resilient=True), owner=worker_id).start()


@app.command()
def broker(port: int = 16379) -> None:
    """Run the embedded Valkey broker (append-only, in the data directory) until Ctrl-C."""
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
    """Start a broker (unless REDIS_URL is set), a worker per backend, run real prompts and a batch, stop everything."""
    from ops.demo import run_demo

    stop_on_sigterm()
    raise typer.Exit(run_demo(prompts, max_tokens))


def main() -> None:
    """The `ib` entry point: the app, with a user's mistakes as one line (ops.user_errors)."""
    run_cli(app)


if __name__ == "__main__":
    main()
