"""What a job does to its logits row before its next token is picked, and the logprobs it
reads off the row: for engines whose sampler the fleet runs (llama.cpp's scheduler).

In order: penalties, where the engine has no sampler of its own for them (PyTorch: vLLM's
rules, presence and frequency over the generated tokens, repetition over the prompt too);
``logit_bias`` is added; end-of-sequence tokens are barred while the job is below
``min_tokens`` or asked to ``ignore_eos`` (as llama-server does: a -inf bias on every
end-of-generation token), unless its grammar admits nothing else; then the grammar masks
what it does not admit. llama.cpp applies penalties and top_k/min_p with its own samplers
(llama.cpp's sequence.make_sampler). Logprobs are the model's own distribution, read
before any of this (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from core.errors import JobValidationError
from core.jobs import SamplingParams, TokenLogprob, TopLogprob
from workers.engines.grammar import Grammars, Guide
from workers.engines.request import EngineRequest


def check_bias(s: SamplingParams, n_vocab: int) -> None:
    """A logit_bias key outside the vocabulary is the request's mistake, said as such."""
    outside = [t for t in s.logit_bias if t >= n_vocab]
    if outside:
        raise JobValidationError(
            f"logit_bias: token id {outside[0]} is not in this model's vocabulary ({n_vocab} tokens)",
            {"errors": [{"field": "logit_bias", "message": "token id out of range"}]},
        )


class Shaper:
    """One job's changes to its logits rows."""

    def __init__(
        self, s: SamplingParams, eos_ids: list[int], guide: Guide | None, prompt: list[int] | None = None
    ) -> None:
        self.guide = guide
        self.penalties = prompt is not None and penalized(s)
        self.presence, self.frequency, self.repetition = s.presence_penalty, s.frequency_penalty, s.repetition_penalty
        self.prompt = np.unique(np.asarray(prompt or [], dtype=np.int64))
        self.eos = np.asarray(eos_ids, dtype=np.int64)
        self.bias_ids = np.asarray(list(s.logit_bias), dtype=np.int64)
        self.bias = np.asarray(list(s.logit_bias.values()), dtype=np.float32)
        self.min_tokens, self.ignore_eos = s.min_tokens, s.ignore_eos
        self.accepted = 0  # tokens the grammar has been told of

    def shape(self, row: np.ndarray, tokens: list[int]) -> None:
        """Change one logits row in place; ``tokens``: what the job generated so far."""
        self.adjust(row, tokens)
        if self.guide is not None:
            self.guide.mask(row)

    def adjust(self, row: np.ndarray, tokens: list[int]) -> None:
        """Everything but the grammar's mask: penalties, bias, the EOS floor."""
        generated = len(tokens)
        if self.penalties:
            self._penalize(row, tokens)
        if self.bias_ids.size:
            row[self.bias_ids] += self.bias
        grammar_done = self.guide is not None and self.guide.completed
        if (self.ignore_eos or generated < self.min_tokens) and not grammar_done and self.eos.size:
            row[self.eos] = -np.inf

    def pick(self, row: np.ndarray, tokens: list[int], choose: Callable[[], int], checks_first: bool) -> int:
        """The token taken from a row, the grammar told of it. ``choose`` picks from the
        row as it stands (argmax, or the job's sampler). ``checks_first``: pick before
        masking and mask only if the grammar refuses the pick, as llama.cpp's own sampler
        does. Filling a mask costs ~0.2 to 4 ms a token on a 49k vocabulary (a grammar's
        state), while the model's own pick is the grammar's far more often than not; the
        result is the same (greedy: the best admitted token is the best token when it is
        admitted; sampling: a refused draw is drawn again from the masked distribution,
        which leaves each admitted token at its masked probability). Off for a job with
        penalties, whose sampler would count the refused draw."""
        self.adjust(row, tokens)
        if self.guide is None:
            tok = choose()
        elif checks_first and self.guide.accept(tok := choose()):
            self.accepted += 1
            return tok
        else:
            self.guide.mask(row)
            tok = choose()
        self.accept(tok)
        return tok

    def _penalize(self, row: np.ndarray, tokens: list[int]) -> None:
        ids, counts = np.unique(np.asarray(tokens, dtype=np.int64), return_counts=True)
        if self.repetition != 1.0:
            seen = np.union1d(ids, self.prompt)
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / self.repetition, vals * self.repetition)
        if ids.size and (self.presence or self.frequency):
            row[ids] -= self.frequency * counts + self.presence

    def accept(self, token: int) -> None:
        self.accepted += 1
        if self.guide is not None:
            self.guide.accept(token)

    def catch_up(self, tokens: list[int]) -> None:
        """Tell the grammar of the tokens taken since it was last told (an engine that
        appends tokens outside the fleet's own loop: transformers' generate)."""
        for token in tokens[self.accepted :]:
            self.accept(token)


def penalized(s: SamplingParams) -> bool:
    return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


def shaper_for(
    s: SamplingParams, eos_ids: list[int], guide: Guide | None, prompt: list[int] | None = None
) -> Shaper | None:
    """A Shaper if the job changes its rows at all (most jobs do not); ``prompt``: given
    where the shaper applies the penalties too (an engine without a sampler for them)."""
    if guide is None and not s.logit_bias and not s.min_tokens and not s.ignore_eos:
        if prompt is None or not penalized(s):
            return None
    return Shaper(s, eos_ids, guide, prompt)


def prepare(
    r: EngineRequest,
    eos_ids: list[int],
    n_vocab: int,
    grammars: Callable[[], Grammars],
    piece: Callable[[int], bytes],
    penalties: bool,
) -> None:
    """Give a request what its job does to its logits and the logprobs it reads, for an
    engine whose sampler the fleet runs: the grammar compiled here, on the task thread
    (the scheduler only applies it); ``penalties``: the shaper applies them too."""
    s = r.sampling
    check_bias(s, n_vocab)
    guide = grammars().guide(s.structured) if s.structured is not None else None
    r.shaper = shaper_for(s, eos_ids, guide, r.prompt_ids if penalties else None)
    if s.logprobs is not None or s.prompt_logprobs is not None:
        r.logprob_reader = Logprobs(s.logprobs or s.prompt_logprobs or 0, piece)


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row.astype(np.float64) - float(np.max(row))
    return shifted - np.log(np.sum(np.exp(shifted)))


class Logprobs:
    """The logprob of the token taken and of the ``k`` likeliest at one position."""

    def __init__(self, k: int, piece: Callable[[int], bytes]) -> None:
        self.k, self.piece = k, piece

    def read(self, row: np.ndarray) -> np.ndarray:
        return log_softmax(row)

    def entry(self, logprobs: np.ndarray, token: int) -> TokenLogprob:
        top: list[TopLogprob] = []
        if self.k:
            ids = np.argpartition(-logprobs, self.k - 1)[: self.k]
            ids = ids[np.argsort(-logprobs[ids], kind="stable")]
            top = [self._top(int(t), float(logprobs[t])) for t in ids]
        chosen = self._top(token, float(logprobs[token]))
        return TokenLogprob(**chosen.model_dump(), top_logprobs=top)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        raw = self.piece(token)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))
