"""The tuner on a real GPU: NVML telemetry, the live budget dimension, a GPU fingerprint."""

import os
import time

import pytest

from tuner.config import load_config
from engine.hardware import Nvml, cuda_available, detect_hardware
from tuner.space import SearchSpace
from tuner.telemetry import TelemetrySampler, summarise

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(Nvml.open() is None or not cuda_available(), reason="needs a CUDA GPU")]


def test_live_gpu_telemetry_and_budget_dimension(tmp_path):
    import torch

    nvml = Nvml.open()
    try:
        hw = detect_hardware(nvml, "auto", torch_cuda=True)
        assert hw.gpu is not None and hw.gpu.total_mb > 1000
        assert hw.gpu.uuid.startswith("GPU-") and hw.gpu.driver
        fp = hw.fingerprint
        assert fp.gpu_name == hw.gpu.name and fp.gpu_vram_mb == hw.gpu.total_mb

        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MB held by this process
        with TelemetrySampler(pid=os.getpid(), nvml=nvml, gpu_index=hw.gpu.nvml_index,
                              interval_s=0.05) as sampler:
            end = time.monotonic() + 1.0
            a = torch.randn(4096, 4096, device="cuda")
            while time.monotonic() < end:
                a = a @ a
                a /= a.norm()
            torch.cuda.synchronize()
        s = summarise(sampler.samples)
        assert s.gpu_mem_max_mb >= 256
        assert s.gpu_temp_max_c is not None and 0 < s.gpu_temp_max_c < 120
        assert s.gpu_power_mean_w is not None and s.gpu_power_mean_w > 0
        assert s.gpu_sm_clock_mean_mhz is not None and s.gpu_sm_clock_mean_mhz > 0
        assert s.gpu_util_mean_pct is not None and s.gpu_util_mean_pct > 0
        assert all(smp.gpu_clock_reasons is not None for smp in sampler.samples)
        del x
    finally:
        nvml.close()

    cfg_path = tmp_path / "appliance.toml"
    cfg_path.write_text('[models]\ntarget = "t.gguf"\n[study]\ntrials = 2\n[publish]\nprofile = "p.toml"\n'
                        "[hardware]\nvram_cap_mb = 9000\nvram_reserve_mb = 1000\n")
    space = SearchSpace.build(load_config(cfg_path), hw, drafts=(), drafter_ok=False, experts_mb=20000)
    assert space.budget_max_mb == 7936  # min(live VRAM, 9000 cap) - 1000 reserve, in 256 MB steps
