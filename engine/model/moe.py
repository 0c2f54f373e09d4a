"""Mixture of experts of qwen35moe: float32 softmax router, top-k renormalised, routed experts
behind an executor, and a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.moe import fused_moe, resolve_impl
from engine.model.config import ModelConfig
from engine.model.weights import ExpertWeights, MoEWeights
from engine.model.linear import linear

# Called with (layer index, top-k expert ids [T, k]) on every MoE layer: calibration statistics.
RoutingObserver = Callable[[int, torch.Tensor], None]


class ExpertExecutor(Protocol):
    """Computes ``sum_i w[t, i] * expert_{ids[t, i]}(x[t])`` for one layer's routed experts.

    An executor whose ``graph_safe`` attribute is true runs without host synchronisation and
    Python-side state, so a decode step through it can be captured in a CUDA graph.
    """

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_w: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], topk_ids [T, k] int64, topk_w [T, k] float32 -> [T, hidden] in x's dtype."""
        ...


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``down(silu(gate x) * up x)``."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


class TorchExpertExecutor:
    """Reference executor: gathers the tokens of each routed expert and runs only those experts.

    The per-expert token counts come to the host once per layer; the captured decode step
    runs ``FusedExpertExecutor`` on the same weights instead.
    """

    graph_safe = False

    def __init__(self, experts: Sequence[ExpertWeights] | Mapping[int, ExpertWeights]):
        self.experts = experts  # indexed by layer

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_w: torch.Tensor) -> torch.Tensor:
        ew = self.experts[layer_idx]
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=ew.n_expert).tolist()
        weights = topk_w.reshape(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            slots = order[start:start + count]
            start += count
            tokens = slots // k
            y = expert_ffn(x[tokens], *ew.expert(e))
            out.index_add_(0, tokens, y.float() * weights[slots, None])
        return out.to(x.dtype)


class FusedExpertExecutor:
    """All experts of every layer through ``engine.kernels.moe.fused_moe`` on the stacked weights.

    With the Triton kernels nothing reads the routing back to the host (graph safe); with
    ``impl="torch"`` it is the reference, which does.
    """

    def __init__(self, experts: Sequence[ExpertWeights] | Mapping[int, ExpertWeights], *, impl: str = "auto",
                 device: torch.device | str = "cpu"):
        self.experts = experts  # indexed by layer
        self.impl = resolve_impl(impl, torch.device(device))
        self.graph_safe = self.impl == "triton"

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_w: torch.Tensor) -> torch.Tensor:
        ew = self.experts[layer_idx]
        return fused_moe(x, ew.gate, ew.up, ew.down, topk_ids, topk_w, impl=self.impl)


def route(router: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top-k, weights renormalised to sum 1: (ids [T, k], weights [T, k])."""
    probs = torch.softmax(F.linear(x.float(), router.float()), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def moe_forward(w: MoEWeights, x: torch.Tensor, layer_idx: int, cfg: ModelConfig, executor: ExpertExecutor,
                observer: RoutingObserver | None = None) -> torch.Tensor:
    """x [T, hidden] (already normed) -> [T, hidden]."""
    ids, weights = route(w.router, x, cfg.n_expert_used)
    if observer is not None:
        observer(layer_idx, ids)
    y = executor(layer_idx, x, ids, weights)
    if w.shared is None:
        return y
    s = w.shared
    gate = torch.sigmoid(x.float() @ s.gate_inp)  # [T]
    return (y.float() + gate[:, None] * expert_ffn(x, s.gate, s.up, s.down).float()).to(x.dtype)
