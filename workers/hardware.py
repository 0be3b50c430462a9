"""Hardware facts for the heartbeat, read without initialising CUDA.

GPUs come from NVML (nvidia-ml-py) when installed, else from ``nvidia-smi``; neither
creates a CUDA context, so a process may still fork safely after asking.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil

from dispatcher.fleet import GPUInfo, HardwareInfo


def cpu_cores() -> int:
    """Cores this process may run on (affinity / container limits), not the host's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def gpus() -> list[GPUInfo]:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            found = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                found.append(
                    GPUInfo(
                        index=i,
                        name=name.decode() if isinstance(name, bytes) else name,
                        memory_total_mb=mem.total // 2**20,
                        memory_used_mb=mem.used // 2**20,
                    )
                )
            return found
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: try the CLI
        pass
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    found = []
    for line in out.strip().splitlines():
        idx, name, total, used = (p.strip() for p in line.split(","))
        found.append(GPUInfo(index=int(idx), name=name, memory_total_mb=int(total), memory_used_mb=int(used)))
    return found


def detect(use_gpu: bool | None = None) -> HardwareInfo:
    """``use_gpu=False`` reports a CPU worker even on a GPU host."""
    found = gpus() if use_gpu is not False else []
    return HardwareInfo(
        kind="gpu" if found else "cpu",
        gpus=found,
        cpu_cores=cpu_cores(),
        ram_gb=round(psutil.virtual_memory().total / 2**30, 1),
        cpu_model=_cpu_model(),
    )
