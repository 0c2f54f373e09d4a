"""An attention head's RMSNorm and its rotary embedding in one Triton launch.

The torch definition is ``engine.model.attention.norm_rope_reference``: ``rms_norm(x, weight)``
then ``apply_rope`` (NeoX pairing: dimension i < half turns with i + half, by the position's
angle i; dimensions from 2 * half on pass through). One program per (token, head), the head
in registers, float32 inside, the output rounded once. The query heads arrive as strided
slices of a wider projection (each head's query is followed by its output gate), so the two
leading dimensions may be strided; the last must be contiguous. Importing this module needs
Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device
from engine.kernels.pdl import begin, launch

MAX_HEAD_DIM = 1024


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, eps,
                      stride_xt, stride_xh, stride_ct, stride_st,
                      D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    row = tl.program_id(0)
    t = row // H
    h = row % H
    o = tl.arange(0, BLOCK_D)
    m = o < D
    base = x_ptr + t * stride_xt + h * stride_xh
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
    c = tl.load(cos_ptr + t * stride_ct + angle, mask=mp, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + angle, mask=mp, other=0.0).to(tl.float32)
    rotated = tl.where(first, y * c - yp * s, y * c + yp * s)
    out = tl.where(first | second, rotated, y)
    tl.store(out_ptr + row * D + o, out.to(out_ptr.dtype.element_ty), mask=m)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """x [T, heads, D] (contiguous last dimension), weight [D], cos and sin [T, half] with
    2 * half <= D -> a new contiguous [T, heads, D] tensor in x's dtype."""
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
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if half == 0:  # nothing turns: stand-ins the kernel never reads (an empty tensor has no address)
        cos = sin = torch.zeros(max(T, 1), 1, device=x.device)
    if out.numel():
        _norm_rope_kernel[(T * H,)](x, weight.contiguous(), cos, sin, out, H, float(eps),
                                    x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                    D=D, HALF=half, BLOCK_D=triton.next_power_of_2(D), num_warps=4,
                                    **launch(x.device))
    return out
