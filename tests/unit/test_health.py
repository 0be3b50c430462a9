"""Worker health: thresholds, the consuming gate, and what the dispatcher makes of it (pure)."""

from __future__ import annotations

import pytest

from conftest import need_module, unavailable
from core.fleet import FleetView, GPUHealth, Health, HealthFacts
from core.settings import HealthSettings, fleet_config
from tests.unit.test_decision import job, run, worker
from workers.lifecycle.health import ConsumeGate, evaluate

GOOD_GPU = GPUHealth(
    index=0, memory_used_mb=60_000, memory_total_mb=143_771, utilization_pct=97, temperature_c=55, ecc_uncorrected=0
)


def facts(**kw) -> HealthFacts:
    base = {"cpu_percent": 50.0, "ram_used_frac": 0.4, "rss_mb": 900.0, "gpus": [GOOD_GPU]}
    return HealthFacts(**{**base, **kw})


LIMITS = fleet_config().health  # config/fleet.yaml's thresholds


def limits(**changed: float) -> HealthSettings:
    return LIMITS.model_copy(update=changed)


def test_config_thresholds_load_and_a_healthy_gpu_worker_passes():
    assert LIMITS.max_gpu_temp_c == 90 and LIMITS.max_rss_mb == 0
    assert evaluate(facts(), LIMITS) == []


def test_each_threshold_names_its_fact():
    hot = GOOD_GPU.model_copy(update={"temperature_c": 93})
    full = GOOD_GPU.model_copy(update={"index": 1, "memory_used_mb": 143_700})
    ecc = GOOD_GPU.model_copy(update={"index": 2, "ecc_uncorrected": 3})
    xid = GOOD_GPU.model_copy(update={"index": 3, "xid_errors": [79, 79]})
    reasons = evaluate(facts(ram_used_frac=0.99, gpus=[hot, full, ecc, xid]), limits(max_rss_mb=500))
    assert reasons == [
        "host RAM 99% used > 97%",
        "worker memory 900 MB > 500 MB",
        "GPU 0 at 93 C > 90 C",
        "GPU 1 memory 143700/143771 MiB > 99.5%",
        "GPU 2: 3 uncorrected ECC error(s)",
        "GPU 3: Xid error(s) 79",
    ]


def test_facts_the_driver_does_not_give_are_not_held_against_a_worker():
    blind = GPUHealth(index=0, memory_used_mb=1, memory_total_mb=80_000)  # no ECC, no temperature
    assert evaluate(facts(gpus=[blind]), LIMITS) == []
    assert evaluate(facts(rss_mb=10**6), limits(max_rss_mb=0)) == []  # 0: no limit


def test_the_gate_stops_and_restarts_consuming_once_per_change():
    calls: list[tuple[str, str]] = []
    gate = ConsumeGate(
        lambda q: calls.append(("cancel", q)), lambda q: calls.append(("add", q)), ["ib.vllm", "ib.vllm.w1"]
    )
    sick = Health(ok=False, reasons=["GPU 0 at 95 C > 90 C"])
    assert gate.update(Health()) is False
    assert gate.update(sick) is True and gate.update(sick) is False
    assert gate.update(Health()) is True
    assert calls == [("cancel", "ib.vllm"), ("cancel", "ib.vllm.w1"), ("add", "ib.vllm"), ("add", "ib.vllm.w1")]


def test_a_failed_control_call_leaves_the_gate_to_try_again():
    replies = iter([RuntimeError("no reply"), None])
    cancelled: list[str] = []

    def cancel(queue: str) -> None:
        if (reply := next(replies)) is not None:
            raise reply
        cancelled.append(queue)

    gate = ConsumeGate(cancel, lambda q: None, ["ib.onnx"])
    sick = Health(ok=False, reasons=["x"])
    with pytest.raises(RuntimeError, match="no reply"):  # the caller (the beat) sees it fail
        gate.update(sick)
    assert gate.consuming is True  # not marked stopped: the next beat tries again
    assert gate.update(sick) is True and cancelled == ["ib.onnx"] and gate.consuming is False


def test_an_unhealthy_worker_is_not_live_and_the_path_says_why():
    sick = worker("llamacpp", False).model_copy(
        update={"health": Health(ok=False, reasons=["host RAM 99% used > 97%"])}
    )
    fleet = FleetView(workers=[sick, worker("onnx", False)])
    assert fleet.live(backend="llamacpp") == []
    sel = run(job(), fleet)
    assert sel.backend == "onnx"  # the fallback, since llama.cpp's only worker is unhealthy
    step = next(s for s in sel.path if s.check == "unhealthy workers")
    assert "host RAM 99% used" in step.detail and sick.worker_id in step.detail


def test_workers_table_line():
    assert Health(ok=False, reasons=["a", "b"]).describe() == "UNHEALTHY: a; b"
    assert Health(facts=facts()).describe().startswith("ok (rss 900 MB, RAM 40%, GPU0 60000/143771 MiB 55 C")


class FakeNVML:
    """The part of nvidia-ml-py the reader calls, with one board that reports an Xid."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU = 1, 0, 0
    nvmlEventTypeXidCriticalError = 8

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.pending = [type("Event", (), {"device": "h1", "eventData": 79})()]
        self.freed = self.shut = False

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, handle, kind, events):
        assert kind == self.nvmlEventTypeXidCriticalError and events == "set"

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # never blocks the heartbeat
        if not self.pending:
            raise self.NVMLError("timeout")
        return self.pending.pop()

    def nvmlDeviceGetIndex(self, handle):
        return {"h0": 0, "h1": 1}[handle]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Mem", (), {"used": 60_000 * 2**20, "total": 143_771 * 2**20})()

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Util", (), {"gpu": 97})()

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        if handle == "h0":
            raise self.NVMLError("not supported")  # a board without ECC
        return 2

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 55

    def nvmlEventSetFree(self, events):
        self.freed = True

    def nvmlShutdown(self):
        self.shut = True


def test_nvml_reader_reports_each_board_and_the_xid_events_it_saw():
    from workers.lifecycle.hardware import NvmlHealthReader

    nvml = FakeNVML()
    reader = NvmlHealthReader(nvml, ["h0", "h1"])
    first, second = reader(), reader()
    assert [g.ecc_uncorrected for g in first] == [None, 2] and first[0].temperature_c == 55
    assert first[1].xid_errors == [79] and second[1].xid_errors == [79]  # kept: the board stays suspect
    assert first[0].memory_used_mb == 60_000 and first[0].utilization_pct == 97
    assert evaluate(facts(gpus=first), LIMITS) == ["GPU 1: 2 uncorrected ECC error(s)", "GPU 1: Xid error(s) 79"]
    reader.close()
    assert nvml.freed and nvml.shut


def test_the_reader_uses_names_that_nvidia_ml_py_has():

    pynvml = need_module("pynvml")  # nvidia-ml-py: the dev extra installs it (no driver needed)
    used = [n for n in dir(FakeNVML) if n.startswith(("nvml", "NVML"))]
    assert [n for n in used if not hasattr(pynvml, n)] == []
    from workers.lifecycle.hardware import NvmlHealthReader

    try:
        pynvml.nvmlInit()
        boards = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver on this host
        boards = 0
    reader = NvmlHealthReader.open()
    if boards == 0:
        assert reader is None  # no GPU facts, and no error
    else:  # a GPU host: the real driver answers the same calls the fake does
        assert reader is not None and len(reader.handles) == boards
        reader.close()


def test_the_peak_rss_is_the_kernels_high_water_mark_not_a_sample():
    from workers.lifecycle.health import process_peak_rss_mb, process_rss_mb

    before = process_peak_rss_mb()
    if before is None:
        unavailable("no /proc VmHWM on this system")
    # more than the old peak, touched, then freed: a sample taken now would miss it
    blob = bytearray(int(before + 64) * 2**20)
    blob[::4096] = b"x" * len(blob[::4096])
    del blob
    peak = process_peak_rss_mb()
    assert peak >= before + 60 and peak >= process_rss_mb()
