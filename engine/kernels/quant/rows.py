"""Single-token decode kernels over Q4_0/Q8_0 rows in the split layout, one weight row per lane.

The block kernels of ``engine.kernels.quant.triton`` lay a tile's lanes along K, so every lane
needs its own slice of x, and every code goes through the int-to-float conversion unit. Here the
32 lanes of a warp hold 32 rows of W and the warps of a program split K: the lanes of a warp read
the same x values (Triton still stages x through shared memory, as broadcast reads), each lane
loads a whole block's codes as one 16-byte vector with ``UNROLL`` blocks in flight, and the codes
become float32 by the exponent trick (a code ORed into the mantissa of 2^23, then 2^23 and the
code's offset subtracted: two full-rate ALU operations), Q4_0's -8 and Q8_0's sign applied in the
same subtraction. Each lane sums its blocks in float32; the warps' sums are added once at the end,
and split-K programs add their partial sums in split order (the arrival-counter pattern of
``_gemv_kernel``), so results are deterministic.

They are candidates of the tile sweep (``gemv_rows_warps`` > 0 in a table entry), not the
default: on the H200 at the Qwen3.6-35B-A3B shapes they ran 9-41% slower than the block kernels
(about 6.6 instructions per weight; docs/benchmarks.md), and the sweep decides per GPU.

- ``gemv_rows``: ``x @ W.T`` for one row of x.
- ``moe_gate_up_rows`` and ``moe_down_rows``: the routed experts (and a shared expert riding as
  one more pair) of few tokens: gate/up with SiLU, then down summed over each token's pairs with
  their routing weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from engine.kernels.moe.triton import pair_route
from engine.kernels.quant.reference import QuantExperts, QuantMatrix

ROWS_PER_PROGRAM = 32  # rows of W per program: one per lane of a warp
LANES = tl.constexpr(ROWS_PER_PROGRAM)


@triton.jit
def _block_dots(p_row, p_x, kb, m_b, QTYPE: tl.constexpr, SPLIT_AT: tl.constexpr):
    """[32, S, U] float32: blocks ``kb`` [S, U] of rows at ``p_row`` [32, S] (byte pointers to split-layout
    rows), each dotted with x at ``p_x`` [S] and scaled; zero where ``m_b`` [S, U] is false (those loads
    read block ``kb``, which callers keep in bounds)."""
    CODES: tl.constexpr = 16 if QTYPE == 0 else 32
    o_i = tl.arange(0, 16)
    p_c = p_row[:, :, None, None] + (kb * CODES)[None, :, :, None] + o_i[None, None, None, :]  # [32, S, U, 16]
    if QTYPE == 0:  # byte i holds code i (low nibble) and code i + 16 (high nibble)
        q = tl.load(p_c).to(tl.int32)
        lo = ((q & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + q - (2^23 + 8)
        hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    else:  # 32 int8 codes: the byte with its top bit flipped is code + 128
        a = tl.load(p_c).to(tl.int32)
        b = tl.load(p_c + 16).to(tl.int32)
        lo = ((a ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        hi = ((b ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    p_d = (p_row[:, :, None] + SPLIT_AT + (kb * 2)[None, :, :]).to(tl.pointer_type(tl.float16))
    d = tl.where(m_b[None, :, :], tl.load(p_d).to(tl.float32), 0.0)  # [32, S, U]
    p_xb = p_x[:, None, None] + (kb * 32)[:, :, None] + o_i[None, None, :]  # [S, U, 16]
    x_lo = tl.load(p_xb).to(tl.float32)
    x_hi = tl.load(p_xb + 16).to(tl.float32)
    return d * tl.sum(lo * x_lo[None, :, :, :] + hi * x_hi[None, :, :, :], axis=3)


@triton.jit
def _rows_dot(p_row, p_x, kb0, n_blocks, N_LOOP: tl.constexpr, N_BLOCKS: tl.constexpr, QTYPE: tl.constexpr,
              SPLIT_AT: tl.constexpr, UNROLL: tl.constexpr, S: tl.constexpr):
    """[32, S] float32: for each of S slices (a warp each), rows ``p_row`` [32, S] times x at ``p_x`` [S]
    over ``n_blocks`` [S] blocks from ``kb0`` [S], ``UNROLL`` blocks per lane at a time; ``N_LOOP`` (at
    least every slice's count) bounds the loop."""
    o_u = tl.arange(0, UNROLL)
    acc = tl.zeros([LANES, S, UNROLL], dtype=tl.float32)
    for j in range(0, N_LOOP, UNROLL):
        kb = kb0[:, None] + j + o_u[None, :]  # [S, U]
        m_b = (j + o_u[None, :] < n_blocks[:, None]) & (kb < N_BLOCKS)
        acc += _block_dots(p_row, p_x, tl.minimum(kb, N_BLOCKS - 1), m_b, QTYPE, SPLIT_AT)
    return tl.sum(acc, axis=2)


@triton.jit
def _slices(n_total, part, PER: tl.constexpr):
    """First block and block count of slice ``part`` (a tensor of slice indices) when ``n_total`` blocks
    are shared out in runs of ``PER``."""
    kb0 = part * PER
    return kb0, tl.minimum(tl.maximum(n_total - kb0, 0), PER)


@triton.jit
def store_shared_gate(p_x, gi_ptr, p_gate, H, BLOCK_H: tl.constexpr):
    """Store ``sigmoid(x . gate_inp)`` in float32 at ``p_gate``, x the ``H`` values at ``p_x``: a token's
    shared-expert gate, computed by one program of the experts' gate/up launch so that each of the
    down launch's programs (64 to 512 per token at the 35B shapes) loads one scalar rather than all of
    x and gate_inp."""
    h = tl.arange(0, BLOCK_H)
    xv = tl.load(p_x + h, mask=h < H, other=0.0).to(tl.float32)
    gi = tl.load(gi_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(p_gate, tl.sigmoid(tl.sum(xv * gi, axis=0)))


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, N, stride_wn, stride_ps,
                      N_BLOCKS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, QTYPE: tl.constexpr,
                      SPLIT_AT: tl.constexpr, WARPS: tl.constexpr, UNROLL: tl.constexpr, SPLITS: tl.constexpr):
    """Rows ``32 pid_n ..`` of ``W x`` over split ``pid_s`` of the blocks (``SPLIT_BLOCKS`` each),
    the split's blocks shared out among ``WARPS`` warps."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    o_n = pid_n * LANES + tl.arange(0, LANES)
    m_n = o_n < N
    p_row = w_ptr + tl.minimum(o_n, N - 1).to(tl.int64) * stride_wn  # [32]
    first = pid_s * SPLIT_BLOCKS
    o_w = tl.arange(0, WARPS)
    PER: tl.constexpr = (SPLIT_BLOCKS + WARPS - 1) // WARPS
    kb0, n_blocks = _slices(tl.minimum(SPLIT_BLOCKS, N_BLOCKS - first), o_w, PER)
    y = tl.sum(_rows_dot(p_row[:, None] + 0 * o_w[None, :], x_ptr + 0 * o_w, first + kb0, n_blocks, PER, N_BLOCKS,
                         QTYPE, SPLIT_AT, UNROLL, WARPS), axis=1)  # [32]
    if SPLITS == 1:
        tl.store(out_ptr + o_n, y.to(out_ptr.dtype.element_ty), mask=m_n)
    else:
        tl.store(part_ptr + pid_s * stride_ps + o_n, y, mask=m_n)
        tl.debug_barrier()  # every lane's partial sum stored before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last split of these rows: add the partial sums in split order
            tl.debug_barrier()
            total = tl.zeros([LANES], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(part_ptr + s * stride_ps + o_n, mask=m_n, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + o_n, total.to(out_ptr.dtype.element_ty), mask=m_n)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (a graph replays it)


@triton.jit
def _moe_gate_up_rows_kernel(
    x_ptr, g_ptr, u_ptr, ids_ptr, act_ptr, sgu_ptr, gi_ptr, sgate_ptr, FFN, N_ROUTED, TOP_K,
    stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_ap, stride_sgu,
    N_BLOCKS: tl.constexpr, QTYPE: tl.constexpr, SPLIT_AT: tl.constexpr, WARPS: tl.constexpr,
    UNROLL: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Pair ``p``, rows ``32 pid_n ..`` of its expert: ``act[p] = silu(gate x) * up x`` (zero for id -1;
    pairs from ``N_ROUTED`` on are the tokens' shared experts, gate rows first in ``sgu``, their first
    programs also storing ``sgate[t] = sigmoid(x[t] . gate_inp)``). Warps ``0 .. WARPS/2`` read gate
    rows and the rest up rows, each half splitting K, all in one loop."""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    HALF: tl.constexpr = WARPS // 2
    shared, live, e, tok = pair_route(ids_ptr, p, N_ROUTED, TOP_K)
    o_n = pid_n * LANES + tl.arange(0, LANES)
    rows = tl.minimum(o_n, FFN - 1).to(tl.int64)[:, None]  # [32, 1]
    o_w = tl.arange(0, WARPS)
    is_up = (o_w >= HALF)[None, :]  # [1, W]
    p_row = tl.where(is_up, u_ptr + e * stride_ue + rows * stride_un, g_ptr + e * stride_ge + rows * stride_gn)
    if HAS_SHARED:
        p_row = tl.where(shared, sgu_ptr + (rows + tl.where(is_up, FFN, 0)) * stride_sgu, p_row)
        if shared & (pid_n == 0):
            store_shared_gate(x_ptr + tok * stride_xt, gi_ptr, sgate_ptr + tok, N_BLOCKS * 32, BLOCK_H)
    PER: tl.constexpr = (N_BLOCKS + HALF - 1) // HALF
    kb0, n_blocks = _slices(N_BLOCKS, o_w % HALF, PER)
    act = tl.zeros([LANES], dtype=tl.float32)
    if live:  # a pair routed nowhere reads nothing
        y = _rows_dot(p_row, x_ptr + tok * stride_xt + 0 * o_w, kb0, n_blocks, PER, N_BLOCKS, QTYPE, SPLIT_AT,
                      UNROLL, WARPS)  # [32, W]
        g = tl.sum(tl.where(is_up, 0.0, y), axis=1)
        u = tl.sum(tl.where(is_up, y, 0.0), axis=1)
        act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p * stride_ap + o_n, act.to(act_ptr.dtype.element_ty), mask=o_n < FFN)


@triton.jit
def _moe_down_rows_kernel(
    act_ptr, d_ptr, ids_ptr, w_ptr, out_ptr, sd_ptr, sgate_ptr, H, N_ROUTED,
    stride_ap, stride_de, stride_dn, stride_ot, stride_sd,
    N_BLOCKS: tl.constexpr, TOP_K: tl.constexpr, QTYPE: tl.constexpr, SPLIT_AT: tl.constexpr,
    WARPS: tl.constexpr, UNROLL: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_UNROLL: tl.constexpr,
):
    """Token ``t``, rows ``32 pid_n ..`` of the output: its pairs' ``down[e] act[p]``, one pair per warp
    (``WARPS`` >= ``TOP_K``, a power of two), weighted and added in pair order; with ``HAS_SHARED``,
    then the shared expert's ``sd act[N_ROUTED + t]`` (its blocks shared out among the warps) times
    ``sgate[t]``, the gate the gate/up launch stored."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_n = pid_n * LANES + tl.arange(0, LANES)
    rows = tl.minimum(o_n, H - 1).to(tl.int64)[:, None]  # [32, 1]
    o_w = tl.arange(0, WARPS)
    m_p = o_w < TOP_K
    pair = t * TOP_K + tl.minimum(o_w, TOP_K - 1)
    e = tl.load(ids_ptr + pair)
    live = m_p & (e >= 0)
    e = tl.maximum(e, 0).to(tl.int64)[None, :]
    n_blocks = tl.where(live, N_BLOCKS, 0)
    y = _rows_dot(d_ptr + e * stride_de + rows * stride_dn, act_ptr + pair * stride_ap, 0 * o_w, n_blocks,
                  N_BLOCKS, N_BLOCKS, QTYPE, SPLIT_AT, UNROLL, WARPS)  # [32, W]
    wt = tl.where(m_p, tl.load(w_ptr + pair), 0.0).to(tl.float32)
    acc = tl.sum(y * wt[None, :], axis=1)
    if HAS_SHARED:
        PER: tl.constexpr = (N_BLOCKS + WARPS - 1) // WARPS
        kb0, n_sh = _slices(N_BLOCKS, o_w, PER)
        y = _rows_dot(sd_ptr + rows * stride_sd + 0 * o_w[None, :], act_ptr + (N_ROUTED + t) * stride_ap + 0 * o_w,
                      kb0, n_sh, PER, N_BLOCKS, QTYPE, SPLIT_AT, SHARED_UNROLL, WARPS)
        acc += tl.load(sgate_ptr + t) * tl.sum(y, axis=1)
    tl.store(out_ptr + t * stride_ot + o_n, acc.to(out_ptr.dtype.element_ty), mask=o_n < H)


_CODE = {Q.Q4_0: 0, Q.Q8_0: 1}
MAX_UNROLL = 8  # 16 blocks a lane spill registers to local memory (seen in the sm_90 machine code)


def rows_fit(qtype: Q, layout: str) -> bool:
    """Whether these kernels read such weights: Q4_0 or Q8_0 in the split layout."""
    return qtype in _CODE and layout == "split"


def _check_warps(warps: int, unroll: int, least: int = 1) -> None:
    for name, v, lo, hi in (("warps", warps, least, 32), ("unroll", unroll, 1, MAX_UNROLL)):
        if v < lo or v & (v - 1) or v > hi:
            raise ValueError(f"the row kernels' {name} must be a power of two in [{lo}, {hi}], got {v}")


def rows_splits(n: int, k: int, warps: int, unroll: int, device: torch.device, splits: int = 0) -> int:
    """K slices for ``gemv_rows``: ``splits`` if given, else as many as keep each warp at least one
    ``unroll`` run of blocks while the programs number under four per SM."""
    blocks = k // 32
    most = max(1, blocks // (warps * unroll))
    if splits:
        return min(splits, blocks)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(most, triton.cdiv(4 * sms, triton.cdiv(n, ROWS_PER_PROGRAM))))


def gemv_rows(x: torch.Tensor, qm: QuantMatrix, part_of, counters, warps: int = 4, unroll: int = 4,
              splits: int = 0) -> torch.Tensor:
    """``x @ W.T`` [1, n] in x's dtype for one row of x (contiguous, checked by the caller) and a
    split-layout Q4_0/Q8_0 matrix; ``part_of(splits)`` gives the float32 [splits, n] partial sums'
    buffer and ``counters`` the zeroed arrival counters (one per 32 rows) when K is split."""
    _check_warps(warps, unroll)
    if not rows_fit(qm.qtype, qm.layout) or x.shape[0] != 1:
        raise ValueError(f"gemv_rows takes one row of x and Q4_0/Q8_0 in the split layout, got {x.shape[0]} "
                         f"rows and {qm.qtype.name} {qm.layout}")
    blocks = qm.k // 32
    splits = rows_splits(qm.n, qm.k, warps, unroll, x.device, splits)
    split_blocks = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, split_blocks)
    out = torch.empty(1, qm.n, dtype=x.dtype, device=x.device)
    part = part_of(splits) if splits > 1 else out
    _gemv_rows_kernel[(triton.cdiv(qm.n, ROWS_PER_PROGRAM), splits)](
        x, qm.raw, out, part, counters if splits > 1 else out, qm.n, qm.raw.stride(0),
        part.stride(0) if splits > 1 else 0, N_BLOCKS=blocks, SPLIT_BLOCKS=split_blocks, QTYPE=_CODE[qm.qtype],
        SPLIT_AT=qm.split_at, WARPS=warps, UNROLL=unroll, SPLITS=splits, num_warps=warps)
    return out


def moe_gate_up_rows(x: torch.Tensor, gate: QuantExperts, up: QuantExperts, ids: torch.Tensor, act: torch.Tensor,
                     n_routed: int, top_k: int, shared=None, warps: int = 8, unroll: int = 4) -> None:
    """Fill ``act`` [pairs, ffn] with ``silu(gate x) * up x`` per pair (``quantized_moe_triton``'s
    first launch); ``shared`` (sgu, gate_inp, sgate): the shared expert's merged gate/up rows, riding
    as pairs from ``n_routed``, and its gate's weights, whose ``sigmoid(x . gate_inp)`` per token is
    stored into the float32 ``sgate`` [T] for ``moe_down_rows``."""
    _check_warps(warps, unroll, least=2)
    _gemv_moe_check(gate)
    sgu, gate_inp, sgate = shared if shared is not None else (None, act, act)  # act: unread without one
    _moe_gate_up_rows_kernel[(act.shape[0], triton.cdiv(gate.n, ROWS_PER_PROGRAM))](
        x, gate.raw, up.raw, ids, act, sgu.raw if sgu is not None else gate.raw, gate_inp, sgate, gate.n,
        n_routed, top_k, x.stride(0), gate.raw.stride(0), gate.raw.stride(1), up.raw.stride(0), up.raw.stride(1),
        act.stride(0), sgu.raw.stride(0) if sgu is not None else 0, N_BLOCKS=gate.k // 32, QTYPE=_CODE[gate.qtype],
        SPLIT_AT=gate.split_at, WARPS=warps, UNROLL=unroll, HAS_SHARED=sgu is not None,
        BLOCK_H=triton.next_power_of_2(gate.k), num_warps=warps)


def moe_down_rows(act: torch.Tensor, down: QuantExperts, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  n_routed: int, shared=None, warps: int = 8, unroll: int = 4) -> None:
    """Fill ``out`` [T, h] with each token's weighted sum over its pairs of ``down[e] act[p]``, plus
    ``sgate * s_down act`` with ``shared`` (s_down, sgate), sgate the tokens' shared gates stored by
    the first launch (the second launch)."""
    top_k = ids.shape[1]
    _check_warps(warps, unroll, least=max(1, triton.next_power_of_2(top_k)))
    _gemv_moe_check(down)
    s_down, sgate = shared if shared is not None else (None, w)  # w: unread without one
    _moe_down_rows_kernel[(out.shape[0], triton.cdiv(down.n, ROWS_PER_PROGRAM))](
        act, down.raw, ids, w, out, s_down.raw if s_down is not None else down.raw, sgate, down.n, n_routed,
        act.stride(0), down.raw.stride(0), down.raw.stride(1), out.stride(0),
        s_down.raw.stride(0) if s_down is not None else 0, N_BLOCKS=down.k // 32, TOP_K=top_k,
        QTYPE=_CODE[down.qtype], SPLIT_AT=down.split_at, WARPS=warps, UNROLL=unroll, HAS_SHARED=shared is not None,
        SHARED_UNROLL=min(unroll, triton.next_power_of_2(triton.cdiv(down.k // 32, warps))), num_warps=warps)


def _gemv_moe_check(qe: QuantExperts) -> None:
    if not rows_fit(qe.qtype, qe.layout):
        raise ValueError(f"the row kernels read Q4_0/Q8_0 in the split layout, got {qe.qtype.name} {qe.layout}")
