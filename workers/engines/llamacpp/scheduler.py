"""The llama.cpp scheduler: which jobs run, and one ``llama_decode`` per step over all of them.

A thread admits waiting requests into free sequence ids (when their prompt + max_tokens
fits in the shared KV pool beside the running ones' reservations), then steps: decoders
add their last token (and, speculating, their drafts), newly admitted jobs a chunk of
their prompt, one ``llama_decode`` evaluates it all, and each sequence with logits
samples its next token. Jobs leave as soon as they end. The engine (engine.py) owns the
model and the context; this owns what runs in it.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from core.errors import EngineError
from workers.engines.base import Engine
from workers.engines.decoding import append_token
from workers.engines.llamacpp.sequence import Sequence, make_sampler, reservation
from workers.engines.llamacpp.speculative import PromptLookup
from workers.engines.prefix_cache import PrefixStateCache, Scope, common_prefix_len
from workers.engines.request import EngineRequest, fail_requests
from workers.engines.shaping import penalized

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextShape:
    """The llama.cpp context the scheduler steps (the engine made it with these numbers)."""

    n_ctx: int  # KV cells in the shared pool
    n_batch: int  # tokens one llama_decode takes
    n_vocab: int
    max_seqs: int  # sequence ids: jobs running at once
    prefill_chunk: int  # prompt tokens a sequence adds per step
    draft_tokens: int  # prompt-lookup drafts a decoding sequence adds per step (0: none)


class Scheduler:
    def __init__(self, engine: Engine[Any], ctx: Any, shape: ContextShape, prefix_cache: PrefixStateCache) -> None:
        self.engine, self.ctx, self.n_ctx, self.n_batch = engine, ctx, shape.n_ctx, shape.n_batch
        self.prefill_chunk = shape.prefill_chunk
        self.prefix_cache = prefix_cache
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.batch = llama_cpp.llama_batch_init(shape.n_batch, 0, 1)
        self.lookup = PromptLookup(ctx, self.memory, shape.draft_tokens)
        self.n_vocab = shape.n_vocab
        self._out_rows: dict[int, int] = {}  # this step's batch index → its row in the logits
        self._scored: list[
            tuple[Sequence, int, int]
        ] = []  # echo: (sequence, batch index, the prompt token it predicts)
        self._argmax: np.ndarray | None = None  # this step's greedy picks, one per logits row
        self.eos = set(engine.eos_ids)
        self.prompt_tokens_evaluated = 0  # what prefix reuse saves
        self.steps = 0

        self._queue: queue.Queue[EngineRequest | None] = queue.Queue()
        self._free = list(range(shape.max_seqs))
        self._held: list[EngineRequest] = []  # waiting for KV room, or for a prefix being evaluated
        self._reserved = 0  # KV cells promised to the running sequences (prompt + max_tokens)
        self._running: list[Sequence] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llamacpp-scheduler", daemon=True)

    # ---------------------------------------------------------- lifecycle

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def submit(self, request: EngineRequest) -> None:
        self._queue.put(request)

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=30)
        llama_cpp.llama_batch_free(self.batch)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self._running and not self._held)
            if not self._running:
                continue
            try:
                self._step()
            except Exception as exc:  # a failed step fails its jobs, not the engine
                log.exception("llama.cpp step with %d sequences failed", len(self._running))
                fail_requests([s.request for s in self._running], exc)
                for s in list(self._running):
                    self._release(s)

    # ---------------------------------------------------------- admission

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
        if not self.engine.drop_cancelled([r]):
            return  # cancelled (or given up on) while waiting: answered, never started
        if not self._free or self._reserved + reservation(r) > self.n_ctx or self._prefix_in_progress(r):
            self._held.append(r)
        else:
            self._start(r)

    def _prefix_in_progress(self, r: EngineRequest) -> bool:
        """A running prompt whose state this one could reuse is still being evaluated."""
        need = self.prefix_cache.min_tokens
        p, mine = np.asarray(r.prompt_ids), scope_of(r)
        return any(
            s.prefilling
            and s.save_prefix
            and mine.reusable(scope_of(s.request), common_prefix_len(p, np.asarray(s.request.prompt_ids))) >= need
            for s in self._running
        )

    def _start(self, r: EngineRequest) -> None:
        seq_id = self._free.pop()
        self._reserved += reservation(r)
        prompt = r.prompt_ids
        n_past = 0
        # An echo needs the logits of every prompt position: nothing comes from the cache.
        hit = None if r.prompt_logprobs is not None else self.prefix_cache.lookup(prompt, scope_of(r))
        if hit is not None:
            # Never the last prompt token: its logits are needed. The rest of the prompt is
            # still cut on the prefill_chunk grid (see _step), as a cold evaluation cuts it.
            n_past = min(hit.tokens, len(prompt) - 1)
            buf = (ctypes.c_uint8 * len(hit.state)).from_buffer_copy(hit.state)
            if llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(hit.state), seq_id) == 0:
                log.warning("prefix state did not load; evaluating the whole prompt")
                n_past = 0
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_past, -1)
        r.cached_tokens = n_past
        sequence = Sequence(
            seq_id=seq_id,
            request=r,
            sampler=make_sampler(r.sampling, self.n_vocab),
            pending=prompt[n_past:],
            n_past=n_past,
            save_prefix=self.prefix_cache.wants(prompt, scope_of(r)),
        )
        self._running.append(sequence)

    def _release(self, s: Sequence) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, s.seq_id, -1, -1)
        if s.sampler is not None:
            llama_cpp.llama_sampler_free(s.sampler)
        self._running.remove(s)
        self._free.append(s.seq_id)
        self._reserved -= reservation(s.request)

    # ---------------------------------------------------------- one step

    def _add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq_id, logits
        b.n_tokens = i + 1
        if logits:
            self._out_rows[i] = len(self._out_rows)
        return i

    def _pick(self, s: Sequence, idx: int) -> int:
        """The token a sequence picks from the logits at batch index ``idx``, and its
        logprobs if the job asked. A job that shapes its logits (a grammar, logit_bias,
        an EOS floor) changes its own row first (workers.engines.shaping)."""
        r = s.request
        if r.shaper is None and r.logprobs is None:
            return self._plain_pick(s, idx)
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
        reader = r.logprob_reader if r.logprobs is not None else None
        logprobs = reader.read(row) if reader is not None else None
        if r.shaper is not None:

            def choose() -> int:
                return llama_cpp.llama_sampler_sample(s.sampler, self.ctx, idx) if s.sampler else int(row.argmax())

            # llama.cpp's penalty sampler counts every draw: such a job masks before it picks
            tok = r.shaper.pick(row, r.tokens, choose, checks_first=not penalized(r.sampling))
        else:
            tok = self._plain_pick(s, idx)
        if reader is not None and logprobs is not None and r.logprobs is not None:
            r.logprobs.append(reader.entry(logprobs, tok))
        return tok

    def _plain_pick(self, s: Sequence, idx: int) -> int:
        """Greedy picks come from one numpy argmax over all the step's logits rows:
        llama.cpp's greedy sampler copies the whole vocabulary into a candidate array on
        every call (~0.09 ms a token here, 8 calls in a step of 8 sequences). Ties go to
        the lowest token id, as in llama.cpp's greedy sampler."""
        if s.sampler is not None:  # a sampling job (make_sampler gives greedy ones none)
            return llama_cpp.llama_sampler_sample(s.sampler, self.ctx, idx)
        if self._argmax is None:
            rows = (len(self._out_rows), self.n_vocab)  # llama.cpp keeps them in batch order
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=rows)
            self._argmax = logits.argmax(axis=1)
        return int(self._argmax[self._out_rows[idx]])

    def _step(self) -> None:
        """One llama_decode over every running sequence: decoders add their last token,
        prefillers a chunk of their prompt; then each sequence with logits samples."""
        self.batch.n_tokens = 0
        self._out_rows.clear()
        self._scored.clear()
        self._argmax = None
        outputs: list[tuple[Sequence, int]] = []  # (sequence, the batch index of its logits)
        drafts: dict[int, tuple[int, list[int], list[int]]] = {}  # id(seq) → its n_past, drafts, their logit rows
        self._add_decoders(outputs, drafts)
        self._add_prefills(outputs)
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} ({len(self._running)} sequences)")
        self.steps += 1
        self._score_prompts()
        self._sample(outputs, drafts, time.time())
        running = list(self._running)
        cancelled = self.engine.cancelled([s.request.job_id for s in running])
        for s in running:
            if s.request.job_id in cancelled or s.request.aborted:
                self._finish(s, "cancelled")

    def _add_decoders(
        self, outputs: list[tuple[Sequence, int]], drafts: dict[int, tuple[int, list[int], list[int]]]
    ) -> None:
        """Each decoding sequence's last token (and, speculating, its drafts) into the batch."""
        for s in self._running:
            if not s.prefilling:
                draft = self.lookup.draft(s)
                outputs.append((s, self._add(s.request.tokens[-1], s.n_past, s.seq_id, True)))
                if draft:
                    rows = [self._add(d, s.n_past + 1 + j, s.seq_id, True) for j, d in enumerate(draft)]
                    drafts[id(s)] = (s.n_past, draft, rows)
                s.n_past += 1

    def _add_prefills(self, outputs: list[tuple[Sequence, int]]) -> None:
        """A chunk of each prefilling sequence's prompt into the batch, while room is left."""
        room = self.n_batch - self.batch.n_tokens
        for s in self._running:
            # Prompt chunks end on multiples of prefill_chunk, so a prompt is cut the same
            # way whether its prefix came from the cache or not (see _start).
            size = self.prefill_chunk - s.n_past % self.prefill_chunk
            if not s.prefilling or room < min(size, len(s.pending)):
                continue
            chunk, s.pending = s.pending[:size], s.pending[size:]
            scoring = s.request.prompt_logprobs is not None
            for j, tok in enumerate(chunk):
                last = not s.pending and j == len(chunk) - 1
                idx = self._add(tok, s.n_past + j, s.seq_id, last or scoring)
                if last:
                    outputs.append((s, idx))
                elif scoring:  # this position's logits score the next prompt token
                    self._scored.append((s, idx, s.n_past + j + 1))
            s.n_past += len(chunk)
            self.prompt_tokens_evaluated += len(chunk)
            room -= len(chunk)

    def _sample(
        self, outputs: list[tuple[Sequence, int]], drafts: dict[int, tuple[int, list[int], list[int]]], now: float
    ) -> None:
        """Each sequence with logits takes its next token (and verifies its drafts)."""

        def take(s: Sequence, tok: int, save_prefix: bool = False) -> bool:
            reason = append_token(self.engine, s.request, tok, self.eos, now)
            if save_prefix:
                # After the first token has gone to the stream (copying the state out is
                # on no reader's path), before _finish frees the sequence. The KV still
                # holds exactly the prompt: the sampled token is evaluated next step.
                self._save_prefix(s)
            if reason:
                self._finish(s, reason)
                return True
            return False

        for s, idx in outputs:
            if s.request.speculative is not None and not s.prefilling:
                s.request.target_passes += 1
            tok = self._pick(s, idx)
            if not take(s, tok, save_prefix=s.save_prefix and len(s.request.tokens) == 0) and id(s) in drafts:
                self.lookup.verify(s, tok, *drafts[id(s)], take, self._pick)

    def _score_prompts(self) -> None:
        """An echo's prompt logprobs: each evaluated position's logprob of the prompt token
        after it (the last position's logits pick the first generated token instead)."""
        for s, idx, pos in self._scored:
            r = s.request
            if r.logprob_reader is None or r.prompt_logprobs is None:
                continue
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
            r.prompt_logprobs.append(r.logprob_reader.entry(r.logprob_reader.read(row), r.prompt_ids[pos]))

    def _save_prefix(self, s: Sequence) -> None:
        """The sequence holds exactly its prompt now: keep that state for later prompts."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, s.seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, s.seq_id)
        self.prefix_cache.put(s.request.prompt_ids, ctypes.string_at(buf, written), scope_of(s.request))

    def _finish(self, s: Sequence, reason: str) -> None:
        if s.request.future.done():
            return
        s.request.finish_reason = reason
        self.engine.deliver(s.request)
        self._release(s)


def scope_of(r: EngineRequest) -> Scope:
    """Whose cached prompt states the request may reuse (workers.engines.prefix_cache)."""
    return Scope(r.cache_salt, r.public_tokens)
