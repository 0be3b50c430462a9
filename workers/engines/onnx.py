"""ONNX Runtime engine: onnxruntime-genai's Generator API with dynamic batching.

Requests with the same sampling configuration that arrive together (no pause longer
than ``arrival_gap_ms``, default 10, and within ``max_wait_ms`` of the oldest) run
together up to ``batch_size``. Prompts are right-padded, as
onnxruntime-genai requires (left padding gave wrong tokens). Rows end on their own
max_tokens, stop string, EOS or cancel flag and are answered at once; the batch stops
stepping when every row has ended. The model runs in a child process
(workers.engines.onnx_process says why).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from core.backends import OnnxSpec
from core.errors import EngineError
from core.jobs import StructuredOutput
from workers.engines.batched import BatchedEngine
from workers.engines.decoding import BatchProgress, batch_key
from workers.engines.onnx_process import GeneratorFailed, GeneratorProcess, special_ids
from workers.engines.request import EngineRequest

log = logging.getLogger(__name__)

REQUIRED_FILES = ("genai_config.json", "model.onnx", "tokenizer.json")


def check_onnx_folder(path: Path) -> None:
    """Refuse a folder that cannot be an onnxruntime-genai model, naming what is missing."""
    missing = [f for f in REQUIRED_FILES if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(f"ONNX model folder {path} is missing {', '.join(missing)}")


def guidance_of(s: StructuredOutput) -> tuple[str, str]:
    """onnxruntime-genai's own guidance (llguidance inside it): a JSON schema, a regex, or a
    Lark grammar for a choice list."""
    if s.kind == "json_object":
        return ("json_schema", json.dumps({"type": "object"}))
    if s.kind == "json_schema":
        return ("json_schema", json.dumps(s.json_schema))
    if s.kind == "regex":
        return ("regex", s.regex or "")
    return ("lark_grammar", "start: " + " | ".join(json.dumps(c) for c in s.choice or []))


class OnnxEngine(BatchedEngine[OnnxSpec]):
    backend = "onnx"
    batching = "dynamic"

    def load(self) -> None:
        self.format = self.config.format or "onnx"
        path = self.model.artifact_path(self.format)
        check_onnx_folder(path)
        t0 = time.monotonic()
        try:
            self.generator = GeneratorProcess(path, self.threads)  # the model steps outside this GIL
        except GeneratorFailed as exc:
            raise EngineError(str(exc)) from None
        self.eos_ids, self.pad_id = special_ids(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        warm_s = self.warm_up()
        self.start_scheduler()
        log.info(
            "onnx engine: %s (%s), %d threads, generator process %s, loaded in %.1f s (warm-up batch %.1f s)",
            self.model.name,
            self.format,
            self.threads,
            self.generator.pid,
            time.monotonic() - t0,
            warm_s,
        )

    def warm_up(self, prompt_tokens: int = 48, new_tokens: int = 16) -> float:
        """Decode one full batch before the worker says it is ready; returns its seconds.
        onnxruntime grows its memory arena and starts its threads on the first batches: a
        fresh worker's first full batch ran at 0.87x of onnxruntime-genai's own loop, its
        later ones at 0.97x (docs/BENCHMARKS.md). Users should not pay that on their jobs."""
        t0 = time.monotonic()
        text = "The quick brown fox jumps over the lazy dog. " * (prompt_tokens // 8 + 1)
        row = self.tokenizer.encode(text)[:prompt_tokens]
        options = {"max_length": len(row) + new_tokens, "batch_size": self.batch_size, "do_sample": False}
        try:
            self.generator.run([row] * self.batch_size, options, lambda tokens: False)
        except GeneratorFailed as exc:
            raise EngineError(f"the warm-up batch failed: {exc}") from None
        return time.monotonic() - t0

    def close(self) -> None:
        super().close()
        if hasattr(self, "generator"):
            self.generator.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": getattr(self, "format", None)}

    @staticmethod
    def batch_key(request: EngineRequest) -> Hashable:
        """A structured request runs alone: onnxruntime-genai's guidance fails the whole
        batch when one row's grammar has ended and the others decode on ("compute_mask()
        called after stop", onnxruntime-genai 0.18, measured with bench/structured.py)."""
        if request.sampling.structured is not None:
            return ("structured", request.request_id)
        return batch_key(request)

    def run_batch(self, batch: list[EngineRequest]) -> None:
        width = max(len(r.prompt_ids) for r in batch)
        ids = [r.prompt_ids + [self.pad_id] * (width - len(r.prompt_ids)) for r in batch]  # right-padded
        s = batch[0].sampling
        options: dict[str, Any] = {
            "max_length": width + max(r.sampling.max_tokens for r in batch),
            "batch_size": len(batch),
            "do_sample": not s.greedy,
        }
        if not s.greedy:
            options.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0)
            if s.seed is not None:
                options["random_seed"] = s.seed
        if s.repetition_penalty != 1.0:
            options["repetition_penalty"] = s.repetition_penalty
        progress = BatchProgress(self, batch)  # one grammar per batch: decoding.batch_key splits on it
        guidance = None if s.structured is None else guidance_of(s.structured)
        try:
            self.generator.run(ids, options, lambda tokens: all(progress.step(tokens)), guidance)
        except GeneratorFailed as exc:
            raise EngineError(str(exc)) from None  # the batch's jobs fail with it (BatchedEngine)
        progress.finish_rest()
