"""Structured outputs on the fleet's own samplers: xgrammar's token masks.

A job's StructuredOutput (any JSON object, a JSON schema, a regex, a choice list) is
compiled once against the engine's vocabulary, on the task thread that hands the job in,
and cached by xgrammar's compiler across jobs (the same schema compiles once). The
scheduler thread then only asks the job's matcher for the next token's mask (0.2 to 4 ms
on a 49k vocabulary, by the grammar's state: workers.engines.shaping.Shaper.pick asks for
it only when the model's own pick breaks the grammar) and tells it the token taken. vLLM
runs its own structured outputs (the same xgrammar underneath); a remote OpenAI server gets the request's own field.

JSON follows the engine's own reading of a schema where it has one: llama.cpp's
schema-to-grammar converter (the one llama-server and llama-cpp-python use) gives the
grammar, xgrammar enforces it, so a greedy answer is the one llama.cpp's own server gives.
Without one, xgrammar's converter is used with JSON compact (no free whitespace between
tokens): a small model given the freedom of JSON's whitespace can spend its whole budget
on newlines.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from core.errors import JobValidationError
from core.jobs import StructuredOutput

CACHE_BYTES = 256 * 2**20  # compiled grammars kept across jobs
# An engine's own JSON grammar (GBNF): for a schema, or for any object (None).
JsonGrammar = Callable[[dict[str, Any] | None], str]


def closed(schema: Any) -> Any:
    """The schema with each object that lists its properties closed to others, unless it
    says ``additionalProperties`` itself: how vLLM (xgrammar's strict mode) and OpenAI's
    strict mode read a schema, so the same request means the same on every engine. Left
    open, llama.cpp's converter lets a model add keys until max_tokens (LangChain sends
    such schemas)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Grammars:
    """The compiler for one engine's vocabulary, with its cache of compiled grammars."""

    @classmethod
    def of_pieces(cls, vocab: list[bytes], stop_ids: list[int], json_grammar: JsonGrammar | None = None) -> Grammars:
        """From each token id's bytes (b"" for control tokens, which no grammar admits)."""
        import xgrammar as xgr  # imports torch (~2 s): paid at the first structured job, not at start

        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=stop_ids)
        return cls(info, len(vocab), json_grammar)

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, n_vocab: int, stop_ids: list[int]) -> Grammars:
        """From a transformers tokenizer; ``n_vocab``: the model's logits width (it may pad)."""
        import xgrammar as xgr

        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=n_vocab, stop_token_ids=stop_ids), n_vocab)

    def __init__(self, info: Any, n_vocab: int, json_grammar: JsonGrammar | None = None) -> None:
        import xgrammar as xgr

        self.n_vocab = n_vocab
        self.json_grammar = json_grammar
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True, cache_limit_bytes=CACHE_BYTES)
        self._lock = threading.Lock()  # task threads compile; one at a time keeps the cache simple

    def compile(self, s: StructuredOutput) -> Any:
        """The compiled grammar; a schema or regex xgrammar refuses is the job's error."""
        try:
            with self._lock:
                return self._compile(s)
        except Exception as exc:  # noqa: BLE001 - whatever a converter raises on a user's schema is the user's error
            field = {"json_schema": "response_format.json_schema", "regex": "structured_outputs.regex"}.get(
                s.kind, s.kind
            )
            raise JobValidationError(
                f"{field}: the grammar engine cannot compile it: {str(exc).splitlines()[0][:300]}",
                {"errors": [{"field": field, "message": "not compilable"}]},
            ) from None

    def _compile(self, s: StructuredOutput) -> Any:
        if self.json_grammar is not None and s.kind in ("json_object", "json_schema"):
            return self.compiler.compile_grammar(self.json_grammar(s.json_schema))
        if s.kind == "json_object":  # an object, as OpenAI's JSON mode gives (the builtin grammar admits any value)
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if s.kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(s.json_schema), any_whitespace=False, strict_mode=True)
        if s.kind == "regex":
            return self.compiler.compile_regex(s.regex or "")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in s.choice or [])
        return self.compiler.compile_grammar(f"root ::= {alternatives}")

    def guide(self, s: StructuredOutput) -> Guide:
        return Guide(self.compile(s), self.n_vocab)


class Guide:
    """One job's walk through its grammar: the mask of the tokens it admits next."""

    def __init__(self, compiled: Any, n_vocab: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.n_vocab = n_vocab
        self.bitmask = np.zeros((1, (n_vocab + 31) // 32), dtype=np.int32)

    @property
    def completed(self) -> bool:
        """The output is whole: only a stop token is admitted now."""
        return bool(self.matcher.is_completed())

    def mask(self, row: np.ndarray) -> None:
        """Set the logits of the tokens the grammar does not admit next to -inf."""
        if not self.matcher.fill_next_token_bitmask(self.bitmask):
            return  # every token is admitted
        allowed = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.n_vocab]
        row[: self.n_vocab][allowed == 0] = -np.inf

    def accept(self, token: int) -> bool:
        """Advance past a taken token; False if the grammar did not admit it."""
        return bool(self.matcher.accept_token(token))
