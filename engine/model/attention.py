"""Gated full attention of qwen35moe: q/k RMSNorm, partial NeoX RoPE, causal GQA, sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.norm import rms_norm
from engine.model.state import KVCache
from engine.model.weights import AttentionWeights
from engine.model.linear import linear


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rope_dim // 2] float32 for integer ``positions`` [T].

    Text-only MRoPE gives all three sections the same position, so it reduces to this.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float32) / rope_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [T, heads, head_dim], NeoX pairing (i, i + half)."""
    half = cos.shape[-1]
    x1 = x[..., :half].float()
    x2 = x[..., half:2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


def attention_forward(w: AttentionWeights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      cfg: ModelConfig) -> torch.Tensor:
    """x [T, hidden] (already normed), positions [T] -> [T, hidden]; appends to ``cache``."""
    T = x.shape[0]
    D = cfg.head_dim
    qg = linear(x, w.q).view(T, cfg.n_head, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, cfg.n_head * D)
    k = linear(x, w.k).view(T, cfg.n_head_kv, D)
    v = linear(x, w.v).view(T, cfg.n_head_kv, D)
    q = rms_norm(q, w.q_norm, cfg.rms_eps)
    k = rms_norm(k, w.k_norm, cfg.rms_eps)
    cos, sin = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    past = cache.length
    keys, values = cache.append(k.transpose(0, 1), v.transpose(0, 1))  # [n_head_kv, past + T, D]
    if past == 0:
        mask, causal = None, True
    else:
        # query i sits at cache index past + i and sees keys 0 ..= past + i
        idx = torch.arange(past + T, device=x.device)
        mask = idx[None, :] <= (past + torch.arange(T, device=x.device))[:, None]
        causal = False
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         is_causal=causal, enable_gqa=cfg.n_head != cfg.n_head_kv)
    out = out[0].transpose(0, 1).reshape(T, cfg.n_head * D)
    return linear(out * torch.sigmoid(gate), w.o)
