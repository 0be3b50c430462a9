"""The in-process loops a user would write instead of the fleet: the baselines of
bench.vs_peers for the engines that have no server of their own here.

* ONNX Runtime: onnxruntime-genai's own batched ``Generator``, the prompts in batches of
  the engine's ``batch_size`` (right-padded, as the engine pads), one batch after another;
* vLLM: one ``AsyncLLM`` with the worker's own engine arguments (VllmEngine.engine_args),
  every prompt submitted at once, as vLLM's own examples do.

Both use the model's chat template through the same HF tokenizer as the workers, greedy,
the same max tokens, and count the tokens generated, the EOS that ends a row included
(as the fleet's completion tokens count it: it cost a step). Each returns generated
tokens, wall seconds and tok/s, and loads its model inside the call and frees it after,
so only one engine is alive at a time.

``first_token_loop`` is the TTFT bench's baseline: one prompt to its first token.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from bench.cpu_time import metered
from core.backends import load_backends
from core.registry import ModelRegistry
from workers.engines.onnx_process import load_model, special_ids

MODEL = "smollm2-135m"
IN_PROCESS_ROLE = "bench process (in-process engine front end)"


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """A user message through the chat template, as workers.engines.hf_tokens encodes it."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def result(tokens: int, wall_s: float, **extra: Any) -> dict:
    return {"tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s, **extra}


def passes(
    timed: Callable[[list[str]], dict],
    texts: list[str],
    first_pass: list[str] | None,
    roots: dict[int, str] | None = None,
) -> dict:
    """``timed(texts)``'s result; with ``first_pass``, a whole pass over those prompts runs
    and is timed first, and its result rides along as ``first_pass``: an engine's first
    full batch after it starts runs slower than the next ones (vLLM on CPU: ~8 %), so
    the second pass is the steady rate and the first says what a cold start costs.
    Each pass carries ``cpu``: the CPU seconds of the processes under ``roots`` (pid →
    role; default: this process and its children), Redis and the machine (bench.cpu_time)."""
    roots = roots or {os.getpid(): IN_PROCESS_ROLE}

    def metered_pass(batch: list[str]) -> dict:
        with metered(roots) as cpu:
            out = timed(batch)
        return out | {"cpu": cpu}

    first = metered_pass(first_pass) if first_pass else None
    out = metered_pass(texts)
    return out | {"first_pass": first} if first else out


def onnx_batched(
    texts: list[str], max_tokens: int, threads: int, fmt: str = "onnx", first_pass: list[str] | None = None
) -> dict:
    """onnxruntime-genai's Generator, ``batch_size`` prompts a batch (config/backends.yaml)."""
    import onnxruntime_genai as og

    spec = ModelRegistry.from_config().get(MODEL)
    batch_size = load_backends()["onnx"].for_model(spec).batch_size
    path = spec.artifact_path(fmt)
    model = load_model(path, threads)
    eos, pad = special_ids(path)
    eos_ids = set(eos)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def generate(batch: list[str], max_tokens: int) -> int:
        prompts = [chat_ids(tokenizer, t) for t in batch]
        width = max(map(len, prompts))
        ids = np.full((len(prompts), width), pad, dtype=np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=width + max_tokens, batch_size=len(prompts), do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        counts, ended = [0] * len(prompts), [False] * len(prompts)
        while not all(ended) and not generator.is_done():
            generator.generate_next_token()
            for i, t in enumerate(generator.get_next_tokens()):
                if not ended[i]:
                    ended[i] = int(t) in eos_ids or counts[i] + 1 >= max_tokens
                    counts[i] += 1
        return sum(counts)

    def timed(batch: list[str]) -> dict:
        t0 = time.perf_counter()
        tokens = sum(generate(batch[i : i + batch_size], max_tokens) for i in range(0, len(batch), batch_size))
        return result(tokens, time.perf_counter() - t0, batch_size=batch_size)

    generate(texts[:1], 4)  # warm: the first run allocates
    return passes(timed, texts, first_pass)  # the model goes with this frame


@contextmanager
def vllm_session(max_tokens: int, threads: int, warm_text: str) -> Iterator[Callable[[list[str]], dict]]:
    """One AsyncLLM with the worker's engine arguments on an asyncio loop in a thread of
    this process (as the worker runs it), warmed by one request (the first compiles and
    allocates). Yields ``timed(batch)``: every prompt at once, as vLLM's own examples do;
    generated tokens, wall seconds and tok/s. The engine is shut down after the block."""
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from workers.engines.vllm import VllmEngine

    spec = ModelRegistry.from_config().get(MODEL)
    engine = VllmEngine(spec, load_backends()["vllm"].for_model(spec), threads=threads)
    path = spec.artifact_path("hf")
    engine.set_environment()  # what the worker sets before vLLM starts: KV cache, bound cores
    tokenizer = AutoTokenizer.from_pretrained(path)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, skip_special_tokens=True)
    ids = itertools.count()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-vllm-loop", daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def create() -> Any:
        return AsyncLLM.from_engine_args(engine.engine_args(str(path)))

    llm = call(create())

    async def count(prompt_ids: list[int]) -> int:
        n = 0
        async for out in llm.generate({"prompt_token_ids": prompt_ids}, sampling, request_id=f"bench-{next(ids)}"):
            n = len(out.outputs[0].token_ids)
        return n

    async def run(batch: list[str]) -> dict:
        # The chat template and the tokenizer run inside the clock: the fleet's worker
        # does that work per job, and so does vLLM for a text prompt. tokenize_s says
        # what it cost (subtract it for the ratio without it).
        t0 = time.perf_counter()
        prompts = [chat_ids(tokenizer, t) for t in batch]
        tokenize_s = time.perf_counter() - t0
        counts = await asyncio.gather(*(count(p) for p in prompts))
        wall = time.perf_counter() - t0
        return result(sum(counts), wall, max_num_seqs=engine.max_num_seqs, tokenize_s=round(tokenize_s, 4))

    async def shutdown() -> None:
        llm.shutdown()  # on the loop, so its output handler is cancelled before EngineCore exits

    try:
        call(count(chat_ids(tokenizer, warm_text)))
        yield lambda batch: call(run(batch))
    finally:
        call(shutdown())
        llm = None  # freed now, while the loop runs, not at interpreter exit
        gc.collect()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        gc.collect()


def vllm_async(texts: list[str], max_tokens: int, threads: int, first_pass: list[str] | None = None) -> dict:
    """One AsyncLLM with the worker's engine arguments, every prompt at once (bench.inprocess.passes)."""
    with vllm_session(max_tokens, threads, texts[0]) as timed:
        return passes(timed, texts, first_pass)


def first_token_loop(backend: str, threads: int) -> Callable[[str], None]:
    """A function that runs one chat prompt to its first generated token in the engine's
    own library: its prefill (and one sampled token), nothing of ours around it. The
    engine is loaded here and lives as long as the function (the TTFT bench pairs it
    with the fleet prompt by prompt). llama.cpp's high-level ``Llama`` keeps the tokens it
    evaluated last and reuses their common prefix, as the fleet's engine reuses the chat
    template's shared system turn."""
    spec = ModelRegistry.from_config().get(MODEL)
    if backend == "llamacpp":
        import llama_cpp

        cfg = load_backends()["llamacpp"].for_model(spec)
        llm = llama_cpp.Llama(
            model_path=str(spec.artifact_path("gguf")),
            n_ctx=2048,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=cfg.flash_attn,
            verbose=False,
        )

        def first(text: str) -> None:
            llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=1, temperature=0)

    elif backend == "onnx":
        import onnxruntime_genai as og

        path = spec.artifact_path("onnx")
        model = load_model(path, threads)
        tokenizer = AutoTokenizer.from_pretrained(path)

        def first(text: str) -> None:
            ids = chat_ids(tokenizer, text)
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + 1, batch_size=1, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(np.array([ids], dtype=np.int32))
            generator.generate_next_token()

    elif backend == "pytorch":
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        # The device the PyTorch worker picks by default (workers.engines.pytorch), so a
        # GPU host compares CUDA with CUDA.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        path = spec.artifact_path("hf")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()

        def first(text: str) -> None:
            ids = torch.tensor([chat_ids(tokenizer, text)], device=device)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            out.tolist()  # the token on the host, as the fleet's first token reaches its stream

    else:
        raise ValueError(f"no in-process first-token loop for {backend}")
    return first
