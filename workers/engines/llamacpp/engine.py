"""The llama.cpp Engine: loads the GGUF, tokenizes with its chat template, owns the context.

The high-level ``Llama`` object owns the weights, tokenizer and chat template (with a
tiny context of its own); decoding runs on a second context made from the same model
through llama-cpp-python's low-level API, which the scheduler (scheduler.py) steps. Its
parameters are copied from the high-level ones (flash attention as configured there), so a
job's greedy output matches what ``Llama.create_chat_completion`` gives for it alone.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_grammar
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from core.backends import LlamaCppSpec
from core.errors import EngineError
from core.jobs import GenerationJob
from workers.engines.base import Engine, ModelArtifactError
from workers.engines.grammar import Grammars, closed
from workers.engines.llamacpp.scheduler import ContextShape, Scheduler
from workers.engines.prefix_cache import PrefixStateCache
from workers.engines.request import EngineRequest
from workers.engines.shaping import prepare

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


EMPTY_FIRST_ALTERNATIVE = re.compile(r"::=[ \t]*\|")


def llama_json_grammar(schema: dict[str, Any] | None) -> str:
    """llama.cpp's own JSON grammar: its schema converter, or any object (JSON mode, the
    grammar llama-cpp-python uses for it). GBNF's empty first alternative (``ws ::= | " "``)
    is written as an empty string, which xgrammar's parser needs."""
    gbnf = llama_grammar.JSON_GBNF if schema is None else llama_grammar.json_schema_to_gbnf(json.dumps(closed(schema)))
    return EMPTY_FIRST_ALTERNATIVE.sub('::= "" |', gbnf)


class LlamaCppEngine(Engine[LlamaCppSpec]):
    backend = "llamacpp"
    supports_speculative = True  # prompt-lookup drafts, verified in the same llama_decode as the batch

    # ---------------------------------------------------------- configuration

    @property
    def max_seqs(self) -> int:
        return self.config.max_seqs

    @property
    def prefill_chunk(self) -> int:
        return self.config.prefill_chunk

    @property
    def capacity(self) -> int:
        return self.max_seqs

    @property
    def draft_tokens(self) -> int:
        """Drafted tokens a speculative sequence may add to a step (0: speculation off)."""
        spec = self.config.speculative
        return spec.num_tokens if spec is not None and spec.method == "ngram" else 0

    # ---------------------------------------------------------- lifecycle

    def load(self) -> None:
        path = self.model.artifact_path("gguf")
        check_gguf_file(path)
        t0 = time.monotonic()
        # Weights, tokenizer and chat template. Its own context is only a formality.
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=64,
            n_batch=64,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            flash_attn=self.config.flash_attn,
            verbose=False,
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.eos_ids = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]
        self.chat = self._chat_formatter()
        self._pieces: dict[int, bytes] = {}
        self._grammars: Grammars | None = None

        params = llama_cpp.llama_context_params.from_buffer_copy(self.llm.context_params)
        params.n_seq_max = self.max_seqs
        params.kv_unified = True
        self.n_ctx = max(self.config.kv_cache_tokens, self.max_model_len)
        params.n_ctx = self.n_ctx
        n_batch = max(self.prefill_chunk, self.max_seqs) + self.max_seqs * (1 + self.draft_tokens)
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create a context for {path}")

        budget = int(self.config.prefix_cache_mb * 2**20)
        self.prefix_cache = PrefixStateCache(budget, self.config.prefix_min_tokens)
        shape = ContextShape(self.n_ctx, n_batch, self.n_vocab, self.max_seqs, self.prefill_chunk, self.draft_tokens)
        self.scheduler = Scheduler(self, self.ctx, shape, self.prefix_cache).start()
        log.info(
            "llama.cpp engine: %s (%s), %d threads, %d sequences, loaded in %.1f s",
            self.model.name,
            path.name,
            self.threads,
            self.max_seqs,
            time.monotonic() - t0,
        )

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
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.stop()
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
        c, s = self.prefix_cache, self.scheduler
        return {
            "prompt_tokens_evaluated": s.prompt_tokens_evaluated,
            "prefix_hits": c.stats.hits,
            "prefix_misses": c.stats.misses,
            "prefix_reused_tokens": c.stats.reused_tokens,
            "prefix_entries": len(c),
            "prefix_bytes": c.bytes_used,
            "prefix_evicted": c.stats.evicted,
            "steps": s.steps,
            "drafted_tokens": s.lookup.drafted_tokens,
            "accepted_tokens": s.lookup.accepted_tokens,
        }

    # ---------------------------------------------------------- requests

    def encode(self, job: GenerationJob) -> list[int]:
        if job.messages is not None:
            if self.chat is None:
                raise EngineError(f"{self.model.name}'s GGUF has no chat template; send a prompt, not messages")
            text = self.chat(messages=[m.model_dump() for m in job.messages]).prompt
            return self.llm.tokenize(text.encode(), add_bos=False, special=True)
        return self.llm.tokenize((job.prompt or "").encode(), add_bos=True, special=False)

    def decode(self, token_ids: list[int]) -> str:
        """Token texts joined, from a per-token cache: streaming and stop strings decode a
        job's whole output after every token, and llama-cpp-python's detokenize makes one
        ctypes call per token (the cost grew with the square of the output)."""
        pieces = self._pieces
        return b"".join([pieces[t] if t in pieces else self._piece(t) for t in token_ids]).decode(
            "utf-8", errors="replace"
        )

    def _piece(self, token: int) -> bytes:
        piece = self._pieces[token] = self.llm.detokenize([token])
        return piece

    @property
    def vocab_size(self) -> int | None:
        return self.n_vocab

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler for this vocabulary, made at the first structured job."""
        if self._grammars is None:
            is_control = llama_cpp.llama_vocab_is_control
            vocab = [b"" if is_control(self.vocab, t) else self.piece(t) for t in range(self.n_vocab)]
            self._grammars = Grammars.of_pieces(vocab, self.eos_ids, llama_json_grammar)
        return self._grammars

    def request_for(self, job: GenerationJob, on_text: Callable[[str], None] | None = None) -> EngineRequest:
        """The scheduler's request, with what the job does to its logits (compiled here,
        on the task thread: the scheduler thread only applies it)."""
        r = super().request_for(job, on_text)
        prepare(r, self.eos_ids, self.n_vocab, lambda: self.grammars, self.piece, penalties=False)
        return r

    def piece(self, token: int) -> bytes:
        """One token's bytes (cached)."""
        pieces = self._pieces
        return pieces[token] if token in pieces else self._piece(token)

    def submit(self, request: EngineRequest) -> None:
        self.scheduler.submit(request)
