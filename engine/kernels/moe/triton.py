"""Fused routed-expert FFN in Triton.

Decode (few tokens) uses one program per routed pair for gate/up + SiLU, then one program
per routed pair and block of output rows for the weighted down projection, and one sum over
each token's k rows (deterministic, unlike atomics): no sorting, no zero-fill. A program per
token for the down projection left 128 programs for the H200's 132 SMs at one token.

Prefill groups the routed pairs by expert (sorted by expert id, each expert's run padded to
a multiple of BLOCK_M) so one program multiplies a block of tokens by one expert's weights
with tensor-core dots; the down kernel writes each pair's weighted row and the k rows of a
token are summed afterwards (deterministic, unlike an atomic scatter-add).

Negative expert ids are skipped: the hybrid executor serves those pairs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.tiles import check_tiles


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile sizes; ``gemv_max_tokens`` picks the per-pair decode kernels up to that many tokens.

    32: on the H200 at the 35B shapes (bf16, ``bench/moe_kernel.py``) the per-pair kernels took
    116 and 199 us at 8 and 16 tokens against the grouped kernels' 877 and 962 us, and 609
    against 627 us at 64 (docs/benchmarks.md, "Fused-MoE kernel at the real shapes"). DFlash
    verify blocks (up to 16 tokens) therefore stay on the per-pair kernels."""

    gemv_max_tokens: int = 32
    gemv_block_n: int = 16
    gemv_block_k: int = 256
    gemv_num_warps: int = 4
    block_m: int = 64
    block_m_small: int = 16  # used when experts see few tokens each
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_tiles(self, {"gemv_block_n": 1, "gemv_block_k": 16, "block_m": 16, "block_m_small": 16,
                           "block_n": 16, "block_k": 16}, ("gemv_num_warps", "num_warps"))
        if self.gemv_max_tokens < 0 or self.num_stages < 1:
            raise ValueError(f"gemv_max_tokens must be >= 0 and num_stages >= 1, got "
                             f"{self.gemv_max_tokens} and {self.num_stages}")


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, g_ptr, u_ptr, ids_ptr, act_ptr,
    H: tl.constexpr, F: tl.constexpr,
    stride_xt, stride_ge, stride_gf, stride_ue, stride_uf, stride_ap,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + pair)
    routed = e >= 0
    e = tl.maximum(e, 0)
    tok = pair // TOPK
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = (o_n < F) & routed
    p_g = g_ptr + e * stride_ge + o_n[:, None] * stride_gf  # [BN, 1]
    p_u = u_ptr + e * stride_ue + o_n[:, None] * stride_uf
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(x_ptr + tok * stride_xt + o_k, mask=m_k & routed, other=0.0).to(tl.float32)  # [BK]
        m_w = m_n[:, None] & m_k[None, :]
        b_g = tl.load(p_g + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)  # [BN, BK]
        b_u = tl.load(p_u + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        acc_g += tl.sum(b_g * b_x[None, :], axis=1)
        acc_u += tl.sum(b_u * b_x[None, :], axis=1)
    b_act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + pair * stride_ap + o_n, b_act.to(act_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _gemv_down_kernel(
    act_ptr, d_ptr, ids_ptr, w_ptr, out_ptr,
    H: tl.constexpr, F: tl.constexpr,
    stride_ap, stride_de, stride_dh, stride_op,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    e = tl.load(ids_ptr + pair)
    routed = e >= 0
    e = tl.maximum(e, 0)
    b_w = tl.load(w_ptr + pair).to(tl.float32)
    p_d = d_ptr + e * stride_de + o_n[:, None] * stride_dh  # [BN, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = (o_k < F) & routed
        b_a = tl.load(act_ptr + pair * stride_ap + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_d = tl.load(p_d + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b_d * b_a[None, :], axis=1)
    tl.store(out_ptr + pair * stride_op + o_n, tl.where(routed, b_w, 0.0) * acc, mask=m_n)


@triton.jit
def pair_route(ids_ptr, p, N_ROUTED, TOP_K):
    """Decode pair ``p`` of a launch whose pairs from ``N_ROUTED`` on are the tokens' shared experts:
    whether it is one, whether it computes (a routed id of -1 does not), its expert (int64, 0 when
    none) and its token."""
    shared = p >= N_ROUTED
    e = tl.load(ids_ptr + tl.minimum(p, N_ROUTED - 1))
    live = (e >= 0) | shared
    return shared, live, tl.maximum(e, 0).to(tl.int64), tl.where(shared, p - N_ROUTED, p // TOP_K)


@triton.jit
def stage_route(ids_ptr, p, N_ROUTED):
    """Whether routed pair ``p`` reads the stage stack (id ``-2 - j``) and its row ``j`` there (int64, 0 when
    not); a shared pair (``p >= N_ROUTED``) never does."""
    e = tl.load(ids_ptr + tl.minimum(p, N_ROUTED - 1))
    return (e <= -2) & (p < N_ROUTED), tl.maximum(-2 - e, 0).to(tl.int64)


@triton.jit
def pair_block(pairs_ptr, block_expert_ptr, pid_m, n_pairs, BLOCK_M: tl.constexpr):
    """Block ``pid_m`` of the pairs grouped by ``align_by_expert``: its expert (int64, 0 for an
    unused block), whether it is used, its pair indices [BLOCK_M] and which of them are real."""
    e = tl.load(block_expert_ptr + pid_m)
    used = e >= 0
    b_pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # n_pairs marks padding
    return tl.maximum(e, 0).to(tl.int64), used, b_pair, (b_pair < n_pairs) & used


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, g_ptr, u_ptr, act_ptr, pairs_ptr, block_expert_ptr,
    n_pairs, H: tl.constexpr, F: tl.constexpr,
    stride_xt, stride_ge, stride_gf, stride_ue, stride_uf, stride_ap,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, used, b_pair, m_m = pair_block(pairs_ptr, block_expert_ptr, pid_m, n_pairs, BLOCK_M)
    b_tok = b_pair // TOPK
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = (o_n < F) & used
    p_g = g_ptr + e * stride_ge + o_n[None, :] * stride_gf  # [1, BN]
    p_u = u_ptr + e * stride_ue + o_n[None, :] * stride_uf
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(x_ptr + b_tok[:, None] * stride_xt + o_k[None, :],
                      mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        m_w = m_k[:, None] & m_n[None, :]
        b_g = tl.load(p_g + o_k[:, None], mask=m_w, other=0.0)  # [BK, BN]
        b_u = tl.load(p_u + o_k[:, None], mask=m_w, other=0.0)
        acc_g = tl.dot(b_x, b_g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(b_x, b_u, acc_u, input_precision=DOT_PRECISION)
    b_act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + b_pair[:, None] * stride_ap + o_n[None, :], b_act.to(act_ptr.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _grouped_down_kernel(
    act_ptr, d_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr,
    n_pairs, H: tl.constexpr, F: tl.constexpr,
    stride_ap, stride_de, stride_dh, stride_op,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, used, b_pair, m_m = pair_block(pairs_ptr, block_expert_ptr, pid_m, n_pairs, BLOCK_M)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = (o_n < H) & used
    p_d = d_ptr + e * stride_de + o_n[None, :] * stride_dh  # [1, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < F
        b_a = tl.load(act_ptr + b_pair[:, None] * stride_ap + o_k[None, :],
                      mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_d = tl.load(p_d + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(b_a, b_d, acc, input_precision=DOT_PRECISION)
    b_w = tl.load(w_ptr + b_pair, mask=m_m, other=0.0).to(tl.float32)  # [BM]
    acc = acc * b_w[:, None]
    tl.store(out_ptr + b_pair[:, None] * stride_op + o_n[None, :], acc, mask=m_m[:, None] & m_n[None, :])


def align_by_expert(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group routed pairs by expert without a host synchronisation.

    Returns ``pairs`` [n_blocks * block_m] (flat pair index t * k + j, sorted by expert, each
    expert's run padded with ``T * k``) and ``block_expert`` [n_blocks] (the expert of each
    block, -1 for blocks past the end). ``n_blocks`` is an upper bound that depends only on
    the shapes, so the grid can be sized without reading the routing back.
    """
    flat = topk_ids.reshape(-1)
    n_pairs = flat.numel()
    dev = flat.device
    key = torch.where(flat < 0, n_experts, flat)  # skipped pairs sort last, into bucket n_experts
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    counts = counts.index_add_(0, key, torch.ones_like(key))[:n_experts]  # bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in sorted order
    n_blocks = triton.cdiv(n_pairs + min(n_pairs, n_experts) * (block_m - 1), block_m)
    capacity = n_blocks * block_m

    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    clamped = sorted_key.clamp(max=n_experts - 1)
    rank = torch.arange(n_pairs, device=dev) - first[clamped]
    dest = torch.where(sorted_key < n_experts, starts[clamped] + rank, capacity)
    pairs = torch.full((capacity + 1,), n_pairs, dtype=torch.int64, device=dev)
    pairs.scatter_(0, dest, order)
    block_start = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, -1)
    return pairs[:capacity], block_expert


def _check(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           topk_ids: torch.Tensor, topk_w: torch.Tensor) -> None:
    T, H = x.shape
    E, F_, H_g = gate.shape
    if up.shape != gate.shape or down.shape != (E, H, F_) or H_g != H:
        raise ValueError(f"expert shapes gate {tuple(gate.shape)}, up {tuple(up.shape)}, down "
                         f"{tuple(down.shape)} do not match hidden size {H}")
    if topk_ids.shape != topk_w.shape or topk_ids.shape[0] != T:
        raise ValueError(f"routing shapes ids {tuple(topk_ids.shape)}, weights {tuple(topk_w.shape)} "
                         f"do not match {T} tokens")
    if topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64, got {topk_ids.dtype}")
    if not (gate.dtype == up.dtype == down.dtype):
        raise ValueError(f"expert dtypes differ: {gate.dtype}, {up.dtype}, {down.dtype}")
    devices = {t.device for t in (x, gate, up, down, topk_ids, topk_w)}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    for name, t in (("gate", gate), ("up", up), ("down", down)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def fused_moe_triton(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                     topk_ids: torch.Tensor, topk_w: torch.Tensor,
                     config: MoEKernelConfig | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x.dtype (see ``reference.moe_reference`` for the maths)."""
    _check(x, gate, up, down, topk_ids, topk_w)
    config = config or MoEKernelConfig()
    T, H = x.shape
    if T == 0:
        return torch.zeros_like(x)
    E, F_, _ = gate.shape
    K = topk_ids.shape[1]
    xw = x.to(gate.dtype).contiguous()
    ids = topk_ids.contiguous()
    w = topk_w.float().contiguous()
    act = torch.empty(T * K, F_, dtype=gate.dtype, device=x.device)
    precision = "ieee" if gate.dtype == torch.float32 else "tf32"

    if T <= config.gemv_max_tokens:
        bn, bk = config.gemv_block_n, config.gemv_block_k
        out_pairs = torch.empty(T * K, H, dtype=torch.float32, device=x.device)
        _gemv_gate_up_kernel[(T * K, triton.cdiv(F_, bn))](
            xw, gate, up, ids, act, H, F_,
            xw.stride(0), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), act.stride(0),
            TOPK=K, BLOCK_N=bn, BLOCK_K=bk, num_warps=config.gemv_num_warps)
        _gemv_down_kernel[(T * K, triton.cdiv(H, bn))](  # one program per routed pair and row block
            act, down, ids, w, out_pairs, H, F_,
            act.stride(0), down.stride(0), down.stride(1), out_pairs.stride(0),
            BLOCK_N=bn, BLOCK_K=bk, num_warps=config.gemv_num_warps)
        return out_pairs.view(T, K, H).sum(1).to(x.dtype)

    bm = config.block_m if T * K >= 4 * E else config.block_m_small
    pairs, block_expert = align_by_expert(ids, E, bm)
    n_blocks = block_expert.numel()
    out_pairs = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
    _grouped_gate_up_kernel[(n_blocks, triton.cdiv(F_, config.block_n))](
        xw, gate, up, act, pairs, block_expert, T * K, H, F_,
        xw.stride(0), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), act.stride(0),
        TOPK=K, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    _grouped_down_kernel[(n_blocks, triton.cdiv(H, config.block_n))](
        act, down, w, out_pairs, pairs, block_expert, T * K, H, F_,
        act.stride(0), down.stride(0), down.stride(1), out_pairs.stride(0),
        BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out_pairs.view(T, K, H).sum(1).to(x.dtype)
