"""Gated full attention of qwen35moe: q/k RMSNorm, partial NeoX RoPE, causal GQA, sigmoid gate."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kernels import fused
from engine.model.config import ModelConfig
from engine.model.norm import rms_norm
from engine.model.state import KVCache
from engine.model.weights import AttentionWeights
from engine.model.linear import linear


# cuDNN's attention builds a new execution plan for every key length it meets: ~17 ms of host
# time per call in decode, where the key length grows by one each step (profiled on the H200)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# A block of at least this many tokens that continues a cache (a long prompt prefilled in chunks)
# attends through the backends' causal mask aligned to the last key ("lower right") rather than a
# [T, past + T] mask built here; shorter blocks (decode steps, DFlash verify blocks) keep the mask.
CONTINUED_CAUSAL_MIN_TOKENS = 64


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to the backends whose cost does not grow with
    the number of distinct shapes seen (flash, memory-efficient, math)."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rope_dim // 2] float32 for integer ``positions`` [T].

    Text-only MRoPE gives all three sections the same position, so it reduces to this.
    """
    angles = positions.to(torch.float32)[:, None] * _inv_freq(rope_dim, theta, positions.device)[None, :]
    return angles.cos(), angles.sin()


@functools.lru_cache(maxsize=16)
def _inv_freq(rope_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's frequencies [rope_dim // 2] float32, computed once per device (a captured decode step
    then launches only the angles' product, cosine and sine). An ordinary tensor, not an inference
    one, so that training passes may use it too."""
    with torch.inference_mode(False):
        return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [T, heads, head_dim], NeoX pairing (i, i + half)."""
    half = cos.shape[-1]
    x1 = x[..., :half].float()
    x2 = x[..., half:2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [T, rope_dim // 2] of a step's positions

# Calls of up to this many tokens on CUDA norm and rotate each query and key head in one launch
# (``engine.kernels.rope_norm``). FUSED_ROPE None: where it applies; True: for every call of up
# to that many tokens, whatever the device (tests, with TRITON_INTERPRET=1); False: never.
ROPE_MAX_TOKENS = 16
FUSED_ROPE: bool | None = None
NORM_ROPE = "attention q/k norm + RoPE"


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """An attention head's RMSNorm, then its rotary embedding: x [T, heads, D] -> [T, heads, D]."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def _picks_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and fused.allowed(NORM_ROPE) and not (torch.is_grad_enabled() and x.requires_grad)


def _rope_kernel_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether heads x [T, heads, D] go through the norm + RoPE kernels (``FUSED_ROPE``)."""
    shaped = x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and x.shape[0] <= ROPE_MAX_TOKENS
    return shaped and (FUSED_ROPE or (FUSED_ROPE is None and _picks_kernel(x)))


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              eps: float) -> torch.Tensor:
    """``norm_rope_reference``'s result; one Triton launch per call of up to ``ROPE_MAX_TOKENS``
    tokens on CUDA."""
    forced = FUSED_ROPE
    if _rope_kernel_applies(x, cos, sin):
        def kernel() -> torch.Tensor:
            from engine.kernels.rope_norm import norm_rope_triton

            return norm_rope_triton(x, weight, cos, sin, eps)

        out = fused.attempt(NORM_ROPE, forced, kernel)
        if out is not None:
            return out
    return norm_rope_reference(x, weight, cos, sin, eps)


def _project(w: AttentionWeights, x: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
             rope: Rope | None = None, *, norm_k: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, n_head, D] and k [T, n_head_kv, D] normed and rotated (k as projected with ``norm_k`` False),
    v [T, n_head_kv, D], gate [T, n_head, D] (a view into the projection)."""
    T = x.shape[0]
    D = cfg.head_dim
    if w.qkv is not None:  # one matrix product, split by columns
        qg, k, v = linear(x, w.qkv).split([cfg.n_head * 2 * D, cfg.n_head_kv * D, cfg.n_head_kv * D], dim=-1)
    else:
        qg, k, v = linear(x, w.q), linear(x, w.k), linear(x, w.v)
    qg = qg.view(T, cfg.n_head, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = k.view(T, cfg.n_head_kv, D)
    v = v.view(T, cfg.n_head_kv, D)
    cos, sin = rope if rope is not None else rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta)
    if norm_k:
        k = norm_rope(k, w.k_norm, cos, sin, cfg.rms_eps)
    return norm_rope(q, w.q_norm, cos, sin, cfg.rms_eps), k, v, gate


def _gated(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output [T, n_head * D] times ``sigmoid(gate)`` ([T, n_head, D])."""
    return out * torch.sigmoid(gate.reshape(out.shape))


def attention_forward(w: AttentionWeights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      cfg: ModelConfig, rope: Rope | None = None) -> torch.Tensor:
    """x [T, hidden] (already normed), positions [T] -> [T, hidden]; appends to ``cache``.
    ``rope``: the positions' (cos, sin) when the caller computed them once for every layer."""
    T = x.shape[0]
    q, k, v, gate = _project(w, x, positions, cfg, rope)
    past = cache.length
    keys, values = cache.append(k.transpose(0, 1), v.transpose(0, 1))  # [n_head_kv, past + T, D]
    if past == 0:  # a prompt from the start: causal attention, the backend's own choice
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], is_causal=True,
                                             enable_gqa=cfg.n_head != cfg.n_head_kv)
        out = out[0].transpose(0, 1).reshape(T, cfg.n_head * cfg.head_dim)
    elif T >= CONTINUED_CAUSAL_MIN_TOKENS:
        out = continued_causal_attention(q, keys, values)
    else:
        # query i sits at cache index past + i and sees keys 0 ..= past + i
        idx = torch.arange(past + T, device=x.device)
        mask = idx[None, :] <= (past + torch.arange(T, device=x.device))[:, None]
        out = grouped_attention(q, keys, values, mask)
    return linear(_gated(out, gate), w.o)


def attention_rows(w: AttentionWeights, x: torch.Tensor, rows: int, cfg: ModelConfig, rope: Rope) -> torch.Tensor:
    """``attention_forward`` over ``rows`` sequences of equal length from empty caches, each causal
    over itself: x [rows * L, hidden] (row-major), ``rope`` the (cos, sin) of every token's position
    [rows * L, rope_dim // 2] -> [rows * L, hidden]. One attention call over the rows as a batch."""
    T = x.shape[0]
    if rows < 1 or T % rows:
        raise ValueError(f"{T} tokens do not split into {rows} rows of equal length")
    L = T // rows
    q, k, v, gate = _project(w, x, torch.empty(0), cfg, rope)

    def batch(t: torch.Tensor) -> torch.Tensor:  # [rows * L, heads, D] -> [rows, heads, L, D]
        return t.reshape(rows, L, *t.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True,
                                         enable_gqa=cfg.n_head != cfg.n_head_kv)
    return linear(_gated(out.transpose(1, 2).reshape(T, cfg.n_head * cfg.head_dim), gate), w.o)


def continued_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [T, n_head, D], the last T of keys, values [n_kv_head, K, D] -> [T, n_head * D]: query i sees keys
    0 ..= K - T + i. The KV heads are repeated for their query heads (the backends' lower-right mask wants
    equal head counts): 2 * n_head * K * D values for the call, against the T * K mask it replaces."""
    # imported here: torch.nn.attention.bias imports Triton, which must not load before the tests set
    # TRITON_INTERPRET for the kernels they run under the interpreter
    from torch.nn.attention.bias import causal_lower_right

    T, n_head, D = q.shape
    n_kv, K, _ = keys.shape
    if n_head != n_kv:
        keys = keys.repeat_interleave(n_head // n_kv, dim=0)  # query head h reads KV head h // group
        values = values.repeat_interleave(n_head // n_kv, dim=0)
    out = sdpa(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=causal_lower_right(T, K))
    return out[0].transpose(0, 1).reshape(T, n_head * D)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [T, n_head, D] against keys, values [n_head_kv, K, D] with ``visible`` [T, K] bool -> [T, n_head * D].

    Query head h reads KV head h // group: the group's heads become group * T queries of their
    KV head, so the cache is read as it is, never expanded to n_head heads.
    """
    T, n_head, D = q.shape
    n_kv = keys.shape[0]
    group = n_head // n_kv
    qh = q.view(T, n_kv, group, D).permute(1, 2, 0, 3).reshape(n_kv, group * T, D)
    mask = visible.repeat(group, 1)  # row g * T + t is query t's
    out = sdpa(qh[None], keys[None], values[None], attn_mask=mask)
    return out[0].view(n_kv, group, T, D).permute(2, 0, 1, 3).reshape(T, n_head * D)


# The captured step's attention over the preallocated cache through ``engine.kernels.decode_attention``
# (split along the keys; chunks past the written slots skipped). FUSED_DECODE_ATTENTION None: on
# CUDA, and under the interpreter when the step's kernels are "triton"; True: always; False: never.
FUSED_DECODE_ATTENTION: bool | None = None
DECODE_ATTENTION = "split-key decode attention"


def static_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     slots: torch.Tensor, kernels: str = "auto", gate: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_attention`` over a whole preallocated cache, through the split-key kernel where it
    applies (``FUSED_DECODE_ATTENTION``; ``kernels="torch"`` keeps torch's); times ``sigmoid(gate)``
    ([T, n_head, D]) when given, inside the kernel's last launch there."""
    forced = FUSED_DECODE_ATTENTION
    if forced is None and kernels == "triton" and not q.is_cuda:
        forced = True  # the Triton interpreter, as the CPU tests run the step
    if forced or (forced is None and kernels != "torch" and q.is_cuda and fused.allowed(DECODE_ATTENTION)
                  and not torch.is_grad_enabled()):
        from engine.kernels import decode_attention

        if decode_attention.supports(q, keys):
            out = fused.attempt(DECODE_ATTENTION, forced, lambda: decode_attention.decode_attention_triton(
                q.contiguous(), keys, values, visible, slots, gate=gate))
            if out is not None:
                return out
    out = grouped_attention(q, keys, values, visible)
    return out if gate is None else _gated(out, gate)


def attention_static(w: AttentionWeights, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     visible: torch.Tensor, cache: KVCache, cfg: ModelConfig, rope: Rope | None = None,
                     kernels: str = "auto") -> torch.Tensor:
    """``attention_forward`` with every index on the device, for a decode step of fixed shapes.

    x [T, hidden] (already normed), positions [T]; ``slots`` [T] int64 are the cache indices
    the tokens' keys and values are written to, ``visible`` [T, max_len] bool the keys each
    query sees. Attention runs over the whole preallocated cache (``static_attention``: with
    ``kernels``, its chunks past the written slots skipped); ``cache.length`` is left to the caller.
    """
    rope = rope if rope is not None else rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta)
    q, k, v, gate = _project(w, x, positions, cfg, rope, norm_k=False)
    write_kv(k, v, w.k_norm, rope, cache.k, cache.v, slots, cfg.rms_eps)
    return linear(static_attention(q, cache.k, cache.v, visible, slots, kernels, gate=gate), w.o)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_norm: torch.Tensor, rope: Rope, cache_k: torch.Tensor,
             cache_v: torch.Tensor, slots: torch.Tensor, eps: float) -> None:
    """The keys k [T, kv heads, D] as projected, normed (``k_norm``) and turned, and the values v into the
    caches [kv heads, L, D] at ``slots`` [T]: one launch where the norm + RoPE kernel applies
    (``FUSED_ROPE``), else torch's norm, rotation and two index copies."""
    cos, sin = rope
    if v.stride(-1) == 1 and _rope_kernel_applies(k, cos, sin):
        def kernel() -> torch.Tensor:
            from engine.kernels.rope_norm import norm_rope_to_cache_triton

            return norm_rope_to_cache_triton(k, v, k_norm, cos, sin, eps, cache_k, cache_v, slots)

        if fused.attempt(NORM_ROPE, FUSED_ROPE, kernel) is not None:
            return
    k = norm_rope(k, k_norm, cos, sin, eps)
    cache_k.index_copy_(1, slots, k.transpose(0, 1).to(cache_k.dtype))
    cache_v.index_copy_(1, slots, v.transpose(0, 1).to(cache_v.dtype))
