"""Derive the formats a model lacks from the one it ships in, cached on disk.

GGUF → HF safetensors: transformers de-quantizes the GGUF; the result is flagged as
quantized and refuses ``save_pretrained``, so its weights are copied into a fresh model
built from the same config, then saved with the tokenizer (and its chat template). The
folder is written next to its final place and renamed in one step, so a crash never
leaves a half-written model that looks prepared.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from dispatcher.registry import ModelSpec

log = logging.getLogger(__name__)


def prepare(spec: ModelSpec, fmt: str = "hf", force: bool = False) -> Path:
    """Make ``fmt`` available for ``spec``; returns its folder. Idempotent."""
    if fmt in spec.artifacts:
        return spec.artifact_path(fmt)
    if fmt not in spec.derive:
        raise ValueError(f"{spec.name}: no way to derive {fmt} (derivable: {', '.join(spec.derive) or 'none'})")
    target = spec.prepared_dir(fmt)
    if (target / ".complete").exists() and not force:
        return target
    source_fmt = spec.derive[fmt].from_
    source = prepare(spec, source_fmt)
    builders = {("gguf", "hf"): _gguf_to_hf}
    build = builders.get((source_fmt, fmt))
    if build is None:
        raise NotImplementedError(f"deriving {fmt} from {source_fmt} is not implemented yet")
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.monotonic()
    build(source, staging, spec.derive[fmt].dtype)
    (staging / ".complete").write_text(
        json.dumps({"from": str(source), "source_bytes": source.stat().st_size, "seconds": round(time.monotonic() - t0, 1)})
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log.info("prepared %s %s in %.1f s: %s", spec.name, fmt, time.monotonic() - t0, target)
    return target


def _gguf_to_hf(gguf: Path, out: Path, dtype_name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
