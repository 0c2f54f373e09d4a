"""Mixture of experts of qwen35moe: float32 softmax router, top-k renormalised, routed experts
behind an executor, and a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from engine.kernels import fused
from engine.kernels.moe import fused_moe, resolve_impl
from engine.model.config import ModelConfig
from engine.model.weights import ExpertWeights, MoEWeights
from engine.model.linear import linear
from engine.model.norm import add_rms_norm

# Called with (layer index, top-k expert ids [T, k]) on every MoE layer: calibration statistics.
RoutingObserver = Callable[[int, torch.Tensor], None]

# Calls of up to this many tokens on CUDA take ``engine.kernels.moe_gate``'s one-launch router
# (logits and top-k), SwiGLU and shared-expert sum. FUSED_GATE None: where they apply; True: for
# every call of up to that many tokens, whatever the device (tests, with TRITON_INTERPRET=1);
# False: never.
GATE_MAX_TOKENS = 16
FUSED_GATE: bool | None = None
GATE = "MoE gate"
# True: where the fused gate applies, the residual add + RMSNorm before the experts runs inside the
# router's launch (``moe_gate.add_norm_route_triton``: 40 launches fewer a 35B step); False: in its own
# launch. On: in three alternating pairs of the captured 35B step on the H200 it ran 2.09 ms against
# 2.11-2.19 ms apart (``bench/profile_decode.py --kernel-variants norm-route=apart,norm-route=inside``).
NORM_IN_ROUTER = True


def _fused_gate(x: torch.Tensor, *params: torch.Tensor) -> bool:
    if x.shape[0] > GATE_MAX_TOKENS:
        return False
    if FUSED_GATE is not None:
        return FUSED_GATE
    return (x.is_cuda and fused.allowed(GATE)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))))


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


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows [T, N]: one launch where the fused gate applies (the shared expert's SwiGLU
    kernel), else torch's two."""
    if gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1 and _fused_gate(gate, up):
        out = fused.attempt(GATE, FUSED_GATE, lambda: _gate_kernels().swiglu_triton(gate, up))
        if out is not None:
            return out
    return F.silu(gate) * up


def _gate_kernels():
    from engine.kernels import moe_gate

    return moe_gate


def _gate_up(x: torch.Tensor, s) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's gate and up projections: one matrix product when they share a matrix."""
    if s.gate_up is not None:
        g, u = linear(x, s.gate_up).split([_rows(s.gate), _rows(s.up)], dim=-1)
        return g, u
    return linear(x, s.gate), linear(x, s.up)


def _rows(w) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.n


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


def add_norm_route(h: torch.Tensor, r: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: MoEWeights,
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The residual stream ``h + r``, its RMSNorm (the experts' input) and, where the router's launch
    takes the add + norm too (``NORM_IN_ROUTER``, decode-sized calls where the fused gate applies),
    the routing (ids, weights) for ``moe_forward``'s ``routed``; else None, and ``add_rms_norm``."""
    E = w.router.shape[0]
    if (NORM_IN_ROUTER and _fused_gate(h, r, norm_weight, w.router) and h.dim() == 2 and h.shape == r.shape
            and h.dtype == r.dtype and h.stride(-1) == 1 and r.stride(-1) == 1 and top_k & (top_k - 1) == 0
            and top_k <= E <= 1024):
        out = fused.attempt(GATE, FUSED_GATE, lambda: _gate_kernels().add_norm_route_triton(
            h, r, norm_weight, eps, w.router.float(), top_k))
        if out is not None:
            h, x, ids, weights = out
            return h, x, (ids, weights)
    h, x = add_rms_norm(h, r, norm_weight, eps)
    return h, x, None


def route(router: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top-k, weights renormalised to sum 1: (ids [T, k], weights [T, k])."""
    E = router.shape[0]
    if _fused_gate(x, router) and top_k & (top_k - 1) == 0 and top_k <= E <= 1024:
        routed = fused.attempt(GATE, FUSED_GATE, lambda: _gate_kernels().route_triton(x, router.float(), top_k))
        if routed is not None:
            return routed
    logits = F.linear(x.float(), router.float())
    probs = torch.softmax(logits, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def moe_forward(w: MoEWeights, x: torch.Tensor, layer_idx: int, cfg: ModelConfig, executor: ExpertExecutor,
                observer: RoutingObserver | None = None,
                routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, hidden] (already normed) -> [T, hidden]; ``routed`` (ids, weights) when the router has
    run (``add_norm_route``)."""
    ids, weights = routed if routed is not None else route(w.router, x, cfg.n_expert_used)
    if observer is not None:
        observer(layer_idx, ids)
    if w.shared is not None and hasattr(executor, "moe_with_shared"):
        out = executor.moe_with_shared(layer_idx, x, ids, weights, w.shared)  # None: not for this call
        if out is not None:
            return out
    y = executor(layer_idx, x, ids, weights)
    if w.shared is None:
        return y
    s = w.shared
    if _fused_gate(x, s.gate_inp):
        def kernels() -> torch.Tensor:
            k = _gate_kernels()
            act = linear(k.swiglu_triton(*_gate_up(x, s)), s.down)
            return k.shared_combine_triton(y.contiguous(), act.contiguous(), x.contiguous(), s.gate_inp, x.dtype)

        out = fused.attempt(GATE, FUSED_GATE, kernels)
        if out is not None:
            return out
    gate = torch.sigmoid(x.float() @ s.gate_inp)  # [T]
    g, u = _gate_up(x, s)
    shared = linear(F.silu(g) * u, s.down)
    return (y.float() + gate[:, None] * shared.float()).to(x.dtype)
