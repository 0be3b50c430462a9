"""One Redis's ceiling: what the fleet's own path costs as workers and clients grow.

    python -m bench.capacity [--workers 1,10,50] [--clients 1,4] [--jobs 2000]
                             [--batch-lines 2000] [--window 16] [--max-tokens 4] [--rounds 3]

Simulated workers (bench.sim_engine: sleeps for compute; everything else real: Celery,
the heartbeat, the reaper, the job store, the prefix hints) on an embedded Valkey of the
run's own, so its counters see the fleet and nothing else. For each number of workers:
for each number of clients, ``--jobs`` interactive jobs through ``Client.submit`` and
the wait for their results, ``--window`` at a time per client process (closed loop);
then one batch of ``--batch-lines`` lines, from ``batches.create`` to its completion.

Reported per point, each the median of ``--rounds`` rounds with its spread (a unit is a
job or a batch line):
- units per second completed;
- Redis commands per unit and Redis CPU seconds per 1,000 units, from ``INFO
  commandstats`` (this benchmark's own INFO calls left out) and ``INFO cpu`` deltas,
  less the idle fleet's own background (heartbeats, reaper, sweeps), measured for 5 s
  before the round and shown beside it in commands per second;
- the commands that take the most, per unit;
- fleet-path latency p50 / p99 (interactive): a job's time from submit to its result
  back in the client, less its time in the engine (the simulated compute);
- Redis's peak used_memory above the idle fleet's, per unit in flight (finished results
  kept for their TTL included: an upper bound, not one job's cost).

The machine's own cores run the workers, the clients and Redis together: a ceiling
found here is this machine's, and Redis's share of it is its CPU seconds per unit.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench import report
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from ops.subprocesses import free_port

console = Console()
MODEL = "smollm2-135m"
IDLE_S = 5.0


class SimWorkerProcess(WorkerProcess):
    """`ib worker` through bench.sim_worker: the simulated engine in place of the backend's."""

    module = "bench.sim_worker"


def sim_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "IB_SIM_PREFILL_S": str(args.prefill_s),
        "IB_SIM_TOKEN_S": str(args.token_s),
        "IB_SIM_CAPACITY": str(args.capacity),
        "IB_METRICS_PORT": "0",  # 200 workers need no 200 /metrics ports
    }


def counters(r: redis.Redis) -> tuple[Counter[str], float]:
    """Calls per command, and Redis's CPU seconds so far."""
    stats = r.info("commandstats")
    calls = Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})
    del calls["info"]  # this benchmark's own sampling
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def client_process(url: str, jobs: int, window: int, max_tokens: int, tag: str, go: Any, out: Any) -> None:
    """One submitting process: ready (imports done, connected), then on ``go`` ``jobs``
    jobs with ``window`` in flight, each awaited by its own thread."""
    from dispatcher.client import Client

    fleet_path: list[float] = []
    with Client(url) as client:

        def one(i: int) -> None:
            t0 = time.time()
            r = client.submit(
                {
                    "model": MODEL,
                    "prompt": f"{tag} job {i}",
                    "sampling": {"max_tokens": max_tokens},
                    "backend": "llamacpp",
                }  # fmt: skip
            ).result(timeout=600)
            engine_s = (r.timings.finished or t0) - (r.timings.started or t0)
            fleet_path.append(time.time() - t0 - engine_s)

        client.workers()  # the fleet view read once, as a long-lived client holds it
        out.put("ready")
        go.wait()
        with ThreadPoolExecutor(window) as pool:
            list(pool.map(one, range(jobs)))
    out.put(fleet_path)


class MemoryPeak:
    """Redis's highest used_memory while the round runs (sampled every 50 ms)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r, self.peak, self._stop = r, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, int(self.r.info("memory")["used_memory"]))

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def metered(r: redis.Redis, run: Callable[[], list[float]], units: int, in_flight: int) -> dict[str, Any]:
    """``run`` (returns each unit's fleet-path seconds) with Redis's counters read around it,
    less the idle fleet's own background measured for ``IDLE_S`` just before."""
    calls0, cpu0 = counters(r)
    time.sleep(IDLE_S)  # the idle fleet's background: heartbeats, the reaper, sweeps
    calls1, cpu1 = counters(r)
    idle_calls = {k: (calls1[k] - calls0[k]) / IDLE_S for k in calls1}
    idle_cpu = (cpu1 - cpu0) / IDLE_S
    base_memory = int(r.info("memory")["used_memory"])
    with MemoryPeak(r) as memory:
        calls_a, cpu_a = counters(r)
        t0 = time.monotonic()
        fleet_path = sorted(run())
        wall = time.monotonic() - t0
        calls_b, cpu_b = counters(r)
    job_calls = Counter({k: (calls_b[k] - calls_a[k]) - idle_calls.get(k, 0) * wall for k in calls_b})
    return {
        "units": units,
        "wall_s": wall,
        "per_s": units / wall,
        "commands_per_unit": sum(job_calls.values()) / units,
        "top_commands_per_unit": {k: round(v / units, 2) for k, v in job_calls.most_common(6)},
        "redis_cpu_s_per_1000": ((cpu_b - cpu_a) - idle_cpu * wall) / units * 1000,
        "idle_commands_per_s": sum(idle_calls.values()),
        "idle_top": {k: round(v, 1) for k, v in Counter(idle_calls).most_common(4)},
        "fleet_path_p50_ms": 1000 * fleet_path[len(fleet_path) // 2] if fleet_path else None,
        "fleet_path_p99_ms": 1000 * fleet_path[int(len(fleet_path) * 0.99)] if fleet_path else None,
        "bytes_per_unit_in_flight": (memory.peak - base_memory) / in_flight,
    }


def interactive_round(url: str, r: redis.Redis, args: argparse.Namespace, clients: int, tag: str) -> dict[str, Any]:
    """``--jobs`` interactive jobs from ``clients`` processes, started and connected first."""
    per_client = args.jobs // clients
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=client_process, args=(url, per_client, args.window, args.max_tokens, f"{tag}c{i}", go, out))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=120) == "ready"

    def run() -> list[float]:
        go.set()
        return [x for _ in procs for x in out.get(timeout=3600)]

    try:
        return metered(r, run, per_client * clients, clients * args.window)
    finally:
        for p in procs:
            p.join(timeout=60)


def batch_round(client: Any, r: redis.Redis, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One batch of ``--batch-lines`` lines: staged, fed, run and recorded; its wall time
    runs from ``create`` to the batch's completion (no fleet-path latency per line)."""
    lines = [
        {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"{tag} line {i}"}],
                  "max_tokens": args.max_tokens, "backend": "llamacpp"}}
        for i in range(args.batch_lines)
    ]  # fmt: skip

    def run() -> list[float]:
        batch = client.batches.create(lines, model=MODEL)
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        if batch.request_counts.completed != args.batch_lines:
            raise RuntimeError(f"batch {batch.id}: {batch.status}, {batch.request_counts}")
        return []

    return metered(r, run, args.batch_lines, args.batch_lines)


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread (min, max) of each number across the rounds."""
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)):
            values = [r[key] for r in rounds]
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["top_commands_per_unit"] = rounds[len(rounds) // 2]["top_commands_per_unit"]
    out["idle_top"] = rounds[len(rounds) // 2]["idle_top"]
    return out


def grow(workers: list[WorkerProcess], to: int, url: str, args: argparse.Namespace, logs: Path) -> None:
    """Start simulated workers until there are ``to``; they load in parallel."""
    new = [
        SimWorkerProcess(
            "llamacpp", url, extra_args=["--threads=1"], env=sim_env(args), log_dir=logs
        ).start()  # fmt: skip
        for _ in range(to - len(workers))
    ]
    for w in new:
        w.wait_ready(timeout=600)
    workers += new


def cell(m: dict[str, float] | None, fmt: str = "{:.1f}") -> str:
    if m is None:
        return "-"
    return f"{fmt.format(m['median'])} [{fmt.format(m['min'])}-{fmt.format(m['max'])}]"


def show(points: list[dict[str, Any]]) -> None:
    table = Table(title="capacity: simulated workers on one embedded Valkey (median of rounds, [min-max])")
    for col in ("work", "workers", "clients", "per s", "cmds/unit", "Redis CPU s /1k", "idle cmds/s",
                "fleet path p50 ms", "p99 ms", "peak mem B/in flight"):  # fmt: skip
        table.add_column(col, justify="right")
    for pt in points:
        table.add_row(
            pt["work"], str(pt["workers"]), str(pt["clients"]), cell(pt["per_s"], "{:.0f}"),
            cell(pt["commands_per_unit"]), cell(pt["redis_cpu_s_per_1000"], "{:.2f}"),
            cell(pt["idle_commands_per_s"], "{:.0f}"), cell(pt.get("fleet_path_p50_ms")),
            cell(pt.get("fleet_path_p99_ms")), cell(pt["bytes_per_unit_in_flight"], "{:.0f}"),
        )  # fmt: skip
    console.print(table)
    for pt in points:
        console.print(f"{pt['work']} {pt['workers']}w/{pt['clients']}c, per unit: {pt['top_commands_per_unit']}; "
                      f"idle per s: {pt['idle_top']}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,10,50", help="simulated workers at each point")
    p.add_argument("--clients", default="1,4", help="submitting processes at each point")
    p.add_argument("--jobs", type=int, default=2000, help="interactive jobs per round")
    p.add_argument("--batch-lines", type=int, default=2000, help="lines of the batch per round (0: none)")
    p.add_argument("--window", type=int, default=16, help="jobs in flight per client")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prefill-s", type=float, default=0.02)
    p.add_argument("--token-s", type=float, default=0.01)
    p.add_argument("--capacity", type=int, default=8, help="jobs each simulated worker runs at once")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    from dispatcher.client import Client

    points: list[dict[str, Any]] = []

    def record(work: str, n_workers: int, clients: int, rounds: list[dict[str, Any]]) -> None:
        point = {"work": work, "workers": n_workers, "clients": clients, **summary(rounds), "rounds": rounds}
        points.append(point)
        console.print(f"{work}: {n_workers} workers, {clients} clients: {point['per_s']['median']:.0f}/s, "
                      f"{point['commands_per_unit']['median']:.1f} commands each")  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="ib-capacity-") as d:
        broker = EmbeddedBroker(port=free_port(), data_dir=Path(d) / "valkey").start(announce=False)
        r = redis.Redis.from_url(broker.url)
        workers: list[WorkerProcess] = []
        try:
            with Client(broker.url) as client:
                for n_workers in [int(x) for x in args.workers.split(",")]:
                    grow(workers, n_workers, broker.url, args, Path(d) / "logs")
                    for clients in [int(x) for x in args.clients.split(",")]:
                        rounds = [interactive_round(broker.url, r, args, clients, f"w{n_workers}c{clients}r{i}")
                                  for i in range(args.rounds)]  # fmt: skip
                        record("interactive", n_workers, clients, rounds)
                    if args.batch_lines:
                        rounds = [batch_round(client, r, args, f"w{n_workers}b{i}") for i in range(args.rounds)]
                        record("batch lines", n_workers, 1, rounds)
        finally:
            for w in workers:
                w.stop(timeout=30)
            broker.stop()
    show(points)
    console.print(f"saved {report.save('capacity', args, points=points)}")


if __name__ == "__main__":
    main()
