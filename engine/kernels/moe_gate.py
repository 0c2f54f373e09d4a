"""The small steps around a decode token's experts, one Triton launch each: the router's top-k,
the shared expert's SwiGLU activation, and the sum of the routed and the gated shared output.

- ``route_topk_triton``: softmax over the experts, the top k, renormalised to sum 1, which is
  the softmax of the k largest logits; ids in descending order of weight, as ``torch.topk``
  gives them (a tie goes to the lower expert id). Replaces softmax, topk, sum and divide.
- ``swiglu_triton``: ``silu(gate) * up``.
- ``shared_combine_triton``: ``y + sigmoid(x . gate_inp) * s`` in float32 (the gate's dot
  product included), cast once to the output dtype.

One program per token row (the router, the combine) or per row and column block (SwiGLU);
everything in float32 inside. The torch definitions are in ``engine.model.moe``. Importing
this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device

WHAT = "the Triton MoE gate kernels"
MAX_EXPERTS = 1024  # one row of router logits in registers
MAX_HIDDEN = 16384  # one row of the layer input in registers (the shared expert's gate)


@triton.jit
def _route_topk_kernel(l_ptr, ids_ptr, w_ptr, E, stride_l, K: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(l_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    o = tl.arange(0, K)
    ids = tl.zeros([K], dtype=tl.int64)
    w = tl.zeros([K], dtype=tl.float32)
    for i in tl.static_range(K):
        m = tl.max(logits, axis=0)
        idx = tl.min(tl.where(logits == m, e, BLOCK_E), axis=0)  # the lowest id among equal logits
        ids = tl.where(o == i, idx.to(tl.int64), ids)
        w = tl.where(o == i, tl.exp(m - top), w)
        logits = tl.where(e == idx, float("-inf"), logits)
    tl.store(ids_ptr + t * K + o, ids)
    tl.store(w_ptr + t * K + o, w / tl.sum(w, axis=0))


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + t * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _shared_combine_kernel(y_ptr, s_ptr, x_ptr, gi_ptr, out_ptr, N, H, stride_y, stride_s, stride_x,
                           BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)  # the gate's logit x . gate_inp, recomputed by each column block
    x = tl.load(x_ptr + t * stride_x + h, mask=h < H, other=0.0).to(tl.float32)
    gi = tl.load(gi_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    gate = tl.sigmoid(tl.sum(x * gi, axis=0))
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    y = tl.load(y_ptr + t * stride_y + c, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + t * stride_s + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + c, (y + gate * s).to(out_ptr.dtype.element_ty), mask=m)


def _rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")


def route_topk_triton(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids [T, k] int64, weights [T, k] float32 summing to 1)."""
    _rows("logits", logits)
    check_device(logits, WHAT)
    T, E = logits.shape
    if not 1 <= k <= E or E > MAX_EXPERTS or k & (k - 1):
        raise ValueError(f"top-k needs 1 <= k <= E <= {MAX_EXPERTS} with k a power of two, got k={k}, E={E}")
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        _route_topk_kernel[(T,)](logits, ids, weights, E, logits.stride(0), K=k,
                                 BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return ids, weights


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [T, N] rows, in gate's dtype."""
    _rows("gate", gate)
    _rows("up", up)
    check_device(gate, WHAT)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    T, N = gate.shape
    out = torch.empty(T, N, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(N))
    if out.numel():
        _swiglu_kernel[(T, triton.cdiv(N, block))](gate, up, out, N, gate.stride(0), up.stride(0), BLOCK=block)
    return out


def shared_combine_triton(y: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate_inp: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """``y + sigmoid(x . gate_inp)[:, None] * shared`` for [T, N] rows of ``y`` and ``shared`` and
    the layer input ``x`` [T, H], in ``out_dtype``."""
    for name, t in (("y", y), ("shared", shared), ("x", x)):
        _rows(name, t)
    check_device(y, WHAT)
    T, N = y.shape
    H = x.shape[1]
    if shared.shape != y.shape or x.shape[0] != T or gate_inp.shape != (H,) or H > MAX_HIDDEN:
        raise ValueError(f"y and shared must be one [T, N] shape, x [T, H] with H <= {MAX_HIDDEN} and gate_inp "
                         f"[H], got {tuple(y.shape)}, {tuple(shared.shape)}, {tuple(x.shape)}, {tuple(gate_inp.shape)}")
    out = torch.empty(T, N, dtype=out_dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(N))
    if out.numel():
        _shared_combine_kernel[(T, triton.cdiv(N, block))](
            y, shared, x, gate_inp.contiguous(), out, N, H, y.stride(0), shared.stride(0), x.stride(0),
            BLOCK=block, BLOCK_H=triton.next_power_of_2(H))
    return out
