"""Partial NeoX RoPE with explicit positions, and gated attention over a KV cache."""

import math

import pytest
import torch

from engine.model import attention as attention_module
from engine.model.attention import (apply_rope, attention_forward, attention_static, continued_causal_attention,
                                  grouped_attention, rope_cos_sin)
from engine.model.config import ModelConfig
from engine.model.state import KVCache
from engine.model.weights import AttentionWeights


def test_rope_rotates_pairs_i_and_i_plus_half_of_the_first_rope_dims():
    x = torch.randn(3, 2, 10)
    pos = torch.tensor([0, 1, 7])
    cos, sin = rope_cos_sin(pos, 4, theta=100.0)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[..., 4:], x[..., 4:], rtol=0, atol=0)  # beyond rope_dim: untouched
    for t, p in enumerate(pos.tolist()):
        for i in range(2):
            angle = p / 100.0 ** (2 * i / 4)
            a, b = x[t, :, i], x[t, :, i + 2]
            torch.testing.assert_close(y[t, :, i], a * math.cos(angle) - b * math.sin(angle))
            torch.testing.assert_close(y[t, :, i + 2], b * math.cos(angle) + a * math.sin(angle))


def test_scores_depend_on_position_differences_only():
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), 8, 1e4)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 8, 1e4)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(9, 4) == pytest.approx(score(105, 100), abs=1e-4)
    assert score(9, 4) != pytest.approx(score(9, 5), abs=1e-3)


def _attention_setup(seed=0):
    cfg = ModelConfig(n_layers=4, hidden=16, vocab=10, n_head=4, n_head_kv=2, head_dim=8, rms_eps=1e-6,
                      rope_theta=1e4, rope_dim=4, n_expert=2, n_expert_used=1, expert_ffn=4, shared_ffn=0,
                      conv_kernel=4, gdn_k_heads=1, gdn_v_heads=1, gdn_head_k=4, gdn_head_v=4,
                      full_attention_interval=4)
    gen = torch.Generator().manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=gen) * 0.3

    w = AttentionWeights(q=rand(64, 16), k=rand(16, 16), v=rand(16, 16), o=rand(16, 32),
                         q_norm=1 + rand(8), k_norm=1 + rand(8))
    return cfg, w, rand(12, 16)


def _reference(cfg, w, x, pos):
    """Dense causal attention with explicit GQA repeat, for comparison."""
    T, D = x.shape[0], cfg.head_dim

    def norm(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * weight

    qg = (x @ w.q.T).view(T, cfg.n_head, 2 * D)
    q, gate = norm(qg[..., :D], w.q_norm), qg[..., D:].reshape(T, -1)
    k = norm((x @ w.k.T).view(T, cfg.n_head_kv, D), w.k_norm)
    v = (x @ w.v.T).view(T, cfg.n_head_kv, D)
    cos, sin = rope_cos_sin(pos, cfg.rope_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = cfg.n_head // cfg.n_head_kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, -1)
    return (out * torch.sigmoid(gate)) @ w.o.T


def test_cached_attention_matches_dense_reference_in_pieces():
    cfg, w, x = _attention_setup()
    pos = torch.tensor([0, 1, 2, 3, 10, 11, 12, 20, 21, 22, 23, 24])  # kept tokens keep their positions
    ref = _reference(cfg, w, x, pos)
    cache = KVCache.empty(cfg.n_head_kv, 12, cfg.head_dim, device="cpu", dtype=torch.float32)
    full = attention_forward(w, x, pos, cache, cfg)
    torch.testing.assert_close(full, ref, rtol=0, atol=1e-5)
    cache = KVCache.empty(cfg.n_head_kv, 12, cfg.head_dim, device="cpu", dtype=torch.float32)
    pieces = [attention_forward(w, x[a:b], pos[a:b], cache, cfg) for a, b in ((0, 5), (5, 6), (6, 12))]
    torch.testing.assert_close(torch.cat(pieces), ref, rtol=0, atol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize("n_head, n_kv, T, K", [(4, 2, 5, 9), (3, 3, 7, 7), (8, 2, 13, 40), (6, 1, 1, 17)])
def test_lower_right_causal_attention_matches_the_built_mask(n_head, n_kv, T, K):
    """Queries at the last T of K cache slots: the backends' lower-right mask against the [T, K] mask."""
    gen = torch.Generator().manual_seed(T * K)
    q = torch.randn(T, n_head, 16, generator=gen, dtype=torch.float64)
    keys, values = (torch.randn(n_kv, K, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    visible = torch.arange(K)[None, :] <= (K - T + torch.arange(T))[:, None]
    ref = grouped_attention(q, keys, values, visible)
    torch.testing.assert_close(continued_causal_attention(q, keys, values), ref, rtol=0, atol=1e-12)
    wrong = torch.arange(K)[None, :] <= torch.arange(T)[:, None]  # the top-left alignment
    if K > T:
        assert not torch.allclose(grouped_attention(q, keys, values, wrong), ref)


def test_a_long_block_continuing_the_cache_takes_the_lower_right_mask(monkeypatch):
    cfg, w, x = _attention_setup(seed=3)
    pos = torch.arange(12)
    ref = _reference(cfg, w, x, pos)
    calls = []
    real = attention_module.continued_causal_attention
    monkeypatch.setattr(attention_module, "continued_causal_attention",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(attention_module, "CONTINUED_CAUSAL_MIN_TOKENS", 4)
    cache = KVCache.empty(cfg.n_head_kv, 12, cfg.head_dim, device="cpu", dtype=torch.float32)
    pieces = [attention_forward(w, x[a:b], pos[a:b], cache, cfg) for a, b in ((0, 5), (5, 8), (8, 12))]
    torch.testing.assert_close(torch.cat(pieces), ref, rtol=0, atol=1e-5)
    assert calls == [4]  # the first piece starts the cache, the second is under the threshold


def test_cropped_cache_recomputes_the_same_tokens():
    cfg, w, x = _attention_setup(seed=1)
    pos = torch.arange(12)
    cache = KVCache.empty(cfg.n_head_kv, 12, cfg.head_dim, device="cpu", dtype=torch.float32)
    first = attention_forward(w, x, pos, cache, cfg)
    cache.crop(7)
    again = attention_forward(w, x[7:], pos[7:], cache, cfg)
    torch.testing.assert_close(again, first[7:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
def test_static_attention_writes_at_device_indices_and_masks_the_rest(T):
    """attention_static over a cache of 15 slots holding 6 tokens, the slots past them filled with
    garbage: same output and cache contents as attention_forward, cache.length untouched."""
    cfg, w, x = _attention_setup(seed=2)
    pos = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13, 14])  # kept tokens keep their positions
    eager = KVCache.empty(cfg.n_head_kv, 15, cfg.head_dim, device="cpu", dtype=torch.float32)
    attention_forward(w, x[:6], pos[:6], eager, cfg)
    static = KVCache(eager.k.clone(), eager.v.clone(), eager.length)
    static.k[:, 6:] = 1e3
    static.v[:, 6:] = -1e3
    ref = attention_forward(w, x[6:6 + T], pos[6:6 + T], eager, cfg)

    slots = torch.tensor(6) + torch.arange(T)
    visible = torch.arange(15)[None, :] <= slots[:, None]
    out = attention_static(w, x[6:6 + T], pos[6:6 + T], slots, visible, static, cfg)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(static.k[:, :6 + T], eager.k[:, :6 + T], rtol=0, atol=0)
    torch.testing.assert_close(static.v[:, :6 + T], eager.v[:, :6 + T], rtol=0, atol=0)
    assert static.length == 6 and bool((static.k[:, 6 + T:] == 1e3).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lower_right_causal_attention_at_the_35b_head_shapes():
    """bf16, 16 query heads on 2 KV heads of 256: within bf16 rounding of the built mask's result, and the
    call's peak memory under the built mask's."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    T, K = 1000, 3000
    q = torch.randn(T, 16, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    keys, values = (torch.randn(2, K, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    visible = torch.arange(K, device="cuda")[None, :] <= (K - T + torch.arange(T, device="cuda"))[:, None]

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    ref, ref_bytes = peak(lambda: grouped_attention(q, keys, values, visible))
    out, out_bytes = peak(lambda: continued_causal_attention(q, keys, values))
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2
    assert out_bytes < ref_bytes
