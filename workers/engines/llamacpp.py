"""llama.cpp engine: continuous batching over sequence ids, with a prefix state cache.

One llama.cpp context holds ``max_seqs`` sequences (one per running job). A scheduler
thread steps them all in one ``llama_decode`` call: each decoding job adds its last
token, each newly admitted job adds a chunk of its prompt (up to ``prefill_chunk``
tokens, so a long prompt does not stall the others for its whole prefill). New jobs join
between steps and finished ones leave, freeing their sequence.

The KV cache is one pool of ``kv_cache_tokens`` cells shared by all sequences (llama.cpp's
unified KV), and a job is admitted only when its prompt plus max_tokens fits beside the
reservations of the running ones, so a step never runs out of cells. Measured here:
with a KV stream per sequence (``kv_unified=False``) eight sequences in one step cost as
much as eight steps of one (104 vs 14 ms), i.e. no batching gain at all; unified, the
same step took 60 ms (1.5x more tokens/s over 8 jobs).

Prefix reuse: right after a prompt is evaluated its sequence's KV state is saved into a
byte-bounded LRU store (``workers.prefix_cache``). A later prompt sharing at least
``prefix_min_tokens`` leading tokens with a stored one loads that state, drops the KV
past the shared run, and evaluates only the rest; the job's usage reports the reused
tokens as ``cached_tokens``.

Why chunks end on multiples of ``prefill_chunk`` and reuse is rounded down to one:
llama.cpp's CPU kernels round differently depending on how a prompt is cut into
batches (measured: the same 18 prompts fed 7 tokens per step instead of whole gave 3
different greedy outputs, token by token 11). With fixed chunk boundaries a prompt is cut
the same way whether its prefix came from the cache or not, and reuse keeps greedy
output identical to a cold run (tested). Sharing steps with other sequences does change
rounding: batched greedy output can part from single-stream output at near-tie logits
(measured and tested; docs/architecture.md).

The high-level ``Llama`` object owns the weights, tokenizer and chat template (with a
tiny context of its own); decoding runs on a second context made from the same model
through llama-cpp-python's low-level API. Its parameters are copied from the high-level
ones (flash attention off, as there), so a job's greedy output matches what
``Llama.create_chat_completion`` gives for it alone.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from dispatcher.jobs import EngineError, GenerationJob, SamplingParams
from workers.engines.base import Engine, EngineRequest, ModelArtifactError, fail_requests
from workers.engines.decoding import append_token
from workers.engines.ngram import ngram_draft
from workers.prefix_cache import PrefixStateCache, common_prefix_len

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Refuse a path that is not a GGUF file before llama.cpp gives a vaguer error."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file {path} not found")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelArtifactError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


@dataclass(eq=False)
class Sequence:
    """A running job in the context: its sequence id, sampler and prompt progress."""

    seq_id: int
    request: EngineRequest
    sampler: Any  # llama_sampler_p
    pending: list[int]  # prompt tokens still to evaluate
    n_past: int  # tokens of this sequence in the KV cache
    save_prefix: bool  # store the prompt's state once it is evaluated

    @property
    def prefilling(self) -> bool:
        return bool(self.pending)


def make_sampler(s: SamplingParams) -> Any:
    """A llama.cpp sampler chain for one job: greedy, or temperature -> top-p -> draw
    (the order transformers applies them), seeded when the job gives a seed."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if s.greedy:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(s.temperature))
    if s.top_p < 1.0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
    seed = s.seed if s.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
    return chain


def reservation(r: EngineRequest) -> int:
    """KV cells a job can use at most."""
    return len(r.prompt_ids) + r.sampling.max_tokens


class LlamaCppEngine(Engine):
    backend = "llamacpp"
    supports_speculative = True  # prompt-lookup drafts, verified in the same llama_decode as the batch

    # ---------------------------------------------------------- configuration

    @property
    def max_seqs(self) -> int:
        return int(self.config.get("max_seqs", 8))

    @property
    def prefill_chunk(self) -> int:
        return int(self.config.get("prefill_chunk", 32))

    @property
    def capacity(self) -> int:
        return self.max_seqs

    @property
    def draft_tokens(self) -> int:
        """Drafted tokens a speculative sequence may add to a step (0: speculation off)."""
        spec = self.config.get("speculative") or {}
        return int(spec.get("num_tokens", 10)) if spec.get("method") == "ngram" else 0

    # ---------------------------------------------------------- lifecycle

    def load(self) -> None:
        path = self.model.artifact_path("gguf")
        check_gguf_file(path)
        t0 = time.monotonic()
        # Weights, tokenizer and chat template. Its own context is only a formality.
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=64, n_batch=64, n_threads=self.threads,
            n_threads_batch=self.threads, verbose=False,
        )  # fmt: skip
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.eos_ids = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]
        self._eos = set(self.eos_ids)
        self.chat = self._chat_formatter()

        params = llama_cpp.llama_context_params.from_buffer_copy(self.llm.context_params)
        params.n_seq_max = self.max_seqs
        params.kv_unified = True
        self.n_ctx = max(int(self.config.get("kv_cache_tokens", 8192)), self.max_model_len)
        params.n_ctx = self.n_ctx
        self.n_batch = max(self.prefill_chunk, self.max_seqs) + self.max_seqs * (1 + self.draft_tokens)
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create a context for {path}")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

        budget = int(float(self.config.get("prefix_cache_mb", 256)) * 2**20)
        self.prefix_cache = PrefixStateCache(budget, int(self.config.get("prefix_min_tokens", 32)))
        self.prompt_tokens_evaluated = 0  # the engine's own count: what prefix reuse saves
        self.steps = 0
        self.drafted_tokens = self.accepted_tokens = 0  # speculative (prompt lookup) counters

        self._queue: queue.Queue[EngineRequest | None] = queue.Queue()
        self._free = list(range(self.max_seqs))
        self._held: list[EngineRequest] = []  # waiting for KV room, or for a prefix being evaluated
        self._reserved = 0  # KV cells promised to the running sequences (prompt + max_tokens)
        self._running: list[Sequence] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llamacpp-scheduler", daemon=True)
        self._thread.start()
        log.info(
            "llama.cpp engine: %s (%s), %d threads, %d sequences, loaded in %.1f s",
            self.model.name, path.name, self.threads, self.max_seqs, time.monotonic() - t0,
        )  # fmt: skip

    def _chat_formatter(self) -> Jinja2ChatFormatter | None:
        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            return None

        def text(token: int) -> str:  # the template's bos/eos variables are token texts
            return llama_cpp.llama_vocab_get_text(self.vocab, token).decode() if token != -1 else ""

        return Jinja2ChatFormatter(
            template=template,
            eos_token=text(llama_cpp.llama_vocab_eos(self.vocab)),
            bos_token=text(llama_cpp.llama_vocab_bos(self.vocab)),
        )

    def close(self) -> None:
        if not hasattr(self, "_thread"):
            return
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=30)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        self.llm.close()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "batching": "continuous",
            "max_seqs": self.max_seqs,
            "kv_cache_tokens": getattr(self, "n_ctx", None),
            "prefill_chunk": self.prefill_chunk,
            "threads": self.threads,
            "prefix_cache_mb": round(self.prefix_cache.budget_bytes / 2**20) if hasattr(self, "prefix_cache") else None,
        }

    def stats(self) -> dict[str, Any]:
        """The engine's own counters (prefix reuse is asserted on these, not on time)."""
        c = self.prefix_cache
        return {
            "prompt_tokens_evaluated": self.prompt_tokens_evaluated,
            "prefix_hits": c.stats.hits,
            "prefix_misses": c.stats.misses,
            "prefix_reused_tokens": c.stats.reused_tokens,
            "prefix_entries": len(c),
            "prefix_bytes": c.bytes_used,
            "prefix_evicted": c.stats.evicted,
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
        }

    # ---------------------------------------------------------- requests

    def encode(self, job: GenerationJob) -> list[int]:
        if job.messages is not None:
            if self.chat is None:
                raise EngineError(f"{self.model.name}'s GGUF has no chat template; send a prompt, not messages")
            text = self.chat(messages=[m.model_dump() for m in job.messages]).prompt
            return self.llm.tokenize(text.encode(), add_bos=False, special=True)
        return self.llm.tokenize(job.prompt.encode(), add_bos=True, special=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.llm.detokenize(token_ids).decode("utf-8", errors="replace")

    def submit(self, request: EngineRequest) -> None:
        self._queue.put(request)

    # ---------------------------------------------------------- scheduler

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self._running and not self._held)
            if not self._running:
                continue
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - a failed step fails its jobs, not the engine
                log.exception("llama.cpp step with %d sequences failed", len(self._running))
                fail_requests([s.request for s in self._running], exc)
                for s in list(self._running):
                    self._release(s)

    def _admit(self, block: bool) -> None:
        """Move waiting requests into free sequences (waiting for one when idle). A request
        whose prompt shares a long prefix with a prompt being evaluated right now is held
        back until that evaluation ends, then served from the prefix cache instead of
        evaluating the same tokens twice (a batch of jobs with one system prompt)."""
        held, self._held = self._held, []
        for r in held:
            self._admit_one(r)
        while self._free:
            try:
                r = self._queue.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            if r is None:
                return
            block = False
            self._admit_one(r)

    def _admit_one(self, r: EngineRequest) -> None:
        if not self.drop_cancelled([r]):
            return  # cancelled (or given up on) while waiting: answered, never started
        if not self._free or self._reserved + reservation(r) > self.n_ctx or self._prefix_in_progress(r.prompt_ids):
            self._held.append(r)
        else:
            self._start(r)

    def _prefix_in_progress(self, prompt: list[int]) -> bool:
        need = max(self.prefix_cache.min_tokens, self.prefill_chunk)
        p = np.asarray(prompt)
        return any(
            s.prefilling and s.save_prefix and common_prefix_len(p, np.asarray(s.request.prompt_ids)) >= need
            for s in self._running
        )

    def _start(self, r: EngineRequest) -> None:
        seq_id = self._free.pop()
        self._reserved += reservation(r)
        prompt = r.prompt_ids
        n_past = 0
        hit = self.prefix_cache.lookup(prompt)
        if hit is not None:
            # Reuse whole chunks only, and never the last prompt token (its logits are needed).
            n_past = min(hit.tokens, len(prompt) - 1) // self.prefill_chunk * self.prefill_chunk
            buf = (ctypes.c_uint8 * len(hit.state)).from_buffer_copy(hit.state)
            if llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(hit.state), seq_id) == 0:
                log.warning("prefix state did not load; evaluating the whole prompt")
                n_past = 0
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_past, -1)
        r.cached_tokens = n_past
        self._running.append(
            Sequence(
                seq_id=seq_id, request=r, sampler=make_sampler(r.sampling), pending=prompt[n_past:],
                n_past=n_past, save_prefix=self.prefix_cache.wants(prompt),
            )
        )  # fmt: skip

    def _release(self, s: Sequence) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, s.seq_id, -1, -1)
        llama_cpp.llama_sampler_free(s.sampler)
        self._running.remove(s)
        self._free.append(s.seq_id)
        self._reserved -= reservation(s.request)

    def _add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq_id, logits
        b.n_tokens = i + 1
        return i

    def _step(self) -> None:
        """One llama_decode over every running sequence: decoders add their last token,
        prefillers a chunk of their prompt; then each sequence with logits samples."""
        self.batch.n_tokens = 0
        outputs: list[tuple[Sequence, int]] = []
        drafts: list[tuple[Sequence, int, list[int], list[int]]] = []  # seq, its n_past, drafted tokens, their logit rows
        for s in self._running:
            if not s.prefilling:
                draft = self._draft(s)
                outputs.append((s, self._add(s.request.tokens[-1], s.n_past, s.seq_id, True)))
                if draft:
                    rows = [self._add(d, s.n_past + 1 + j, s.seq_id, True) for j, d in enumerate(draft)]
                    drafts.append((s, s.n_past, draft, rows))
                s.n_past += 1
        room = self.n_batch - self.batch.n_tokens
        for s in self._running:
            # Prompt chunks end on multiples of prefill_chunk, so a prompt is cut the same
            # way whether its prefix came from the cache or not (see _start).
            size = self.prefill_chunk - s.n_past % self.prefill_chunk
            if not s.prefilling or room < min(size, len(s.pending)):
                continue
            chunk, s.pending = s.pending[:size], s.pending[size:]
            for j, tok in enumerate(chunk):
                last = not s.pending and j == len(chunk) - 1
                idx = self._add(tok, s.n_past + j, s.seq_id, last)
                if last:
                    outputs.append((s, idx))
            s.n_past += len(chunk)
            self.prompt_tokens_evaluated += len(chunk)
            room -= len(chunk)
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} ({len(self._running)} sequences)")
        self.steps += 1
        now = time.time()
        drafted = {id(s): (n_past, draft, rows) for s, n_past, draft, rows in drafts}
        for s, idx in outputs:
            if s.save_prefix and len(s.request.tokens) == 0:
                self._save_prefix(s)
            if s.request.speculative and not s.prefilling:
                s.request.target_passes += 1
            tok = llama_cpp.llama_sampler_sample(s.sampler, self.ctx, idx)
            if reason := append_token(self, s.request, tok, self._eos, now):
                self._finish(s, reason)
            elif id(s) in drafted:
                self._verify(s, tok, *drafted[id(s)], now)
        running = list(self._running)
        cancelled = self.cancelled([s.request.job_id for s in running])
        for s in running:
            if s.request.job_id in cancelled or s.request.aborted:
                self._finish(s, "cancelled")

    def _draft(self, s: Sequence) -> list[int]:
        """Prompt-lookup drafts for a decoding sequence whose job speculates (greedy only),
        never past its max_tokens: its KV cells stay within its reservation."""
        r = s.request
        if not r.speculative or not self.draft_tokens:
            return []
        k = min(self.draft_tokens, r.sampling.max_tokens - len(r.tokens) - 1)
        spec = r.speculative
        return ngram_draft(r.prompt_ids + r.tokens, k, int(spec.get("max_ngram", 3)), int(spec.get("min_ngram", 1)))

    def _verify(self, s: Sequence, first: int, n_past: int, draft: list[int], rows: list[int], now: float) -> None:
        """Accept drafts while each is the target's own pick at the position before it;
        the first miss is replaced by that pick. Cells of rejected drafts are removed."""
        s.request.drafted_tokens = (s.request.drafted_tokens or 0) + len(draft)
        self.drafted_tokens += len(draft)
        accepted, tok = 0, first
        for d, row in zip(draft, rows):
            if tok != d:
                break
            accepted += 1
            self.accepted_tokens += 1
            tok = llama_cpp.llama_sampler_sample(s.sampler, self.ctx, row)  # the pick after the accepted draft
            if reason := append_token(self, s.request, tok, self._eos, now):
                self._finish(s, reason)
                return
        # Cells n_past .. n_past + accepted hold the last token and the accepted drafts.
        s.n_past = n_past + 1 + accepted
        llama_cpp.llama_memory_seq_rm(self.memory, s.seq_id, s.n_past, -1)

    def _save_prefix(self, s: Sequence) -> None:
        """The sequence holds exactly its prompt now: keep that state for later prompts."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, s.seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, s.seq_id)
        self.prefix_cache.put(s.request.prompt_ids, ctypes.string_at(buf, written))

    def _finish(self, s: Sequence, reason: str) -> None:
        if s.request.future.done():
            return
        s.request.finish_reason = reason
        self.deliver(s.request)
        self._release(s)
