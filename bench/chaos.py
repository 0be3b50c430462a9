"""Chaos: a batch and interactive jobs through worker kills and broker outages, counting
what was lost, doubled, stuck or run twice, and what stayed in Redis afterwards.

    python -m bench.chaos [--lines 500] [--interactive 200] [--max-tokens 8] [--outage-s 30]
                          [--kills 2] [--oom-s 30] [--gateway-stop-s 20] [--streams 64]
                          [--seed 7] [--threads 1]
    python -m bench.chaos --soak [--soak-jobs 10000] [--restart-every 1000] [--soak-files 100]

The run (defaults): two llama.cpp workers on the embedded broker (append-only, as `ib up`
starts it), the heartbeat TTL and everything else at their defaults. A batch of
``--lines`` lines is submitted, and ``--interactive`` jobs arrive one by one while it
runs. At moments drawn from ``--seed`` (within set stretches of the batch's progress): a
worker's main process is SIGKILLed ``--kills`` times (a replacement starts at once), the
broker is restarted once, it is held down for ``--outage-s`` once (longer than the
15 s heartbeat TTL), it is full for ``--oom-s`` once (its maxmemory lowered to what it
holds, under noeviction, and another client taking whatever is freed), and it is
stopped for ``--gateway-stop-s`` while ``--streams`` streams run through `ib serve`
(bench.chaos_faults). Printed, and saved as JSON under bench/results:

- lines ok / failed / lost (no record) / doubled (two records, or two outcomes);
  interactive jobs ok / lost (no answer); jobs stuck (not final at the end);
- engine runs per job (``attempts``); recomputed = runs beyond the first of jobs that no
  killed worker held when it died (those, and only those, must run again);
- deliveries of jobs that had already finished (answered from the record: no engine work);
- seconds from the last fault to the batch's end; from memory freed to the batch's next
  finished line (work resumed);
- the gateway through its stop: 503s answered (and the slowest), how each stream ended
  (an error event, not a hang), the event loop's longest stall;
- Redis keys and ``used_memory`` before the jobs and after their results expired
  (``celery.result_expires_s`` and the batch retention are shortened for the run).

The soak: ``--soak-jobs`` one-token jobs through two workers, one of them restarted
(SIGTERM, then a new process) every ``--restart-every`` jobs, and ``--soak-files`` batch
input files uploaded through `ib serve` along the way, each expiring after a minute
(``gateway.min_file_expiry_s`` lowered for it); Redis keys and memory, and the files on
disk, are sampled at each restart and once the last files have expired: bounded means
flat, not growing with the jobs or the files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench import report
from bench.chaos_faults import Filler, gateway_through_a_stop
from core.errors import JobError
from core.records import line_job_id
from core.store import keys
from dispatcher.client import Client
from ops.local.broker import EmbeddedBroker
from ops.local.processes import GatewayProcess, WorkerProcess
from ops.subprocesses import free_port

console = Console()
MODEL = "smollm2-135m"
GATEWAY_KEY = "chaos-key"
RESULT_TTL_S = 300  # results expire this long after a job ends (24 h by default)
HINT_TTL_S = 120  # prefix hints (1 h by default)
SOAK_RESULT_TTL_S = 60
SOAK_FILE_EXPIRY_S = 60  # the soak's uploads expire within it
TOPICS = ["the sea", "a cat", "winter", "bread", "a clock", "the moon", "a river", "chess", "rain", "a lamp"]


def redis_footprint(r: redis.Redis) -> dict[str, Any]:
    """Keys by kind (the part of the name before its id) and used_memory."""
    kinds: Counter[str] = Counter()
    for key in r.scan_iter(count=1000):
        name = key.decode(errors="replace")
        kinds[re.sub(r"[:.][0-9a-f]{16,}.*$|:batch_[0-9a-f]+.*$|-[0-9a-f]{8}$", ":<id>", name)] += 1
    used = r.info("memory")["used_memory"]
    return {"keys": sum(kinds.values()), "by_kind": dict(kinds.most_common()), "used_memory": used}


class Fleet:
    """The workers of the run, replaced as they are killed; what each held when it died."""

    def __init__(self, url: str, env: dict[str, str], threads: int, log_dir: Path) -> None:
        self.url, self.env, self.threads, self.log_dir = url, env, threads, log_dir
        self.workers: list[WorkerProcess] = []
        self.ever: list[WorkerProcess] = []
        self.held_at_death: set[str] = set()

    def start(self) -> WorkerProcess:
        w = WorkerProcess("llamacpp", self.url, extra_args=[f"--threads={self.threads}"], env=self.env,
                          log_dir=self.log_dir).start()  # fmt: skip
        self.workers.append(w)
        self.ever.append(w)
        return w

    def kill_one(self, r: redis.Redis, rng: random.Random) -> str:
        victim = rng.choice(self.workers)
        victim.kill()
        # what it held: its in-flight record survives it until a live worker reaps it
        self.held_at_death |= {k.decode() for k in r.hkeys(keys.inflight(victim.worker_id))}
        self.workers.remove(victim)
        self.start()
        return victim.worker_id

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def log_count(self, pattern: str) -> int:
        return sum(len(re.findall(pattern, w.log_path.read_text(errors="replace"))) for w in self.ever)


def chaos(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    run = ChaosRun(args, tmp)
    try:
        return run.run()
    finally:
        run.gateway.stop()
        run.fleet.stop()
        run.broker.stop()


class ChaosRun:
    """One chaos run: its broker (restarted by the faults), fleet, and what was asked."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.port, self.data = free_port(), tmp / "valkey"
        self.tmp = tmp
        self.broker = EmbeddedBroker(port=self.port, data_dir=self.data).start(announce=False)
        self.fleet = Fleet(self.broker.url, short_lived(), args.threads, tmp / "logs")
        self.faults: list[tuple[float, str]] = []
        self.interactive: list[str] = []
        self.answers: dict[str, str] = {}
        self.waiting = ThreadPoolExecutor(max_workers=64)  # each interactive job's caller, waiting for its answer
        self.answered: dict[str, Future] = {}
        env = {"IB_API_KEYS": GATEWAY_KEY, "IB_API_KEYS_FILE": str(tmp / "no-keys")}
        self.gateway = GatewayProcess(self.broker.url, env=env, log_dir=tmp / "logs").start()
        self.oom: dict[str, Any] = {}
        self.gateway_fault: dict[str, Any] = {}

    def run(self) -> dict[str, Any]:
        args = self.args
        for _ in range(2):
            self.fleet.start()
        for w in self.fleet.workers:
            w.wait_ready(timeout=300)
        with Client(self.broker.url, resilient=True) as client:
            before = redis_footprint(client.redis)
            src = self.tmp / "requests.jsonl"
            with src.open("w") as fh:
                for i in range(args.lines):
                    question = f"Write one sentence about {TOPICS[i % len(TOPICS)]} (note {i})."
                    fh.write(json.dumps({"custom_id": f"line-{i}", "messages": [{"role": "user", "content": question}],
                                         "max_tokens": args.max_tokens}) + "\n")  # fmt: skip
            # The window covers the run; its records expire with it (retention 0), so the
            # "after" footprint can be measured within the run.
            batch = client.batches.create(src, model=MODEL, completion_window=f"{args.window_s}s")
            started = time.monotonic()
            asker = threading.Thread(target=self.ask, args=(client,), daemon=True)
            asker.start()
            self.inject(client, batch.id, started)
            last_fault = time.monotonic()
            final = self.await_final(client, batch.id, started)
            batch_end = time.monotonic()
            asker.join(timeout=args.timeout_s)
            self.collect_answers()
            result = self.tally(client, batch.id, final)
            result |= {"last_fault_to_batch_end_s": round(batch_end - last_fault, 1), "redis_before": before}
            result |= {"oom": self.oom, "gateway_stop": self.gateway_fault}
            # After every result and the batch's records have expired.
            purge_in = final.expires_at + 2 - time.time() if final else 0
            wait = max(max(RESULT_TTL_S, HINT_TTL_S) + 5 - (time.monotonic() - batch_end), purge_in, 0)
            console.print(f"waiting {wait:.0f} s for results and the batch to expire...")
            time.sleep(wait)
            result["redis_after"] = redis_footprint(client.redis)
            result["live_workers"] = len(self.fleet.workers)
            return result

    def ask(self, client: Client) -> None:
        """Interactive jobs, one by one, while the batch runs."""
        for i in range(self.args.interactive):
            try:
                messages = [{"role": "user", "content": f"Say hi to {i}."}]
                h = client.submit(model=MODEL, messages=messages, sampling={"max_tokens": 4}, priority="interactive")
                self.interactive.append(h.id)
                self.answered[h.id] = self.waiting.submit(h.result, 600)
            except redis.RedisError:
                self.answers[f"submit-{i}"] = "refused"  # the broker was down at submit: the caller saw an error
            time.sleep(self.args.interactive_every_s)

    def inject(self, client: Client, batch_id: str, started: float) -> None:
        """Each fault at a moment drawn within its stretch of the batch's progress."""
        args, rng = self.args, self.rng

        def done() -> float:
            try:
                return client.batches.retrieve(batch_id).done / args.lines
            except redis.RedisError:
                return 0.0

        plan = [("kill", rng.uniform(0.05, 0.2)), ("kill", rng.uniform(0.25, 0.4))][: args.kills]
        plan += [("restart", rng.uniform(0.45, 0.5)), ("outage", rng.uniform(0.55, 0.6))]
        plan += [("oom", rng.uniform(0.65, 0.7)), ("gateway", rng.uniform(0.75, 0.8))]
        for kind, at in plan:
            while done() < at:
                time.sleep(0.1)
            t = time.monotonic() - started
            if kind == "kill":
                self.faults.append((t, f"SIGKILL {self.fleet.kill_one(client.redis, rng)}"))
                continue
            if kind == "oom":
                self.full_redis(client, batch_id, done)
                self.faults.append((t, f"Redis full {args.oom_s:g} s"))
                continue
            if kind == "gateway":
                self.gateway_stop()
                self.faults.append((t, f"broker stop {args.gateway_stop_s:g} s under {args.streams} gateway streams"))
                continue
            self.broker.server.stop()
            if kind == "outage":
                time.sleep(args.outage_s)
            self.broker = EmbeddedBroker(port=self.port, data_dir=self.data).start(announce=False)
            self.faults.append((t, f"broker {kind}" + (f" {args.outage_s:g} s" if kind == "outage" else "")))

    def full_redis(self, client: Client, batch_id: str, done: Callable[[], float]) -> None:
        """Redis full for ``--oom-s``: maxmemory lowered to what it holds now (noeviction, as
        the embedded broker runs), another client keeping it full; then memory is freed
        and the seconds to the batch's next finished line are the time to resume."""
        r = client.redis
        old = r.config_get("maxmemory")["maxmemory"]
        r.config_set("maxmemory", r.info("memory")["used_memory"] + (8 << 20))
        try:
            with Filler(self.broker.url):
                time.sleep(self.args.oom_s)
                progress = done()
        finally:
            r.config_set("maxmemory", old)
        freed = time.monotonic()
        while done() <= progress and time.monotonic() - freed < 120:
            time.sleep(0.05)
        self.oom = {"seconds": self.args.oom_s, "freed_to_resumed_s": round(time.monotonic() - freed, 2)}

    def gateway_stop(self) -> None:
        """The broker stopped for ``--gateway-stop-s`` while ``--streams`` run through `ib serve`."""

        def stop() -> None:
            self.broker.server.stop()

        def start() -> None:
            self.broker = EmbeddedBroker(port=self.port, data_dir=self.data).start(announce=False)

        url = self.gateway.url
        self.gateway_fault = gateway_through_a_stop(
            url, GATEWAY_KEY, MODEL, stop, start, self.args.streams, self.args.gateway_stop_s
        )

    def await_final(self, client: Client, batch_id: str, started: float) -> Any:
        """The batch once it has ended (None: not within the run's time-out)."""
        while time.monotonic() - started < self.args.timeout_s:
            try:
                b = client.batches.retrieve(batch_id)
                if b.is_final:
                    return b
            except redis.RedisError:
                pass
            time.sleep(0.5)
        return None

    def collect_answers(self) -> None:
        for job_id, future in self.answered.items():
            try:
                self.answers[job_id] = future.result().status
            except (JobError, TimeoutError, redis.RedisError) as exc:  # a lost job: the count says so
                self.answers[job_id] = f"lost: {type(exc).__name__}"
        self.waiting.shutdown()

    def tally(self, client: Client, batch_id: str, final: Any) -> dict[str, Any]:
        """Lost, doubled, stuck and recomputed, from the batch's records and the job records."""
        args, fleet, answers = self.args, self.fleet, self.answers
        records = list(client.batches.results(batch_id))
        per_line = Counter(r["custom_id"] for r in records)
        ids = [line_job_id(batch_id, n) for n in range(1, args.lines + 1)] + self.interactive
        jobs = {i: client.record(i) for i in ids}
        attempts = {i: int(j.get("attempts", 0)) for i, j in jobs.items()}
        return {
            "faults": [{"at_s": round(t, 1), "what": w} for t, w in self.faults],
            "batch": {
                "status": final.status if final else "not final",
                "ok": sum(1 for r in records if r["error"] is None),
                "failed": sum(1 for r in records if r["error"] is not None),
                "lost": args.lines - len(per_line),
                "doubled": sum(1 for n in per_line.values() if n > 1)
                + sum(1 for i in ids[: args.lines] if int(jobs[i].get("completions", 0)) > 1),
            },
            "interactive": {
                "ok": sum(1 for s in answers.values() if s == "completed"),
                "refused_at_submit": sum(1 for s in answers.values() if s == "refused"),
                "lost": sum(1 for s in answers.values() if s.startswith("lost")),
            },
            "stuck": sum(1 for j in jobs.values() if j and "final" not in j),
            "engine_runs": sum(attempts.values()),
            "jobs": len(ids),
            "held_by_killed_workers": len(fleet.held_at_death),
            "rerun_held": sum(a - 1 for i, a in attempts.items() if a > 1 and i in fleet.held_at_death),
            "recomputed": sum(a - 1 for i, a in attempts.items() if a > 1 and i not in fleet.held_at_death),
            "redelivered_finished": fleet.log_count(r"already finished \("),
            "duplicate_deliveries_waited": fleet.log_count(r"this delivery waits for its outcome"),
            "workers_reaped_alive": fleet.log_count(r"is gone: redelivered") - args.kills,
        }


def gateway_rows(g: dict[str, Any]) -> list[tuple[str, str]]:
    """The gateway's stop, as table rows."""
    if not g:
        return [("gateway through a Redis stop", "not run")]
    return [
        (
            f"gateway: requests during the {g['stop_s']:g} s stop → 503 (slowest)",
            f"{g['answered_503']} of {g['requests_during_stop']} ({g['slowest_503_s']} s); other {g['other_answers']}",
        ),
        (f"gateway: {g['streams']} streams ended", f"{g['stream_endings']}; hung {g['streams_hung']}"),
        ("gateway: event loop's longest stall", f"{g['event_loop_max_stall_s']} s"),
    ]


def short_lived(result_ttl_s: int = RESULT_TTL_S) -> dict[str, str]:
    """Results, hints and the batch expire within the run (here and in the workers), so
    the footprint after it shows what would stay for good."""
    env = {
        "IB_CELERY_RESULT_EXPIRES_S": str(result_ttl_s),
        "IB_PREFIX_HINT_TTL_S": str(HINT_TTL_S),
        "IB_BATCH_RETENTION_S": "0",
    }
    os.environ.update(env)
    return env


def files_on_disk(root: Path) -> dict[str, int]:
    """Uploaded files' bytes where the gateway keeps them (its ``files_url``)."""
    found = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    return {"files_on_disk": len(found), "file_bytes_on_disk": sum(p.stat().st_size for p in found)}


def upload_files(sdk: Any, count: int, tag: str) -> None:
    """``count`` batch input files (150 lines, ~37 KB each) uploaded through ``/v1/files``,
    each expiring after ``SOAK_FILE_EXPIRY_S``: what a user of the Batch API leaves behind."""
    import io

    for i in range(count):
        lines = "".join(
            json.dumps({"custom_id": f"{tag}-{i}-{n}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Line {n} " + "x" * 80}]}})
            + "\n"
            for n in range(150)
        )  # fmt: skip
        sdk.files.create(
            file=(f"{tag}-{i}.jsonl", io.BytesIO(lines.encode())),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": SOAK_FILE_EXPIRY_S},
        )


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Jobs through two workers restarted in turn, and files uploaded through `ib serve`
    with a short expiry: Redis's keys and memory, and the files' bytes, sampled at each
    restart and once the last files have expired."""
    from openai import OpenAI

    broker = EmbeddedBroker(port=free_port(), data_dir=tmp / "valkey").start(announce=False)
    env = short_lived(SOAK_RESULT_TTL_S)  # a plateau within the soak: keys live a minute
    files_root = tmp / "files"
    gateway_env = {
        "IB_API_KEYS": GATEWAY_KEY,
        "IB_API_KEYS_FILE": str(tmp / "no-keys"),
        "IB_GATEWAY_FILES_URL": str(files_root),
        "IB_GATEWAY_MIN_FILE_EXPIRY_S": str(SOAK_FILE_EXPIRY_S),  # OpenAI's minimum is an hour
    }
    gateway = GatewayProcess(broker.url, env=gateway_env, log_dir=tmp / "logs").start()
    sdk = OpenAI(base_url=f"{gateway.url}/v1", api_key=GATEWAY_KEY)
    fleet = Fleet(broker.url, env, args.threads, tmp / "logs")
    chunks = -(-args.soak_jobs // args.restart_every)
    per_chunk = -(-args.soak_files // chunks) if args.soak_files else 0
    samples, uploaded = [], 0

    def sample(client: Client, jobs: int, t0: float) -> dict[str, Any]:
        s = {"jobs": jobs, "files": uploaded, "s": round(time.monotonic() - t0, 1), **redis_footprint(client.redis),
             **files_on_disk(files_root)}  # fmt: skip
        samples.append(s)
        console.print(f"{jobs} jobs, {uploaded} files: {s['keys']} keys, {s['used_memory'] / 2**20:.1f} MiB, "
                      f"{s['files_on_disk']} files on disk")  # fmt: skip
        return s

    try:
        for _ in range(2):
            fleet.start()
        for w in fleet.workers:
            w.wait_ready(timeout=300)
        with Client(broker.url) as client:
            t0, sent, lost = time.monotonic(), 0, 0
            sample(client, 0, t0)
            while sent < args.soak_jobs:
                chunk = min(args.restart_every, args.soak_jobs - sent)
                n_files = min(per_chunk, args.soak_files - uploaded)
                upload_files(sdk, n_files, f"soak{sent}")
                uploaded += n_files
                handles = []
                for start in range(0, chunk, 100):
                    jobs = [{"model": MODEL, "prompt": f"Number {sent + start + i}:", "sampling": {"max_tokens": 1},
                             "backend": "llamacpp"} for i in range(min(100, chunk - start))]  # fmt: skip
                    handles += client.submit_many(jobs)
                for h in handles:
                    try:
                        h.result(timeout=300)
                    except (JobError, TimeoutError, redis.RedisError):
                        lost += 1
                sent += chunk
                old = fleet.workers.pop(0)
                old.stop()  # a restart: SIGTERM, then a new process
                fleet.start().wait_ready(timeout=300)
                sample(client, sent, t0)
            # the last files expire, and the gateway's prune (each minute) deletes their bytes
            deadline = time.monotonic() + SOAK_FILE_EXPIRY_S + 180
            while time.monotonic() < deadline and (files_on_disk(files_root)["files_on_disk"] or
                                                   any(client.redis.scan_iter("ib:file:*", count=1000))):  # fmt: skip
                time.sleep(5)
            after = sample(client, sent, t0)
            after["after_expiry"] = True
        return {"samples": samples, "lost": lost, "files_uploaded": uploaded, "file_expiry_s": SOAK_FILE_EXPIRY_S}
    finally:
        fleet.stop()
        gateway.stop()
        broker.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=500)
    p.add_argument("--interactive", type=int, default=200)
    p.add_argument("--interactive-every-s", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--oom-s", type=float, default=30.0, help="how long Redis stays full")
    p.add_argument("--gateway-stop-s", type=float, default=20.0, help="the Redis stop under the gateway's streams")
    p.add_argument("--streams", type=int, default=64, help="streams open through `ib serve` during that stop")
    p.add_argument("--window-s", type=int, default=420, help="the batch's completion window (its records expire after)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads per worker")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--soak", action="store_true")
    p.add_argument("--soak-jobs", type=int, default=10_000)
    p.add_argument("--restart-every", type=int, default=1000)
    p.add_argument("--soak-files", type=int, default=100, help="files uploaded through `ib serve` during the soak")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ib-chaos-") as d:
        if args.soak:
            out = soak(args, Path(d))
            table = Table(title="soak: Redis while jobs and files flow (a worker restarted at each row)")
            for col in ("jobs", "files uploaded", "keys", "used_memory MiB", "files on disk", "file KiB on disk"):
                table.add_column(col, justify="right")
            for s in out["samples"]:
                jobs = f"{s['jobs']} (files expired)" if s.get("after_expiry") else str(s["jobs"])
                table.add_row(jobs, str(s["files"]), str(s["keys"]), f"{s['used_memory'] / 2**20:.1f}",
                              str(s["files_on_disk"]), f"{s['file_bytes_on_disk'] / 1024:.0f}")  # fmt: skip
            console.print(table)
            console.print(f"lost: {out['lost']}")
            console.print(f"saved {report.save('chaos-soak', args, **out)}")
            return
        out = chaos(args, Path(d))
    table = Table(title="chaos: two llama.cpp workers, embedded broker")
    table.add_column("measure")
    table.add_column("value", justify="right")
    b, i = out["batch"], out["interactive"]
    rows = [
        ("faults", "; ".join(f"{f['what']} at {f['at_s']} s" for f in out["faults"])),
        ("batch lines ok / failed / lost / doubled", f"{b['ok']} / {b['failed']} / {b['lost']} / {b['doubled']}"),
        ("interactive ok / refused at submit / lost", f"{i['ok']} / {i['refused_at_submit']} / {i['lost']}"),
        ("jobs stuck", str(out["stuck"])),
        ("engine runs / jobs", f"{out['engine_runs']} / {out['jobs']}"),
        ("runs again of jobs a killed worker held", f"{out['rerun_held']} (held: {out['held_by_killed_workers']})"),
        ("recomputed (any other job run twice)", str(out["recomputed"])),
        ("finished jobs delivered again", str(out["redelivered_finished"])),
        ("duplicate deliveries that waited", str(out["duplicate_deliveries_waited"])),
        ("live workers reaped", str(out["workers_reaped_alive"])),
        ("last fault → batch end", f"{out['last_fault_to_batch_end_s']} s"),
        ("Redis full: memory freed → work resumed", f"{out['oom'].get('freed_to_resumed_s')} s"),
        *gateway_rows(out["gateway_stop"]),
        ("Redis keys before → after", f"{out['redis_before']['keys']} → {out['redis_after']['keys']}"),
        (
            "Redis used_memory before → after",
            f"{out['redis_before']['used_memory'] / 2**20:.1f} → {out['redis_after']['used_memory'] / 2**20:.1f} MiB",
        ),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"keys after, by kind: {out['redis_after']['by_kind']}")
    console.print(f"saved {report.save('chaos', args, **out)}")


if __name__ == "__main__":
    main()
