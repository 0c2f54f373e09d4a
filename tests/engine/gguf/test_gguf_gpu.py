"""Dequantization on the accelerator gives the CPU's bits, and loads land on the device."""

import numpy as np
import pytest
import torch

from engine.gguf import quants
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, write_gguf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("qtype", quants.SUPPORTED, ids=lambda q: q.name)
def test_cuda_dequantize_equals_cpu(qtype):
    shape = (7, 3, 512)
    raw = quants.random_quantized(shape, qtype, np.random.default_rng(0), 0.05)
    cpu = quants.dequantize(torch.from_numpy(raw), qtype, shape)
    gpu = quants.dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)


def test_load_to_cuda(tmp_path):
    rng = np.random.default_rng(1)
    specs = [TensorSpec(f"t.{q.name}", (5, 1024), q, lambda q=q: quants.random_quantized((5, 1024), q, rng, 0.1))
             for q in quants.SUPPORTED]
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "qwen35moe"}, specs)
    with GGUFFile(path) as f:
        for name in f.tensors:
            on_gpu = f.load(name, dtype=torch.bfloat16, device="cuda")
            assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.bfloat16
            assert torch.equal(on_gpu.cpu(), f.load(name).to(torch.bfloat16))
