"""PyTorch eager engine: transformers ``generate`` with static batching.

Jobs with the same sampling configuration are padded on the left into one batch (up to
``batch_size``, closed as workers.engines.batched says: ``arrival_gap_ms``,
``max_wait_ms``) and decoded together. A per-step monitor (a StoppingCriteria) records
each row's tokens and first-token time, and ends a row on its own max_tokens, stop
string, EOS or cancel flag, so jobs in one batch may ask for different lengths; a row
that ends is answered at once, while the rest of its batch decodes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
)

from core.backends import PyTorchSpec
from core.jobs import GenerationJob
from workers.engines.batched import BatchedEngine
from workers.engines.decoding import BatchProgress
from workers.engines.grammar import Grammars
from workers.engines.request import EngineRequest
from workers.engines.shaping import prepare

log = logging.getLogger(__name__)


class BatchMonitor(StoppingCriteria):
    """Called by ``generate`` after every decoding step with the whole batch's ids. A
    speculative step appends several tokens at once (the accepted drafts and the
    target's own next token): each is recorded in order, and the step is counted."""

    def __init__(
        self,
        progress: BatchProgress,
        prompt_width: int,
        drafted: Callable[[], int] | None = None,
        shaping: RowShaping | None = None,
    ) -> None:
        self.progress = progress
        self.seen = prompt_width
        self.shaping = shaping
        self.drafted = drafted  # a draft model's tokens proposed so far (a speculative request runs alone)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        for r in self.progress.requests:
            r.target_passes += 1
            if self.drafted is not None:
                r.drafted_tokens = self.drafted()
        done = list(self.progress.done)
        for pos in range(self.seen, input_ids.shape[1]):
            tokens = input_ids[:, pos].tolist()
            if self.shaping is not None:
                for i, token in enumerate(tokens):
                    self.shaping.taken(i, token)
            done = self.progress.step(tokens)
        self.seen = input_ids.shape[1]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class RowShaping(LogitsProcessor):
    """Each row's own logits changes (workers.engines.shaping: penalties, bias, an EOS
    floor, its grammar) and the logprobs it asked for, read before them; the rows of one
    batch may differ. Logprobs wait in ``pending`` until the monitor sees the token taken."""

    def __init__(self, requests: list[EngineRequest]) -> None:
        self.requests = requests
        self.pending: list[np.ndarray | None] = [None] * len(requests)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for i, r in enumerate(self.requests):
            if r.future.done() or (r.shaper is None and r.logprobs is None):
                continue
            row = scores[i].detach().float().cpu().numpy()  # a view of the row on a CPU (float32)
            if r.logprobs is not None and r.logprob_reader is not None:
                self.pending[i] = r.logprob_reader.read(row)
            if r.shaper is not None:
                r.shaper.catch_up(r.tokens)
                r.shaper.shape(row, r.tokens)
                if scores.device.type != "cpu" or scores.dtype != torch.float32:
                    scores[i] = torch.from_numpy(row).to(scores.device, scores.dtype)
        return scores

    def taken(self, i: int, token: int) -> None:
        """Row ``i`` took ``token``: its logprob entry, from the row read before."""
        r, lp = self.requests[i], self.pending[i]
        if lp is not None and r.logprobs is not None and r.logprob_reader is not None:
            r.logprobs.append(r.logprob_reader.entry(lp, token))
            self.pending[i] = None


class PyTorchEngine(BatchedEngine[PyTorchSpec]):
    backend = "pytorch"
    batching = "static"
    supports_speculative = True  # transformers' assisted generation: a draft model, or prompt lookup

    def load(self) -> None:
        path = self.model.artifact_path("hf")
        torch.set_num_threads(self.threads)
        self.device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, self.config.dtype)
        t0 = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        gen = self.hf_model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids: list[int] = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.draft_model = self._load_draft(dtype)
        self._grammars: Grammars | None = None
        self.start_scheduler()
        log.info(
            "pytorch engine: %s on %s, %d threads, loaded in %.1f s",
            self.model.name,
            self.device,
            self.threads,
            time.monotonic() - t0,
        )

    def _load_draft(self, dtype: torch.dtype) -> Any | None:
        """The registered draft model, checked against this one, when the config drafts with one."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft":
            return None
        from core.drafts import check_draft
        from core.registry import ModelRegistry

        drafts = ModelRegistry.from_config().drafts_for(self.model.name)
        if not drafts:
            raise ValueError(f"speculative method 'draft' but {self.model.name} has no registered draft model")
        check_draft(self.model, drafts[0])
        draft = AutoModelForCausalLM.from_pretrained(drafts[0].artifact_path("hf"), dtype=dtype).to(self.device).eval()
        gen = draft.generation_config  # a fixed number of drafted tokens per pass, every pass
        gen.num_assistant_tokens = spec.num_tokens
        gen.num_assistant_tokens_schedule = "constant"
        gen.assistant_confidence_threshold = 0.0
        # Each forward of the draft model proposes one token: counting them is counting
        # what was drafted (the job's speculative counts report it, not an assumed 4 a pass).
        self.draft_forwards = 0
        draft.register_forward_hook(self._count_draft_forward)
        return draft

    def _count_draft_forward(self, module: Any, args: Any, output: Any) -> None:
        self.draft_forwards += 1

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": getattr(self, "device", "cpu")}

    @property
    def n_vocab(self) -> int:
        return int(self.hf_model.config.vocab_size)  # the logits' width

    def request_for(self, job: GenerationJob, on_text: Callable[[str], None] | None = None) -> EngineRequest:
        """The request, with its own logits changes and logprob reader (RowShaping applies
        them in generate's loop); the grammar compiles here, on the task thread."""
        r = super().request_for(job, on_text)
        prepare(r, self.eos_ids, self.n_vocab, self.grammars, self.piece, penalties=True)
        return r

    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars.of_tokenizer(self.tokenizer, self.n_vocab, self.eos_ids)
        return self._grammars

    def piece(self, token: int) -> bytes:
        return self.tokenizer.decode([token]).encode()

    def run_batch(self, batch: list[EngineRequest]) -> None:
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        s = batch[0].sampling
        config = GenerationConfig(
            max_new_tokens=max(r.sampling.max_tokens for r in batch),
            do_sample=not s.greedy,
            temperature=s.temperature if not s.greedy else None,
            top_p=s.top_p if not s.greedy else None,
            top_k=(s.top_k or 0) if not s.greedy else None,
            min_p=s.min_p if not s.greedy and s.min_p > 0 else None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        if s.seed is not None:
            torch.manual_seed(s.seed)
        spec = batch[0].speculative  # a speculative request runs alone (decoding.batch_key)
        extra: dict[str, Any] = {}
        if spec is not None and spec.method == "ngram":
            extra["prompt_lookup_num_tokens"] = spec.num_tokens
        elif spec is not None and spec.method == "draft" and self.draft_model is not None:
            extra["assistant_model"] = self.draft_model
        progress = BatchProgress(self, batch)
        drafted: Callable[[], int] | None = None
        if "assistant_model" in extra:
            before = self.draft_forwards

            def drafted() -> int:
                return self.draft_forwards - before

        shaping = RowShaping(batch) if any(r.shaper or r.logprobs is not None for r in batch) else None
        if shaping is not None:
            extra["logits_processor"] = LogitsProcessorList([shaping])
        with torch.inference_mode():
            self.hf_model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                stopping_criteria=[BatchMonitor(progress, width, drafted, shaping)],
                **extra,
            )
        progress.finish_rest()
