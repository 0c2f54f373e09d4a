import os
import time

import pynvml
import pytest

from storage.records import TelemetrySample
from tuner import telemetry
from engine.hardware import Nvml, cgroup_memory_mb, detect_hardware
from tuner.telemetry import TelemetrySampler, summarise


def test_throttle_bits_match_nvml():
    assert telemetry.SW_POWER_CAP == pynvml.nvmlClocksEventReasonSwPowerCap
    assert telemetry.HW_SLOWDOWN == pynvml.nvmlClocksEventReasonHwSlowdown
    assert telemetry.SW_THERMAL == pynvml.nvmlClocksEventReasonSwThermalSlowdown
    assert telemetry.HW_THERMAL == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert telemetry.HW_POWER_BRAKE == pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown


def _s(t, reasons=None, energy=None, power=None):
    return TelemetrySample(t_s=t, cpu_pct=50.0, rss_mb=100.0 + t, ram_available_mb=1000.0 - t,
                           gpu_clock_reasons=reasons, gpu_energy_j=energy, gpu_power_w=power)


def test_summary_flags_thermal_and_power_throttling_but_not_idle():
    idle = summarise([_s(0, reasons=pynvml.nvmlClocksEventReasonGpuIdle), _s(1, reasons=0)])
    assert not idle.throttled and idle.throttle_reasons == 0
    hot = summarise([_s(0, reasons=0), _s(1, reasons=pynvml.nvmlClocksEventReasonSwThermalSlowdown)])
    assert hot.throttled
    capped = summarise([_s(0, reasons=pynvml.nvmlClocksEventReasonSwPowerCap | 1)])
    assert capped.throttled and capped.throttle_reasons == pynvml.nvmlClocksEventReasonSwPowerCap


def test_summary_of_cpu_only_samples():
    s = summarise([_s(0.0, energy=10.0, power=100.0), _s(0.5, energy=60.0, power=300.0), _s(1.0)])
    assert s.samples == 3 and s.duration_s == 1.0
    assert s.rss_max_mb == 101.0 and s.ram_available_min_mb == 999.0
    assert s.gpu_energy_j == 50.0 and s.gpu_power_mean_w == 200.0
    assert s.gpu_temp_max_c is None and not s.throttled
    assert s.as_dict()["throttled"] is False


def test_sampler_without_nvml_records_host_telemetry_of_a_process():
    with TelemetrySampler(pid=os.getpid(), nvml=None, gpu_index=0, interval_s=0.05) as sampler:
        end = time.monotonic() + 10  # a bound, not a wait: on a loaded machine the sampler gets fewer turns
        while len(sampler.samples) < 5 and time.monotonic() < end:
            sum(range(20000))  # keep a core busy so cpu_pct has something to see...
            time.sleep(0.001)  # ...and let the sampler's thread run
    summary = summarise(sampler.samples)
    assert summary.samples >= 4
    assert all(s.gpu_mem_mb is None for s in sampler.samples)
    assert summary.rss_max_mb > 10 and summary.ram_available_min_mb > 0
    assert summary.cpu_mean_pct > 0


def test_missing_driver_degrades_to_cpu_only():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        assert Nvml.open() is None
        hw = detect_hardware(None, "auto", torch_cuda=False)
        assert hw.gpu is None and hw.fingerprint.gpu_vram_mb == 0 and hw.ram_mb > 0
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present: covered by the GPU run")


def test_cgroup_reading_matches_the_files():
    limit, current = cgroup_memory_mb()
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        assert current is not None and current > 0
    else:  # cgroup v1 or none: nothing to read, nothing invented
        assert (limit, current) == (None, None)
