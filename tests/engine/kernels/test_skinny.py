"""The few-row float32 projection (``engine.kernels.skinny``) against ``F.linear`` in float64 on
fresh random inputs at odd sizes; its dispatch in ``engine.model.linear``; on the CPU through the
Triton interpreter, on CUDA at the shipped model's shapes and inside a CUDA graph."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

skinny = pytest.importorskip("engine.kernels.skinny")
from engine.model import linear as linear_mod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(m, n, k, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k * (2 if strided else 1), generator=g)
    if strided:  # rows of a wider tensor, as a split projection hands them on
        x = x[:, 1:k + 1]
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x.to(DEVICE), w.to(DEVICE)


def max_rel(out, x, w):
    ref = F.linear(x.double(), w.double())
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (33, 64), (130, 65), (257, 200)])
def test_matches_float64_reference(m, n, k):
    x, w = case(m, n, k, seed=m * 1000 + n + k)
    out = skinny.skinny_linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    assert max_rel(out, x, w) < 1e-5


def test_leading_dims_and_strided_rows():
    x, w = case(6, 19, 37, seed=3, strided=True)
    assert x.stride(0) != x.shape[1]
    assert max_rel(skinny.skinny_linear(x, w), x, w) < 1e-5
    x3 = torch.randn(2, 5, 37, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = skinny.skinny_linear(x3, w)
    assert out.shape == (2, 5, 19)
    assert max_rel(out.reshape(10, 19), x3.reshape(10, 37), w) < 1e-5


def test_refuses_what_it_does_not_take():
    x, w = case(4, 8, 16, seed=5)
    assert skinny.applies(x, w)
    assert skinny.applies(x[:1], w)
    assert not skinny.applies(x[:0], w)
    assert not skinny.applies(torch.randn(skinny.MAX_M + 1, 16, device=DEVICE), w)  # prefill: cuBLAS
    assert not skinny.applies(x.bfloat16(), w.bfloat16())
    assert not skinny.applies(x, w.t().contiguous().t())  # weight columns not contiguous
    assert not skinny.applies(x, w.requires_grad_(True))  # autograd: draft training
    with pytest.raises(ValueError, match="skinny_linear takes"):
        skinny.skinny_linear(x[:0], w.detach())


def test_linear_dispatch(monkeypatch):
    """``linear`` takes the kernel when told to (or on CUDA by itself) and ``F.linear`` otherwise: the
    same values within float32 rounding, and the kernel's launch really taken."""
    x, w = case(9, 40, 96, seed=6)
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", True)
    on = linear_mod.linear(x, w)
    assert calls == [1]
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", False)
    off = linear_mod.linear(x, w)
    assert calls == [1]
    assert (on - off).abs().max().item() <= 1e-5 * off.abs().max().item()
    monkeypatch.setattr(linear_mod, "FUSED_SKINNY", True)
    linear_mod.linear(x[:skinny.MIN_M - 1], w)  # fewer rows (the decode step's one, DFlash blocks of 4): F.linear
    assert calls == [1]
    linear_mod.linear(x[:skinny.MIN_M], w)
    assert calls == [1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [5, 17])
@pytest.mark.parametrize("n,k", [(4096, 256), (1024, 256), (256, 768), (32, 256), (8, 256)])
def test_cuda_shapes_in_a_graph(m, n, k):
    """The shipped target's and draft's projections (LM head, qkv, fc, router, alpha/beta) for a verify
    block of 4 and 16 tokens: eager and replayed in a CUDA graph on new rows."""
    x, w = case(m, n, k, seed=m + n + k)
    assert max_rel(skinny.skinny_linear(x, w), x, w) < 1e-5
    static = x.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny.skinny_linear(static, w)
    fresh = torch.randn_like(x)
    static.copy_(fresh)
    g.replay()
    torch.cuda.synchronize()
    assert max_rel(out, fresh, w) < 1e-5
