"""RMSNorm in one Triton launch: ``x / rms(x) * weight``, optionally times ``silu(gate)``; and
the residual add before a norm, ``h + r`` and its RMSNorm, in one launch too.

One program per row of the last dimension, the row held in registers: float32 inside, the
output cast once. Rows may be strided in the two leading dimensions (the query and key heads
arrive as slices of a wider projection), the last dimension must be contiguous. The torch
definition is ``engine.model.norm.rms_norm_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import begin, launch
from engine.kernels.warps import warps

MAX_DIM = 16384  # one row in registers


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, B, D, eps,
                     stride_xa, stride_xb, stride_ga, stride_gb,
                     HAS_GATE: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    row = tl.program_id(0)
    a = row // B
    b = row % B
    o = tl.arange(0, BLOCK_D)
    m = o < D
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + o, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r * tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(g_ptr + a * stride_ga + b * stride_gb + o, mask=m, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(out_ptr + row * D + o, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, h_out_ptr, out_ptr, D, eps, stride_h, stride_r,
                         BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    row = tl.program_id(0)
    o = tl.arange(0, BLOCK_D)
    m = o < D
    h = tl.load(h_ptr + row * stride_h + o, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + o, mask=m, other=0.0).to(tl.float32)
    s = (h + r).to(h_out_ptr.dtype.element_ty)  # the residual stream, rounded as ``h + r`` is
    tl.store(h_out_ptr + row * D + o, s, mask=m)
    x = s.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + o, y.to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm_triton(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, r [A, D] (contiguous last dimension), weight [D] -> (h + r, rms_norm(h + r) * weight),
    both new contiguous tensors in h's dtype, the sum rounded to it before the norm."""
    if h.dim() != 2 or h.shape != r.shape or h.stride(-1) != 1 or r.stride(-1) != 1:
        raise ValueError(f"h and r must be one [A, D] shape with contiguous rows, got {tuple(h.shape)} and "
                         f"{tuple(r.shape)}")
    A, D = h.shape
    if weight.shape != (D,) or not 1 <= D <= MAX_DIM:
        raise ValueError(f"weight must be [{D}] with 1 <= D <= {MAX_DIM}, got {tuple(weight.shape)}")
    h_out, out = torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(
        h, memory_format=torch.contiguous_format)
    if h.numel():
        _add_rms_norm_kernel[(A,)](h, r, weight.contiguous(), h_out, out, D, float(eps), h.stride(0), r.stride(0),
                                   BLOCK_D=triton.next_power_of_2(D), num_warps=_warps(D),
                                   **launch(h.device, A, "norm"))
    return h_out, out


def _warps(D: int, gated: bool = False) -> int:
    """The warps table's count for rows up to 4096 (``engine.kernels.warps``: ``gated_norm`` for the
    gated norm, else ``norm``), 8 for longer rows."""
    return warps("gated_norm" if gated else "norm") if D <= 4096 else 8


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t[:, None] if t.dim() == 2 else t


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gate: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [A, D] or [A, B, D] (last dimension contiguous), weight [D], gate like x or None ->
    a new contiguous tensor of x's shape in ``out_dtype`` (default x's dtype)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D or 3-D with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    D = x.shape[-1]
    if weight.shape != (D,) or not 1 <= D <= MAX_DIM:
        raise ValueError(f"weight must be [{D}] with 1 <= D <= {MAX_DIM}, got {tuple(weight.shape)}")
    if gate is not None and (gate.shape != x.shape or gate.stride(-1) != 1):
        raise ValueError(f"gate must have x's shape {tuple(x.shape)} with a contiguous last dimension, got "
                         f"{tuple(gate.shape)}")
    x3 = _as_3d(x)
    g3 = _as_3d(gate) if gate is not None else x3
    A, B, _ = x3.shape
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if out.numel():
        _rms_norm_kernel[(A * B,)](
            x3, weight.contiguous(), g3, out, B, D, float(eps),
            x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1),
            HAS_GATE=gate is not None, BLOCK_D=triton.next_power_of_2(D), num_warps=_warps(D, gate is not None),
            **launch(x.device, A, "norm"))
    return out
