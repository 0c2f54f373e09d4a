"""An attention head's RMSNorm and its rotary embedding in one Triton launch.

The torch definition is ``engine.model.attention.norm_rope_reference``: ``rms_norm(x, weight)``
then ``apply_rope`` (NeoX pairing: dimension i < half turns with i + half, by the position's
angle i; dimensions from 2 * half on pass through). One program per (token, head), the head
in registers, float32 inside, the output rounded once. The query heads arrive as strided
slices of a wider projection (each head's query is followed by its output gate), so the two
leading dimensions may be strided; the last must be contiguous.

``norm_rope_to_cache_triton`` does the same to a decode step's key heads and stores them, with
the value heads, straight into the KV caches at the step's slots (the captured step's cache write,
one launch instead of a norm, two casts and two ``index_copy_``). Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device
from engine.kernels.pdl import begin, launch
from engine.kernels.warps import warps

MAX_HEAD_DIM = 1024


@triton.jit
def _norm_rope_row(base, w_ptr, cos_row, sin_row, eps, D: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One head's row at ``base``, normed and turned by the angles at ``cos_row``/``sin_row``: float32
    [BLOCK_D] (zero past D) and its mask."""
    o = tl.arange(0, BLOCK_D)
    m = o < D
    x = tl.load(base + o, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r * w
    first = o < HALF  # turns with o + HALF
    second = (o >= HALF) & (o < 2 * HALF)  # turns with o - HALF
    partner = tl.where(first, o + HALF, o - HALF)
    mp = (first | second) & m
    yp = tl.load(base + partner, mask=mp, other=0.0).to(tl.float32) * r * tl.load(w_ptr + partner, mask=mp, other=0.0)
    angle = tl.where(first, o, o - HALF)
    c = tl.load(cos_row + angle, mask=mp, other=1.0).to(tl.float32)
    s = tl.load(sin_row + angle, mask=mp, other=0.0).to(tl.float32)
    rotated = tl.where(first, y * c - yp * s, y * c + yp * s)
    return tl.where(first | second, rotated, y), m


@triton.jit
def _program_head(x_ptr, w_ptr, cos_ptr, sin_ptr, H, eps, stride_xt, stride_xh, stride_ct, stride_st,
                  D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (token, head) of x [T, H, D], normed and turned: t, h, the row and its mask."""
    row = tl.program_id(0)
    t = row // H
    h = row % H
    out, m = _norm_rope_row(x_ptr + t * stride_xt + h * stride_xh, w_ptr, cos_ptr + t * stride_ct,
                            sin_ptr + t * stride_st, eps, D, HALF, BLOCK_D)
    return t, h, out, m


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, eps,
                      stride_xt, stride_xh, stride_ct, stride_st,
                      D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    t, h, out, m = _program_head(x_ptr, w_ptr, cos_ptr, sin_ptr, H, eps, stride_xt, stride_xh, stride_ct, stride_st,
                                 D, HALF, BLOCK_D)
    tl.store(out_ptr + (t * H + h) * D + tl.arange(0, BLOCK_D), out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _norm_rope_cache_kernel(k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, ck_ptr, cv_ptr, H, eps,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                            stride_ckh, stride_cks, stride_cvh, stride_cvs,
                            D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Token t's key head h, normed and turned, and its value head, into the caches at slot ``slots[t]``."""
    begin(PDL)
    t, h, key, m = _program_head(k_ptr, w_ptr, cos_ptr, sin_ptr, H, eps, stride_kt, stride_kh, stride_ct, stride_st,
                                 D, HALF, BLOCK_D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    o = tl.arange(0, BLOCK_D)
    tl.store(ck_ptr + h * stride_ckh + slot * stride_cks + o, key.to(ck_ptr.dtype.element_ty), mask=m)
    value = tl.load(v_ptr + t * stride_vt + h * stride_vh + o, mask=m, other=0.0)
    tl.store(cv_ptr + h * stride_cvh + slot * stride_cvs + o, value.to(cv_ptr.dtype.element_ty), mask=m)


def _check_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """The shapes ``norm_rope_triton`` takes; returns half (the turned pairs)."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, heads, D] with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    T, H, D = x.shape
    half = cos.shape[-1]
    if weight.shape != (D,) or not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"weight must be [{D}] with 1 <= D <= {MAX_HEAD_DIM}, got {tuple(weight.shape)}")
    if cos.shape != (T, half) or sin.shape != (T, half) or 2 * half > D:
        raise ValueError(f"cos and sin must be [T, half] = [{T}, half] with 2 * half <= {D}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos and sin need a contiguous last dimension")
    check_device(x, "the Triton norm + RoPE kernel")
    return half


def _angles(cos: torch.Tensor, sin: torch.Tensor, T: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    if half == 0:  # nothing turns: stand-ins the kernel never reads (an empty tensor has no address)
        cos = sin = torch.zeros(max(T, 1), 1, device=cos.device)
    return cos, sin


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """x [T, heads, D] (contiguous last dimension), weight [D], cos and sin [T, half] with
    2 * half <= D -> a new contiguous [T, heads, D] tensor in x's dtype."""
    half = _check_rope(x, weight, cos, sin)
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    cos, sin = _angles(cos, sin, T, half)
    if out.numel():
        _norm_rope_kernel[(T * H,)](x, weight.contiguous(), cos, sin, out, H, float(eps),
                                    x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                    D=D, HALF=half, BLOCK_D=triton.next_power_of_2(D), num_warps=warps("rope"),
                                    **launch(x.device, T, "attention"))
    return out


def norm_rope_to_cache_triton(k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, eps: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                              slots: torch.Tensor) -> torch.Tensor:
    """``cache_k[:, slots] = norm_rope(k)`` and ``cache_v[:, slots] = v`` in one launch: k, v [T, kv heads,
    D] (contiguous last dimension), caches [kv heads, L, D] (contiguous last dimension, values cast
    to their dtype), slots [T] distinct cache indices. Returns ``cache_k``."""
    half = _check_rope(k, weight, cos, sin)
    T, H, D = k.shape
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"v must be {tuple(k.shape)} with a contiguous last dimension, got {tuple(v.shape)}")
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        if c.dim() != 3 or c.shape[0] != H or c.shape[2] != D or c.stride(-1) != 1 or c.device != k.device:
            raise ValueError(f"{name} must be [{H}, L, {D}] on {k.device} with a contiguous last dimension, got "
                             f"{tuple(c.shape)} on {c.device}")
    if slots.shape != (T,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != k.device:
        raise ValueError(f"slots must be an int tensor [{T}] on {k.device}, got {slots.dtype} {tuple(slots.shape)}")
    cos, sin = _angles(cos, sin, T, half)
    if T * H:
        _norm_rope_cache_kernel[(T * H,)](
            k, v, weight.contiguous(), cos, sin, slots, cache_k, cache_v, H, float(eps),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
            cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
            D=D, HALF=half, BLOCK_D=triton.next_power_of_2(D), num_warps=warps("rope"),
            **launch(k.device, T, "attention"))
    return cache_k
