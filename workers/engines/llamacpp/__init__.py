"""llama.cpp engine: continuous batching over sequence ids, with a prefix state cache.

Parts, the way nano-vllm keeps its scheduler apart from its model runner:

- engine.py: the Engine (loads the GGUF, tokenizes with its chat template, owns the
  llama.cpp context, answers the worker's questions);
- scheduler.py: which jobs run, one ``llama_decode`` per step over all of them;
- sequence.py: one running job in the context (its sequence id, sampler, prompt progress);
- speculative.py: prompt-lookup drafts added to a step and verified against the target.

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
byte-bounded LRU store (``workers.engines.prefix_cache``). A later prompt sharing at
least ``prefix_min_tokens`` leading tokens with a stored one loads that state, drops the
KV past the shared run, and evaluates only the rest; the job's usage reports the reused
tokens as ``cached_tokens``.

Why chunks end on multiples of ``prefill_chunk`` (reuse is not rounded to one: the chat
template's shared system turn is shorter than a chunk; docs/architecture.md):
llama.cpp's CPU kernels round differently depending on how a prompt is cut into
batches (measured: the same 18 prompts fed 7 tokens per step instead of whole gave 3
different greedy outputs, token by token 11). With fixed chunk boundaries a prompt is cut
on the same grid whether its prefix came from the cache or not, and reuse keeps greedy
output identical to a cold run on the tested prompts. Sharing steps with other sequences does change
rounding: batched greedy output can part from single-stream output at near-tie logits
(measured and tested; docs/architecture.md).
"""
