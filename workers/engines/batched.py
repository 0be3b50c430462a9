"""What the engines that batch jobs themselves share: an HF tokenizer for chat templates,
a BatchQueue, and one scheduler thread that runs batch after batch.

Static batching (PyTorch eager) and dynamic batching (ONNX Runtime) are the same loop
with different defaults: how many jobs a batch takes, how long a pause in arrivals closes
a forming batch and how long its oldest job waits at most (``batch_size``,
``arrival_gap_ms``, ``max_wait_ms`` in config/backends.yaml).
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from typing import Any, TypeVar

from dispatcher.registry import OnnxSpec, PyTorchSpec
from workers.engines.base import Engine
from workers.engines.batching import BatchQueue
from workers.engines.decoding import batch_key
from workers.engines.hf_tokens import HFTokenizerMixin
from workers.engines.request import EngineRequest, fail_requests

log = logging.getLogger(__name__)

BatchedSpec = TypeVar("BatchedSpec", PyTorchSpec, OnnxSpec)


class BatchedEngine(HFTokenizerMixin, Engine[BatchedSpec]):
    batching = "static"

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def arrival_gap_s(self) -> float:
        return self.config.arrival_gap_ms / 1000

    @property
    def max_wait_s(self) -> float:
        return self.config.max_wait_ms / 1000

    @property
    def capacity(self) -> int:
        # One batch decoding and one filling up behind it.
        return 2 * self.batch_size

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "batching": self.batching,
            "batch_size": self.batch_size,
            "arrival_gap_ms": self.arrival_gap_s * 1000,
            "max_wait_ms": self.max_wait_s * 1000,
        }

    def start_scheduler(self) -> None:
        """Call at the end of load(), once the model is ready."""
        self.queue: BatchQueue[EngineRequest] = BatchQueue(batch_key)
        self._thread = threading.Thread(target=self._loop, name=f"{self.backend}-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if hasattr(self, "queue"):
            self.queue.close()
            self._thread.join(timeout=30)

    def submit(self, request: EngineRequest) -> None:
        self.queue.put(request)

    def _loop(self) -> None:
        while (batch := self.queue.next_batch(self.batch_size, self.arrival_gap_s, self.max_wait_s)) is not None:
            try:
                batch = self.drop_cancelled(batch)  # cancelled while waiting: never reaches the model
                if batch:
                    self.run_batch(batch)
            except Exception as exc:  # a bad batch must not stop the engine
                log.exception("batch of %d failed", len(batch))
                fail_requests(batch, exc)

    @abstractmethod
    def run_batch(self, batch: list[EngineRequest]) -> None:
        """Decode one batch; every request's future must be completed (BatchProgress does)."""
