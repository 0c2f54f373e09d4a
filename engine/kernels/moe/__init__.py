"""Routed-expert FFN: ``fused_moe`` picks the Triton kernel on CUDA and plain torch elsewhere.

The Triton module is imported on first use, so the CPU path never needs Triton.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from engine.kernels.moe.reference import experts_sum, moe_reference, routed_experts

if TYPE_CHECKING:
    from engine.kernels.moe.triton import MoEKernelConfig

__all__ = ["IMPLS", "experts_sum", "fused_moe", "moe_reference", "resolve_impl", "routed_experts"]

IMPLS = ("auto", "triton", "torch")


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto`` means Triton on CUDA when it is installed, torch otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"MoE implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        has_triton = importlib.util.find_spec("triton") is not None
        return "triton" if device.type == "cuda" and has_triton else "torch"
    return impl


def fused_moe(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              topk_ids: torch.Tensor, topk_w: torch.Tensor, *, impl: str = "auto",
              config: "MoEKernelConfig | None" = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x.dtype.

    x [T, H]; gate, up [E, ffn, H]; down [E, H, ffn]; topk_ids [T, k] int64 indexing the
    first dimension of the weights (negative ids are skipped); topk_w [T, k] float32.
    """
    if resolve_impl(impl, x.device) == "triton":
        from engine.kernels.moe.triton import fused_moe_triton

        return fused_moe_triton(x, gate, up, down, topk_ids, topk_w, config)
    return moe_reference(x, gate, up, down, topk_ids, topk_w)
