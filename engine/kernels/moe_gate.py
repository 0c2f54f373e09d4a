"""The small steps around a decode token's experts, one Triton launch each: the router, the
shared expert's SwiGLU activation, and the sum of the routed and the gated shared output.

- ``route_triton``: the router's logits ``x . router`` in float32, the softmax over the experts,
  the top k renormalised to sum 1 (the softmax of the k largest logits), for up to 16 tokens; ids
  in descending order of weight, as ``torch.topk`` gives them (a tie goes to the lower expert id).
  It replaces x's conversion to float32, the fp32 GEMV, softmax, topk, sum and divide. The
  logits are spread over ``BLOCK_E``-expert programs per token, which store them in a scratch
  row; the program that arrives last at the token's counter (the semaphore of the split
  GEMVs in ``engine.kernels.quant.triton``) takes the top-k over the row and zeroes the
  counter for the next call. Scratch and counters are one per device, so calls on one
  device must not run concurrently on several streams.
- ``swiglu_triton``: ``silu(gate) * up``.
- ``shared_combine_triton``: ``y + sigmoid(x . gate_inp) * s`` in float32 (the gate's dot
  product included), cast once to the output dtype.

One program per token row (the combine), per row and column block (SwiGLU) or per
row and expert block (the router); everything in float32 inside. The torch definitions are in
``engine.model.moe``. Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device, scratch
from engine.kernels.pdl import begin, launch, launch_next, prefetch, wait_previous
from engine.kernels.warps import warps

WHAT = "the Triton MoE gate kernels"
MAX_EXPERTS = 1024  # one row of router logits in registers
MAX_HIDDEN = 16384  # one row of the layer input in registers (the shared expert's gate)
MAX_TOKENS = 16  # rows of the router's scratch and counters (decode and verify blocks)
TILE = 2048  # router weights per loop step of a ``route_triton`` program: 64 a thread at one warp
PROGRAMS = 256  # ``route_triton`` programs to aim at (up to 16 experts each): two per SM of an H200


@triton.jit
def _top_k(logits, e, ids_ptr, w_ptr, K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Stores the ids of the K largest ``logits`` [BLOCK_E] float32 (ids ``e``, -inf past E) and their
    softmax among themselves, in descending order, ties to the lower id."""
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
    tl.store(ids_ptr + o, ids)
    tl.store(w_ptr + o, w / tl.sum(w, axis=0))


@triton.jit
def _route_kernel(x_ptr, r_ptr, l_ptr, count_ptr, ids_ptr, w_ptr, E, H: tl.constexpr, stride_x, stride_r,
                  stride_l, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ALL_E: tl.constexpr,
                  res_ptr, nw_ptr, h_out_ptr, x_out_ptr, stride_res, eps, ADD_NORM: tl.constexpr, PDL: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """With ``ADD_NORM`` the router's input is ``rms_norm(x + res) * nw`` (``x`` the residual stream,
    ``res`` the mixer's output), formed by every program from the two rows (L2 hits) as the residual
    add + norm kernel forms it: the sum rounded to x's dtype, float32 inside, the norm rounded to it
    too. The first expert block's programs store the sum and the norm for the experts' launches.
    ``PREFETCH`` with the row in one tile: the program's router rows are loaded before the wait for
    the kernel before (``engine.kernels.pdl``)."""
    ONE_TILE: tl.constexpr = H <= BLOCK_H
    if PREFETCH:
        launch_next(PDL)
    else:
        begin(PDL)
    pid_e = tl.program_id(0)
    t = tl.program_id(1)
    o_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    p_r = r_ptr + o_e.to(tl.int64)[:, None] * stride_r  # [BE, 1]
    p_x = x_ptr + t * stride_x
    if PREFETCH:
        if ONE_TILE:
            o_w = tl.arange(0, BLOCK_H)
            r_first = tl.load(p_r + o_w[None, :], mask=m_e[:, None] & (o_w < H)[None, :], other=0.0)
        wait_previous(PDL)
    if ADD_NORM:  # the row's mean square, in tiles (the same in every program of the token)
        sq = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            o_h = h0 + tl.arange(0, BLOCK_H)
            m_h = o_h < H
            s = _residual_sum(p_x, res_ptr + t * stride_res, o_h, m_h, x_ptr.dtype.element_ty)
            sq += s * s
        rs = tl.rsqrt(tl.sum(sq, axis=0) / H + eps)
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)  # summed over the columns at the end
    for h0 in range(0, H, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        if ADD_NORM:
            s = _residual_sum(p_x, res_ptr + t * stride_res, o_h, m_h, x_ptr.dtype.element_ty)
            y = (s * rs * tl.load(nw_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if pid_e == 0:
                tl.store(h_out_ptr + t * H + o_h, s.to(x_ptr.dtype.element_ty), mask=m_h)
                tl.store(x_out_ptr + t * H + o_h, y, mask=m_h)
            x = y.to(tl.float32)
        else:
            x = tl.load(p_x + o_h, mask=m_h, other=0.0).to(tl.float32)
        if PREFETCH and ONE_TILE:
            r = r_first  # the loop's one tile
        else:
            r = tl.load(p_r + o_h[None, :], mask=m_e[:, None] & m_h[None, :], other=0.0)
        acc += r * x[None, :]
    p_l = l_ptr + t * stride_l
    tl.store(p_l + o_e, tl.sum(acc, axis=1), mask=m_e)
    tl.debug_barrier()  # every thread's logits stored, then one release (``_gemv_kernel``'s semaphore)
    arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:  # the last expert block of this token: the row is complete
        tl.debug_barrier()  # the acquire above before any thread's loads below
        e = tl.arange(0, ALL_E)
        logits = tl.load(p_l + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")
        _top_k(logits, e, ids_ptr + t * K, w_ptr + t * K, K, ALL_E)
        tl.atomic_xchg(count_ptr + t, 0)  # ready for the next call (a graph replays it)


@triton.jit
def _residual_sum(p_h, p_r, o_h, m_h, DTYPE: tl.constexpr):
    """``h + r`` at columns ``o_h``, rounded to ``DTYPE`` as the residual stream is, as float32."""
    h = tl.load(p_h + o_h, mask=m_h, other=0.0).to(tl.float32)
    r = tl.load(p_r + o_h, mask=m_h, other=0.0).to(tl.float32)
    return (h + r).to(DTYPE).to(tl.float32)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + t * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _shared_combine_kernel(y_ptr, s_ptr, x_ptr, gi_ptr, out_ptr, N, H, stride_y, stride_s, stride_x,
                           BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
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


def _route_scratch(device: torch.device, tag: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The device's logits row [MAX_TOKENS, MAX_EXPERTS] float32 and per-token arrival counters of
    ``route_triton`` (its own: not the split GEMVs'), from ``fused.scratch``; ``tag`` names another set
    (the side stream's)."""
    return (scratch(tag + "router logits", (MAX_TOKENS, MAX_EXPERTS), torch.float32, device),
            scratch(tag + "router counters", (MAX_TOKENS,), torch.int32, device))


def route_triton(x: torch.Tensor, router: torch.Tensor, k: int, num_warps: int | None = None, *,
                 side: bool = False, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer input x [T, H] (float32, float16 or bfloat16; T <= 16) and the float32 router [E, H]
    -> (ids [T, k] int64, weights [T, k] float32 summing to 1), in one launch of ``num_warps``
    warps per program (left out: ``engine.kernels.warps``'s entry for the router). ``side``: a launch on a
    second stream, which may run beside the step's own routers: scratch of its own, no programmatic launch,
    16 experts a program. ``ahead``: a prediction on the step's own stream between its kernels (scratch of its
    own, no programmatic launch, the whole device's programs)."""
    if side and ahead:
        raise ValueError("a router launch is on the second stream (side) or a prediction on the step's (ahead)")
    return _route(x, router, k, num_warps, None, side=side, ahead=ahead)


def add_norm_route_triton(h: torch.Tensor, r: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          router: torch.Tensor, k: int, num_warps: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual add + RMSNorm before the experts and the router in one launch: h (the residual
    stream) and r (the mixer's output) [T, H] of one dtype, norm_weight [H], router [E, H] float32 ->
    (h + r and its norm, new contiguous [T, H] in h's dtype, as ``rms_norm.add_rms_norm_triton``
    gives them up to its summation order; ids; weights), the routing that of ``route_triton`` on
    that norm."""
    _rows("r", r)
    if r.shape != h.shape or r.dtype != h.dtype or norm_weight.shape != (h.shape[-1],):
        raise ValueError(f"h and r must be one [T, H] shape and dtype and the norm's weight [H], got "
                         f"{tuple(h.shape)} {h.dtype}, {tuple(r.shape)} {r.dtype} and {tuple(norm_weight.shape)}")
    return _route(h, router, k, num_warps, (r, norm_weight.contiguous(), float(eps)))


def _route(x: torch.Tensor, router: torch.Tensor, k: int, num_warps: int | None,
           add: tuple[torch.Tensor, torch.Tensor, float] | None, side: bool = False,
           ahead: bool = False) -> tuple[torch.Tensor, ...]:
    _rows("x", x)
    _rows("router", router)
    check_device(x, WHAT)
    T, H = x.shape
    E = router.shape[0]
    if router.device != x.device:
        raise ValueError(f"x is on {x.device} but the router is on {router.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or router.dtype != torch.float32:
        raise ValueError(f"x must be float32, float16 or bfloat16 and the router float32, got {x.dtype} "
                         f"and {router.dtype}")
    if router.shape[1] != H or T > MAX_TOKENS:
        raise ValueError(f"x must be [T, H] with T <= {MAX_TOKENS} and the router [E, H], got {tuple(x.shape)} "
                         f"and {tuple(router.shape)}")
    if not 1 <= k <= E or E > MAX_EXPERTS or k & (k - 1):
        raise ValueError(f"top-k needs 1 <= k <= E <= {MAX_EXPERTS} with k a power of two, got k={k}, E={E}")
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    res, norm_weight, eps = add if add is not None else (x, router, 0.0)  # unread without the add + norm
    h_out, x_out = (torch.empty(T, H, dtype=x.dtype, device=x.device) for _ in range(2)) if add is not None \
        else (x, x)
    if T:
        scratch, counters = _route_scratch(x.device, "side " if side else "ahead " if ahead else "")
        # a side launch runs beside the step's own kernels: a few wide programs rather than the whole GPU
        block_e = 16 if side else min(16, triton.next_power_of_2(triton.cdiv(E * T, PROGRAMS)))
        _route_kernel[(triton.cdiv(E, block_e), T)](
            x, router, scratch, counters, ids, weights, E, H, x.stride(0), router.stride(0), scratch.stride(0),
            K=k, BLOCK_E=block_e, BLOCK_H=min(triton.next_power_of_2(H), TILE // block_e),
            ALL_E=triton.next_power_of_2(E), res_ptr=res, nw_ptr=norm_weight, h_out_ptr=h_out, x_out_ptr=x_out,
            stride_res=res.stride(0), eps=eps, ADD_NORM=add is not None, PREFETCH=prefetch(),
            num_warps=warps("router") if num_warps is None else num_warps,
            **({"PDL": False, "launch_pdl": False} if side or ahead else launch(x.device, T, "router")))
    return (h_out, x_out, ids, weights) if add is not None else (ids, weights)


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
        _swiglu_kernel[(T, triton.cdiv(N, block))](gate, up, out, N, gate.stride(0), up.stride(0), BLOCK=block,
                                                   **launch(gate.device, T, "experts"))
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
            BLOCK=block, BLOCK_H=triton.next_power_of_2(H), **launch(x.device, T, "experts"))
    return out
