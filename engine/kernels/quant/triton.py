"""Matmuls that read ggml blocks and dequantize in registers: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K.

Every kernel maps each weight element (row n, column k) to its bytes: the block
``k // QK`` of row n, the fp16 scale(s) at the block's start, and the code's byte and bit
position inside the block (the layouts of ggml's ``block_q4_0`` ... ``block_q6_K``, decoded
in ``_dequant``). Values are formed in float32 exactly as ``engine.gguf.quants`` forms them.
Every element loads its own code and scale bytes; lanes of a warp that share a block hit the
same cache lines, so HBM traffic stays at the weight bytes, but the load count per element
is several, which may bound the decode kernels by instructions rather than bandwidth.

- GEMV (``M <= gemv_max_m``, decode): one program per ``BLOCK_N`` rows of W and one slice
  of K; it dequantizes each weight tile once and multiplies it with all M rows of x in fp32.
  When the N tiles alone cannot fill the GPU, K is split too: each split writes fp32 partial
  sums, counts itself in with an atomic on its N tile's counter, and the split that arrives
  last adds the partial sums in split order and writes the output (so the sum is
  deterministic, and no second launch is needed), then zeroes the counter for the next call.
- GEMM (prefill): output tiles of ``BLOCK_M x BLOCK_N``; the dequantized [BLOCK_K, BLOCK_N]
  tile is cast to x's dtype (bf16/fp16) and fed to ``tl.dot`` with fp32 accumulation. Split-layout
  Q4_0/Q8_0 rows are read as whole blocks (``_split_tile``: one vector load of a row's codes, the low
  and high nibbles as two half tiles, each multiplied with x's matching columns), as are the grouped
  expert launches' (prefill): 3.4x faster than per-weight tiles at 512 tokens on the H200.
- Experts (decode of the routed FFN): one program per routed pair and ``BLOCK_N`` rows of
  that pair's expert; negative expert ids write zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from engine.kernels.quant import rows
from engine.kernels.quant.rows import store_shared_gate
from engine.kernels.quant.reference import QuantExperts, QuantMatrix
from engine.kernels.fused import scratch
from engine.kernels.moe.triton import align_by_expert, pair_block, pair_route, stage_route
from engine.kernels.pdl import begin, launch, launch_next, prefetch, wait_previous
from engine.kernels.quant.tuned import config_for
from engine.kernels.tiles import check_tiles

# Kernel-side codes for the quant types (constexpr branches in ``_dequant``).
_CODE = {Q.Q4_0: 0, Q.Q8_0: 1, Q.Q4_K: 2, Q.Q5_K: 3, Q.Q6_K: 4}
# The prefill launches (GEMM, grouped experts) read split-layout Q4_0/Q8_0 tiles as whole blocks
# (``_split_tile``); False: per weight (``_dequant``), as before (benchmarks compare the two).
WHOLE_BLOCK_TILES = True


@dataclass(frozen=True)
class QuantKernelConfig:
    """Tile sizes; ``gemv_max_m`` picks the GEMV kernel up to that many rows of x (at most 16);
    from ``dequant_min_m`` rows of a bf16/fp16 x (prefill) the weight is dequantized once into a
    temporary and multiplied by the dense (cuBLAS) matmul, whose tensor-core tiles then never
    wait on per-element decoding (0 turns that off).

    ``gemv_split_k`` 0 splits K only as far as needed to give every SM two programs.

    ``gemv_rows_warps`` > 0 takes the row kernels of ``engine.kernels.quant.rows`` for one token
    over Q4_0/Q8_0 in the split layout (one weight row per lane, that many warps splitting K or, in
    the experts' down launch, one pair each), ``gemv_rows_unroll`` blocks per lane in flight; the
    block tiles above then do not apply to those launches. The experts' gate/up launch needs at
    least 2 warps (gate and up halves) and the down launch at least top-k rounded up to a power of
    two (a pair each); fewer keep the block kernels there.

    ``gemv_words`` 1 takes ``engine.kernels.quant.words`` for one token over Q4_0 in the split layout on
    CUDA, with ``gemv_block_n`` rows and ``gemv_block_k`` columns a program and ``gemv_num_warps`` warps
    (the K tile holding at least 32 blocks a warp; other tiles keep the block kernel); in the experts'
    gate/up launch (kind ``moe_gate_up``) it takes the word layout for every pair of a decode or verify
    block, and in the down launch (kind ``moe_down``) a program per token and ``gemv_block_n`` output rows,
    K (the experts' ffn) in one tile.

    ``gemv_pair_split`` 1 gives the experts' down launch a program per pair (the shared expert one
    more) and row block rather than per token and row block: each stores its pair's weighted rows
    in float32, and the token's pair that arrives last adds them in pair order (the sum the
    per-token program forms, so the result is the same) and stores the output.
    """

    gemv_max_m: int = 16
    # half-precision x of this many rows: dequantize W once, then a dense matmul. 4096: the whole-block GEMM
    # tiles (``_split_tile``) measured as fast or faster below that on the H200's 35B prefill, 2,048 tokens
    # in 154 ms against 209 with 256 (docs/benchmarks.md); at 8,192 the two ties, and the GEMM throughout
    # took 380 ms against 310
    dequant_min_m: int = 4096
    gemv_block_n: int = 16
    gemv_block_k: int = 128
    gemv_split_k: int = 0
    gemv_num_warps: int = 4
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    gemv_rows_warps: int = 0
    gemv_rows_unroll: int = 4
    gemv_pair_split: int = 0
    gemv_words: int = 0

    def __post_init__(self) -> None:
        check_tiles(self, {"gemv_block_n": 1, "gemv_block_k": 16, "block_m": 16, "block_n": 16, "block_k": 16},
                    ("gemv_num_warps", "num_warps"))
        for name in ("gemv_rows_warps", "gemv_rows_unroll"):
            v = getattr(self, name)
            most = rows.MAX_UNROLL if name == "gemv_rows_unroll" else 32
            if v < 0 or v & (v - 1) or v > most or (name == "gemv_rows_unroll" and v == 0):
                raise ValueError(f"{name} must be a power of two up to {most} (gemv_rows_warps may be 0), got {v}")
        if self.gemv_pair_split not in (0, 1):
            raise ValueError(f"gemv_pair_split must be 0 or 1, got {self.gemv_pair_split}")
        if self.gemv_words not in (0, 1):
            raise ValueError(f"gemv_words must be 0 or 1, got {self.gemv_words}")
        if not 0 <= self.gemv_max_m <= 16:
            raise ValueError(f"gemv_max_m must be in [0, 16], got {self.gemv_max_m}")
        if self.dequant_min_m < 0:
            raise ValueError(f"dequant_min_m must be >= 0, got {self.dequant_min_m}")
        if self.gemv_split_k < 0 or self.num_stages < 1:
            raise ValueError(f"gemv_split_k must be >= 0 and num_stages >= 1, got {self.gemv_split_k} "
                             f"and {self.num_stages}")


# The tiles of calls made without a config past ``gemv_max_m`` rows (prefill: the GEMM, the dense
# matmul from ``dequant_min_m`` rows, the grouped experts); a benchmark may swap it for another.
PREFILL = QuantKernelConfig()


@triton.jit
def _f16(p):
    """The fp16 stored at byte pointer(s) ``p``, as float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _block_ptrs(p_row, blk, CODES: tl.constexpr, SPLIT_AT: tl.constexpr):
    """Byte pointers to the codes and the fp16 scale of blocks ``blk`` in rows starting at ``p_row``:
    Q4_0 (``CODES`` 16 bytes) or Q8_0 (32), in ggml's order (scale, then codes) or split
    (``SPLIT_AT`` > 0: every block's codes, then every scale from that byte on)."""
    if SPLIT_AT > 0:
        p_q = p_row + blk * CODES
        p_d = p_row + SPLIT_AT + blk * 2
    else:
        p_d = p_row + blk * (CODES + 2)
        p_q = p_d + 2
    return p_q, p_d


@triton.jit
def _dequant(p_row, o_k, mask, QTYPE: tl.constexpr, SPLIT_AT: tl.constexpr):
    """Weights at byte row starts ``p_row`` and columns ``o_k`` (broadcast together) as float32.

    ``SPLIT_AT`` > 0: a Q4_0/Q8_0 row in the split layout (every block's codes, then the fp16
    scales from that byte on; ``engine.kernels.quant.reference.split_rows``). The loads are
    unmasked: callers clamp rows into the tensor, and masked-off columns read block 0 of their
    row; those elements are then forced to zero.
    """
    o_k = tl.where(mask, o_k, 0)
    if QTYPE == 0:  # Q4_0: d, qs[16]; element i < 16 is qs[i] & 15, element i + 16 is qs[i] >> 4
        i = o_k % 32
        p_q, p_d = _block_ptrs(p_row, o_k // 32, 16, SPLIT_AT)
        q = (_u8(p_q + i % 16) >> ((i // 16) * 4)) & 15
        w = _f16(p_d) * (q - 8).to(tl.float32)
    elif QTYPE == 1:  # Q8_0: d, qs[32] int8
        p_q, p_d = _block_ptrs(p_row, o_k // 32, 32, SPLIT_AT)
        q = tl.load((p_q + o_k % 32).to(tl.pointer_type(tl.int8)))
        w = _f16(p_d) * q.to(tl.float32)
    elif QTYPE < 4:  # Q4_K (2) / Q5_K (3): d, dmin, scales[12], (qh[32],) qs[128]
        SIZE: tl.constexpr = 144 + (QTYPE - 2) * 32
        QS: tl.constexpr = 16 + (QTYPE - 2) * 32
        p_b = p_row + (o_k // 256) * SIZE
        i = o_k % 256
        j = i // 32  # sub-block: qs bytes 32 * (j // 2) .., low nibble for even j
        l = i % 32
        s_a = _u8(p_b + 4 + j)
        s_b = _u8(p_b + 8 + j)
        s_c = _u8(p_b + 4 + j % 4)
        low = j < 4  # 6-bit scale and min packed as ggml's get_scale_min_k4
        sc = tl.where(low, s_a & 63, (s_b & 15) | ((s_c >> 6) << 4))
        mn = tl.where(low, s_b & 63, (s_b >> 4) | ((s_a >> 6) << 4))
        q = (_u8(p_b + QS + (j // 2) * 32 + l) >> ((j % 2) * 4)) & 15
        if QTYPE == 3:
            q = q | (((_u8(p_b + 16 + l) >> j) & 1) << 4)
        w = q.to(tl.float32) * (_f16(p_b) * sc.to(tl.float32)) - _f16(p_b + 2) * mn.to(tl.float32)
    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d; halves of 128 in groups g of 32
        p_b = p_row + (o_k // 256) * 210
        i = o_k % 256
        h = i // 128
        g = (i % 128) // 32
        l = i % 32
        q = (_u8(p_b + h * 64 + (g % 2) * 32 + l) >> ((g // 2) * 4)) & 15
        q = q | (((_u8(p_b + 128 + h * 32 + l) >> (g * 2)) & 3) << 4)
        sc = tl.load((p_b + 192 + i // 16).to(tl.pointer_type(tl.int8))).to(tl.float32)
        w = (q - 32).to(tl.float32) * (_f16(p_b + 208) * sc)
    return tl.where(mask, w, 0.0)


@triton.jit
def _block_codes(p_row, kb, m_b, QTYPE: tl.constexpr, SPLIT_AT: tl.constexpr):
    """The codes of whole Q4_0 (``QTYPE`` 0) or Q8_0 (1) blocks ``kb`` [NB] of the rows starting at
    ``p_row`` [BN, 1]: the first and second 16 codes of each block, [BN, NB, 16] float32 each, as
    stored (Q4_0's unsigned nibbles, without the -8), and the blocks' scales [BN, NB] float32
    (zero for blocks where ``m_b`` is false; their loads read block ``kb``, kept in bounds).

    A block's codes are one contiguous run of bytes: in the split layout (``SPLIT_AT`` > 0) the
    runs start 16-byte aligned and load as one vector per thread, so a block's dot product with
    x (``_block_dots``) sums inside the thread.
    """
    o_i = tl.arange(0, 16)
    CODES: tl.constexpr = 16 if QTYPE == 0 else 32
    p_c, _ = _block_ptrs(p_row[:, :, None], kb[None, :, None], CODES, SPLIT_AT)  # [BN, NB, 1]
    _, p_d = _block_ptrs(p_row, kb[None, :], CODES, SPLIT_AT)  # [BN, NB]
    # the conversion unit's int-to-float (I2F) rather than the exponent trick of the row kernels: here
    # the trick's extra ALU operations cost 3-7% at the 35B shapes on the H200 (docs/benchmarks.md)
    if QTYPE == 0:  # d, qs[16]: code i is qs[i] & 15, code i + 16 is qs[i] >> 4
        q = _u8(p_c + o_i[None, None, :])  # [BN, NB, 16]
        lo = q & 15
        hi = q >> 4
    else:  # Q8_0: d, qs[32] int8
        p_q = (p_c + o_i[None, None, :]).to(tl.pointer_type(tl.int8))
        lo = tl.load(p_q).to(tl.int32)
        hi = tl.load(p_q + 16).to(tl.int32)
    d = tl.where(m_b[None, :], _f16(p_d), 0.0)
    return lo.to(tl.float32), hi.to(tl.float32), d


@triton.jit
def _block_x(p_x, kb, mask):
    """x at the weights of blocks ``kb`` [NB] from row pointer ``p_x``: two halves [NB, 16] float32,
    and each block's sum [NB] (Q4_0's -8 offset, applied once per block)."""
    o = kb[:, None] * 32 + tl.arange(0, 16)[None, :]
    m = mask & (kb[:, None] >= 0)
    x_lo = tl.load(p_x + o, mask=m, other=0.0).to(tl.float32)
    x_hi = tl.load(p_x + o + 16, mask=m, other=0.0).to(tl.float32)
    return x_lo, x_hi, tl.sum(x_lo + x_hi, axis=1)


@triton.jit
def _block_dots(lo, hi, d, x_lo, x_hi, x_sum, QTYPE: tl.constexpr):
    """[BN, NB] float32: each block's weights (``_block_codes``) dotted with x's (``_block_x``)."""
    s = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)
    if QTYPE == 0:
        s = s - 8.0 * x_sum[None, :]
    return d * s


@triton.jit
def _tile_codes(p_row, k0, K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_AT: tl.constexpr):
    """The K tile of whole blocks from column ``k0``: its block indices [NB] (clamped into the row) and
    ``_block_codes`` (blocks past K scaled by zero)."""
    N_BLOCKS: tl.constexpr = K // 32
    kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # [NB]
    m_b = kb < N_BLOCKS
    kb = tl.minimum(kb, N_BLOCKS - 1)
    lo, hi, d = _block_codes(p_row, kb, m_b, QTYPE, SPLIT_AT)  # [BN, NB, 16] x2, [BN, NB]
    return kb, lo, hi, d


@triton.jit
def _tile_dots(acc, acc_b, lo, hi, d, kb, x_ptr, M, stride_xm, o_m, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr):
    """One K tile's products with the rows of x: into ``acc_b`` [BN, NB] per block for one row (summed
    at the end), else into ``acc`` [BLOCK_M, BN]."""
    if BLOCK_M == 1:
        x_lo, x_hi, x_sum = _block_x(x_ptr, kb, M > 0)
        acc_b += _block_dots(lo, hi, d, x_lo, x_hi, x_sum, QTYPE)
    else:
        for m in tl.static_range(BLOCK_M):
            x_lo, x_hi, x_sum = _block_x(x_ptr + m * stride_xm, kb, m < M)  # [NB, 16] x2, [NB]
            b_y = tl.sum(_block_dots(lo, hi, d, x_lo, x_hi, x_sum, QTYPE), axis=1)  # [BN]
            acc += tl.where(o_m[:, None] == m, b_y[None, :], 0.0)
    return acc, acc_b


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K: tl.constexpr, K_SPLIT: tl.constexpr,
    stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCKWISE: tl.constexpr, SPLITS: tl.constexpr, SPLIT_AT: tl.constexpr, PDL: tl.constexpr,
):
    launch_next(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_row = w_ptr + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1], in bounds
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_s * K_SPLIT
    if BLOCKWISE:  # Q4_0 / Q8_0, BLOCK_K a multiple of 32: whole blocks at a time
        acc_b = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
        # the first K tile's weights are loaded while the kernel before may still run (``engine.kernels.pdl``)
        kb, lo, hi, d = _tile_codes(p_row, k_lo, K, QTYPE, BLOCK_K, SPLIT_AT)
        wait_previous(PDL)
        acc, acc_b = _tile_dots(acc, acc_b, lo, hi, d, kb, x_ptr, M, stride_xm, o_m, QTYPE, BLOCK_M)
        for k0 in range(BLOCK_K, K_SPLIT, BLOCK_K):
            kb, lo, hi, d = _tile_codes(p_row, k_lo + k0, K, QTYPE, BLOCK_K, SPLIT_AT)
            acc, acc_b = _tile_dots(acc, acc_b, lo, hi, d, kb, x_ptr, M, stride_xm, o_m, QTYPE, BLOCK_M)
        if BLOCK_M == 1:  # decode: the sum over blocks waited for the end of the loop
            acc += tl.sum(acc_b, axis=1)[None, :]
    else:
        wait_previous(PDL)
        for k0 in range(0, K_SPLIT, BLOCK_K):  # the last slice may end past K: masked
            o_k = k_lo + k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_w = _dequant(p_row, o_k[None, :], m_n[:, None] & m_k[None, :], QTYPE, SPLIT_AT)  # [BN, BK]
            for m in tl.static_range(BLOCK_M):
                b_x = tl.load(x_ptr + m * stride_xm + o_k, mask=m_k & (m < M), other=0.0).to(tl.float32)  # [BK]
                b_y = tl.sum(b_w * b_x[None, :], axis=1)  # [BN]
                acc += tl.where(o_m[:, None] == m, b_y[None, :], 0.0)
    m_o = m_m[:, None] & m_n[None, :]
    p_o = out_ptr + o_m[:, None] * stride_om + o_n[None, :]
    if SPLITS == 1:
        tl.store(p_o, acc.to(out_ptr.dtype.element_ty), mask=m_o)
    else:
        p_p = part_ptr + o_m[:, None] * stride_pm + o_n[None, :]
        tl.store(p_p + pid_s * stride_ps, acc, mask=m_o)
        # every thread's partial sums stored, then one release: the semaphore pattern of split-K GEMMs
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last split of this N tile: every partial sum is written
            tl.debug_barrier()  # the acquire above before any thread's loads below
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # in split order, whichever split arrived last
                total += tl.load(p_p + s * stride_ps, mask=m_o, other=0.0, cache_modifier=".cg")
            tl.store(p_o, total.to(out_ptr.dtype.element_ty), mask=m_o)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (a graph replays it)


@triton.jit
def _split_tile(p_row, k0, QTYPE: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_AT: tl.constexpr):
    """The K tile from column ``k0`` of split-layout Q4_0/Q8_0 rows starting at byte pointers ``p_row``
    [1, BN], read as whole blocks: a row's codes are one contiguous run of bytes (vector loads), and
    the tile lies inside the row (``BLOCK_K`` divides K). Returns (lo, hi) weights [BLOCK_K / 2, BN]
    float32, ``d * code`` as ``_dequant`` forms them, and the columns of x that ``lo`` multiplies
    [BLOCK_K / 2]: Q4_0's low nibbles are a block's first 16 weights and its high nibbles the other 16
    (``hi``'s columns are 16 past ``lo``'s); Q8_0's are the tile's two halves."""
    HALF: tl.constexpr = BLOCK_K // 2
    j = tl.arange(0, HALF)
    if QTYPE == 0:  # byte j of the tile: block k0 / 32 + j // 16, weights j % 16 (low) and j % 16 + 16 (high)
        q = tl.load(p_row + (k0 // 2 + j)[:, None]).to(tl.int32)  # [HALF, BN]
        d = _f16(p_row + SPLIT_AT + (k0 // 32 + j // 16)[:, None] * 2)
        return ((q & 15) - 8).to(tl.float32) * d, ((q >> 4) - 8).to(tl.float32) * d, k0 + (j // 16) * 32 + j % 16
    else:  # Q8_0, 32 bytes a block
        col = k0 + j
        lo = tl.load((p_row + col[:, None]).to(tl.pointer_type(tl.int8))).to(tl.float32)
        hi = tl.load((p_row + (col + HALF)[:, None]).to(tl.pointer_type(tl.int8))).to(tl.float32)
        d_lo = _f16(p_row + SPLIT_AT + (col // 32)[:, None] * 2)
        d_hi = _f16(p_row + SPLIT_AT + ((col + HALF) // 32)[:, None] * 2)
        return lo * d_lo, hi * d_hi, col


@triton.jit
def _x_halves(p_x, col, HI: tl.constexpr, m_m):
    """Rows ``p_x`` [BM, 1] of x at a tile's ``lo`` columns ``col`` and its ``hi`` columns (``col + HI``):
    [BM, BK / 2] x2, zeros in rows outside ``m_m``."""
    return (tl.load(p_x + col[None, :], mask=m_m[:, None], other=0.0),
            tl.load(p_x + (col + HI)[None, :], mask=m_m[:, None], other=0.0))


@triton.jit
def _rows_dot(p_x, m_m, p_row, m_n, K, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_AT: tl.constexpr, HALVES: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32: rows of x starting at ``p_x`` [BM, 1] (zeros outside ``m_m``) times the
    weight rows starting at byte pointers ``p_row`` [1, BN] (clamped in bounds; ``m_n`` the real ones) over
    K, tensor-core dots on tiles dequantized in registers: whole blocks with ``HALVES``
    (``_split_tile``), else per weight (``_dequant``)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HALVES:
        HI: tl.constexpr = 16 if QTYPE == 0 else BLOCK_K // 2
        for k0 in range(0, K, BLOCK_K):
            w_lo, w_hi, col = _split_tile(p_row, k0, QTYPE, BLOCK_K, SPLIT_AT)
            x_lo, x_hi = _x_halves(p_x, col, HI, m_m)
            acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc, input_precision=DOT_PRECISION)
    else:
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            b_w = _dequant(p_row, o_k[:, None], m_k[:, None] & m_n[None, :], QTYPE, SPLIT_AT)  # [BK, BN] float32
            acc = tl.dot(b_x, b_w.to(b_x.dtype), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr,
    stride_xm, stride_wn, stride_om,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_AT: tl.constexpr, HALVES: tl.constexpr = False,
):
    """Output tiles [BLOCK_M, BLOCK_N]; ``HALVES`` (split-layout Q4_0/Q8_0 rows that ``BLOCK_K`` divides):
    weight tiles of whole blocks (``_split_tile``), two products a tile; else per weight (``_dequant``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_row = w_ptr + tl.minimum(o_n, N - 1).to(tl.int64)[None, :] * stride_wn  # [1, BN], in bounds
    acc = _rows_dot(x_ptr + o_m[:, None] * stride_xm, m_m, p_row, m_n, K, QTYPE, BLOCK_M, BLOCK_N, BLOCK_K,
                    DOT_PRECISION, SPLIT_AT, HALVES)
    tl.store(out_ptr + o_m[:, None] * stride_om + o_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _pair_dot(p_row, p_x, K: tl.constexpr, live, N_ROWS, o_n,
              QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
              SPLIT_AT: tl.constexpr):
    """[BLOCK_N] float32: the rows at ``p_row`` [BN, 1] of one expert times the vector at ``p_x``
    (zero where ``live`` is false: a pair routed nowhere reads block 0 and discards it)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if BLOCKWISE:
        N_BLOCKS: tl.constexpr = K // 32
        acc_b = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)  # summed over blocks at the end
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            m_b = (kb < N_BLOCKS) & live
            kb = tl.minimum(kb, N_BLOCKS - 1)
            lo, hi, d = _block_codes(p_row, kb, m_b, QTYPE, SPLIT_AT)
            x_lo, x_hi, x_sum = _block_x(p_x, kb, live)
            acc_b += _block_dots(lo, hi, d, x_lo, x_hi, x_sum, QTYPE)
        acc = tl.sum(acc_b, axis=1)
    else:
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = (o_k < K) & live
            b_w = _dequant(p_row, o_k[None, :], (o_n < N_ROWS)[:, None] & m_k[None, :], QTYPE, SPLIT_AT)
            b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
            acc += tl.sum(b_w * b_x[None, :], axis=1)
    return acc


@triton.jit
def _pair_dots2(p_a, p_b, p_x, K: tl.constexpr, live, N_ROWS, o_n,
                QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
                SPLIT_AT: tl.constexpr):
    """``_pair_dot`` of two row sets of one expert (gate's at ``p_a``, up's at ``p_b``) with the same
    vector, in one loop over K: each K tile's loads of both sets issue together, twice the bytes in
    flight a program, and x's tile is read once for both. Each set's sum runs in ``_pair_dot``'s
    order, so the results are its results bit for bit."""
    acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    if BLOCKWISE:
        N_BLOCKS: tl.constexpr = K // 32
        blk_a = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)  # summed over blocks at the end
        blk_b = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            m_b = (kb < N_BLOCKS) & live
            kb = tl.minimum(kb, N_BLOCKS - 1)
            lo_a, hi_a, d_a = _block_codes(p_a, kb, m_b, QTYPE, SPLIT_AT)
            lo_b, hi_b, d_b = _block_codes(p_b, kb, m_b, QTYPE, SPLIT_AT)
            x_lo, x_hi, x_sum = _block_x(p_x, kb, live)
            blk_a += _block_dots(lo_a, hi_a, d_a, x_lo, x_hi, x_sum, QTYPE)
            blk_b += _block_dots(lo_b, hi_b, d_b, x_lo, x_hi, x_sum, QTYPE)
        acc_a = tl.sum(blk_a, axis=1)
        acc_b = tl.sum(blk_b, axis=1)
    else:
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = (o_k < K) & live
            m_w = (o_n < N_ROWS)[:, None] & m_k[None, :]
            w_a = _dequant(p_a, o_k[None, :], m_w, QTYPE, SPLIT_AT)
            w_b = _dequant(p_b, o_k[None, :], m_w, QTYPE, SPLIT_AT)
            b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
            acc_a += tl.sum(w_a * b_x[None, :], axis=1)
            acc_b += tl.sum(w_b * b_x[None, :], axis=1)
    return acc_a, acc_b


@triton.jit
def _experts_kernel(
    x_ptr, w_ptr, ids_ptr, out_ptr, N, K: tl.constexpr,
    stride_xt, stride_we, stride_wn, stride_ot,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
    SPLIT_AT: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + t)
    routed = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_row = w_ptr + e * stride_we + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    acc = _pair_dot(p_row, x_ptr + t * stride_xt, K, routed, N, o_n, QTYPE, BLOCK_N, BLOCK_K, BLOCKWISE, SPLIT_AT)
    tl.store(out_ptr + t * stride_ot + o_n, acc.to(out_ptr.dtype.element_ty), mask=o_n < N)


def _blockwise(qtype: Q, block_k: int) -> bool:
    """Whether the decode kernels take whole blocks (``_block_codes``): Q4_0 and Q8_0 with K tiles
    of whole 32-weight blocks."""
    return qtype in (Q.Q4_0, Q.Q8_0) and block_k % 32 == 0


def _halves(qe: QuantExperts | QuantMatrix, block_k: int) -> bool:
    """Whether the prefill launches read ``qe`` in whole-block tiles (``_split_tile``): ``WHOLE_BLOCK_TILES``
    on, split-layout Q4_0/Q8_0 rows, and K tiles of whole blocks that divide K."""
    return WHOLE_BLOCK_TILES and _blockwise(qe.qtype, block_k) and qe.layout == "split" and qe.k % block_k == 0


def _check_x(x: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the weights are on {device}")
    return x.contiguous()


def _split_k(n_tiles: int, k: int, block_k: int, config: QuantKernelConfig, device: torch.device) -> int:
    """Number of K slices: the configured one, or enough for two programs per SM."""
    k_tiles = triton.cdiv(k, block_k)
    if config.gemv_split_k:
        return min(config.gemv_split_k, k_tiles)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(k_tiles, triton.cdiv(2 * sms, n_tiles)))


MAX_SPLIT_TILES = 1 << 16  # N tiles a split GEMV may count in (one int32 counter each, per device)


def _split_counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters of split GEMVs and the per-pair down launch (``fused.scratch``)."""
    return scratch("split GEMV counters", (MAX_SPLIT_TILES,), torch.int32, device)


def qmatmul_gemv(x: torch.Tensor, qm: QuantMatrix, config: QuantKernelConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for at most 16 rows of x, [M, n] in x.dtype (tiles: ``config``, else the
    measured ones for this shape and GPU, else the defaults)."""
    config = config or config_for("gemv", qm.qtype.name, qm.n, qm.k, qm.device, QuantKernelConfig())
    x = _check_x(x, qm.k, qm.device)
    M = x.shape[0]
    if not 1 <= M <= 16:
        raise ValueError(f"the GEMV kernel takes 1 to 16 rows of x, got {M}")
    if config.gemv_words and M == 1 and x.is_cuda:
        from engine.kernels.quant import words

        if words.fits(qm, config.gemv_block_k, config.gemv_num_warps):
            return words.gemv_words(x, qm, config.gemv_block_n, config.gemv_block_k, config.gemv_num_warps)
    if config.gemv_rows_warps and M == 1 and rows.rows_fit(qm.qtype, qm.layout):
        return rows.gemv_rows(x, qm, lambda s: torch.empty(s, qm.n, dtype=torch.float32, device=x.device),
                              _split_counters(x.device), config.gemv_rows_warps, config.gemv_rows_unroll,
                              config.gemv_split_k)
    bn, bk = config.gemv_block_n, config.gemv_block_k
    n_tiles = triton.cdiv(qm.n, bn)
    splits = _split_k(n_tiles, qm.k, bk, config, x.device) if n_tiles <= MAX_SPLIT_TILES else 1
    k_split = triton.cdiv(triton.cdiv(qm.k, bk), splits) * bk  # whole K tiles per slice
    splits = triton.cdiv(qm.k, k_split)
    out = torch.empty(M, qm.n, dtype=x.dtype, device=x.device)
    part, counters = out, out  # unread without a split
    if splits > 1:
        part = torch.empty(splits, M, qm.n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    _gemv_kernel[(n_tiles, splits)](
        x, qm.raw, out, part, counters, M, qm.n, qm.k, k_split,
        x.stride(0), qm.raw.stride(0), out.stride(0), part.stride(0), part.stride(1) if splits > 1 else 0,
        QTYPE=_CODE[qm.qtype], BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk,
        BLOCKWISE=_blockwise(qm.qtype, bk), SPLITS=splits, SPLIT_AT=qm.split_at, num_warps=config.gemv_num_warps,
        **launch(x.device, M, "gemv"))
    return out


def qmatmul_gemm(x: torch.Tensor, qm: QuantMatrix, config: QuantKernelConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` with tensor-core dots on dequantized tiles, [M, n] in x.dtype."""
    config = config or PREFILL
    x = _check_x(x, qm.k, qm.device)
    M = x.shape[0]
    out = torch.empty(M, qm.n, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn = config.block_m, config.block_n
    _gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(qm.n, bn))](
        x, qm.raw, out, M, qm.n, qm.k,
        x.stride(0), qm.raw.stride(0), out.stride(0),
        QTYPE=_CODE[qm.qtype], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT_AT=qm.split_at,
        HALVES=_halves(qm, config.block_k),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def qmatmul(x: torch.Tensor, qm: QuantMatrix, config: QuantKernelConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` [M, n] in x.dtype: GEMV up to ``gemv_max_m`` rows of x, GEMM beyond."""
    defaults = config or PREFILL
    if x.dim() == 2 and 1 <= x.shape[0] <= defaults.gemv_max_m:
        return qmatmul_gemv(x, qm, config)  # None: the measured tiles of this shape, if any
    if (x.dim() == 2 and defaults.dequant_min_m and x.shape[0] >= defaults.dequant_min_m
            and x.dtype in (torch.bfloat16, torch.float16)):
        _check_x(x, qm.k, qm.device)
        return x @ qm.dequantize(x.dtype).T
    return qmatmul_gemm(x, qm, config)


def qmatmul_experts(x: torch.Tensor, qe: QuantExperts, ids: torch.Tensor,
                    config: QuantKernelConfig | None = None) -> torch.Tensor:
    """Row t of the [T, n] result is ``W[ids[t]] @ x[t]`` (zero where ``ids[t] < 0``), in x.dtype.

    Expert ids past ``qe.e`` are not checked here (that would synchronise the host).
    """
    config = config or config_for("experts", qe.qtype.name, qe.n, qe.k, qe.raw.device, QuantKernelConfig())
    x = _check_x(x, qe.k, qe.raw.device)
    T = x.shape[0]
    if ids.shape != (T,) or ids.dtype not in (torch.int32, torch.int64) or ids.device != x.device:
        raise ValueError(f"ids must be an int tensor [{T}] on {x.device}, got {ids.dtype} {tuple(ids.shape)} "
                         f"on {ids.device}")
    out = torch.empty(T, qe.n, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    bn = config.gemv_block_n
    _experts_kernel[(T, triton.cdiv(qe.n, bn))](
        x, qe.raw, ids.contiguous(), out, qe.n, qe.k,
        x.stride(0), qe.raw.stride(0), qe.raw.stride(1), out.stride(0),
        QTYPE=_CODE[qe.qtype], BLOCK_N=bn, BLOCK_K=config.gemv_block_k,
        BLOCKWISE=_blockwise(qe.qtype, config.gemv_block_k), SPLIT_AT=qe.split_at, num_warps=config.gemv_num_warps)
    return out



@triton.jit
def _moe_gate_up_kernel(
    x_ptr, g_ptr, u_ptr, ids_ptr, act_ptr, sgu_ptr, gi_ptr, sgate_ptr, tg_ptr, tu_ptr, FFN, N_ROUTED,
    K: tl.constexpr, TOP_K: tl.constexpr, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_ap,
    stride_sgu, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
    SPLIT_AT: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_STAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr, WAIT_FIRST: tl.constexpr,
):
    """Pair ``p``, rows ``BLOCK_N`` of its expert's gate and up: ``act[p] = silu(gate x) * up x``
    in float32, stored in act's dtype (zero for id -1). Pairs below ``N_ROUTED`` are routed
    (token ``p // TOP_K``); with ``HAS_SHARED``, pair ``N_ROUTED + t`` is token t's shared
    expert, whose gate rows are the first ``FFN`` rows of ``sgu`` and its up rows the next, and
    its first row block also stores ``sgate[t] = sigmoid(x[t] . gate_inp)`` for the down launch.
    ``HAS_STAGE``: an id ``-2 - j`` reads expert ``j`` of the stage stacks ``tg``/``tu`` (``stage_route``).
    ``WAIT_FIRST``: the wait for the kernel before comes before the down launch may start (which then
    reads the ids before its own wait, ``engine.kernels.pdl``)."""
    if WAIT_FIRST:
        wait_previous(PDL)
        launch_next(PDL)
    else:
        begin(PDL)
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    shared, live, e, tok = pair_route(ids_ptr, p, N_ROUTED, TOP_K)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(o_n, FFN - 1).to(tl.int64)[:, None]
    p_x = x_ptr + tok * stride_xt
    p_g = g_ptr + e * stride_ge + rows * stride_gn
    p_u = u_ptr + e * stride_ue + rows * stride_un
    if HAS_STAGE:
        staged, j = stage_route(ids_ptr, p, N_ROUTED)
        live = live | staged
        p_g = tl.where(staged, tg_ptr + j * stride_ge + rows * stride_gn, p_g)
        p_u = tl.where(staged, tu_ptr + j * stride_ue + rows * stride_un, p_u)
    if HAS_SHARED:
        p_g = tl.where(shared, sgu_ptr + rows * stride_sgu, p_g)
        p_u = tl.where(shared, sgu_ptr + (rows + FFN) * stride_sgu, p_u)
        if shared & (pid_n == 0):
            store_shared_gate(p_x, gi_ptr, sgate_ptr + tok, K, BLOCK_H)
    g, u = _pair_dots2(p_g, p_u, p_x, K, live, FFN, o_n, QTYPE, BLOCK_N, BLOCK_K, BLOCKWISE, SPLIT_AT)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p * stride_ap + o_n, act.to(act_ptr.dtype.element_ty), mask=o_n < FFN)


@triton.jit
def _moe_down_kernel(
    act_ptr, d_ptr, ids_ptr, w_ptr, out_ptr, sd_ptr, sgate_ptr, td_ptr, H, N_ROUTED, FFN: tl.constexpr,
    TOP_K: tl.constexpr, stride_ap, stride_de, stride_dn, stride_ot, stride_sd,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
    SPLIT_AT: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_STAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token ``t``, rows ``BLOCK_N`` of the output: the routing-weighted sum over its ``TOP_K``
    pairs of ``down[e] act[p]``, added in pair order in float32 (no partial sums leave the
    program); with ``HAS_SHARED``, then its shared expert's ``sd act[N_ROUTED + t]`` times
    ``sgate[t]``, the gate ``sigmoid(x[t] . gate_inp)`` the gate/up launch stored once per token
    (computed here, every row block would read all of x[t] and gate_inp: more than its weights)."""
    begin(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(o_n, H - 1).to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = t * TOP_K + j
        e = tl.load(ids_ptr + p)
        live = e >= 0
        p_row = d_ptr + tl.maximum(e, 0).to(tl.int64) * stride_de + rows * stride_dn
        if HAS_STAGE:  # an id -2 - i: expert i of the stage stack
            live = live | (e <= -2)
            p_row = tl.where(e <= -2, td_ptr + tl.maximum(-2 - e, 0).to(tl.int64) * stride_de + rows * stride_dn,
                             p_row)
        y = _pair_dot(p_row, act_ptr + p * stride_ap, FFN, live, H, o_n, QTYPE, BLOCK_N, BLOCK_K, BLOCKWISE,
                      SPLIT_AT)
        acc = tl.fma(tl.load(w_ptr + p).to(tl.float32), y, acc)  # one rounding, as the per-pair launch's sum
    if HAS_SHARED:
        y = _pair_dot(sd_ptr + rows * stride_sd, act_ptr + (N_ROUTED + t) * stride_ap, FFN, t >= 0, H, o_n,
                      QTYPE, BLOCK_N, BLOCK_K, BLOCKWISE, SPLIT_AT)
        acc = tl.fma(tl.load(sgate_ptr + t), y, acc)
    tl.store(out_ptr + t * stride_ot + o_n, acc.to(out_ptr.dtype.element_ty), mask=o_n < H)


@triton.jit
def _moe_down_pairs_kernel(
    act_ptr, d_ptr, ids_ptr, w_ptr, out_ptr, sd_ptr, sgate_ptr, td_ptr, part_ptr, count_ptr, H, N_ROUTED,
    FFN: tl.constexpr, TOP_K: tl.constexpr, stride_ap, stride_de, stride_dn, stride_ot, stride_sd,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
    SPLIT_AT: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_STAGE: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``_moe_down_kernel``'s sum with a program per pair: program ``q`` is token ``q // PAIRS``'s
    pair ``j = q % PAIRS`` (``j`` < ``TOP_K`` routed, ``j == TOP_K`` its shared expert), rows
    ``BLOCK_N`` of the output. It stores its rows, unweighted, in its float32 partial row; the
    token's pair that arrives last at the row block's counter adds them times their weights in
    pair order, by the fused multiply-adds of the per-token program's sum from zero (explicit in
    both: a compiler free to contract ``acc + w * y`` would make the two differ in the last bits),
    stores the output, then zeroes the counter for the next call.

    ``PREFETCH`` (whole blocks, K in one tile, after a gate/up launch with ``WAIT_FIRST``): the pair's
    expert id and its weight codes are loaded before the wait for the gate/up launch, the activations
    after it (``engine.kernels.pdl``); the same sum as ``_pair_dot``'s."""
    if PREFETCH:
        launch_next(PDL)
    else:
        begin(PDL)
    PAIRS: tl.constexpr = TOP_K + HAS_SHARED
    q = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = q // PAIRS
    j = q % PAIRS
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    rows = tl.minimum(o_n, H - 1).to(tl.int64)[:, None]
    p = t * TOP_K + tl.minimum(j, TOP_K - 1)
    e = tl.load(ids_ptr + p)
    live = e >= 0
    p_row = d_ptr + tl.maximum(e, 0).to(tl.int64) * stride_de + rows * stride_dn
    p_act = act_ptr + p * stride_ap
    if HAS_STAGE:  # an id -2 - i: expert i of the stage stack
        staged = e <= -2
        live = live | staged
        p_row = tl.where(staged, td_ptr + tl.maximum(-2 - e, 0).to(tl.int64) * stride_de + rows * stride_dn, p_row)
    if HAS_SHARED:
        shared = j == TOP_K
        live = live | shared
        p_row = tl.where(shared, sd_ptr + rows * stride_sd, p_row)
        p_act = tl.where(shared, act_ptr + (N_ROUTED + t) * stride_ap, p_act)
    if PREFETCH:
        N_BLOCKS: tl.constexpr = FFN // 32
        kb = tl.arange(0, BLOCK_K // 32)
        m_b = (kb < N_BLOCKS) & live
        kb = tl.minimum(kb, N_BLOCKS - 1)
        lo, hi, d = _block_codes(p_row, kb, m_b, QTYPE, SPLIT_AT)
        wait_previous(PDL)
        x_lo, x_hi, x_sum = _block_x(p_act, kb, live)
        acc_b = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
        acc_b += _block_dots(lo, hi, d, x_lo, x_hi, x_sum, QTYPE)
        y = tl.sum(acc_b, axis=1)
    else:
        y = _pair_dot(p_row, p_act, FFN, live, H, o_n, QTYPE, BLOCK_N, BLOCK_K, BLOCKWISE, SPLIT_AT)
    p_part = part_ptr + t * PAIRS * H + o_n
    tl.store(p_part + j * H, y, mask=m_n)
    tl.debug_barrier()  # every thread's rows stored, then one release (``_gemv_kernel``'s semaphore)
    count = count_ptr + t * tl.num_programs(1) + pid_n
    arrived = tl.atomic_add(count, 1, sem="acq_rel")
    if arrived == PAIRS - 1:  # the token's last pair at this row block: every partial row is written
        tl.debug_barrier()  # the acquire above before any thread's loads below
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(PAIRS):
            if i < TOP_K:
                scale = tl.load(w_ptr + t * TOP_K + i).to(tl.float32)
            else:
                scale = tl.load(sgate_ptr + t)
            acc = tl.fma(scale, tl.load(p_part + i * H, mask=m_n, other=0.0, cache_modifier=".cg"), acc)
        tl.store(out_ptr + t * stride_ot + o_n, acc.to(out_ptr.dtype.element_ty), mask=m_n)
        tl.atomic_xchg(count, 0)  # ready for the next call (a graph replays it)


@triton.jit
def _q_grouped_gate_up_kernel(
    x_ptr, g_ptr, u_ptr, act_ptr, pairs_ptr, block_expert_ptr,
    n_pairs, H: tl.constexpr, FFN,
    stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_ap,
    QTYPE: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_AT: tl.constexpr, HALVES: tl.constexpr,
):
    """A block of ``BLOCK_M`` pairs routed to one expert (``align_by_expert``) times ``BLOCK_N``
    rows of its gate and up, weight tiles dequantized in registers and fed to ``tl.dot``: each
    expert's blocks are read once per block of its pairs, not once per pair. ``HALVES`` (split-layout
    Q4_0/Q8_0): tiles of whole blocks (``_split_tile``), two products a tile; else per weight (``_dequant``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, used, b_pair, m_m = pair_block(pairs_ptr, block_expert_ptr, pid_m, n_pairs, BLOCK_M)
    if not used:  # a block past the last expert's (the grid is an upper bound): nothing to store
        return
    b_tok = b_pair // TOP_K
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < FFN
    rows = tl.minimum(o_n, FFN - 1).to(tl.int64)[None, :]  # [1, BN], in bounds
    p_g = g_ptr + e * stride_ge + rows * stride_gn
    p_u = u_ptr + e * stride_ue + rows * stride_un
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HALVES:
        HI: tl.constexpr = 16 if QTYPE == 0 else BLOCK_K // 2
        p_x = x_ptr + b_tok[:, None] * stride_xt
        for k0 in range(0, H, BLOCK_K):
            g_lo, g_hi, col = _split_tile(p_g, k0, QTYPE, BLOCK_K, SPLIT_AT)
            u_lo, u_hi, _ = _split_tile(p_u, k0, QTYPE, BLOCK_K, SPLIT_AT)
            x_lo, x_hi = _x_halves(p_x, col, HI, m_m)
            acc_g = tl.dot(x_lo, g_lo.to(x_lo.dtype), acc_g, input_precision=DOT_PRECISION)
            acc_g = tl.dot(x_hi, g_hi.to(x_hi.dtype), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(x_lo, u_lo.to(x_lo.dtype), acc_u, input_precision=DOT_PRECISION)
            acc_u = tl.dot(x_hi, u_hi.to(x_hi.dtype), acc_u, input_precision=DOT_PRECISION)
    else:
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < H
            b_x = tl.load(x_ptr + b_tok[:, None] * stride_xt + o_k[None, :],
                          mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            m_w = m_k[:, None] & m_n[None, :]
            b_g = _dequant(p_g, o_k[:, None], m_w, QTYPE, SPLIT_AT)  # [BK, BN] float32
            b_u = _dequant(p_u, o_k[:, None], m_w, QTYPE, SPLIT_AT)
            acc_g = tl.dot(b_x, b_g.to(b_x.dtype), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(b_x, b_u.to(b_x.dtype), acc_u, input_precision=DOT_PRECISION)
    b_act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + b_pair[:, None] * stride_ap + o_n[None, :], b_act.to(act_ptr.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _q_grouped_down_kernel(
    act_ptr, d_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr,
    n_pairs, H, FFN: tl.constexpr,
    stride_ap, stride_de, stride_dn, stride_op,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_AT: tl.constexpr, HALVES: tl.constexpr,
):
    """Down for a block of pairs of one expert: weighted rows of ``out`` [pairs, H] in float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, used, b_pair, m_m = pair_block(pairs_ptr, block_expert_ptr, pid_m, n_pairs, BLOCK_M)
    if not used:
        return
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    p_d = d_ptr + e * stride_de + tl.minimum(o_n, H - 1).to(tl.int64)[None, :] * stride_dn  # [1, BN]
    acc = _rows_dot(act_ptr + b_pair[:, None] * stride_ap, m_m, p_d, m_n, FFN, QTYPE, BLOCK_M, BLOCK_N, BLOCK_K,
                    DOT_PRECISION, SPLIT_AT, HALVES)
    b_w = tl.load(w_ptr + b_pair, mask=m_m, other=0.0).to(tl.float32)  # [BM]
    tl.store(out_ptr + b_pair[:, None] * stride_op + o_n[None, :], acc * b_w[:, None],
             mask=m_m[:, None] & m_n[None, :])




def _grouped_quantized_moe(x: torch.Tensor, gate: QuantExperts, up: QuantExperts, down: QuantExperts,
                           ids: torch.Tensor, w: torch.Tensor, config: QuantKernelConfig) -> torch.Tensor:
    """Many tokens (prefill): pairs grouped by expert, tensor-core tiles over dequantized weights."""
    T, top_k = ids.shape
    n_pairs = T * top_k
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    pairs, block_expert = align_by_expert(ids, gate.e, bm)
    n_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(n_pairs, gate.n, dtype=x.dtype, device=x.device)
    _q_grouped_gate_up_kernel[(n_blocks, triton.cdiv(gate.n, bn))](
        x, gate.raw, up.raw, act, pairs, block_expert, n_pairs, gate.k, gate.n,
        x.stride(0), gate.raw.stride(0), gate.raw.stride(1), up.raw.stride(0), up.raw.stride(1), act.stride(0),
        QTYPE=_CODE[gate.qtype], TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision,
        SPLIT_AT=gate.split_at, HALVES=_halves(gate, bk), num_warps=config.num_warps,
        num_stages=config.num_stages)
    out = torch.zeros(n_pairs, down.n, dtype=torch.float32, device=x.device)
    _q_grouped_down_kernel[(n_blocks, triton.cdiv(down.n, bn))](
        act, down.raw, w, out, pairs, block_expert, n_pairs, down.n, down.k,
        act.stride(0), down.raw.stride(0), down.raw.stride(1), out.stride(0),
        QTYPE=_CODE[down.qtype], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision,
        SPLIT_AT=down.split_at, HALVES=_halves(down, bk), num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out.view(T, top_k, down.n).sum(1).to(x.dtype)


def shared_fits(gate: QuantExperts, down: QuantExperts, gate_up: QuantMatrix, s_down: QuantMatrix) -> bool:
    """Whether a shared expert (gate and up merged in ``gate_up``, then ``s_down``) can ride in the
    routed experts' launches: the same block type, layout and shapes as one routed expert."""
    return (gate_up.qtype == s_down.qtype == gate.qtype == down.qtype and gate_up.layout == s_down.layout
            == gate.layout == down.layout and gate_up.n == 2 * gate.n and gate_up.k == gate.k
            and s_down.n == down.n and s_down.k == down.k)


def quantized_moe_triton(x: torch.Tensor, gate: QuantExperts, up: QuantExperts, down: QuantExperts,
                         ids: torch.Tensor, w: torch.Tensor, config: QuantKernelConfig | None = None,
                         down_config: QuantKernelConfig | None = None,
                         shared: tuple[QuantMatrix, QuantMatrix, torch.Tensor] | None = None,
                         stage: tuple[QuantExperts, QuantExperts, QuantExperts] | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed-expert SwiGLU over quantized experts: [T, H] in x's dtype.

    x [T, H]; gate, up [E, ffn, H] and down [E, H, ffn] blocks of one type; ids [T, k] (-1: no
    expert); w [T, k] float32. Up to ``gemv_max_m`` tokens (decode, verify blocks), two GEMV
    launches: gate and up together write ``silu(g) * u`` per pair, and down sums each token's
    pairs with their weights in registers (tiles: ``config`` and ``down_config`` (default: ``config``),
    else the measured ones for these shapes on this GPU, kinds ``moe_gate_up`` and ``moe_down``). Longer calls group the pairs
    by expert and run tensor-core tiles over weights dequantized in registers, so each expert's
    blocks are read once per block of its pairs rather than once per pair.

    ``shared`` (gate and up merged [2 ffn, H], down [H, ffn], gate_inp [H] float32; ``shared_fits``),
    up to ``gemv_max_m`` tokens: each token's shared expert runs as one more pair of the same two
    launches, and the result is ``routed + sigmoid(x . gate_inp) * shared`` summed in float32.

    ``stage`` (gate, up, down stacks of the routed experts' type, layout and strides: ``words.stage_fits``),
    up to ``gemv_max_m`` tokens: a routed id ``-2 - j`` reads expert ``j`` of these stacks, so experts held
    in two places (device slots and a buffer the cold tier copied others into) share the two launches.
    ``out_dtype`` (default x's): the output's dtype."""
    T, top_k = ids.shape
    x = _check_x(x, gate.k, gate.raw.device)
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != x.device or w.shape != ids.shape:
        raise ValueError(f"ids must be an int tensor [T, k] on {x.device} and w of its shape, got {ids.dtype} "
                         f"{tuple(ids.shape)} on {ids.device} and {tuple(w.shape)}")
    if not (gate.qtype == up.qtype and gate.layout == up.layout and gate.n == up.n == down.k and down.n == gate.k):
        raise ValueError(f"gate {gate.qtype.name} [{gate.n}, {gate.k}], up {up.qtype.name} [{up.n}, {up.k}] and "
                         f"down {down.qtype.name} [{down.n}, {down.k}] do not make one SwiGLU expert")
    out = torch.empty(T, down.n, dtype=out_dtype or x.dtype, device=x.device)
    if T == 0:
        return out
    ids = ids.contiguous()
    w = w.contiguous().float()
    if stage is not None:
        from engine.kernels.quant.words import stage_fits

        if not all(stage_fits(a, b) for a, b in zip((gate, up, down), stage)):
            raise ValueError("the stage stacks must have the routed experts' block type, layout, shapes and strides")
    if T > (config or QuantKernelConfig()).gemv_max_m:  # prefill: read each expert once per block of its pairs
        if shared is not None or stage is not None:
            raise ValueError(f"a shared expert or a stage stack rides in the decode launches only (up to "
                             f"{(config or QuantKernelConfig()).gemv_max_m} tokens), got {T}")
        if out_dtype is not None and out_dtype != x.dtype:
            return _grouped_quantized_moe(x, gate, up, down, ids.long(), w, config or PREFILL).to(out_dtype)
        return _grouped_quantized_moe(x, gate, up, down, ids.long(), w, config or PREFILL)
    s_gu, s_down, gate_inp = shared if shared is not None else (None, None, w)  # w: unread without one
    if shared is not None:
        if not shared_fits(gate, down, s_gu, s_down) or gate_inp.shape != (gate.k,):
            raise ValueError(f"the shared expert ({s_gu.qtype.name} [{s_gu.n}, {s_gu.k}] {s_gu.layout}, down "
                             f"[{s_down.n}, {s_down.k}], gate_inp {tuple(gate_inp.shape)}) does not match the "
                             f"routed experts ({gate.qtype.name} [{gate.n}, {gate.k}] {gate.layout})")
        if s_gu.raw.device != x.device or s_down.raw.device != x.device:
            raise ValueError(f"the shared expert is on {s_gu.raw.device}, x on {x.device}")
        gate_inp = gate_inp.contiguous().float()
    c_up = config or config_for("moe_gate_up", gate.qtype.name, gate.n, gate.k, x.device, QuantKernelConfig())
    # down runs a program per token and row block: 4 rows give 512 programs at one token (16 gave 128)
    c_down = down_config or config or config_for("moe_down", down.qtype.name, down.n, down.k, x.device,
                                                 QuantKernelConfig(gemv_block_n=4))
    n_routed = T * top_k
    n_pairs = n_routed + (T if shared is not None else 0)
    act = torch.empty(n_pairs, gate.n, dtype=x.dtype, device=x.device)
    sgu_raw = s_gu.raw if s_gu is not None else gate.raw  # unread without a shared expert
    sd_raw = s_down.raw if s_down is not None else down.raw
    sgu_stride = s_gu.raw.stride(0) if s_gu is not None else 0
    sd_stride = s_down.raw.stride(0) if s_down is not None else 0
    # each token's shared gate, sigmoid(x . gate_inp): stored by the gate/up launch, read by the down
    # launch that follows it on the stream
    sgate = torch.empty(T, dtype=torch.float32, device=x.device) if shared is not None else w
    bn, bk = c_up.gemv_block_n, c_up.gemv_block_k
    # the gate/up launch waits before the down launch may start, so the down launch can load its ids and
    # weights before its own wait (``engine.kernels.pdl``); the row kernels' gate/up does not
    # the row kernels take no stage stack: with one, the word or the block kernels run
    rows_up = stage is None and c_up.gemv_rows_warps >= 2 and rows.rows_fit(gate.qtype, gate.layout)
    wait_first = prefetch() and not rows_up
    words_up = False
    if c_up.gemv_words and x.is_cuda:
        from engine.kernels.quant import words

        words_up = words.experts_fit(gate, up, bk, c_up.gemv_num_warps)
    t_g, t_u, t_d = (s.raw for s in stage) if stage is not None else (gate.raw, up.raw, down.raw)  # unread without
    if words_up:
        words.moe_gate_up_words(x, gate, up, ids, act, n_routed, top_k,
                                (s_gu, gate_inp, sgate) if shared is not None else None, bn, bk, c_up.gemv_num_warps,
                                wait_first=wait_first, stage=stage[:2] if stage is not None else None)
    elif rows_up:
        rows.moe_gate_up_rows(x, gate, up, ids, act, n_routed, top_k,
                              (s_gu, gate_inp, sgate) if shared is not None else None, c_up.gemv_rows_warps,
                              c_up.gemv_rows_unroll)
    else:
        _moe_gate_up_kernel[(n_pairs, triton.cdiv(gate.n, bn))](
            x, gate.raw, up.raw, ids, act, sgu_raw, gate_inp, sgate, t_g, t_u, gate.n, n_routed, gate.k, top_k,
            x.stride(0), gate.raw.stride(0), gate.raw.stride(1), up.raw.stride(0), up.raw.stride(1), act.stride(0),
            sgu_stride, QTYPE=_CODE[gate.qtype], BLOCK_N=bn, BLOCK_K=bk, BLOCKWISE=_blockwise(gate.qtype, bk),
            SPLIT_AT=gate.split_at, HAS_SHARED=shared is not None, HAS_STAGE=stage is not None,
            BLOCK_H=triton.next_power_of_2(gate.k),
            WAIT_FIRST=wait_first, num_warps=c_up.gemv_num_warps, **launch(x.device, T, "experts"))
    bn, bk = c_down.gemv_block_n, c_down.gemv_block_k
    if c_down.gemv_words and x.is_cuda and stage is None:
        from engine.kernels.quant import words

        if words.down_fits(down, bn, c_down.gemv_num_warps):
            words.moe_down_words(act, down, ids, w, out, n_routed, top_k,
                                 (s_down, sgate) if shared is not None else None, bn, c_down.gemv_num_warps)
            return out
    if (stage is None and c_down.gemv_rows_warps >= triton.next_power_of_2(top_k)
            and rows.rows_fit(down.qtype, down.layout)):
        rows.moe_down_rows(act, down, ids, w, out, n_routed, (s_down, sgate) if shared is not None else None,
                           c_down.gemv_rows_warps, c_down.gemv_rows_unroll)
        return out
    if c_down.gemv_pair_split and T * triton.cdiv(down.n, bn) <= MAX_SPLIT_TILES:
        pairs = top_k + (shared is not None)
        part = torch.empty(T * pairs, down.n, dtype=torch.float32, device=x.device)
        _moe_down_pairs_kernel[(T * pairs, triton.cdiv(down.n, bn))](
            act, down.raw, ids, w, out, sd_raw, sgate, t_d, part, _split_counters(x.device), down.n, n_routed,
            down.k, top_k, act.stride(0), down.raw.stride(0), down.raw.stride(1), out.stride(0), sd_stride,
            QTYPE=_CODE[down.qtype], BLOCK_N=bn, BLOCK_K=bk, BLOCKWISE=_blockwise(down.qtype, bk),
            SPLIT_AT=down.split_at, HAS_SHARED=shared is not None, HAS_STAGE=stage is not None,
            PREFETCH=wait_first and _blockwise(down.qtype, bk) and bk >= down.k, num_warps=c_down.gemv_num_warps,
            **launch(x.device, T, "experts"))
        return out
    _moe_down_kernel[(T, triton.cdiv(down.n, bn))](
        act, down.raw, ids, w, out, sd_raw, sgate, t_d, down.n, n_routed, down.k, top_k,
        act.stride(0), down.raw.stride(0), down.raw.stride(1), out.stride(0), sd_stride,
        QTYPE=_CODE[down.qtype], BLOCK_N=bn, BLOCK_K=bk, BLOCKWISE=_blockwise(down.qtype, bk),
        SPLIT_AT=down.split_at, HAS_SHARED=shared is not None, HAS_STAGE=stage is not None,
        num_warps=c_down.gemv_num_warps, **launch(x.device, T, "experts"))
    return out
