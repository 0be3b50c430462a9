"""`ib worker` with the simulated engine (bench.sim_engine) in place of every backend's.

    python -m bench.sim_worker worker --backend llamacpp [any `ib worker` option]

Everything but the engine is the real worker, started as operators start it: Celery,
the queues of the backend named, the heartbeat, the reaper, the job store. The timing
comes from ``IB_SIM_PREFILL_S``, ``IB_SIM_TOKEN_S`` and ``IB_SIM_CAPACITY``. For capacity
benchmarks only (bench.capacity); users never get this engine.
"""

from __future__ import annotations

from workers import engines

SIMULATED = "bench.sim_engine:SimulatedEngine"


def main() -> None:
    for backend in engines.ENGINE_CLASSES:
        engines.ENGINE_CLASSES[backend] = SIMULATED
    from ops.cli import app

    app(prog_name="ib")


if __name__ == "__main__":
    main()
