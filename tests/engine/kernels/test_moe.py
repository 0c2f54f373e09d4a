"""Fused-MoE kernel against its torch reference: odd shapes on the CPU (Triton interpreter),
the real Qwen3.6-35B-A3B expert shapes on CUDA.

Errors are reported relative to the reference's largest output: fp32 kernels must agree to
1e-5 (only summation order differs); fp16/bf16 kernels store the SiLU(gate)*up activation in
the weights' dtype, so they get 1e-2 of the fp32 reference computed from the same rounded
weights. The interpreter's bf16 dot is broken (it multiplies raw bit patterns), so bf16 is
tested on CUDA only.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

from engine.kernels.moe import fused_moe, moe_reference, resolve_impl  # noqa: E402

triton_kernels = pytest.importorskip("engine.kernels.moe.triton")
MoEKernelConfig = triton_kernels.MoEKernelConfig
DECODE = MoEKernelConfig(gemv_max_tokens=10**9)
PREFILL = MoEKernelConfig(gemv_max_tokens=0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_case(E, H, F_, K, T, *, dtype=torch.float32, device="cpu", skip=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, F_, H, generator=g) / H**0.5).to(dtype)
    up = (torch.randn(E, F_, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, F_, generator=g) / F_**0.5).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if skip:
        ids = torch.where(torch.rand(T, K, generator=g) < skip, -1, ids)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return [t.to(device) for t in (x, gate, up, down, ids, w)]


def naive(x, gate, up, down, ids, w):
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            xt = x[t].double()
            act = F.silu(gate[e].double() @ xt) * (up[e].double() @ xt)
            out[t] += float(w[t, j]) * (down[e].double() @ act)
    return out


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("T", [1, 2, 5, 17])
def test_reference_matches_naive_loop(T):
    case = make_case(7, 40, 24, 3, T, skip=0.2)
    assert rel_err(moe_reference(*case), naive(*case)) < 1e-6


def test_reference_skips_negative_ids_and_keeps_dtype():
    x, gate, up, down, ids, w = make_case(7, 40, 24, 3, 4, dtype=torch.float16)
    out = moe_reference(x, gate, up, down, torch.full_like(ids, -1), w)
    assert out.dtype == torch.float16 and not out.any()


@pytest.mark.parametrize("path", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("T", [1, 2, 5, 17])
def test_triton_matches_reference_fp32_odd_shapes(T, path):
    case = make_case(7, 40, 24, 3, T, skip=0.15, seed=T)
    out = triton_kernels.fused_moe_triton(*case, config=path)
    assert out.shape == (T, 40) and out.dtype == torch.float32
    assert rel_err(out, moe_reference(*case)) < 1e-5


@pytest.mark.parametrize("path", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_triton_matches_reference_fp16(path):
    x, gate, up, down, ids, w = make_case(7, 40, 24, 3, 5, dtype=torch.float16, seed=11)
    out = triton_kernels.fused_moe_triton(x, gate, up, down, ids, w, config=path)
    ref = moe_reference(x.float(), gate.float(), up.float(), down.float(), ids, w)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 1e-2


def test_align_by_expert_groups_every_pair_once():
    ids = torch.tensor([[3, 0, -1], [3, 5, 0], [6, -1, 3], [0, 3, 5]])
    block_m = 4
    pairs, block_expert = triton_kernels.align_by_expert(ids, 7, block_m)
    n_pairs = ids.numel()
    flat = ids.reshape(-1)
    assert pairs.numel() == block_expert.numel() * block_m
    real = pairs[pairs < n_pairs]
    assert sorted(real.tolist()) == [i for i in range(n_pairs) if flat[i] >= 0]
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * block_m:(b + 1) * block_m]
        members = block[block < n_pairs]
        if e < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and bool((flat[members] == e).all())


def test_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="block_n"):
        MoEKernelConfig(block_n=48)
    with pytest.raises(ValueError, match="block_k"):
        MoEKernelConfig(block_k=8)


def test_auto_picks_torch_on_cpu():
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="one of"):
        resolve_impl("cuda", torch.device("cpu"))


REAL = dict(E=256, H=2048, F_=512, K=8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", [None, DECODE, PREFILL], ids=["auto", "decode", "prefill"])
@pytest.mark.parametrize("T", [1, 2, 8, 16, 64, 512])
def test_triton_matches_reference_real_shapes_bf16(T, path):
    x, gate, up, down, ids, w = make_case(**REAL, T=T, dtype=torch.bfloat16, device="cuda", seed=T)
    out = fused_moe(x, gate, up, down, ids, w, impl="triton", config=path)
    ref = moe_reference(x.float(), gate.float(), up.float(), down.float(), ids, w)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64])
def test_triton_skips_cold_pairs_real_shapes(T):
    x, gate, up, down, ids, w = make_case(**REAL, T=T, dtype=torch.bfloat16, device="cuda", skip=0.5, seed=7)
    out = fused_moe(x, gate, up, down, ids, w, impl="triton")
    ref = moe_reference(x.float(), gate.float(), up.float(), down.float(), ids, w)
    assert rel_err(out, ref) < 1e-2
