"""What a model is, read from its own files: a Hugging Face folder's ``config.json`` and
``tokenizer_config.json``, or a GGUF file's header (the ``gguf`` package). Nothing here
is typed by hand, so a registry entry written by ``ib models add`` says what the weights
are, and the registry file may still override a value (a smaller serving context).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from core.models.sources import SourceError

GGUF_MAGIC = b"GGUF"


class NotAModelError(SourceError):
    """Files that are not a model this fleet can load; the message names the fix."""


class ModelFacts(BaseModel):
    format: Literal["hf", "gguf"]
    architecture: str  # transformers' model_type, or the GGUF's general.architecture
    hf_architecture: str | None = None  # the transformers class (config.json "architectures")
    context_length: int
    vocab_size: int
    chat: bool  # a chat template ships with it
    parameters: int | None = None
    dtype: str | None = None  # torch dtype of HF weights, or the GGUF's quantization
    license: str | None = None
    license_files: list[str] = []  # LICENSE / NOTICE / terms files shipped beside the weights
    display_name: str | None = None
    size_bytes: int


LICENSE_FILES = ("LICENSE*", "LICENCE*", "NOTICE*", "*TERMS*", "USE_POLICY*")


def read_facts(path: Path) -> ModelFacts:
    """The facts of a model folder or a GGUF file; NotAModelError if it is neither."""
    facts = _read(path)
    folder = path if path.is_dir() else path.parent
    found = {p.name for pattern in LICENSE_FILES for p in folder.glob(pattern) if p.is_file()}
    return facts.model_copy(update={"license_files": sorted(found)})


def _read(path: Path) -> ModelFacts:
    if path.is_dir():
        if (path / "config.json").exists():
            return _hf_facts(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_facts(ggufs[0])
        raise NotAModelError(
            f"{path} is not a Hugging Face model folder (no config.json)"
            + (f" and holds {len(ggufs)} .gguf files: name one" if ggufs else "")
        )
    with path.open("rb") as fh:
        head = fh.read(4)
    if head == GGUF_MAGIC:
        return _gguf_facts(path)
    raise NotAModelError(
        f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF'): give a .gguf file "
        "or a Hugging Face folder with config.json and safetensors weights"
    )


def _hf_facts(folder: Path) -> ModelFacts:
    config = _json(folder / "config.json")
    text = config.get("text_config") or {}  # multimodal configs keep the language model's here
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        raise NotAModelError(
            f"{folder} has no .safetensors weights"
            + (
                f" ({', '.join(pickled)} are pickles, which are never loaded: save the model with "
                "save_pretrained(safe_serialization=True))"
                if pickled
                else ""
            )
        )
    model_type = config.get("model_type")
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    vocab = config.get("vocab_size") or text.get("vocab_size")
    if not model_type or not context or not vocab:
        raise NotAModelError(f"{folder}/config.json lacks model_type, max_position_embeddings or vocab_size")
    tok_cfg = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    chat = bool(tok_cfg.get("chat_template")) or (folder / "chat_template.jinja").exists()
    archs = config.get("architectures") or []
    return ModelFacts(
        format="hf",
        architecture=model_type,
        hf_architecture=archs[0] if archs else None,
        context_length=int(context),
        vocab_size=int(vocab),
        chat=chat,
        parameters=_safetensors_parameters(weights),
        dtype=config.get("dtype") or config.get("torch_dtype"),
        license=_readme_license(folder / "README.md"),
        display_name=config.get("_name_or_path") or folder.name,
        size_bytes=sum(p.stat().st_size for p in weights),
    )


def _safetensors_parameters(files: list[Path]) -> int:
    """Parameter count from the safetensors headers alone (8-byte length, then JSON)."""
    total = 0
    for path in files:
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count
    return total


def _gguf_facts(path: Path) -> ModelFacts:
    import gguf

    from workers.models.gguf_header import read_header

    try:
        header = read_header(path)
    except (ValueError, OSError) as exc:
        raise NotAModelError(f"{path}: not a readable GGUF file ({exc})") from None
    fields = header.fields
    arch = fields.get("general.architecture")
    if not arch:
        raise NotAModelError(f"{path}: the GGUF header has no general.architecture")
    file_type = fields.get("general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant = str(file_type)
    return ModelFacts(
        format="gguf",
        architecture=arch,
        context_length=int(fields.get(f"{arch}.context_length") or 0),
        vocab_size=int(fields.get(f"{arch}.vocab_size") or fields.get("tokenizer.ggml.tokens") or 0),
        chat=bool(fields.get("tokenizer.chat_template")),
        parameters=header.parameters,
        dtype=quant,
        license=fields.get("general.license"),
        display_name=fields.get("general.name"),
        size_bytes=path.stat().st_size,
    )


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotAModelError(f"{path} is not valid JSON ({exc})") from None


def _readme_license(readme: Path) -> str | None:
    """The model card's ``license:`` (its YAML front matter), as the Hub shows it."""
    if not readme.exists():
        return None
    match = re.search(r"^license:\s*(\S+)\s*$", readme.read_text(errors="replace").split("\n---", 1)[0], re.M)
    return match.group(1) if match else None
