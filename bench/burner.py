"""A contender for bench.contention: burns CPU in bursts beside an engine.

Started before the pass (its interpreter's start-up is not the engine's contention), it
prints ``ready``, waits for a line on stdin, then burns ``intake_jobs`` bursts of
``intake_ms`` (a 2 ms pause after each, as jobs arrive), then a burst of ``tick_ms``
every ``tick_every_ms`` until it is killed.

    python -m bench.burner INTAKE_JOBS INTAKE_MS TICK_MS TICK_EVERY_MS
"""

from __future__ import annotations

import sys
import time


def burn(seconds: float) -> None:
    """Spin for this much of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def contend(intake_jobs: int, intake_ms: float, tick_ms: float, tick_every_ms: float) -> None:
    for _ in range(intake_jobs):
        burn(intake_ms / 1000)
        time.sleep(0.002)
    while True:
        burn(tick_ms / 1000)
        time.sleep(max(0.0, tick_every_ms - tick_ms) / 1000)


if __name__ == "__main__":
    print("ready", flush=True)
    sys.stdin.readline()
    contend(int(sys.argv[1]), *(float(x) for x in sys.argv[2:5]))
