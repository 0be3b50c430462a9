"""Which engines can run a model, asked of the engines' own packages: transformers'
auto-model table (PyTorch eager; TGI serves what transformers knows), vLLM's model
registry, llama.cpp's GGUF architectures (gguf-py, llama.cpp's own Python half), and
onnxruntime-genai's model builder. Asked once, by ``ib models add``; the answer is
written into the registry entry so the decision tree refuses a backend with the reason,
instead of a worker failing at load.

Formats a model lacks are derived where a converter exists here: GGUF → HF through
transformers' own GGUF loader (it de-quantizes the architectures it lists), HF → ONNX
through the builder, HF → GGUF (q8_0) through llama.cpp's own ``convert_hf_to_gguf.py``
for the architectures it registers; the converter is not in the llama-cpp-python wheel,
so scripts/llamacpp_wheel.sh unpacks it from the same sdist into the data directory.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from workers.models.facts import ModelFacts

log = logging.getLogger(__name__)

ONNX_PRECISIONS = {"onnx": "fp32", "onnx-int4": "int4"}
GGUF_FROM_HF = "q8_0"  # the converter's near-lossless type (f16/bf16/f32 are the others)


@dataclass
class Capabilities:
    """What an added model can be served as: the derivations to register, the backends
    that cannot run it (with why), and whether transformers knows it natively."""

    derive: dict[str, dict[str, str]] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    hf_native: bool = False
    hf_model_type: str | None = None  # of the HF weights, given or derived
    hf_architecture: str | None = None


def capabilities(facts: ModelFacts, path: Path | None = None) -> Capabilities:
    """``path``: the model's files, for the checks that need more than its facts (the ONNX
    builder is asked to read an HF folder's config, which it can refuse)."""
    caps = Capabilities()
    arch = facts.architecture
    has_hf = facts.format == "hf"
    if has_hf:
        caps.hf_model_type, caps.hf_architecture = arch, facts.hf_architecture
    else:
        caps.hf_model_type = _gguf_to_hf_model_type(arch)
        if caps.hf_model_type is not None:
            caps.derive["hf"] = {"from": "gguf", "dtype": "float32"}
            caps.hf_architecture = _causal_lm_class(caps.hf_model_type)
            has_hf = True
    caps.hf_native = caps.hf_model_type is not None and _causal_lm_class(caps.hf_model_type) is not None
    _llamacpp(facts, caps)
    _transformers(arch, has_hf, caps)
    _onnx(facts, has_hf, path, caps)
    return caps


def _llamacpp(facts: ModelFacts, caps: Capabilities) -> None:
    """llama.cpp: a GGUF of an architecture it knows, given or converted from HF weights."""
    arch = facts.architecture
    if facts.format == "gguf":
        if arch not in _gguf_architectures():
            caps.unsupported["llamacpp"] = f"llama.cpp does not know the GGUF architecture {arch!r}"
    elif converter_dir() is None:
        caps.unsupported["llamacpp"] = (
            f"llama.cpp cannot run {arch} from hf: no GGUF, and llama.cpp's converter is not unpacked here "
            "(scripts/llamacpp_wheel.sh does it), or add a .gguf of it"
        )
    elif facts.hf_architecture not in _converter_architectures():
        caps.unsupported["llamacpp"] = (
            f"llama.cpp cannot run {arch} from hf: no GGUF, and llama.cpp's converter has no {facts.hf_architecture}"
        )
    else:
        caps.derive["gguf"] = {"from": "hf", "precision": GGUF_FROM_HF}


def _transformers(arch: str, has_hf: bool, caps: Capabilities) -> None:
    """The transformers engines (PyTorch, TGI) and vLLM: HF weights of a causal LM they know."""
    if not has_hf:
        why = f"no HF weights for {arch}, and transformers cannot de-quantize a {arch} GGUF"
        caps.unsupported |= {"pytorch": why, "tgi": why, "vllm": why}
    elif not caps.hf_native:
        why = f"transformers has no causal-LM class for {caps.hf_model_type!r}"
        caps.unsupported |= {"pytorch": why, "tgi": why}
    if has_hf and "vllm" not in caps.unsupported:
        known = _vllm_architectures()
        if known is not None and caps.hf_architecture not in known:
            caps.unsupported["vllm"] = f"vLLM's model registry has no {caps.hf_architecture}"


def _onnx(facts: ModelFacts, has_hf: bool, path: Path | None, caps: Capabilities) -> None:
    """ONNX Runtime: the builder's architectures, from HF weights; given an HF folder, the
    builder itself reads its config (config_only: seconds, no weights converted)."""
    listed = has_hf and caps.hf_architecture in _onnx_builder_architectures()
    refused = _onnx_builder_refuses(path) if listed and facts.format == "hf" and path is not None else None
    if refused:
        caps.unsupported["onnx"] = f"onnxruntime-genai's model builder refuses this model: {refused}"
    elif listed:
        for fmt, precision in ONNX_PRECISIONS.items():
            caps.derive[fmt] = {"from": "hf", "precision": precision}
    else:
        caps.unsupported["onnx"] = (
            f"onnxruntime-genai's model builder cannot export {caps.hf_architecture or facts.architecture}"
            if has_hf
            else f"no HF weights for {facts.architecture} to export to ONNX"
        )


def _gguf_to_hf_model_type(arch: str) -> str | None:
    """The transformers model type a GGUF of ``arch`` de-quantizes to; None where
    transformers' GGUF loader does not list the architecture. The loader builds the
    text-only model where transformers has one beside a multimodal class (gemma3 →
    gemma3_text)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        return None
    return next((t for t in (f"{arch}_text", arch) if _causal_lm_class(t) is not None), None)


@cache
def _causal_lm_class(model_type: str) -> str | None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


@cache
def _gguf_architectures() -> frozenset[str]:
    import gguf

    return frozenset(gguf.MODEL_ARCH_NAMES.values())


@cache
def _vllm_architectures() -> frozenset[str] | None:
    """vLLM's text-generation model classes; None where vLLM is not installed (not checked)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.model_executor.models.registry import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


@cache
def _onnx_builder_architectures() -> frozenset[str]:
    """The HF classes onnxruntime-genai's builder has a branch for (read from its source:
    it has no list to import)."""
    spec = importlib.util.find_spec("onnxruntime_genai.models.builder")
    if spec is None or spec.origin is None:
        return frozenset()
    source = Path(spec.origin).read_text()
    return frozenset(re.findall(r'config\.architectures\[0\] == "(\w+)"', source))


def converter_dir() -> Path | None:
    """llama.cpp's HF → GGUF converter, unpacked by scripts/llamacpp_wheel.sh for the
    installed llama-cpp-python; None where it is not."""
    from importlib.metadata import PackageNotFoundError, version

    from core import settings

    try:
        folder = settings.data_dir() / f"llama.cpp-convert-{version('llama-cpp-python')}"
    except PackageNotFoundError:
        return None
    return folder if (folder / "convert_hf_to_gguf.py").exists() else None


@cache
def _converter_architectures() -> frozenset[str]:
    """The HF classes the converter registers (``@ModelBase.register("...")``; it has no
    list to import without importing torch and every model class)."""
    folder = converter_dir()
    if folder is None:
        return frozenset()
    names: set[str] = set()
    for path in [folder / "convert_hf_to_gguf.py", *(folder / "conversion").glob("*.py")]:
        for args in re.findall(r"ModelBase\.register\(([^)]*)\)", path.read_text()):
            names |= set(re.findall(r'"(\w+)"', args))
    return frozenset(names)


def _onnx_builder_refuses(hf: Path) -> str | None:
    """The builder's last error line when it cannot even write the config of ``hf``
    (onnxruntime-genai 0.18 reads gemma3's per-layer-type RoPE settings wrongly, for
    one); None when it can. Asked only about an architecture the builder lists."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", f"{tmp}/out"]
        cmd += ["-p", "fp32", "-e", "cpu", "-c", f"{tmp}/cache", "--extra_options", "config_only=true"]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return next(
        (line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), f"exit {done.returncode}"
    )
