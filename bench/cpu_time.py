"""Where the CPU goes during a timed pass: CPU seconds per process, and the machine's own.

A side-by-side throughput ratio says that one side is slower, not why. On a 2-core
machine an engine's OpenMP threads own both cores, so every CPU second anything else
spends (a worker's Celery threads, Redis, the client) or the hypervisor steals is taken
from the engine. ``metered`` snapshots, before and after the pass, the CPU time
(user + system) of each process in the given trees and of the local Redis / Valkey
server, and the machine's busy, steal and idle time from /proc/stat (psutil), so each
side's JSON carries the accounting of its own pass. It also counts each process's
involuntary context switches, summed over its threads: how often something else took a
core from it (an OpenMP thread taken off its core may stall its partner at the next
barrier, which its CPU seconds alone would not show). A process that exits during the
pass is not counted (its time is lost with it); one that starts during it counts from 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

BROKER_NAMES = ("redis-server", "valkey-server")


def _processes(roots: dict[int, str], by_root: bool = False) -> dict[int, tuple[str, psutil.Process]]:
    """Every live process of the root trees (labelled: the root by its given role, its
    descendants by their process name, which vLLM sets to its role, e.g. VLLM::EngineCore)
    and the broker's server processes. ``by_root``: a descendant's label starts with its
    root's role, and a root inside another root's tree is its own (two engines alive at
    once, one the other's grandchild, are told apart)."""
    found: dict[int, tuple[str, psutil.Process]] = {}
    for pid, role in roots.items():
        try:
            root = psutil.Process(pid)
            found[pid] = (role, root)
            below = root.children(recursive=True)
            if by_root:
                inner = {c.pid for r in below if r.pid in roots and r.pid != pid for c in r.children(recursive=True)}
                below = [c for c in below if c.pid not in roots and c.pid not in inner]
            for child in below:
                found.setdefault(child.pid, (f"{role} / {child.name()}" if by_root else child.name(), child))
        except psutil.Error:
            continue
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in BROKER_NAMES:
            found[proc.pid] = ("redis/valkey server", proc)
    return found


def _cpu_seconds(procs: dict[int, tuple[str, psutil.Process]]) -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for pid, (label, proc) in procs.items():
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        out[pid] = (label, t.user + t.system)
    return out


def _preemptions(procs: dict[int, tuple[str, psutil.Process]]) -> dict[int, int]:
    """Involuntary context switches per process, summed over its threads (psutil's
    num_ctx_switches reads only the main thread's /proc status)."""
    out: dict[int, int] = {}
    for pid in procs:
        total = 0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("nonvoluntary_ctxt_switches:"):
                            total += int(line.split()[1])
        except OSError:  # exited, or a thread exited while read: counted as far as read
            pass
        out[pid] = total
    return out


def _machine() -> dict[str, float]:
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return {"busy_s": busy, "steal_s": getattr(t, "steal", 0.0), "idle_s": t.idle + getattr(t, "iowait", 0.0)}


@contextmanager
def metered(roots: dict[int, str], by_root: bool = False) -> Iterator[dict]:
    """Yields a dict that, after the block, holds ``processes`` (label → CPU seconds
    spent during the block, processes of one label summed, largest first) and
    ``machine`` (busy / steal / idle seconds summed over all cores, and the core count),
    and ``preempted`` (label → involuntary context switches during the block).
    ``roots``: pid → role, e.g. ``{os.getpid(): "bench process"}``; ``by_root``: see
    ``_processes``."""
    out: dict = {}
    procs = _processes(roots, by_root)
    before, switches_before, machine_before = _cpu_seconds(procs), _preemptions(procs), _machine()
    yield out
    procs.update({pid: p for pid, p in _processes(roots, by_root).items() if pid not in procs})
    after, switches_after, machine_after = _cpu_seconds(procs), _preemptions(procs), _machine()
    per_label: dict[str, float] = {}
    preempted: dict[str, int] = {}
    for pid, (label, seconds) in after.items():
        spent = seconds - before.get(pid, (label, 0.0))[1]
        per_label[label] = per_label.get(label, 0.0) + spent
        switched = switches_after.get(pid, 0) - switches_before.get(pid, 0)
        preempted[label] = preempted.get(label, 0) + max(0, switched)
    out["processes"] = {k: round(v, 3) for k, v in sorted(per_label.items(), key=lambda kv: -kv[1])}
    out["preempted"] = dict(sorted(preempted.items(), key=lambda kv: -kv[1]))
    out["machine"] = {k: round(machine_after[k] - machine_before[k], 3) for k in machine_before} | {
        "cores": psutil.cpu_count() or os.cpu_count() or 0
    }


def summary(cpu: dict, top: int = 5) -> str:
    """One line: the largest CPU users of a pass, the machine's steal and idle, then the
    processes taken off a core most often."""
    procs = ", ".join(f"{k} {v:.2f}" for k, v in list(cpu["processes"].items())[:top])
    m = cpu["machine"]
    line = f"{procs}; machine busy {m['busy_s']:.1f}, steal {m['steal_s']:.2f}, idle {m['idle_s']:.1f} CPU s"
    preempted = ", ".join(f"{k} {v}" for k, v in list(cpu.get("preempted", {}).items())[:2])
    return f"{line}; preempted {preempted}" if preempted else line


def engine_split(tokens: int, wall_s: float, cpu: dict) -> dict[str, float]:
    """A pass's tok/s as the product of two factors: ``engine_cores``, how many cores its
    busiest process (the engine's compute process, e.g. VLLM::Worker) held on average,
    and ``tokens_per_engine_cpu_s``, how many tokens each of its CPU seconds produced.
    On a saturated machine what a serving layer costs shows up in the first (it takes
    cores from the engine, or makes it wait); the second moves with the machine's speed
    of the moment (a noisy neighbour, the clock), the same for either side."""
    engine_s = max(cpu["processes"].values(), default=0.0)
    if engine_s <= 0 or wall_s <= 0:
        return {"engine_cores": 0.0, "tokens_per_engine_cpu_s": 0.0}
    return {
        "engine_cores": round(engine_s / wall_s, 3),
        "tokens_per_engine_cpu_s": round(tokens / engine_s, 2),
    }
