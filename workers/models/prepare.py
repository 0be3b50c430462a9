"""Derive the formats a model lacks from the one it ships in, cached on disk.

HF safetensors → ONNX (fp32, int4): onnxruntime-genai's model builder, run as a
subprocess.

HF safetensors → GGUF (q8_0): llama.cpp's own convert_hf_to_gguf.py, from the sdist the
wheel is built from (scripts/llamacpp_wheel.sh unpacks it), run as a subprocess.

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
import subprocess
import sys
import time
from pathlib import Path

from core.models import sources
from core.registry import DERIVED_GGUF, Derivation, ModelRegistry, ModelSpec

log = logging.getLogger(__name__)


class PreparationError(RuntimeError):
    """A converter refused the model; the message says which and why (its last error
    line), and where its whole output was saved."""


def _run_converter(what: str, cmd: list[str], spec_dir: Path) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == 0:
        return
    log_path = spec_dir.parent / f"{spec_dir.name.strip('.').removesuffix('.tmp')}-prepare.log"
    log_path.write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), f"exit {done.returncode}")
    raise PreparationError(f"{what} failed: {last.strip()} (full output: {log_path})")


def prepare(spec: ModelSpec, fmt: str = "hf", force: bool = False) -> Path:
    """Make ``fmt`` available for ``spec``; returns its path (``spec.artifact_path``: a
    folder, or a derived GGUF's file). Idempotent. An artifact
    from the Hub is downloaded here (once, into its cache), never by a running job."""
    if fmt in spec.artifacts:
        return sources.fetch(sources.parse(spec.artifacts[fmt].source))
    if fmt not in spec.derive:
        raise ValueError(f"{spec.name}: no way to derive {fmt} (derivable: {', '.join(spec.derive) or 'none'})")
    target = spec.prepared_dir(fmt)
    if (target / ".complete").exists() and not force:
        return spec.artifact_path(fmt)
    how = spec.derive[fmt]
    source_fmt = how.from_
    if how.model is not None:  # another model's format (a draft derived from its target)
        source = prepare(ModelRegistry.from_config().get(how.model), source_fmt)
    else:
        source = prepare(spec, source_fmt)
    builders = {
        ("gguf", "hf"): _gguf_to_hf,
        ("hf", "onnx"): _hf_to_onnx,
        ("hf", "onnx-int4"): _hf_to_onnx,
        ("hf", "gguf"): _hf_to_gguf,
    }
    build = (
        _first_layers
        if how.layers is not None and (source_fmt, fmt) == ("hf", "hf")
        else builders.get((source_fmt, fmt))
    )
    if build is None:
        raise NotImplementedError(f"deriving {fmt} from {source_fmt} is not implemented yet")
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.monotonic()
    try:
        build(source, staging, spec.derive[fmt])
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never a half-written format left behind
        raise
    (staging / ".complete").write_text(
        json.dumps(
            {"from": str(source), "source_bytes": source.stat().st_size, "seconds": round(time.monotonic() - t0, 1)}
        )
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log.info("prepared %s %s in %.1f s: %s", spec.name, fmt, time.monotonic() - t0, target)
    return spec.artifact_path(fmt)


def _gguf_to_hf(gguf: Path, out: Path, how: Derivation) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, how.dtype)
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


def _first_layers(hf: Path, out: Path, how: Derivation) -> None:
    """A draft model: the first ``how.layers`` decoder layers of ``hf`` with its own final
    norm and LM head, saved with the same tokenizer: same vocabulary and family by
    construction, a fraction of the compute per token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=getattr(torch, how.dtype))
    total = model.config.num_hidden_layers
    if how.layers >= total:
        raise ValueError(f"a draft needs fewer layers than its source ({how.layers} >= {total})")
    model.model.layers = model.model.layers[: how.layers]
    model.config.num_hidden_layers = how.layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: how.layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)


def _hf_to_gguf(hf: Path, out: Path, how: Derivation) -> None:
    """llama.cpp's converter (it puts its own gguf-py first on its path)."""
    from workers.models.support import converter_dir

    folder = converter_dir()
    if folder is None:
        raise FileNotFoundError("llama.cpp's converter is not unpacked here: run scripts/llamacpp_wheel.sh")
    outfile = out / DERIVED_GGUF
    cmd = [sys.executable, str(folder / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(outfile)]
    cmd += ["--outtype", how.precision or "q8_0"]
    _run_converter("llama.cpp's HF → GGUF conversion", cmd, out)
    if not outfile.exists():
        raise PreparationError(f"llama.cpp's converter wrote no {outfile}")


def _hf_to_onnx(hf: Path, out: Path, how: Derivation) -> None:
    """onnxruntime-genai's model builder (not optimum: it mis-reads this model's RoPE)."""
    cache = out.parent / f".{out.name}.builder-cache"
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf),
        "-o",
        str(out),
        "-p",
        how.precision or "fp32",
        "-e",
        "cpu",
        "-c",
        str(cache),
    ]
    try:
        _run_converter("onnxruntime-genai's ONNX export", cmd, out)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    from workers.engines.onnx import check_onnx_folder

    check_onnx_folder(out)
