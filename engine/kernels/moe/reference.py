"""Routed experts in plain torch: the reference for the Triton kernel and the CPU path.

Each routed (token, k) pair with expert ``e`` contributes
``w * down[e] @ (silu(gate[e] @ x) * (up[e] @ x))`` to its token's output. Pairs whose id
is negative are skipped (the hybrid executor marks experts it serves elsewhere that way).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F


def routed_experts(topk_ids: torch.Tensor) -> list[int]:
    """The distinct non-negative expert ids in ``topk_ids``, ascending (synchronises the host)."""
    ids = topk_ids[topk_ids >= 0]
    return torch.unique(ids).tolist()


def experts_sum(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Iterable[int]) -> torch.Tensor:
    """Sum of the contributions of ``experts`` only, as float32 [T, H].

    Matmuls run in the weights' dtype (fp32 accumulation inside torch); the weighted sum over
    experts is kept in float32.
    """
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xw = x.to(gate.dtype)
    for e in experts:
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)  # [n], [n]
        xs = xw[tok]  # [n, H]
        act = F.silu(F.linear(xs, gate[e])) * F.linear(xs, up[e])  # [n, ffn]
        y = F.linear(act, down[e]).float()  # [n, H]
        out.index_add_(0, tok, y * topk_w[tok, slot].float().unsqueeze(1))
    return out


def moe_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """Routed-expert output [T, H] in x.dtype.

    x [T, H]; gate, up [E, ffn, H]; down [E, H, ffn]; topk_ids [T, k] int64 (negative: skip);
    topk_w [T, k] float32.
    """
    return experts_sum(x, gate, up, down, topk_ids, topk_w, routed_experts(topk_ids)).to(x.dtype)
