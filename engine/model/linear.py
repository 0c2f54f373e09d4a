"""Projections whose weight is either a dense tensor or a quantized matrix kept as GGUF blocks."""

from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F

from engine.kernels.quant import QuantMatrix

Weight = Union[torch.Tensor, QuantMatrix]


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` over the last dimension of ``x``, for a dense or a quantized ``w``."""
    if isinstance(w, QuantMatrix):
        flat = x.reshape(-1, x.shape[-1])
        return w.matmul(flat.contiguous()).view(*x.shape[:-1], w.n)
    return F.linear(x, w)
