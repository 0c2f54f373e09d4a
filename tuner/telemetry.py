"""A sampler thread that records GPU and host telemetry while a trial runs, and its summary."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import psutil

from storage.records import TelemetrySample
from engine.hardware import MB, Nvml, cgroup_memory_mb

# NVML clocks-event reasons that mean the GPU slowed itself down (power cap, thermal, or a
# hardware brake). Idle, application clocks, sync boost and display clocks do not count.
SW_POWER_CAP = 0x04
HW_SLOWDOWN = 0x08
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
THROTTLE_MASK = SW_POWER_CAP | HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE


@dataclass(frozen=True)
class TelemetrySummary:
    samples: int
    duration_s: float
    cpu_mean_pct: float | None
    rss_max_mb: float | None
    ram_available_min_mb: float | None
    cgroup_mem_max_mb: float | None
    gpu_mem_max_mb: float | None
    gpu_power_mean_w: float | None
    gpu_energy_j: float | None  # energy counter difference over the measurement
    gpu_temp_max_c: float | None
    gpu_sm_clock_mean_mhz: float | None
    gpu_util_mean_pct: float | None
    throttle_reasons: int  # OR of the throttling bits seen in any sample

    @property
    def throttled(self) -> bool:
        return bool(self.throttle_reasons & THROTTLE_MASK)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"throttled": self.throttled}


def summarise(samples: Sequence[TelemetrySample]) -> TelemetrySummary:
    def values(name: str) -> list[float]:
        return [v for v in (getattr(s, name) for s in samples) if v is not None]

    def agg(name: str, fn: Callable[[list[float]], float]) -> float | None:
        v = values(name)
        return float(fn(v)) if v else None

    energy = values("gpu_energy_j")
    reasons = 0
    for r in values("gpu_clock_reasons"):
        reasons |= int(r) & THROTTLE_MASK
    return TelemetrySummary(
        samples=len(samples),
        duration_s=samples[-1].t_s - samples[0].t_s if samples else 0.0,
        cpu_mean_pct=agg("cpu_pct", statistics.fmean),
        rss_max_mb=agg("rss_mb", max),
        ram_available_min_mb=agg("ram_available_mb", min),
        cgroup_mem_max_mb=agg("cgroup_mem_mb", max),
        gpu_mem_max_mb=agg("gpu_mem_mb", max),
        gpu_power_mean_w=agg("gpu_power_w", statistics.fmean),
        gpu_energy_j=energy[-1] - energy[0] if len(energy) >= 2 else None,
        gpu_temp_max_c=agg("gpu_temp_c", max),
        gpu_sm_clock_mean_mhz=agg("gpu_sm_clock_mhz", statistics.fmean),
        gpu_util_mean_pct=agg("gpu_util_pct", statistics.fmean),
        throttle_reasons=reasons,
    )


class TelemetrySampler:
    """Samples every ``interval_s`` on a daemon thread between ``start()`` and ``stop()``.

    ``pid`` is the engine worker: its CPU share and RSS are what the trial costs. With
    ``nvml`` None (no driver) only host telemetry is recorded.
    """

    def __init__(self, *, pid: int | None, nvml: Nvml | None, gpu_index: int | None,
                 interval_s: float = 0.25,
                 on_sample: Callable[[TelemetrySample], None] | None = None) -> None:
        self.pid = pid
        self.nvml = nvml if gpu_index is not None else None
        self.gpu_index = gpu_index
        self.interval_s = interval_s
        self.on_sample = on_sample
        self.samples: list[TelemetrySample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: psutil.Process | None = None
        self._t0 = 0.0

    def __enter__(self) -> "TelemetrySampler":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._t0 = time.monotonic()
        try:
            self._proc = psutil.Process(self.pid) if self.pid is not None else None
            if self._proc is not None:
                self._proc.cpu_percent(None)  # the first call only sets the reference point
        except psutil.Error:
            self._proc = None
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> TelemetrySummary:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(self.read())  # the end of the window, even for short trials
        return summarise(self.samples)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            sample = self.read()
            self.samples.append(sample)
            if self.on_sample is not None:
                self.on_sample(sample)

    def read(self) -> TelemetrySample:
        cpu = rss = 0.0
        if self._proc is not None:
            try:
                with self._proc.oneshot():
                    cpu = self._proc.cpu_percent(None)
                    rss = self._proc.memory_info().rss / MB
            except psutil.Error:  # the worker died or was killed: keep sampling the host
                self._proc = None
        _, cgroup_current = cgroup_memory_mb()
        gpu: dict[str, Any] = {}
        if self.nvml is not None:
            try:
                gpu = self.nvml.read(self.gpu_index, self.pid)
            except self.nvml.nv.NVMLError:
                gpu = {}
        return TelemetrySample(
            t_s=time.monotonic() - self._t0, cpu_pct=cpu, rss_mb=rss,
            ram_available_mb=psutil.virtual_memory().available / MB,
            cgroup_mem_mb=cgroup_current, **gpu)
