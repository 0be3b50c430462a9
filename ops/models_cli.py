"""`ib models ...`: list registered models, prepare derived formats, check drafts."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from dispatcher.drafts import IncompatibleDraftError, check_draft
from dispatcher.registry import ModelRegistry
from ops.console import console
from workers.model_prep import prepare

app = typer.Typer(help="The ModelRegistry: list models, prepare derived formats.", no_args_is_help=True)


@app.command("list")
def models_list() -> None:
    """Registered models and their formats."""
    table = Table(title="models")
    for col in ("model", "family", "HF native", "context", "formats", "drafts"):
        table.add_column(col)
    for spec in ModelRegistry.from_config().models.values():
        formats = ", ".join(f"{f} ({how})" for f, how in spec.formats().items())
        drafts = ", ".join(spec.drafts) or (f"(a draft for {spec.draft_of})" if spec.draft_of else "-")
        native = "yes" if spec.hf_native else "no"
        table.add_row(spec.name, spec.family, native, str(spec.context_length), formats, drafts)
    console.print(table)


@app.command("prepare")
def models_prepare(
    name: str,
    fmt: Annotated[str, typer.Option("--format", help="format to derive")] = "hf",
    force: bool = False,
) -> None:
    """Derive a format (e.g. HF safetensors from the shipped GGUF) into the data directory."""
    spec = ModelRegistry.from_config().get(name)
    with console.status(f"preparing {name} ({fmt})..."):
        path = prepare(spec, fmt, force=force)
    console.print(f"{name} {fmt}: {path}")
    if spec.draft_of and fmt == "hf":  # a draft is checked against its target once it exists
        _check_drafts(spec.draft_of, only=name)


@app.command("check-draft")
def models_check_draft(
    model: str, draft: Annotated[str | None, typer.Option(help="one draft (default: all registered)")] = None
) -> None:
    """Check that a model's registered drafts share its vocabulary and architecture family."""
    _check_drafts(model, only=draft)


def _check_drafts(model: str, only: str | None = None) -> None:
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
            console.print(
                f"draft {c.draft} for {c.target}: compatible ({c.vocab_size} tokens, family {c.family}, "
                f"{c.draft_layers} of {c.target_layers} layers)"
            )
    except IncompatibleDraftError as exc:
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
