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


@pytest.mark.parametrize("T, H, D, rope_dim", [(1, 2, 64, 16), (3, 1, 24, 8), (4, 3, 33, 0)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cache_write_equals_norm_rope_then_index_copy(T, H, D, rope_dim, cache_dtype):
    """Keys normed and turned and values, straight into the caches at a step's slots (strided views
    of one projection, as the attention layer passes them); every other slot untouched."""
    g = torch.Generator().manual_seed(T * 31 + D)
    kv = (torch.randn(T, 2 * H * D + 5, generator=g) * 2).to(DEVICE)  # one projection row per token
    k, v = kv[:, :H * D].view(T, H, D), kv[:, H * D:2 * H * D].view(T, H, D)
    w = (torch.rand(D, generator=g) + 0.5).to(DEVICE)
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin(torch.arange(T) + 9, rope_dim, 1e7))
    L = 13
    cache_k = torch.full((H, L, D), 7.0, dtype=cache_dtype, device=DEVICE)
    cache_v = torch.full((H, L, D), -7.0, dtype=cache_dtype, device=DEVICE)
    slots = torch.tensor([5, 2, 11, 8][:T], device=DEVICE)
    assert kernels.norm_rope_to_cache_triton(k, v, w, cos, sin, 1e-6, cache_k, cache_v, slots) is cache_k
    ref_k = torch.full_like(cache_k, 7.0)
    ref_v = torch.full_like(cache_v, -7.0)
    ref_k.index_copy_(1, slots, norm_rope_reference(k, w, cos, sin, 1e-6).transpose(0, 1).to(cache_dtype))
    ref_v.index_copy_(1, slots, v.transpose(0, 1).to(cache_dtype))
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cache_k.float(), ref_k.float(), rtol=tol, atol=tol)
    ulp = 0 if cache_dtype == torch.float32 else 2 ** -7  # the interpreter's float32 -> bf16 cast may truncate
    torch.testing.assert_close(cache_v.float(), ref_v.float(), rtol=ulp, atol=0)


def test_cache_write_refuses_mismatched_caches():
    k, w, cos, sin = case(2, 3, 16, 8, seed=4)
    cache = torch.zeros(3, 9, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="cache_v must be"):
        kernels.norm_rope_to_cache_triton(k, k, w, cos, sin, 1e-6, cache, cache[:2], slots)
    with pytest.raises(ValueError, match="slots must be"):
        kernels.norm_rope_to_cache_triton(k, k, w, cos, sin, 1e-6, cache, cache, slots[:1])


@pytest.mark.parametrize("T", [1, 3])
def test_static_attention_with_the_fused_cache_write_and_gate(T, monkeypatch):
    """The captured step's attention layer with the fused cache write and the gate inside the split-key
    attention, against its torch path: the same output and the same caches."""
    from engine.model.attention import attention_static
    from engine.model.config import ModelConfig
    from engine.model.state import KVCache
    from engine.model.weights import AttentionWeights

    cfg = ModelConfig(n_layers=1, hidden=48, n_head=4, n_head_kv=2, head_dim=16, rope_dim=8,
                      rope_theta=1e7, rms_eps=1e-6, vocab=32, full_attention_interval=1, n_expert=4,
                      n_expert_used=2, expert_ffn=8, shared_ffn=8, gdn_k_heads=2, gdn_v_heads=2, gdn_head_k=8,
                      gdn_head_v=8, conv_kernel=4, context_length=64)
    g = torch.Generator().manual_seed(T)
    D, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
    w = AttentionWeights(qkv=(torch.randn((2 * nh + 2 * nkv) * D, cfg.hidden, generator=g) * 0.2).to(DEVICE),
                         q=None, k=None, v=None, o=(torch.randn(cfg.hidden, nh * D, generator=g) * 0.2).to(DEVICE),
                         q_norm=(torch.rand(D, generator=g) + 0.5).to(DEVICE),
                         k_norm=(torch.rand(D, generator=g) + 0.5).to(DEVICE))
    x = torch.randn(T, cfg.hidden, generator=g).to(DEVICE)
    L = 12
    base = KVCache(torch.randn(nkv, L, D, generator=g).to(DEVICE), torch.randn(nkv, L, D, generator=g).to(DEVICE), 5)
    slots = torch.arange(T, device=DEVICE) + 5
    visible = torch.arange(L, device=DEVICE)[None, :] <= slots[:, None]
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(attention, "FUSED_ROPE", fused)
        monkeypatch.setattr(attention, "FUSED_DECODE_ATTENTION", fused)
        cache = KVCache(base.k.clone(), base.v.clone(), base.length)
        runs.append((attention_static(w, x, slots, slots, visible, cache, cfg), cache))
    (ref, ref_cache), (out, cache) = runs
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.k, ref_cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, ref_cache.v, rtol=0, atol=0)


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
