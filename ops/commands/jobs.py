"""`ib explain`, `ib submit`, `ib result`, `ib status`, `ib cancel`: one job at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from core.backends import load_backends
from core.jobs import BACKENDS
from core.openai_bodies import default_max_tokens, endpoint_of, parse_request
from ops.console import ModelOpt, console, print_results
from ops.console import client as _client

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


@dataclass
class JobOptions:
    """A job as the command line gives it, field for field."""

    model: str
    prompt: str | None
    message: list[str] | None
    max_tokens: int
    temperature: float
    latency_ms: float | None
    throughput: float | None
    hardware: str | None
    backend: str | None

    def job(self) -> dict[str, Any]:
        job: dict[str, Any] = {
            "model": self.model,
            "sampling": {"max_tokens": self.max_tokens, "temperature": self.temperature},
            "slo": {"latency_target_ms": self.latency_ms, "throughput_target_tok_s": self.throughput},
            "hardware": self.hardware,
            "backend": self.backend,
        }
        if self.message:
            job["messages"] = [_message(m) for m in self.message]
        else:
            job["prompt"] = self.prompt
        return job


def _message(text: str) -> dict:
    role, sep, content = text.partition(":")
    if sep and role.strip() in ("system", "user", "assistant"):
        return {"role": role.strip(), "content": content.strip()}
    return {"role": "user", "content": text}


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
    body: Annotated[
        str | None,
        typer.Option(
            "--body",
            help="an OpenAI chat or completions request body (JSON, or @FILE), read as `ib serve` reads it:"
            " where that request would go (its features: json_schema, tools, logprobs, n, ...)",
        ),
    ] = None,
) -> None:
    """Show where a job would go and why, without running it."""
    options = JobOptions(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend)
    job = options.job() if body is None else body_job(body)
    sel = _client().explain(job)
    table = Table(title=f"decision for {model}: {sel.backend} on queue {sel.queue}")
    table.add_column("step")
    table.add_column("answer")
    table.add_column("why")
    for step in sel.path:
        table.add_row(step.check, step.answer, step.detail)
    console.print(table)
    console.print(f"engine config: {json.dumps(sel.config)}")
    console.print(
        f"{sel.backend} serves: {', '.join(sorted(load_backends()[sel.backend].SERVES)) or 'none of the features'}"
    )


def body_job(text: str) -> dict[str, Any]:
    """A request body given on the command line (or @FILE) as the job the gateway makes of it."""
    raw = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--body is not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise typer.BadParameter("--body must be a JSON object (a chat or completions request body)")
    return parse_request(endpoint_of(data), data).to_job(default_max_tokens()).model_dump()


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
    options = JobOptions(model, prompt, message, max_tokens, temperature, latency_ms, throughput, hardware, backend)
    handle = client.submit({**options.job(), "stream": stream})
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


def result(job_id: str, timeout: float = 300) -> None:
    """Wait for a job and print its result."""
    print_results([_client().result(job_id, timeout=timeout)])


def status(job_id: str) -> None:
    """A job's record: status, backend, worker, attempts."""
    record = _client().record(job_id)
    if not record:
        console.print(f"[red]unknown job {job_id}[/]")
        raise typer.Exit(1)
    for key in ("status", "model", "backend", "queue", "worker", "attempts"):
        if key in record:
            console.print(f"{key:>9}: {record[key]}")


def cancel(job_id: str) -> None:
    """Cancel a job: it stops at the next decoding step with the tokens so far."""
    _client().cancel(job_id)
    console.print(f"cancel requested for {job_id}")
