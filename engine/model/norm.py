"""RMSNorm with a plain multiplier (engine order: GGUF already stores ``1 + w``).

``rms_norm`` runs the one-launch Triton kernel (``engine.kernels.rms_norm``) on CUDA tensors
outside autograd, and the torch definition everywhere else (the CPU, draft training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import fused


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gate: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / rms(x) * weight`` (times ``silu(gate)`` when given) over the last dim, in float32,
    returned in ``out_dtype`` (default x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if gate is not None:
        xf = xf * F.silu(gate.float())
    return xf.to(out_dtype or x.dtype)


# None: ``rms_norm`` takes its Triton kernel on CUDA tensors; True: off CUDA too (with TRITON_INTERPRET=1:
# tests, the launch counts of ``bench/dflash_launches.py``); False: never.
FUSED_NORM: bool | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rms_norm_reference``'s result; one Triton launch where it applies."""
    on_device = x.is_cuda if FUSED_NORM is None else FUSED_NORM
    if (fused.TRITON and on_device and x.dim() in (2, 3) and x.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (gate is None or gate.stride(-1) == 1)):
        from engine.kernels.rms_norm import MAX_DIM, rms_norm_triton

        if x.shape[-1] <= MAX_DIM:
            return rms_norm_triton(x, weight, eps, gate=gate, out_dtype=out_dtype)
    return rms_norm_reference(x, weight, eps, gate=gate, out_dtype=out_dtype)


# None: ``add_rms_norm`` takes its Triton kernel where it applies (CUDA); True: off CUDA too
# (tests, with TRITON_INTERPRET=1); False: never.
FUSED_ADD_NORM: bool | None = None
ADD_NORM = "residual add + RMSNorm"


def _picks_kernel(h: torch.Tensor) -> bool:
    return h.is_cuda and fused.allowed(ADD_NORM)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``h + r`` (``h`` itself when ``r`` is None) and its ``rms_norm``; one
    Triton launch where it applies (CUDA rows outside autograd), the same values as the add
    (rounded to h's dtype) followed by ``rms_norm``."""
    if r is None:
        return h, rms_norm(h, weight, eps)
    on_device = _picks_kernel(h) if FUSED_ADD_NORM is None else FUSED_ADD_NORM
    if (on_device and h.dim() == 2 and h.shape == r.shape and h.dtype == r.dtype
            and h.stride(-1) == 1 and r.stride(-1) == 1
            and not (torch.is_grad_enabled() and (h.requires_grad or r.requires_grad or weight.requires_grad))):
        from engine.kernels.rms_norm import MAX_DIM, add_rms_norm_triton

        if h.shape[-1] <= MAX_DIM:
            out = fused.attempt(ADD_NORM, FUSED_ADD_NORM, lambda: add_rms_norm_triton(h, r, weight, eps))
            if out is not None:
                return out
    h = h + r
    return h, rms_norm(h, weight, eps)
