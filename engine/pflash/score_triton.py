"""Triton kernels for the lookahead token scores, without the [H, NL, T] attention matrix.

Two passes over the keys. Pass 1 (grid: key heads x key splits) keeps a running row max and
sum of exponentials for every (query head, lookahead query) row; the splits are merged in
torch into one log-sum-exp per row. Pass 2 (grid: key blocks) recomputes the logits of each
key block for all heads, normalises them with that log-sum-exp, maxes over heads and folds
the result into a running [NL, T] maximum, so calling it once per layer leaves the max over
layers and heads. A program's rows are (query head of its group, lookahead query) pairs,
padded to powers of two. ``score.py`` holds the reference these kernels are tested against.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from engine.pflash.score import check_lookahead


@triton.jit
def _row_stats_kernel(
    q_ptr, k_ptr, m_ptr, l_ptr,
    T, NL, sm_scale,
    stride_qh, stride_qi, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_ms, stride_mh,
    G: tl.constexpr, D: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_kv = tl.program_id(0)
    i_s = tl.program_id(1)
    BM: tl.constexpr = BLOCK_H * BLOCK_Q
    o_r = tl.arange(0, BM)
    o_h = i_kv * G + o_r // BLOCK_Q  # query head of each row
    o_i = o_r % BLOCK_Q  # lookahead query of each row
    m_r = (o_r // BLOCK_Q < G) & (o_i < NL)
    pos = T - NL + o_i  # [BM]
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)

    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    for i_b in range(SPLIT_BLOCKS):
        o_t = (i_s * SPLIT_BLOCKS + i_b) * BLOCK_N + o_n
        b_s = tl.zeros([BM, BLOCK_N], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            m_d = d0 + o_d < D
            p_q = q_ptr + o_h[:, None] * stride_qh + o_i[:, None] * stride_qi + (d0 + o_d)[None, :] * stride_qd
            b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
            p_k = k_ptr + i_kv * stride_kh + o_t[None, :] * stride_kt + (d0 + o_d)[:, None] * stride_kd
            b_k = tl.load(p_k, mask=m_d[:, None] & (o_t < T)[None, :], other=0.0)  # [BD, BN]
            b_s += tl.dot(b_q, b_k, input_precision=PRECISION)
        m_s = m_r[:, None] & (o_t[None, :] <= pos[:, None]) & (o_t < T)[None, :]
        b_s = tl.where(m_s, b_s * sm_scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_l = b_l * tl.exp(b_m - m_safe) + tl.sum(tl.exp(b_s - m_safe[:, None]), axis=1)
        b_m = m_new
    p_out = i_s * stride_ms + o_h * stride_mh + o_i
    tl.store(m_ptr + p_out, b_m, mask=m_r)
    tl.store(l_ptr + p_out, b_l, mask=m_r)


@triton.jit
def _prob_max_kernel(
    q_ptr, k_ptr, lse_ptr, out_ptr,
    T, NL, sm_scale,
    stride_qh, stride_qi, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_lh, stride_oi,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_n = tl.program_id(0)
    BM: tl.constexpr = BLOCK_H * BLOCK_Q
    o_r = tl.arange(0, BM)
    o_g = o_r // BLOCK_Q  # query head within the group
    o_i = o_r % BLOCK_Q
    m_r = (o_g < G) & (o_i < NL)
    pos = T - NL + o_i
    o_d = tl.arange(0, BLOCK_D)
    o_t = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_t = o_t < T
    m_s = m_r[:, None] & (o_t[None, :] <= pos[:, None]) & m_t[None, :]  # [BM, BN]

    b_best = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    for i_kv in range(HKV):
        o_h = i_kv * G + o_g
        b_s = tl.zeros([BM, BLOCK_N], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            m_d = d0 + o_d < D
            p_q = q_ptr + o_h[:, None] * stride_qh + o_i[:, None] * stride_qi + (d0 + o_d)[None, :] * stride_qd
            b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
            p_k = k_ptr + i_kv * stride_kh + o_t[None, :] * stride_kt + (d0 + o_d)[:, None] * stride_kd
            b_k = tl.load(p_k, mask=m_d[:, None] & m_t[None, :], other=0.0)  # [BD, BN]
            b_s += tl.dot(b_q, b_k, input_precision=PRECISION)
        b_lse = tl.load(lse_ptr + o_h * stride_lh + o_i, mask=m_r, other=0.0)  # [BM]
        b_p = tl.where(m_s, tl.exp(b_s * sm_scale - b_lse[:, None]), 0.0)
        b_p = tl.max(tl.reshape(b_p, [BLOCK_H, BLOCK_Q, BLOCK_N]), axis=0)  # [BQ, BN]
        b_best = tl.maximum(b_best, b_p)
    o_q = tl.arange(0, BLOCK_Q)
    p_o = out_ptr + o_q[:, None] * stride_oi + o_t[None, :]
    m_o = (o_q < NL)[:, None] & m_t[None, :]
    b_old = tl.load(p_o, mask=m_o, other=0.0)
    tl.store(p_o, tl.maximum(b_old, b_best), mask=m_o)


def _blocks(n_group: int, n_look: int, head_dim: int) -> tuple[int, int, int]:
    block_h = triton.next_power_of_2(n_group)
    block_q = max(triton.next_power_of_2(n_look), 16 // min(block_h, 16))  # tl.dot needs >= 16 rows
    block_d = min(max(triton.next_power_of_2(head_dim), 16), 128)
    return block_h, block_q, block_d


def lookahead_max_probs_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *,
                         block_n: int = 64) -> torch.Tensor:
    """Fold one layer into ``out`` [NL, T] float32: out = max(out, max over heads of P) in place.

    q: [H, NL, D], k: [Hkv, T, D], same dtype and device, any strides; P is the causal
    softmax of the lookahead queries over all keys.
    """
    check_lookahead(q, k)
    n_head, n_look, head_dim = q.shape
    n_kv, t, _ = k.shape
    if out.shape != (n_look, t) or out.dtype != torch.float32 or out.device != q.device:
        raise ValueError(f"out must be float32 [{n_look}, {t}] on {q.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"queries and keys must be float32, float16 or bfloat16, got {q.dtype}")
    group = n_head // n_kv
    block_h, block_q, block_d = _blocks(group, n_look, head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    scale = 1.0 / math.sqrt(head_dim)
    n_blocks = triton.cdiv(t, block_n)
    # Blocks per split are a compile-time trip count (a power of two, so few variants compile):
    # about 64 programs per key head keep a GPU busy on long prompts.
    split_blocks = triton.next_power_of_2(triton.cdiv(n_blocks, 64))
    n_splits = triton.cdiv(n_blocks, split_blocks)

    m = torch.empty(n_splits, n_head, n_look, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    common = dict(G=group, D=head_dim, BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=block_n,
                  BLOCK_D=block_d, PRECISION=precision)
    _row_stats_kernel[(n_kv, n_splits)](
        q, k, m, l, t, n_look, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        m.stride(0), m.stride(1), SPLIT_BLOCKS=split_blocks, **common)
    big = m.amax(dim=0)  # [H, NL]; key 0 is visible to every query, so it is finite
    lse = (big + torch.log((l * torch.exp(m - big)).sum(dim=0))).contiguous()
    _prob_max_kernel[(triton.cdiv(t, block_n),)](
        q, k, lse, out, t, n_look, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        lse.stride(0), out.stride(0), HKV=n_kv, **common)
    return out


def token_scores_triton(queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor], *,
                        block_n: int = 64) -> torch.Tensor:
    """Same contract as ``score.token_scores``: [T] float32, max over layers and heads,
    mean over the lookahead queries."""
    if not queries or len(queries) != len(keys):
        raise ValueError(f"need one key tensor per query tensor and at least one layer, got "
                         f"{len(queries)} and {len(keys)}")
    n_look, t = queries[0].shape[1], keys[0].shape[1]
    out = torch.zeros(n_look, t, device=queries[0].device, dtype=torch.float32)
    for q, k in zip(queries, keys):
        lookahead_max_probs_(out, q, k, block_n=block_n)
    return out.mean(dim=0)
