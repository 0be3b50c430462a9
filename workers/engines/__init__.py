"""Engines: one interface (base.Engine), one module (or package) per backend, imported on demand."""

from __future__ import annotations

import importlib

from core.backends import BackendSpec
from core.errors import UnknownBackendError
from core.jobs import BACKENDS
from core.registry import ModelSpec
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
    if backend not in ENGINE_CLASSES:  # one per name in core.jobs.BACKENDS
        raise UnknownBackendError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    module, _, cls = ENGINE_CLASSES[backend].partition(":")
    return getattr(importlib.import_module(module), cls)(model, config, threads, cancel_source)
