"""What the engines that batch jobs themselves share (PyTorch eager, ONNX Runtime): an HF
tokenizer for chat templates, a BatchQueue that forms the batches, and one scheduler
thread that runs batch after batch.

Static batching (PyTorch eager) and dynamic batching (ONNX Runtime) are the same loop
with different defaults: how many jobs a batch takes, how long a pause in arrivals closes
a forming batch and how long its oldest job waits at most (``batch_size``,
``arrival_gap_ms``, ``max_wait_ms`` in config/backends.yaml).

A batch starts with the oldest waiting request and takes more requests with the same
batch key (same sampling configuration) until it is full, or until no new one has come
for ``gap_s`` (the arrivals have paused), or ``window_s`` has passed since the oldest
one arrived. Requests with another key wait for a later batch, in order.

Why a gap and not a fixed window: jobs reach the engine one task thread at a time, a few
milliseconds apart (a worker's threads parse, record and tokenize each one first), so a
burst of 32 jobs takes tens of milliseconds to arrive. A fixed 10 ms window from the
first one cut such a burst into batches of 1-3 rows and then the rest; waiting while
they keep coming forms full batches, and a lone job still waits only ``gap_s``. A job
that already waited (behind a batch that was decoding) waits no longer.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from core.backends import OnnxSpec, PyTorchSpec
from workers.engines.base import Engine
from workers.engines.decoding import batch_key
from workers.engines.hf_tokens import HFTokenizerMixin
from workers.engines.request import EngineRequest, fail_requests

log = logging.getLogger(__name__)

T = TypeVar("T")


class BatchQueue(Generic[T]):
    def __init__(self, key: Callable[[T], Hashable]) -> None:
        self._key = key
        self._items: deque[tuple[float, T]] = deque()  # (arrival, item), oldest first
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: T) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._items.append((time.monotonic(), item))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def next_batch(self, max_size: int, gap_s: float, window_s: float | None = None) -> list[T] | None:
        """Block for the next batch; None once closed and drained. ``window_s`` (at least
        ``gap_s``; default ``gap_s``): the longest the oldest request waits for company."""
        window_s = max(gap_s, window_s if window_s is not None else gap_s)
        with self._cond:
            while not self._items:
                if self._closed:
                    return None
                self._cond.wait()
            first_at, first = self._items[0]
            key = self._key(first)
            while True:
                batch = [(at, i) for at, i in self._items if self._key(i) == key][:max_size]
                deadline = min(first_at + window_s, batch[-1][0] + gap_s)
                remaining = deadline - time.monotonic()
                if len(batch) >= max_size or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            for entry in batch:
                self._items.remove(entry)
            return [i for _, i in batch]


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

    @staticmethod
    def batch_key(request: EngineRequest) -> Hashable:
        """Which requests may share a batch (workers.engines.decoding.batch_key)."""
        return batch_key(request)

    def start_scheduler(self) -> None:
        """Call at the end of load(), once the model is ready."""
        self.queue: BatchQueue[EngineRequest] = BatchQueue(self.batch_key)
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
