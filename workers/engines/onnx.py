"""ONNX Runtime engine: onnxruntime-genai's Generator API with dynamic batching.

Requests that arrive within ``max_wait_ms`` (default 10) of the first one, with the same
sampling configuration, run together up to ``batch_size``. Prompts are right-padded, as
onnxruntime-genai requires (left padding gave wrong tokens). Rows end on their own
max_tokens, stop string, EOS or cancel flag and are answered at once; the batch stops
stepping when every row has ended.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og
from transformers import AutoTokenizer

from dispatcher.registry import OnnxSpec
from workers.engines.batched import BatchedEngine
from workers.engines.decoding import BatchProgress
from workers.engines.request import EngineRequest

log = logging.getLogger(__name__)

REQUIRED_FILES = ("genai_config.json", "model.onnx", "tokenizer.json")


def check_onnx_folder(path: Path) -> None:
    """Refuse a folder that cannot be an onnxruntime-genai model, naming what is missing."""
    missing = [f for f in REQUIRED_FILES if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(f"ONNX model folder {path} is missing {', '.join(missing)}")


class OnnxEngine(BatchedEngine[OnnxSpec]):
    backend = "onnx"
    batching = "dynamic"

    def load(self) -> None:
        self.format = self.config.format or "onnx"
        path = self.model.artifact_path(self.format)
        check_onnx_folder(path)
        t0 = time.monotonic()
        cfg = og.Config(str(path))
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": self.threads}}}}))
        self.og_model = og.Model(cfg)
        genai = json.loads((path / "genai_config.json").read_text())["model"]
        eos = genai["eos_token_id"]
        self.eos_ids = list(eos) if isinstance(eos, list) else [eos]
        self.pad_id = int(genai.get("pad_token_id", self.eos_ids[0]))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.start_scheduler()
        log.info(
            "onnx engine: %s (%s), %d threads, loaded in %.1f s",
            self.model.name,
            self.format,
            self.threads,
            time.monotonic() - t0,
        )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": getattr(self, "format", None)}

    def run_batch(self, batch: list[EngineRequest]) -> None:
        width = max(len(r.prompt_ids) for r in batch)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int32)
        for i, r in enumerate(batch):
            ids[i, : len(r.prompt_ids)] = r.prompt_ids  # right-padded
        s = batch[0].sampling
        params = og.GeneratorParams(self.og_model)
        options: dict[str, Any] = {
            "max_length": width + max(r.sampling.max_tokens for r in batch),
            "batch_size": len(batch),
            "do_sample": not s.greedy,
        }
        if not s.greedy:
            options.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
            if s.seed is not None:
                options["random_seed"] = s.seed
        params.set_search_options(**options)
        generator = og.Generator(self.og_model, params)
        generator.append_tokens(ids)
        progress = BatchProgress(self, batch)
        while not progress.all_done and not generator.is_done():
            generator.generate_next_token()
            progress.step([int(t) for t in generator.get_next_tokens()])
        progress.finish_rest()
