"""llama.cpp engine: continuous batching over sequence ids, with a prefix state cache.

Parts, the way nano-vllm keeps its scheduler apart from its model runner:

- engine.py: the Engine (loads the GGUF, tokenizes with its chat template, owns the
  llama.cpp context, answers the worker's questions);
- scheduler.py: which jobs run, one ``llama_decode`` per step over all of them;
- sequence.py: one running job in the context (its sequence id, sampler, prompt progress);
- speculative.py: prompt-lookup drafts added to a step and verified against the target.

One context holds ``max_seqs`` sequences sharing one unified KV pool; a job joins between
steps when its prompt plus max_tokens fits beside the running ones' reservations, and a
prompt is fed in ``prefill_chunk`` chunks. Why each of these choices, with what was
measured: docs/architecture.md, "Engines".
"""
