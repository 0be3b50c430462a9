"""bench.cpu_time: the CPU accounting each side-by-side pass carries in its JSON."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from bench.cpu_time import engine_split, metered, summary

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_the_root_counts_under_its_role_and_a_child_that_exits_inside_the_block_is_not_added() -> None:
    with metered({os.getpid(): "this test"}) as cpu:
        burner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.4)])
        burner.wait(timeout=60)  # exits inside the block: its time is lost, as documented
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
    assert cpu["processes"]["this test"] >= 0.25  # the root's own spin
    assert cpu["processes"]["this test"] < 0.65  # the exited burner's 0.4 s is not added to it
    assert cpu["machine"]["busy_s"] >= 0.25
    assert cpu["machine"]["cores"] == (os.cpu_count() or 0)
    assert "this test" in summary(cpu)
    assert "; preempted " in summary(cpu)


def test_a_descendant_alive_through_the_block_is_counted_by_its_process_name() -> None:
    burner = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.3)\n" + SPIN.format(s=0.4) + "time.sleep(30)"]
    )
    try:
        with metered({os.getpid(): "this test"}) as cpu:
            time.sleep(1.5)
    finally:
        burner.kill()
        burner.wait()
    name = next(k for k in cpu["processes"] if k != "this test" and "server" not in k)
    assert cpu["processes"][name] >= 0.3


def test_the_split_multiplies_back_to_the_pass_rate_and_takes_the_busiest_process_as_the_engine() -> None:
    cpu = {"processes": {"VLLM::Worker": 28.0, "worker process": 0.8, "redis/valkey server": 0.1}, "machine": {}}
    split = engine_split(3024, 15.0, cpu)
    assert split["engine_cores"] == round(28.0 / 15.0, 3)
    assert split["tokens_per_engine_cpu_s"] == round(3024 / 28.0, 2)
    assert abs(split["engine_cores"] * split["tokens_per_engine_cpu_s"] - 3024 / 15.0) < 0.1
    assert engine_split(10, 1.0, {"processes": {}, "machine": {}}) == {
        "engine_cores": 0.0,
        "tokens_per_engine_cpu_s": 0.0,
    }


def test_processes_sharing_one_core_count_the_times_they_were_taken_off_it() -> None:
    # Two spinners pinned to one core: the scheduler takes each off it every few ms. A
    # sleeper beside them is never preempted. A meter that read no thread's counts, or
    # counted voluntary switches (the sleeper's), fails here.
    core = sorted(os.sched_getaffinity(0))[0]
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\n" + SPIN.format(s=1.5)
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with metered({os.getpid(): "this test"}) as cpu:
            time.sleep(1.0)
    finally:
        for p in (*spinners, sleeper):
            p.kill()
            p.wait()
    spinner_label = os.path.basename(sys.executable)
    assert cpu["preempted"].get(spinner_label, 0) >= 20
    assert cpu["preempted"].get("sleep", 0) <= 2


def test_by_root_labels_each_process_with_its_own_roots_role_when_one_root_is_inside_another() -> None:
    # bench.paired: the fleet's worker is a child of the bench process, and both run an
    # engine whose processes have the same names. With ``by_root`` the worker's
    # grandchild spinner counts under the worker's role, not the outer root's.
    grandchild = "import time; time.sleep(0.3)\n" + SPIN.format(s=0.5) + "time.sleep(30)"
    spawn = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {grandchild!r}])\ntime.sleep(30)"
    inner = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        time.sleep(0.2)  # the grandchild exists before the meter looks
        with metered({os.getpid(): "outer", inner.pid: "inner"}, by_root=True) as cpu:
            time.sleep(1.5)
    finally:
        for child in psutil.Process(inner.pid).children(recursive=True):
            child.kill()
        inner.kill()
        inner.wait()
    spent = cpu["processes"]
    assert sum(v for k, v in spent.items() if k.startswith("inner / ")) >= 0.35
    assert sum(v for k, v in spent.items() if k.startswith("outer")) < 0.2
