"""Projections whose weight is either a dense tensor or a quantized matrix kept as GGUF blocks.

Dense float32 projections of 8 to 32 rows on CUDA (DFlash verify and draft blocks) take the one-launch
kernel of ``engine.kernels.skinny``; everything else ``F.linear``.
"""

from __future__ import annotations

import os
from typing import Union

import torch
import torch.nn.functional as F

from engine.kernels import fused
from engine.kernels.quant import QuantMatrix

Weight = Union[torch.Tensor, QuantMatrix]

# None: ``linear`` takes the few-row kernel where it applies (CUDA); True: off CUDA too (tests, with
# TRITON_INTERPRET=1); False: never (``LUCE_TUNE_SKINNY=0``, for measuring what it changes).
FUSED_SKINNY: bool | None = False if os.environ.get("LUCE_TUNE_SKINNY", "1") == "0" else None
SKINNY = "few-row float32 projection"


def _skinny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    on = (x.is_cuda and fused.allowed(SKINNY)) if FUSED_SKINNY is None else FUSED_SKINNY
    if not on or x.dtype != torch.float32:  # bf16 models never take it: no import, no checks
        return None
    from engine.kernels import skinny

    if not skinny.applies(x, w, min_rows=skinny.MIN_M):
        return None
    return fused.attempt(SKINNY, FUSED_SKINNY, lambda: skinny.skinny_linear(x, w))


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` over the last dimension of ``x``, for a dense or a quantized ``w``."""
    if isinstance(w, QuantMatrix):
        flat = x.reshape(-1, x.shape[-1])
        return w.matmul(flat.contiguous()).view(*x.shape[:-1], w.n)
    out = _skinny(x, w)
    return F.linear(x, w) if out is None else out
