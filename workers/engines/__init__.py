"""Engines: one interface (base.Engine), one module (or package) per backend, imported on demand."""

from __future__ import annotations

import importlib

from dispatcher.jobs import BACKENDS, UnknownBackendError
from dispatcher.registry import BackendSpec, ModelSpec
from workers.engines.base import Engine
from workers.engines.request import CancelSource, never_cancelled

ENGINE_CLASSES = {
    "pytorch": "workers.engines.pytorch:PyTorchEngine",
    "onnx": "workers.engines.onnx:OnnxEngine",
    "llamacpp": "workers.engines.llamacpp.engine:LlamaCppEngine",
    "vllm": "workers.engines.vllm:VllmEngine",
    "tgi": "workers.engines.tgi:TgiEngine",
}


def create_engine(
    backend: str, model: ModelSpec, config: BackendSpec, threads: int, cancel_source: CancelSource = never_cancelled
) -> Engine:
    if backend not in BACKENDS:
        raise UnknownBackendError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    if backend not in ENGINE_CLASSES:
        raise NotImplementedError(f"no {backend} engine in this build yet (available: {', '.join(ENGINE_CLASSES)})")
    module, _, cls = ENGINE_CLASSES[backend].partition(":")
    return getattr(importlib.import_module(module), cls)(model, config, threads, cancel_source)
