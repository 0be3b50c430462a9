"""bench.burner, the contender of bench.contention: it must spend what it is told to,
after the go, and keep ticking rather than spin flat out."""

import subprocess
import sys
import time

import psutil


def test_the_burner_spends_its_intake_bursts_after_the_go_then_ticks():
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.burner", "5", "20", "2", "100"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        ps = psutil.Process(proc.pid)
        before = sum(ps.cpu_times()[:2])
        time.sleep(0.3)
        assert sum(ps.cpu_times()[:2]) - before < 0.05  # nothing burnt before the go
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(1.2)
        spent = sum(ps.cpu_times()[:2]) - before
        # 5 x 20 ms of intake, then ~2 ms per 100 ms: ~0.12 s, far from 1.2 s of spinning
        assert 0.09 <= spent <= 0.4, spent
        assert proc.poll() is None  # still ticking until killed
    finally:
        proc.kill()
        proc.wait()


def test_the_contention_report_counts_only_the_engines_processes(tmp_path):
    import argparse
    import json

    import pytest

    from bench import contention

    def side(tok_s: float, wall_s: float, engine: float, spent: float = 0.0) -> dict:
        processes = {
            "bench process (in-process engine)": 0.2,  # the front end: not the engine
            "bench process (in-process engine) / VLLM::Worker": engine,
            "bench process (in-process engine) / VLLM::EngineCore": 0.3,
        }
        return {"tok_s": tok_s, "wall_s": wall_s, "contender_cpu_s": spent, "cpu": {"processes": processes}}

    pairs = [{"quiet": side(300, 10.0, 19.0), "contended": side(285, 10.5, 19.5, 0.5)}]
    assert contention.report(argparse.Namespace(prompts=64, out=str(tmp_path)), pairs) == 0
    saved = json.loads(next(tmp_path.glob("contention_vllm-*.json")).read_text())
    assert saved["ratio"] == pytest.approx(0.95)
    assert saved["extra_engine_cpu_s"] == pytest.approx(0.5) and saved["extra_wall_s"] == pytest.approx(0.5)
    assert saved["contender_cpu_s"] == pytest.approx(0.5)
