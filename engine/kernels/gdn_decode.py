"""Gated delta rule decode step (a few tokens) in one Triton launch.

The maths is ``engine.model.gated_deltanet.delta_rule_recurrent``: per value head, with state
``S`` [dk, dv] in float32 and per token ``t``:
``S = exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = S^T (scale q_t)``.

The grid is (head, block of value columns). Every column of ``S`` evolves on its own (the
update mixes rows through ``k_t`` only), so a program keeps its [dk, BLOCK_V] slice of the
state in registers across all T tokens and writes it back once: the state is read and
written once per call whatever T is, and nothing needs a second launch. With ``states``, the
state after every token is also stored (a DFlash verify block's: the state at any accepted
prefix is then a copy, not a replay of the block).

With ``norm``, the launch also applies Gated DeltaNet's gated RMSNorm to each head's output
(``rms_norm(o, weight, eps, gate=z)``, ``engine.model.norm``), which needs the head's whole row
of values: the head's program that arrives last at its counter (the semaphore of the split
GEMVs) reads the head's rows back and writes them normed, in the output dtype, then zeroes the
counter. That replaces the norm's own launch in a decode step.

Importing this module needs Triton; ``decode_kernel_available`` says where it runs compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device, scratch
from engine.kernels.pdl import begin, launch, launch_next, prefetch, wait_previous
from engine.kernels.warps import warps

MAX_HEAD_DIM = 128  # a [128, BLOCK_V] float32 slice of the state still fits in registers
MAX_TOKENS = 16  # the token count is a compile-time constant: one compiled kernel per T
MAX_HEADS = 1024  # value heads a normed call may count in (one int32 counter each, per device)


def decode_kernel_available(device: torch.device | str, head_k: int = MAX_HEAD_DIM,
                            head_v: int = MAX_HEAD_DIM) -> bool:
    """True on a usable CUDA device for head sizes the kernel handles (up to ``MAX_HEAD_DIM``)."""
    device = torch.device(device)
    fits = 1 <= head_k <= MAX_HEAD_DIM and 1 <= head_v <= MAX_HEAD_DIM
    return fits and device.type == "cuda" and torch.cuda.is_available()


@triton.jit
def _delta_rule_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, s_out_ptr,
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    stride_sh, stride_sk, stride_sv, stride_ot, stride_oh, stride_zh, stride_zk, stride_zv,
    gate_ptr, nw_ptr, y_ptr, count_ptr, eps, stride_gate_t, stride_gate_h, stride_yt, stride_yh,
    st_ptr, stride_st, stride_sth, stride_stk, stride_stv,
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    NORM: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    STATES: tl.constexpr,
):
    if PREFETCH:  # the state first, while the kernel before still runs (``engine.kernels.pdl``)
        launch_next(PDL)
    else:
        begin(PDL)
    i_h = tl.program_id(0)
    i_v = tl.program_id(1)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k = o_k < DK
    m_v = o_v < DV
    m_s = m_k[:, None] & m_v[None, :]

    p_s = s_ptr + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # [BK, BV]
    if PREFETCH:
        wait_previous(PDL)
    for t in range(T):
        b_q = tl.load(q_ptr + t * stride_qt + i_h * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k_ptr + t * stride_kt + i_h * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_v = tl.load(v_ptr + t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_g = tl.load(g_ptr + t * stride_gt + i_h * stride_gh).to(tl.float32)
        b_beta = tl.load(beta_ptr + t * stride_bt + i_h * stride_bh).to(tl.float32)

        b_s = b_s * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))  # [BV]
        b_s = b_s + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(o_ptr + t * stride_ot + i_h * stride_oh + o_v, b_o, mask=m_v)
        if STATES:  # the state after token t
            p_t = st_ptr + t * stride_st + i_h * stride_sth + o_k[:, None] * stride_stk + o_v[None, :] * stride_stv
            tl.store(p_t, b_s, mask=m_s)

    p_z = s_out_ptr + i_h * stride_zh + o_k[:, None] * stride_zk + o_v[None, :] * stride_zv
    tl.store(p_z, b_s, mask=m_s)
    if NORM:
        tl.debug_barrier()  # every thread's outputs stored, then one release (the split GEMVs' semaphore)
        arrived = tl.atomic_add(count_ptr + i_h, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:  # the head's last value block: its rows are complete
            tl.debug_barrier()  # the acquire above before any thread's loads below
            o_d = tl.arange(0, BLOCK_DV)
            m_d = o_d < DV
            w = tl.load(nw_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
            for t in range(T):
                x = tl.load(o_ptr + t * stride_ot + i_h * stride_oh + o_d, mask=m_d, other=0.0,
                            cache_modifier=".cg")
                r = tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)
                z = tl.load(gate_ptr + t * stride_gate_t + i_h * stride_gate_h + o_d, mask=m_d,
                            other=0.0).to(tl.float32)
                y = x * r * w  # as ``engine.kernels.rms_norm``'s kernel forms it, operation for operation
                y = y * z * tl.sigmoid(z)
                tl.store(y_ptr + t * stride_yt + i_h * stride_yh + o_d, y.to(y_ptr.dtype.element_ty), mask=m_d)
            tl.atomic_xchg(count_ptr + i_h, 0)  # ready for the next call (a graph replays it)


def _check(q, k, v, g, beta, state, out_state, block_v, states=None):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (T, H):
        raise ValueError(f"v must be [T, H, dv] with T={T}, H={H}, got {tuple(v.shape)}")
    dv = v.shape[2]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (T, H):
            raise ValueError(f"{name} must be [T, H] = {(T, H)}, got {tuple(x.shape)}")
    if state.shape != (H, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [H, dk, dv] = {(H, dk, dv)}, got {state.dtype} {tuple(state.shape)}")
    if out_state is not None and (out_state.shape != state.shape or out_state.dtype != torch.float32):
        raise ValueError(f"out_state must be float32 {tuple(state.shape)}, got {out_state.dtype} "
                         f"{tuple(out_state.shape)}")
    if states is not None and (states.shape != (T, *state.shape) or states.dtype != torch.float32):
        raise ValueError(f"states must be float32 [T, H, dk, dv] = {(T, H, dk, dv)}, got {states.dtype} "
                         f"{tuple(states.shape)}")
    if T > MAX_TOKENS:
        raise ValueError(f"the decode kernel takes at most {MAX_TOKENS} tokens, got T={T}")
    if not (1 <= dk <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM):
        raise ValueError(f"head sizes must be 1..{MAX_HEAD_DIM}, got dk={dk}, dv={dv}")
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, "out_state": out_state,
               "states": states}
    for name, x in tensors.items():
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x is not None and x.device != q.device:
            raise ValueError(f"all tensors must be on {q.device}, {name} is on {x.device}")
    check_device(q, "the Triton decode kernel")


def _check_norm(norm, T: int, H: int, dv: int, device: torch.device) -> None:
    gate, weight, eps, dtype = norm
    if gate.shape != (T, H, dv) or gate.stride(-1) != 1 or gate.device != device:
        raise ValueError(f"the norm's gate must be [T, H, dv] = {(T, H, dv)} on {device} with a contiguous last "
                         f"dimension, got {tuple(gate.shape)} on {gate.device}")
    if weight.shape != (dv,) or weight.device != device or not isinstance(dtype, torch.dtype):
        raise ValueError(f"the norm's weight must be [{dv}] on {device} and its output a dtype, got "
                         f"{tuple(weight.shape)} on {weight.device} and {dtype!r}")
    if H > MAX_HEADS:
        raise ValueError(f"a normed call takes at most {MAX_HEADS} value heads, got {H}")


def delta_rule_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, scale: float, *,
                             out_state: torch.Tensor | None = None, block_v: int = 32,
                             num_warps: int | None = None,
                             norm: tuple[torch.Tensor, torch.Tensor, float, torch.dtype] | None = None,
                             states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``DeltaRuleFn`` contract of ``delta_rule_recurrent`` for T of 0..``MAX_TOKENS`` tokens.

    q, k [T, H, dk] unit rows and v [T, H, dv] in any float dtype; g, beta [T, H]; state
    [H, dk, dv] float32. Returns (o [T, H, dv] float32, as the reference does, and the new
    state). The new state is written to ``out_state`` when given, which may be ``state``
    itself (each program reads its slice before writing it back), else to a new tensor and
    ``state`` is left unchanged.

    ``norm`` (gate [T, H, dv], weight [dv], eps, dtype): the output is instead
    ``rms_norm(o, weight, eps, gate=gate)`` in that dtype, Gated DeltaNet's gated norm, applied by
    each head's last program.

    ``states`` [T, H, dk, dv] float32: also receives the state after each token (the last equals
    the new state).
    """
    _check(q, k, v, g, beta, state, out_state, block_v, states)
    T, H, dk = q.shape
    dv = v.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = torch.empty(T, H, dv, dtype=torch.float32, device=q.device)
    s_out = torch.empty_like(state) if out_state is None else out_state
    block_k = triton.next_power_of_2(dk)
    block_v = min(block_v, triton.next_power_of_2(dv))
    if norm is not None:
        _check_norm(norm, T, H, dv, q.device)
        gate, weight, eps, dtype = norm
        y = torch.empty(T, H, dv, dtype=dtype, device=q.device)
        counters = scratch("delta rule norm counters", (MAX_HEADS,), torch.int32, q.device)
    else:  # unread stand-ins
        gate, weight, eps, y, counters = o, o, 0.0, o, o
    st = states if states is not None else s_out.unsqueeze(0)  # an unread stand-in without ``states``
    _delta_rule_decode_kernel[(H, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state, o, s_out,
        float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        s_out.stride(0), s_out.stride(1), s_out.stride(2),
        gate, weight, y, counters, float(eps), gate.stride(0), gate.stride(1), y.stride(0), y.stride(1),
        st, st.stride(0), st.stride(1), st.stride(2), st.stride(3),
        T=T, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, NORM=norm is not None,
        BLOCK_DV=triton.next_power_of_2(dv), PREFETCH=prefetch(), STATES=states is not None,
        num_warps=warps("delta_rule") if num_warps is None else num_warps, **launch(q.device, T, "gdn"))
    return (y if norm is not None else o), s_out


delta_rule_decode_triton.takes_norm = True  # ``norm=``: see above (``engine.model.gated_deltanet``)
delta_rule_decode_triton.takes_states = True  # ``states=``: likewise
