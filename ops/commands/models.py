"""`ib models ...`: add your own models, list and show them, prepare derived formats,
check drafts.

``add`` reads everything it writes from the model's own files (workers.models.facts)
and asks the engines' packages which backends can run it (workers.models.support); it
validates before writing, so a refused add leaves the registry as it was.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from core.backends import load_backends
from core.drafts import IncompatibleDraftError, check_draft
from core.models import sources, user_file
from core.registry import MODEL_NAME, ModelRegistry, ModelSpec
from ops.console import console
from workers.models.facts import ModelFacts, read_facts
from workers.models.prepare import PreparationError, prepare
from workers.models.support import capabilities

app = typer.Typer(
    help="The ModelRegistry: add your own models, list them, prepare derived formats.", no_args_is_help=True
)

SourceError = sources.SourceError


@app.command("add")
def models_add(
    name: Annotated[str, typer.Argument(help="the name jobs will use (letters, digits, . _ -)")],
    source: Annotated[str, typer.Option("--from", help="hf:ORG/NAME[@REVISION], a model folder, or a .gguf file")],
    context: Annotated[int | None, typer.Option(help="serving context window (default: the model's own)")] = None,
    draft_of: Annotated[str | None, typer.Option(help="register it as a speculative draft of this model")] = None,
    replace: Annotated[bool, typer.Option(help="replace a model already registered under this name")] = False,
) -> None:
    """Register a model from the Hub, a local folder or a GGUF file; its metadata is read from it."""
    if not MODEL_NAME.match(name):
        raise SourceError(f"model name {name!r}: use letters, digits, '.', '_' and '-' (64 at most)")
    registry = ModelRegistry.from_config()
    if name in registry.models and not replace:
        where = "config/models.yaml" if registry.models[name].origin == "config" else str(user_file.path())
        raise SourceError(f"{name} is already registered (in {where}): pick another name, or pass --replace")
    parsed = sources.parse(source)
    if parsed.kind == "path":  # the registry file outlives the shell's working directory
        parsed = sources.Source("path", str(Path(parsed.location).expanduser().resolve()))
    if parsed.kind == "hf":  # huggingface_hub draws its own progress bars
        console.print(f"fetching {parsed} (config, tokenizer, safetensors) into the Hugging Face cache...")
    path = sources.fetch(parsed)
    with console.status(f"reading {path.name}..."):
        facts = read_facts(path)
        caps = capabilities(facts, path)
    runnable_backends = [b for b in load_backends() if b not in caps.unsupported]
    if not runnable_backends:
        reasons = "; ".join(f"{b}: {why}" for b, why in caps.unsupported.items())
        raise SourceError(f"no backend can run {facts.architecture} here ({reasons})")
    if context is not None and not 1 <= context <= facts.context_length:
        raise SourceError(f"--context {context}: {name} was trained for {facts.context_length} tokens; give 1 to that")
    if draft_of is not None:
        _check_draft_facts(registry, draft_of, facts)
    entry = _entry(name, parsed, path, facts, caps, context, draft_of)
    ModelSpec(name=name, **entry)  # the entry must load as the registry will load it
    models = user_file.read()
    models[name] = entry
    written = user_file.write(models)
    console.print(f"added {name} to {written}")
    _show(ModelRegistry.from_config().get(name))


def _entry(
    name: str,
    source: sources.Source,
    path: Path,
    facts: ModelFacts,
    caps: Any,
    context: int | None,
    draft_of: str | None,
) -> dict[str, Any]:
    """The registry entry: every value read from the model, the user's choices beside them."""
    fmt = facts.format
    artifact: dict[str, Any] = {"source": str(source)}
    if fmt == "gguf":
        artifact["quantization"] = facts.dtype
    entry: dict[str, Any] = {
        "display_name": source.location if source.kind == "hf" else facts.display_name or name,
        "family": facts.architecture,
        "architecture": facts.architecture,
        "hf_native": caps.hf_native,
        "context_length": context or facts.context_length,
        "model_context_length": facts.context_length,
        "vocab_size": facts.vocab_size,
        "parameters": facts.parameters,
        "dtype": facts.dtype,
        "revision": _revision(source, path),
        "chat": facts.chat,
        "license": facts.license,
        "license_files": facts.license_files or None,
        "source": str(source),
        "artifacts": {fmt: artifact},
        "derive": caps.derive,
        "unsupported": caps.unsupported,
    }
    if draft_of:
        entry["draft_of"] = draft_of
    return {k: v for k, v in entry.items() if v is not None}


def _revision(source: sources.Source, path: Path) -> str:
    """What prefix hashes are rooted in: a Hub snapshot's commit, else a fingerprint of
    the weights (size and first MiB), so re-adding changed files never reuses old hints."""
    if source.kind == "hf":
        return f"hf-{path.name}"
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in {".safetensors", ".gguf"})
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + str(f.stat().st_size).encode())
        with f.open("rb") as fh:
            digest.update(fh.read(1 << 20))
    return f"local-{digest.hexdigest()[:16]}"


def _check_draft_facts(registry: ModelRegistry, target_name: str, draft: ModelFacts) -> None:
    """A draft must share its target's vocabulary (token ids are compared, not text)."""
    if target_name not in registry.models:
        raise SourceError(f"--draft-of {target_name}: no such model (known: {', '.join(registry.names())})")
    target = registry.models[target_name]
    vocab = target.vocab_size
    if vocab is None:  # a hand-written entry: read it from its files
        fmt = next(iter(target.artifacts), None)
        if fmt is None:
            raise SourceError(f"--draft-of {target_name}: it has no artifact to read its vocabulary from")
        vocab = read_facts(target.artifact_path(fmt)).vocab_size
    if vocab != draft.vocab_size:
        raise SourceError(
            f"a draft must share its target's vocabulary: {target_name} has {vocab} tokens, this model "
            f"{draft.vocab_size}; pick a draft of the same tokenizer"
        )


@app.command("remove")
def models_remove(name: str) -> None:
    """Unregister a model added with `ib models add` (its prepared files stay on disk)."""
    registry = ModelRegistry.from_config()
    spec = registry.get(name)
    if spec.origin == "config":
        raise SourceError(f"{name} is defined in config/models.yaml, not added with `ib models add`: edit it there")
    dependants = [m.name for m in registry.models.values() if m.draft_of == name]
    if dependants:
        raise SourceError(f"{', '.join(dependants)} are drafts of {name}: remove them first")
    models = user_file.read()
    models.pop(name)
    written = user_file.write(models)
    console.print(f"removed {name} from {written}; prepared formats stay in {spec.prepared_dir('hf').parent}")


@app.command("list")
def models_list() -> None:
    """Registered models: formats (present, derivable), the backends that can run them."""
    backends = load_backends()
    table = Table(title="models")
    for col in ("model", "architecture", "params", "context", "formats", "runs on", "chat", "from"):
        table.add_column(col)
    for spec in ModelRegistry.from_config().models.values():
        formats = ", ".join(f"{f} ({_state(spec, f)})" for f in spec.formats())
        runs = ", ".join(spec.runnable_on(backends)) or "-"
        table.add_row(
            spec.name + (" (default)" if spec.is_default else ""),
            spec.architecture or spec.family,
            _count(spec.parameters),
            str(spec.context_length),
            formats,
            runs,
            "yes" if spec.chat else "no",
            "config" if spec.origin == "config" else (spec.source or "user"),
        )
    console.print(table)


@app.command("show")
def models_show(name: str) -> None:
    """One model: what it is, where its files are, which backends can run it and why not."""
    _show(ModelRegistry.from_config().get(name))


def _show(spec: ModelSpec) -> None:
    backends = load_backends()
    table = Table(title=spec.name, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    rows = {
        "display name": spec.display_name,
        "architecture": spec.architecture or spec.family,
        "parameters": _count(spec.parameters),
        "dtype": spec.dtype,
        "context": f"{spec.context_length}"
        + (f" (trained for {spec.model_context_length})" if spec.model_context_length else ""),
        "vocabulary": spec.vocab_size,
        "chat template": "yes" if spec.chat else "no: completions (prompt) only",
        "license": spec.license or "not stated in the model's files: check its source",
        "license files": f"{', '.join(spec.license_files)} (beside the weights: read them)"
        if spec.license_files
        else None,
        "revision": spec.revision,
        "source": spec.source or "config/models.yaml",
        "drafts": ", ".join(spec.drafts) or None,
        "draft of": spec.draft_of,
    }
    for key, value in rows.items():
        if value is not None:
            table.add_row(key, str(value))
    for fmt, how in spec.formats().items():
        table.add_row(f"format {fmt}", f"{how}: {_state(spec, fmt, full=True)}")
    runnable = spec.runnable_on(backends)
    for backend in backends:
        if backend in runnable:
            table.add_row(f"backend {backend}", f"yes ({runnable[backend]})")
        else:
            why = spec.unsupported.get(backend) or f"needs {' or '.join(backends[backend].formats)}"
            table.add_row(f"backend {backend}", f"[red]no[/]: {why}")
    console.print(table)


def _state(spec: ModelSpec, fmt: str, full: bool = False) -> str:
    try:
        path = spec.artifact_path(fmt)
    except FileNotFoundError as exc:
        return str(exc) if full else ("derivable" if fmt in spec.derive else "missing")
    return str(path) if full else "present"


def _count(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


@app.command("prepare")
def models_prepare(
    name: str,
    fmt: Annotated[
        str | None, typer.Option("--format", help="format to make ready (default: its artifacts and hf)")
    ] = None,
    force: bool = False,
) -> None:
    """Download a Hub model and derive formats (e.g. HF safetensors from a GGUF) into the data directory."""
    spec = ModelRegistry.from_config().get(name)
    default = [*spec.artifacts, *(["hf"] if "hf" in spec.formats() and "hf" not in spec.artifacts else [])]
    for f in [fmt] if fmt else default:
        try:
            with console.status(f"preparing {name} ({f})..."):
                path = prepare(spec, f, force=force)
        except PreparationError as exc:
            _record_refusal(spec, f, exc)
            raise
        console.print(f"{name} {f}: {path}")
        if spec.draft_of and f == "hf":  # a draft is checked against its target once it exists
            _check_drafts(spec.draft_of, only=name)


def _record_refusal(spec: ModelSpec, fmt: str, exc: PreparationError) -> None:
    """A converter refused an added model: the backends whose workers would load that
    format are marked unsupported in its entry, so the tree stops choosing them (a worker
    for them could never start). `ib models add --replace` starts over."""
    backends = [b for b, f in spec.runnable_on(load_backends()).items() if f == fmt]
    if spec.origin != "user" or not backends:
        return
    models = user_file.read()
    entry = models[spec.name]
    entry["unsupported"] = {**(entry.get("unsupported") or {}), **{b: str(exc) for b in backends}}
    user_file.write(models)
    console.print(f"recorded in {user_file.path()}: {', '.join(backends)} cannot serve {spec.name}")


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
