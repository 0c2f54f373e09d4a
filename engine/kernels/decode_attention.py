"""Attention of a few query tokens over a long preallocated KV cache, split along the keys.

The captured decode step attends over the whole preallocated cache with a mask of the keys each
query sees (``engine.model.attention.attention_static``). A fused attention kernel with one
query token parallelises over heads only (two KV heads here): at 16K keys that was 1.4 ms per
layer on the H200. This one splits the keys into chunks of ``chunk_for(L)`` keys, one program per (KV
head, chunk, block of query rows), each keeping a running maximum, sum and weighted sum of
values (the online softmax) over its chunk; a second launch combines the chunks per query row.
Chunks past the last written cache slot return at once, so the cost follows the tokens in the
cache, not its size, and the step stays one graph for every length.

Query heads of one KV head are rows of one tile (GQA: query head h reads KV head h // group),
so the cache is read once per block of rows. The torch definition is
``engine.model.attention.grouped_attention``. Everything inside is float32 (``tl.dot`` in
exact float32 for float32 caches); masked keys weigh zero. Importing this module needs Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device
from engine.kernels.pdl import begin, launch
from engine.kernels.warps import warps

WHAT = "the Triton decode attention kernel"
CHUNK: int | None = None  # keys per program; None: ``chunk_for`` the cache's length (a benchmark may fix it)
# Keys per program by the cache's length: the captured 35B step on the H200 (2026-12-01,
# bench/profile_decode.py --attention-chunks 64,128,256) took 2.91 / 3.00 / 3.08 ms with a short
# cache and 3.15 / 3.19 / 3.01 ms with 16,384 keys. Few keys favour small chunks (fewer serial steps
# per program), many keys fewer chunks to combine; up to 16K keys the rule keeps 64 chunks or fewer.
CHUNK_BY_LENGTH = ((4096, 64), (8192, 128))
LONG_CHUNK = 256
BLOCK_S = 32  # keys per step inside a chunk
BLOCK_Q = 16  # query rows (group * tokens) per program
MAX_HEAD_DIM = 256
MAX_TOKENS = 16
NEG = tl.constexpr(-1.0e30)  # the running maximum before any visible key (finite: no inf - inf)


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr,
                  T, L, scale, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_vt,
                  stride_mh, stride_mc, stride_ah, stride_ac,
                  GROUP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    kv = tl.program_id(0)
    c = tl.program_id(1)
    qb = tl.program_id(2)
    o_t = tl.arange(0, BLOCK_T)
    limit = tl.max(tl.load(slots_ptr + o_t, mask=o_t < T, other=-1), axis=0) + 1  # keys written so far
    start = c * CHUNK
    if start < limit:
        r = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)  # row r: token r // GROUP, query head kv * GROUP + r % GROUP
        m_r = r < T * GROUP
        t = tl.minimum(r // GROUP, T - 1)
        h = kv * GROUP + r % GROUP
        o_d = tl.arange(0, D)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + o_d[None, :], mask=m_r[:, None],
                    other=0.0)
        m_i = tl.full([BLOCK_Q], NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
        for s0 in range(0, CHUNK, BLOCK_S):
            o_s = start + s0 + tl.arange(0, BLOCK_S)
            m_s = o_s < tl.minimum(limit, L)
            k = tl.load(k_ptr + kv * stride_kh + o_s[:, None] * stride_ks + o_d[None, :], mask=m_s[:, None],
                        other=0.0)
            if EXACT:
                s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            seen = tl.load(vis_ptr + t[:, None] * stride_vt + o_s[None, :], mask=m_r[:, None] & m_s[None, :],
                           other=0).to(tl.int1)
            s = tl.where(seen, s * scale, NEG)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.where(seen, tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + kv * stride_vh + o_s[:, None] * stride_vs + o_d[None, :], mask=m_s[:, None],
                        other=0.0)
            if EXACT:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        o_r = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
        tl.store(m_ptr + kv * stride_mh + c * stride_mc + o_r, m_i)
        tl.store(l_ptr + kv * stride_mh + c * stride_mc + o_r, l_i)
        tl.store(acc_ptr + kv * stride_ah + c * stride_ac + o_r[:, None] * D + o_d[None, :], acc)


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, slots_ptr, out_ptr, g_ptr, T, N_CHUNKS: tl.constexpr,
                    stride_mh, stride_mc, stride_ah, stride_ac, stride_ot, stride_gt, stride_gh,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_C: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    kv = tl.program_id(0)
    r = tl.program_id(1)
    o_t = tl.arange(0, BLOCK_T)
    limit = tl.max(tl.load(slots_ptr + o_t, mask=o_t < T, other=-1), axis=0) + 1
    n_chunks = (limit + CHUNK - 1) // CHUNK  # the chunks that ran (of N_CHUNKS in the cache)
    o_c = tl.arange(0, BLOCK_C)
    o_d = tl.arange(0, D)
    top = tl.full([BLOCK_C], NEG, dtype=tl.float32)
    for c0 in range(0, N_CHUNKS, BLOCK_C):
        cs = c0 + o_c
        top = tl.maximum(top, tl.load(m_ptr + kv * stride_mh + cs * stride_mc + r, mask=cs < n_chunks, other=NEG))
    M = tl.max(top, axis=0)
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc = tl.zeros([BLOCK_C, D], dtype=tl.float32)
    for c0 in range(0, N_CHUNKS, BLOCK_C):
        cs = c0 + o_c
        ran = cs < n_chunks
        m = tl.load(m_ptr + kv * stride_mh + cs * stride_mc + r, mask=ran, other=NEG)
        w = tl.where(ran, tl.exp(m - M), 0.0)
        total += w * tl.load(l_ptr + kv * stride_mh + cs * stride_mc + r, mask=ran, other=0.0)
        part = tl.load(acc_ptr + kv * stride_ah + cs[:, None] * stride_ac + r * D + o_d[None, :], mask=ran[:, None],
                       other=0.0)
        acc += w[:, None] * part
    out = tl.sum(acc, axis=0) / tl.sum(total, axis=0)
    t = r // GROUP
    h = kv * GROUP + r % GROUP
    if GATED:  # the attention layer's output gate, sigmoid(gate) times the head's output
        out = out * tl.sigmoid(tl.load(g_ptr + t * stride_gt + h * stride_gh + o_d).to(tl.float32))
    tl.store(out_ptr + t * stride_ot + h * D + o_d, out.to(out_ptr.dtype.element_ty))


def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether these shapes fit the kernel: a power-of-two head size up to ``MAX_HEAD_DIM`` and at
    most ``MAX_TOKENS`` query tokens; under the Triton interpreter float32 caches only (its
    ``tl.dot`` of bf16 or fp16 operands returns garbage: a 16 x 16 product was 2.6e10 off)."""
    D = q.shape[-1]
    if _interpreted_low_precision(keys):
        return False
    return (q.dim() == 3 and 16 <= D <= MAX_HEAD_DIM and D & (D - 1) == 0 and 1 <= q.shape[0] <= MAX_TOKENS
            and q.shape[1] % keys.shape[0] == 0)


def _interpreted_low_precision(keys: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and keys.dtype != torch.float32


def chunk_for(length: int) -> int:
    """Keys per program for a cache of ``length`` slots (``CHUNK_BY_LENGTH``)."""
    return next((chunk for most, chunk in CHUNK_BY_LENGTH if length <= most), LONG_CHUNK)


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                            slots: torch.Tensor, *, chunk: int | None = None,
                            gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, n_head, D] against the cache ``keys``, ``values`` [n_kv, L, D] -> [T, n_head * D] in q's dtype.

    ``visible`` [T, L] bool: the keys each query sees; ``slots`` [T]: the cache slots the step
    wrote, none of which may be past a key some query sees (keys past the largest slot are never
    read). Scale 1 / sqrt(D), as ``F.scaled_dot_product_attention``'s default. ``chunk``: keys per
    program, a power of two of at least ``BLOCK_S`` (default: the module's ``CHUNK`` if set, read
    at each call so that a benchmark can set it before a step is captured, else ``chunk_for(L)``).
    ``gate`` [T, n_head, D] (contiguous last dimension): the output times ``sigmoid(gate)``, in float32
    before the one rounding (the gated attention of qwen35moe's attention layers).
    """
    if chunk is None:
        chunk = CHUNK if CHUNK is not None else chunk_for(keys.shape[1])
    if chunk < BLOCK_S or chunk & (chunk - 1):
        raise ValueError(f"the decode attention's chunk must be a power of two of at least {BLOCK_S} keys, got {chunk}")
    check_device(q, WHAT)
    if _interpreted_low_precision(keys):
        raise ValueError(f"the Triton interpreter cannot run the decode attention on {keys.dtype} caches (its tl.dot "
                         f"of low-precision operands is wrong); use float32 or a GPU")
    T, n_head, D = q.shape
    n_kv, L, _ = keys.shape
    if not supports(q, keys) or values.shape != keys.shape or visible.shape != (T, L) or slots.shape != (T,):
        raise ValueError(f"decode attention takes q [T <= {MAX_TOKENS}, heads, D (a power of two <= "
                         f"{MAX_HEAD_DIM})], keys and values [kv heads, L, D], visible [T, L] and slots [T]; got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(visible.shape)}, "
                         f"{tuple(slots.shape)}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode attention needs a contiguous last dimension in q, keys and values")
    if gate is not None and (gate.shape != q.shape or gate.stride(-1) != 1 or gate.device != q.device):
        raise ValueError(f"gate must be {tuple(q.shape)} on {q.device} with a contiguous last dimension, got "
                         f"{tuple(gate.shape)} on {gate.device}")
    group = n_head // n_kv
    n_chunks = triton.cdiv(L, chunk)
    q_blocks = triton.cdiv(T * group, BLOCK_Q)
    rows = q_blocks * BLOCK_Q
    m = torch.empty(n_kv, n_chunks, rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(n_kv, n_chunks, rows, D, dtype=torch.float32, device=q.device)
    visible = visible.contiguous()
    slots = slots.contiguous()
    block_t = triton.next_power_of_2(T)
    _chunk_kernel[(n_kv, n_chunks, q_blocks)](
        q, keys, values, visible.view(torch.uint8), slots, m, l, acc, T, L, D ** -0.5,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        visible.stride(0), m.stride(0), m.stride(1), acc.stride(0), acc.stride(1),
        GROUP=group, D=D, BLOCK_T=block_t, CHUNK=chunk, BLOCK_S=BLOCK_S, BLOCK_Q=BLOCK_Q,
        EXACT=keys.dtype == torch.float32, num_warps=warps("attention_chunk"), **launch(keys.device, T, "attention"))
    out = torch.empty(T, n_head * D, dtype=q.dtype, device=q.device)
    g = gate if gate is not None else out  # unread without a gate
    _combine_kernel[(n_kv, T * group)](
        m, l, acc, slots, out, g, T, n_chunks, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), out.stride(0),
        g.stride(0), g.stride(1) if gate is not None else 0,
        GROUP=group, D=D, BLOCK_T=block_t, CHUNK=chunk, BLOCK_C=16, GATED=gate is not None,
        num_warps=warps("attention_combine"),
        **launch(keys.device, T, "attention"))
    return out
