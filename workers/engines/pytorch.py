"""PyTorch eager engine: transformers ``generate`` with static batching.

Jobs with the same sampling configuration are padded on the left into one batch (up to
``batch_size``, waiting at most ``max_wait_ms`` for company) and decoded together. A
per-step monitor (a StoppingCriteria) records each row's tokens and first-token time,
and ends a row on its own max_tokens, stop string, EOS or cancel flag, so jobs in one
batch may ask for different lengths; a row that ends is answered at once, while the
rest of its batch decodes on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteria

from dispatcher.jobs import GenerationJob
from workers.batching import BatchQueue
from workers.engines.base import Engine, EngineOutput, EngineRequest, fail_requests

log = logging.getLogger(__name__)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in ``text``, if any appeared."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def batch_key(request: EngineRequest) -> Hashable:
    """Requests that can share one ``generate`` call: same sampling; a seeded one runs alone."""
    s = request.sampling
    if s.greedy:
        return ("greedy",)
    return ("sample", s.temperature, s.top_p, s.seed if s.seed is None else (s.seed, request.job_id))


class BatchMonitor(StoppingCriteria):
    """Called by ``generate`` after every decoding step with the whole batch's ids."""

    def __init__(self, engine: "PyTorchEngine", requests: list[EngineRequest]) -> None:
        self.engine = engine
        self.requests = requests
        self.done = [False] * len(requests)
        self.eos = set(engine.eos_ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        t = time.time()
        last = input_ids[:, -1].tolist()
        for i, (req, tok) in enumerate(zip(self.requests, last)):
            if self.done[i]:
                continue
            req.tokens.append(tok)
            if req.first_token_at is None:
                req.first_token_at = t
            if tok in self.eos:
                self._finish(i, "stop")
            elif req.sampling.stop and self.engine.stop_index(req) is not None:
                self._finish(i, "stop")
            elif len(req.tokens) >= req.sampling.max_tokens:
                self._finish(i, "length")
        running = [r.job_id for r, d in zip(self.requests, self.done) if not d]
        cancelled = self.engine.cancelled(running)
        for i, req in enumerate(self.requests):
            if not self.done[i] and (req.job_id in cancelled or req.aborted):
                self._finish(i, "cancelled")
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)

    def _finish(self, i: int, reason: str) -> None:
        # A row that is done is answered now, not when the batch's longest row ends.
        self.done[i] = True
        self.requests[i].finish_reason = reason
        self.engine._deliver(self.requests[i])


class PyTorchEngine(Engine):
    backend = "pytorch"

    def load(self) -> None:
        path = self.model.artifact_path("hf")
        torch.set_num_threads(self.threads)
        self.device = self.config.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, self.config.get("dtype", "float32"))
        t0 = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        gen = self.hf_model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids: list[int] = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.batch_size = int(self.config.get("batch_size", 8))
        self.max_wait_s = float(self.config.get("max_wait_ms", 20)) / 1000
        self.queue: BatchQueue[EngineRequest] = BatchQueue(batch_key)
        self._thread = threading.Thread(target=self._loop, name="pytorch-scheduler", daemon=True)
        self._thread.start()
        log.info("pytorch engine: %s on %s, %d threads, loaded in %.1f s", self.model.name, self.device, self.threads, time.monotonic() - t0)

    def close(self) -> None:
        if hasattr(self, "queue"):
            self.queue.close()
            self._thread.join(timeout=30)

    @property
    def capacity(self) -> int:
        # One batch decoding and one filling up behind it.
        return 2 * int(self.config.get("batch_size", 8))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": getattr(self, "device", "cpu"), "batching": "static", "batch_size": self.config.get("batch_size", 8)}

    # ---------------------------------------------------------- requests

    def encode(self, job: GenerationJob) -> list[int]:
        if job.messages is not None:
            text = self.tokenizer.apply_chat_template(
                [m.model_dump() for m in job.messages], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(job.prompt)["input_ids"]

    def submit(self, request: EngineRequest) -> None:
        self.queue.put(request)

    def stop_index(self, request: EngineRequest) -> int | None:
        return first_stop(self.tokenizer.decode(request.tokens, skip_special_tokens=True), request.sampling.stop)

    # ---------------------------------------------------------- scheduler

    def _loop(self) -> None:
        while (batch := self.queue.next_batch(self.batch_size, self.max_wait_s)) is not None:
            try:
                self._run_batch(batch)
            except Exception as exc:  # noqa: BLE001 - a bad batch must not stop the engine
                log.exception("batch of %d failed", len(batch))
                fail_requests(batch, exc)

    def _run_batch(self, batch: list[EngineRequest]) -> None:
        # Jobs cancelled while they waited never reach the model.
        cancelled = self.cancelled([r.job_id for r in batch])
        gone = [r for r in batch if r.job_id in cancelled or r.aborted]
        for r in gone:
            r.finish_reason = "cancelled"
            self._deliver(r)
        batch = [r for r in batch if r not in gone]
        if not batch:
            return
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
            top_k=0 if not s.greedy else None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        if s.seed is not None:
            torch.manual_seed(s.seed)
        monitor = BatchMonitor(self, batch)
        with torch.inference_mode():
            self.hf_model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                stopping_criteria=[monitor],
            )
        for r in batch:
            if not r.future.done():  # rows the monitor did not end (generate's own limit)
                r.finish_reason = r.finish_reason or "length"
                self._deliver(r)

    def _deliver(self, r: EngineRequest) -> None:
        tokens = [t for t in r.tokens if t not in self.eos_ids]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = first_stop(text, r.sampling.stop)
        if cut is not None:
            text = text[:cut]
        r.future.set_result(
            EngineOutput(
                token_ids=list(r.tokens),
                text=text,
                finish_reason=r.finish_reason or "length",
                prompt_tokens=len(r.prompt_ids),
                first_token_at=r.first_token_at,
                finished_at=time.time(),
            )
        )
