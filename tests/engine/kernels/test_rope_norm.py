"""An attention head's RMSNorm and rotary embedding in one launch against the torch definition
(rms_norm then apply_rope): odd head sizes, partial and full rotation, strided query heads,
bf16; then a model's logits with the fused path. On the CPU through the Triton interpreter,
on CUDA compiled."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated

from engine.model import attention  # noqa: E402
from engine.model.attention import norm_rope_reference, rope_cos_sin  # noqa: E402

kernels = pytest.importorskip("engine.kernels.rope_norm")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T, H, D, rope_dim, seed, dtype=torch.float32, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, 2 * D if strided else D, generator=g) * 2
    if strided:  # the query heads: each followed by its output gate in one projection
        x = x[..., :D]
    w = torch.rand(D, generator=g) + 0.5
    cos, sin = rope_cos_sin(torch.arange(T) * 7 + 3, rope_dim, 1e7)
    return x.to(DEVICE, dtype), w.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("T, H, D, rope_dim", [(1, 1, 8, 8), (3, 5, 24, 8), (4, 3, 33, 16), (16, 2, 256, 64),
                                               (2, 4, 64, 0)])
@pytest.mark.parametrize("strided", [False, True])
def test_matches_norm_then_rope(T, H, D, rope_dim, strided):
    x, w, cos, sin = case(T, H, D, rope_dim, seed=T * H + D, strided=strided)
    out = kernels.norm_rope_triton(x, w, cos, sin, 1e-6)
    assert out.shape == (T, H, D) and out.is_contiguous() and out.dtype == x.dtype
    torch.testing.assert_close(out, norm_rope_reference(x, w, cos, sin, 1e-6), rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once():
    x, w, cos, sin = case(3, 4, 64, 16, seed=2, dtype=torch.bfloat16, strided=True)
    out = kernels.norm_rope_triton(x, w, cos, sin, 1e-6)
    ref = norm_rope_reference(x.float(), w, cos, sin, 1e-6)  # the same inputs, float32 throughout
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=2e-2)


def test_bad_shapes_are_refused():
    x, w, cos, sin = case(2, 3, 16, 8, seed=1)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.norm_rope_triton(x, w[:4], cos, sin, 1e-6)
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.norm_rope_triton(x, w, cos[:1], sin[:1], 1e-6)
    big = rope_cos_sin(torch.arange(2), 64, 1e4)
    with pytest.raises(ValueError, match="2 \\* half"):
        kernels.norm_rope_triton(x, w, big[0].to(DEVICE), big[1].to(DEVICE), 1e-6)


@pytest.mark.parametrize("T", [1, 6])
def test_model_logits_with_the_fused_attention_norms(tiny_float32_model, fused_against_reference, T):
    (ref, _), (out, _) = fused_against_reference(tiny_float32_model, attention, "FUSED_ROPE", 10, T)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_shapes_on_cuda(dtype):
    """Qwen3.6-35B-A3B's attention: 16 query heads (strided by their gates), 2 KV heads of 256, RoPE on 64."""
    for H, strided in ((16, True), (2, False)):
        x, w, cos, sin = case(16, H, 256, 64, seed=H, dtype=dtype, strided=strided)
        out = kernels.norm_rope_triton(x, w, cos, sin, 1e-6)
        ref = norm_rope_reference(x.float(), w, cos, sin, 1e-6)
        tol = dict(rtol=2 ** -7, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.float(), ref, **tol)
