"""One Redis's ceiling: what the fleet's own path costs as workers and clients grow.

    python -m bench.capacity [--workers 1,10,50] [--clients 1,4] [--jobs 2000]
                             [--window 16] [--max-tokens 4] [--rounds 3]

Simulated workers (bench.sim_engine: sleeps for compute; everything else real: Celery,
the heartbeat, the reaper, the job store, the prefix hints) on an embedded Valkey of the
run's own, so its counters see the fleet and nothing else. For each number of workers,
each number of clients: ``--jobs`` interactive jobs through ``Client.submit`` and the
wait for their results, ``--window`` at a time per client process (closed loop).

Reported per point, each the median of ``--rounds`` rounds with its spread:
- jobs per second completed;
- Redis commands per job and Redis CPU seconds per 1,000 jobs, from ``INFO
  commandstats`` and ``INFO cpu`` deltas, with the idle fleet's own background
  (heartbeats, reaper, sweeps: measured for 5 s before the round) subtracted, and that
  background beside it in commands per second;
- the commands that take the most (per job);
- fleet-path latency p50 / p99: a job's time from submit to its result back in the
  client, less its time in the engine (the simulated compute);
- Redis's peak used_memory above the idle fleet's, per job in flight.

The machine's own cores run the workers, the clients and Redis together: a ceiling
found here is this machine's, and Redis's share of it is its CPU seconds per job.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from collections import Counter
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
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def client_process(url: str, jobs: int, window: int, max_tokens: int, tag: str, out: Any) -> None:
    """One submitting process: ``window`` jobs in flight, each awaited by its own thread."""
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


def one_round(url: str, r: redis.Redis, args: argparse.Namespace, clients: int, tag: str) -> dict[str, Any]:
    calls0, cpu0 = counters(r)
    time.sleep(IDLE_S)  # the idle fleet's background: heartbeats, the reaper, sweeps
    calls1, cpu1 = counters(r)
    idle_calls = {k: (calls1[k] - calls0[k]) / IDLE_S for k in calls1}
    idle_cpu = (cpu1 - cpu0) / IDLE_S
    base_memory = int(r.info("memory")["used_memory"])
    per_client = args.jobs // clients
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=client_process, args=(url, per_client, args.window, args.max_tokens, f"{tag}c{i}", out))
        for i in range(clients)
    ]
    with MemoryPeak(r) as memory:
        t0 = time.monotonic()
        calls_a, cpu_a = counters(r)
        for p in procs:
            p.start()
        fleet_path = [x for _ in procs for x in out.get(timeout=3600)]
        wall = time.monotonic() - t0
        calls_b, cpu_b = counters(r)
    for p in procs:
        p.join()
    jobs = per_client * clients
    job_calls = Counter({k: (calls_b[k] - calls_a[k]) - idle_calls.get(k, 0) * wall for k in calls_b})
    fleet_path.sort()
    return {
        "jobs": jobs,
        "wall_s": wall,
        "jobs_per_s": jobs / wall,
        "commands_per_job": sum(job_calls.values()) / jobs,
        "top_commands_per_job": {k: round(v / jobs, 2) for k, v in job_calls.most_common(6)},
        "redis_cpu_s_per_1000_jobs": ((cpu_b - cpu_a) - idle_cpu * wall) / jobs * 1000,
        "idle_commands_per_s": sum(idle_calls.values()),
        "idle_top": {k: round(v, 1) for k, v in Counter(idle_calls).most_common(4)},
        "fleet_path_p50_ms": 1000 * fleet_path[len(fleet_path) // 2],
        "fleet_path_p99_ms": 1000 * fleet_path[int(len(fleet_path) * 0.99)],
        "bytes_per_job_in_flight": (memory.peak - base_memory) / (clients * args.window),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread (min, max) of each number across the rounds."""
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)):
            values = [r[key] for r in rounds]
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["top_commands_per_job"] = rounds[len(rounds) // 2]["top_commands_per_job"]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,10,50", help="simulated workers at each point")
    p.add_argument("--clients", default="1,4", help="submitting processes at each point")
    p.add_argument("--jobs", type=int, default=2000, help="jobs per round")
    p.add_argument("--window", type=int, default=16, help="jobs in flight per client")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prefill-s", type=float, default=0.02)
    p.add_argument("--token-s", type=float, default=0.01)
    p.add_argument("--capacity", type=int, default=8, help="jobs each simulated worker runs at once")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    points = []
    with tempfile.TemporaryDirectory(prefix="ib-capacity-") as d:
        broker = EmbeddedBroker(port=free_port(), data_dir=Path(d) / "valkey").start(announce=False)
        r = redis.Redis.from_url(broker.url)
        workers: list[WorkerProcess] = []
        try:
            for n_workers in [int(x) for x in args.workers.split(",")]:
                grow(workers, n_workers, broker.url, args, Path(d) / "logs")
                for clients in [int(x) for x in args.clients.split(",")]:
                    rounds = [one_round(broker.url, r, args, clients, f"w{n_workers}r{i}") for i in range(args.rounds)]
                    point = {"workers": n_workers, "clients": clients, **summary(rounds), "rounds": rounds}
                    points.append(point)
                    console.print(
                        f"{n_workers} workers, {clients} clients: {point['jobs_per_s']['median']:.0f} jobs/s, "
                        f"{point['commands_per_job']['median']:.1f} commands/job, "
                        f"fleet path p50 {point['fleet_path_p50_ms']['median']:.1f} ms"
                    )
        finally:
            for w in workers:
                w.stop(timeout=30)
            broker.stop()
    table = Table(title="capacity: simulated workers on one embedded Valkey (median of rounds, [min-max])")
    for col in ("workers", "clients", "jobs/s", "cmds/job", "Redis CPU s /1k jobs", "idle cmds/s",
                "fleet path p50 ms", "p99 ms", "B/job in flight"):  # fmt: skip
        table.add_column(col, justify="right")

    def cell(m: dict[str, float], fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(m['median'])} [{fmt.format(m['min'])}-{fmt.format(m['max'])}]"

    for pt in points:
        table.add_row(
            str(pt["workers"]), str(pt["clients"]), cell(pt["jobs_per_s"], "{:.0f}"), cell(pt["commands_per_job"]),
            cell(pt["redis_cpu_s_per_1000_jobs"], "{:.2f}"), cell(pt["idle_commands_per_s"], "{:.0f}"),
            cell(pt["fleet_path_p50_ms"]), cell(pt["fleet_path_p99_ms"]), cell(pt["bytes_per_job_in_flight"], "{:.0f}"),
        )  # fmt: skip
    console.print(table)
    for pt in points:
        console.print(f"{pt['workers']}w/{pt['clients']}c top per job: {pt['top_commands_per_job']}; "
                      f"idle per s: {pt['idle_top']}")  # fmt: skip
    console.print(f"saved {report.save('capacity', args, points=points)}")


if __name__ == "__main__":
    main()
