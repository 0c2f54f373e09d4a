"""Gated DeltaNet's inputs for a few tokens in one Triton launch: the short causal conv, SiLU,
the query/key L2 norms and their spread over the value heads, and the gates.

The torch definition is ``engine.model.gated_deltanet.gdn_prologue_reference``. From the
``qkv`` projection [T, C] (C = 2 * key_dim + value_dim), the conv state [C, K-1], the conv
weight [C, K] and the gate projections ``b`` and ``alpha`` [T, hv]:

    mixed = silu(causal_conv(qkv, state))          the state then holds the last K-1 inputs
    q, k  = l2norm(mixed's key heads), each copied to the hv / hk value heads that read it
    v     = mixed's value heads
    beta  = sigmoid(b);  g = a * softplus(alpha + dt_bias)

A decode step or a DFlash verify block otherwise spends some fifteen small kernels on this
per layer. One program per key head of q, per key head of k and per value head of v (its
channels across all T tokens, so the conv state it updates is its own), and one for the gates.
Everything is computed in float32; q, k, g and beta are returned in float32, v in qkv's dtype.
With ``window``, the conv window the DFlash rollback replays (the old state, then the T
inputs) is written too. Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device
from engine.kernels.pdl import begin, launch
from engine.kernels.warps import warps

MAX_TOKENS = 16  # the token count is a compile-time constant: one compiled kernel per T
MAX_HEAD_DIM = 256


@triton.jit
def _conv_value(x_ptr, s_ptr, i, o, m, stride_xt, stride_sc, stride_sk, KM1: tl.constexpr):
    """Column ``i`` of the padded sequence [state | x^T] for channels ``o``."""
    from_state = tl.load(s_ptr + o * stride_sc + i * stride_sk, mask=m & (i < KM1), other=0.0).to(tl.float32)
    from_x = tl.load(x_ptr + (i - KM1) * stride_xt + o, mask=m & (i >= KM1), other=0.0).to(tl.float32)
    return from_state + from_x


@triton.jit
def _gdn_prologue_kernel(
    x_ptr, s_ptr, w_ptr, b_ptr, al_ptr, a_ptr, dt_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, win_ptr,
    eps,
    stride_xt, stride_sc, stride_sk, stride_wc, stride_bt, stride_at,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
    stride_winc,
    T: tl.constexpr, K: tl.constexpr, KM1: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
    R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)
    # KM1 = K - 1 (the conv state's width), R = HV // HK (value heads per key head)
    pid = tl.program_id(0)
    if pid == 2 * HK + HV:  # the gates, every value head and token
        h = tl.arange(0, BLOCK_H)
        mh = h < HV
        a = tl.load(a_ptr + h, mask=mh, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + h, mask=mh, other=0.0).to(tl.float32)
        for t in range(T):
            b = tl.load(b_ptr + t * stride_bt + h, mask=mh, other=0.0).to(tl.float32)
            al = tl.load(al_ptr + t * stride_at + h, mask=mh, other=0.0).to(tl.float32) + dt
            softplus = tl.where(al > 20.0, al, tl.log(1.0 + tl.exp(al)))
            tl.store(beta_ptr + t * stride_betat + h, tl.sigmoid(b), mask=mh)
            tl.store(g_ptr + t * stride_gt + h, a * softplus, mask=mh)
    else:
        # a query (pid < HK) or key head: DK channels, L2-normed, spread; else a value head
        # (no branch assigns these: a compiled kernel cannot merge two different constexprs)
        is_qk = pid < 2 * HK
        D = tl.where(is_qk, DK, DV)
        c0 = tl.where(is_qk, pid * DK, 2 * HK * DK + (pid - 2 * HK) * DV)
        d = tl.arange(0, BLOCK)
        m = d < D
        o = c0 + d
        xs = x_ptr
        ss = s_ptr
        for t in range(T):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(K):
                wj = tl.load(w_ptr + o * stride_wc + j, mask=m, other=0.0).to(tl.float32)
                acc += wj * _conv_value(xs, ss, t + j, o, m, stride_xt, stride_sc, stride_sk, KM1)
            y = acc * tl.sigmoid(acc)  # silu
            if pid < 2 * HK:
                y = y * tl.rsqrt(tl.sum(y * y, axis=0) + eps)
                head = pid % HK
                if pid < HK:
                    for r in tl.static_range(R):
                        tl.store(q_ptr + t * stride_qt + (head * R + r) * stride_qh + d, y, mask=m)
                else:
                    for r in tl.static_range(R):
                        tl.store(k_ptr + t * stride_kt + (head * R + r) * stride_kh + d, y, mask=m)
            else:
                tl.store(v_ptr + t * stride_vt + (pid - 2 * HK) * stride_vh + d,
                         y.to(v_ptr.dtype.element_ty), mask=m)
        if HAS_WINDOW:  # the old state, then the T inputs: what the rollback replays
            for i in range(KM1 + T):
                val = _conv_value(xs, ss, i, o, m, stride_xt, stride_sc, stride_sk, KM1)
                tl.store(win_ptr + o * stride_winc + i, val.to(win_ptr.dtype.element_ty), mask=m)
        # the new state: the last K-1 columns; column T+j is read before column j is written
        for j in range(KM1):
            val = _conv_value(xs, ss, T + j, o, m, stride_xt, stride_sc, stride_sk, KM1)
            tl.store(s_ptr + o * stride_sc + j * stride_sk, val.to(s_ptr.dtype.element_ty), mask=m)


def gdn_prologue_triton(qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                        b: torch.Tensor, alpha: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, *,
                        k_heads: int, v_heads: int, head_k: int, head_v: int, eps: float = 1e-6,
                        out: tuple[torch.Tensor, ...] | None = None, window: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gdn_prologue_reference``'s (q, k, v, g, beta); ``conv_state`` is updated in place.

    qkv [T, C] with a contiguous last dimension; conv_state [C, K-1]; conv_weight [C, K];
    b and alpha [T, hv]; a and dt_bias [hv]. ``out`` gives the five output tensors to write
    (q, k [T, hv, dk] float32, v [T, hv, dv] in qkv's dtype, g and beta [T, hv] float32);
    ``window`` [C, K-1+T] receives the old state and the inputs.
    """
    T, C = qkv.shape
    hk, hv, dk, dv = k_heads, v_heads, head_k, head_v
    K = conv_weight.shape[1]
    if C != 2 * hk * dk + hv * dv or conv_weight.shape != (C, K) or conv_state.shape != (C, K - 1):
        raise ValueError(f"qkv [T, {C}], conv_weight {tuple(conv_weight.shape)} and conv_state "
                         f"{tuple(conv_state.shape)} do not fit {hk} key heads of {dk} and {hv} value heads of {dv}")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"the prologue kernel takes 1 to {MAX_TOKENS} tokens, got T={T}")
    if hv % hk or max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk}), head sizes at most "
                         f"{MAX_HEAD_DIM} (got {dk}, {dv})")
    for name, x in (("b", b), ("alpha", alpha)):
        if x.shape != (T, hv) or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [T, hv] = {(T, hv)} with a contiguous last dimension, "
                             f"got {tuple(x.shape)}")
    if qkv.stride(-1) != 1 or conv_weight.stride(-1) != 1:
        raise ValueError("qkv and conv_weight need a contiguous last dimension")
    check_device(qkv, "the Triton prologue kernel")
    dev, f32 = qkv.device, torch.float32
    if out is None:
        out = (torch.empty(T, hv, dk, device=dev, dtype=f32), torch.empty(T, hv, dk, device=dev, dtype=f32),
               torch.empty(T, hv, dv, device=dev, dtype=qkv.dtype), torch.empty(T, hv, device=dev, dtype=f32),
               torch.empty(T, hv, device=dev, dtype=f32))
    q, k, v, g, beta = out
    shapes = ((T, hv, dk), (T, hv, dk), (T, hv, dv), (T, hv), (T, hv))
    for name, x, shape in zip(("q", "k", "v", "g", "beta"), out, shapes):
        if tuple(x.shape) != shape or x.stride(-1) != 1:
            raise ValueError(f"out {name} must be {shape} with a contiguous last dimension, got {tuple(x.shape)}")
    if window is not None and (window.shape != (C, K - 1 + T) or window.stride(-1) != 1):
        raise ValueError(f"window must be [{C}, {K - 1 + T}], contiguous rows, got {tuple(window.shape)}")
    _gdn_prologue_kernel[(2 * hk + hv + 1,)](
        qkv, conv_state, conv_weight, b, alpha, a, dt_bias,
        q, k, v, g, beta, window if window is not None else q,
        float(eps),
        qkv.stride(0), conv_state.stride(0), conv_state.stride(1), conv_weight.stride(0), b.stride(0),
        alpha.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), window.stride(0) if window is not None else 0,
        T=T, K=K, KM1=K - 1, HK=hk, HV=hv, R=hv // hk, DK=dk, DV=dv, BLOCK=triton.next_power_of_2(max(dk, dv)),
        BLOCK_H=triton.next_power_of_2(hv), HAS_WINDOW=window is not None, num_warps=warps("gdn_prologue"),
        **launch(qkv.device, qkv.shape[0], "gdn"))
    return q, k, v, g, beta
