"""Hardware facts for the heartbeat, read without initialising CUDA.

GPUs come from NVML (nvidia-ml-py) when installed, else from ``nvidia-smi``; neither
creates a CUDA context, so a process may still fork safely after asking.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil

from core.fleet import GPUHealth, GPUInfo, HardwareInfo


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


class NvmlHealthReader:
    """GPU health facts for each heartbeat, through one NVML session for the worker's life.

    Memory, utilisation and temperature are read each call; uncorrected ECC errors where
    the board has ECC; critical Xid events (the driver's fault reports) are collected
    from an NVML event set registered once, without blocking. NVML creates no CUDA
    context. ``open()`` returns None where there is no NVML (CPU hosts)."""

    def __init__(self, pynvml, handles: list) -> None:
        self.nvml, self.handles = pynvml, handles
        self.xids: dict[int, list[int]] = {i: [] for i in range(len(handles))}
        self.events = None
        try:
            self.events = pynvml.nvmlEventSetCreate()
            for h in handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
        except pynvml.NVMLError:  # not supported (some boards, MIG, containers): no Xid facts
            self.events = None

    @classmethod
    def open(cls) -> NvmlHealthReader | None:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no driver, no library
            return None
        return cls(pynvml, handles) if handles else None

    def _optional(self, fn, *args):
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return None

    def _drain_xids(self) -> None:
        while self.events is not None:
            try:
                event = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                return
            idx = self._optional(self.nvml.nvmlDeviceGetIndex, event.device)
            self.xids.setdefault(idx or 0, []).append(int(event.eventData))

    def __call__(self) -> list[GPUHealth]:
        n = self.nvml
        self._drain_xids()
        out = []
        for i, h in enumerate(self.handles):
            mem = n.nvmlDeviceGetMemoryInfo(h)
            util = self._optional(n.nvmlDeviceGetUtilizationRates, h)
            ecc = self._optional(
                n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
            )
            out.append(
                GPUHealth(
                    index=i,
                    memory_used_mb=mem.used // 2**20,
                    memory_total_mb=mem.total // 2**20,
                    utilization_pct=None if util is None else int(util.gpu),
                    temperature_c=self._optional(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                    ecc_uncorrected=None if ecc is None else int(ecc),
                    xid_errors=list(self.xids.get(i, [])),
                )
            )
        return out

    def close(self) -> None:
        try:
            if self.events is not None:
                self.nvml.nvmlEventSetFree(self.events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass
