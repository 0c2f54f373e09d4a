"""Single-token decode GEMV over Q4_0 rows in the split layout, codes taken apart as 32-bit words, in
Triton's Gluon dialect (explicit layouts).

The block kernel of ``engine.kernels.quant.triton`` (``_gemv_kernel``) takes every code byte out of its
register, splits it into two nibbles and turns each into float32 on the int-to-float unit (a quarter
of the ALU rate); compiled for sm_90 its ``gdn_in`` program (4 rows x 2,048, 2 warps) is 1,048
instructions for 128 codes a thread, with 122 registers. Here the codes stay in the 32-bit words they
were loaded in: one ``lop3`` per word and shift, ``(w & 0x000F000F) | 0x64006400``, makes two fp16
numbers ``1024 + q`` (a nibble in the mantissa of 1024, whose step is 1), one ``sub.f16x2`` takes
1,032 from both (``q - 8``, exact), and each half turns into float32 on the half-precision path. Word
j of a block holds its bytes 4j .. 4j + 3, so the shifts 0, 4, 8 and 12 give the codes of columns
(4j, 4j + 2), (4j + 16, 4j + 18), (4j + 1, 4j + 3) and (4j + 17, 4j + 19) of the block.

The layout is fixed by hand (Triton's own choice moved x and the products between lanes,
docs/benchmarks.md): a lane holds one block's four words for every row of the program, the 32 lanes
of a warp and the warps lie along the blocks. So each x value is loaded and turned into float32 once
for all the rows, and the only exchange between lanes is the final sum over blocks. The same program
compiles to 680 instructions and 60 registers, 688 and 64 with the PDL wait
(``tests/engine/kernels/test_rows_compile.py``).

Each block's products are summed in float32 (fused multiply-adds), scaled by the block's fp16 scale,
and the blocks' sums added at the end. The torch definition is
``engine.kernels.quant.reference.qmatmul_reference``. Gluon kernels run on CUDA only (the Triton
interpreter cannot run them): the CPU tests compile them for sm_90 and check the machine code; the
CUDA tests compare them with the reference. A candidate of the tile sweep (``gemv_words`` 1 in a table
entry), not the default until the H200 has measured it.
"""

from __future__ import annotations

import torch
import triton
from gguf import GGMLQuantizationType as Q
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from engine.kernels.pdl import launch
from engine.kernels.quant.reference import QuantExperts, QuantMatrix

LANES = 32


@gluon.jit
def _launch_next(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _wait_previous(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _code_pair(v):
    """The codes at bits 0-3 and 16-19 of int32 ``v``, each less 8, as float32 (module docstring)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, c;
        .reg .b16 l, h;
        lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA;
        mov.b32 c, 0x64086408;
        sub.rn.f16x2 t, t, c;
        mov.b32 {l, h}, t;
        cvt.f32.f16 $0, l;
        cvt.f32.f16 $1, h;
        }""",
        constraints="=r,=r,r", args=[v], dtype=(gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.constexpr_function
def _word_layout(block_n, warps):
    """[rows, blocks, words]: a lane holds one block's four words for all ``block_n`` rows, the 32 lanes of
    a warp and the ``warps`` warps lie along the blocks."""
    return gl.BlockedLayout(size_per_thread=[block_n, 1, 4], threads_per_warp=[1, 32, 1],
                            warps_per_cta=[1, warps, 1], order=[2, 1, 0])


@gluon.jit
def _tile_words(w_words, w_bytes, row_w, row_b, k0, N_BLOCKS: gl.constexpr, NB: gl.constexpr, SPLIT_AT: gl.constexpr,
                L: gl.constexpr):
    """The blocks ``k0 // 32 ..`` of the rows at word offsets ``row_w`` and byte offsets ``row_b`` ([BN]): their
    words [BN, NB, 4] and their scales [BN, NB] in float32, zero for blocks past K (those read the last
    block, in bounds)."""
    L_bw: gl.constexpr = gl.SliceLayout(0, L)  # [NB, 4]: a block's words
    L_nb: gl.constexpr = gl.SliceLayout(2, L)  # [BN, NB]: a row's blocks
    kb = gl.minimum(k0 // 32 + gl.arange(0, NB, layout=gl.SliceLayout(1, L_bw)), N_BLOCKS - 1)  # in bounds
    o_j = gl.arange(0, 4, layout=gl.SliceLayout(0, L_bw))
    o_w = gl.max_contiguous(gl.multiple_of(gl.expand_dims(kb * 4, 1) + gl.expand_dims(o_j, 0), [4, 4]), [1, 4])
    w = gl.load(w_words + gl.expand_dims(gl.expand_dims(row_w, 1), 2) + gl.expand_dims(o_w, 0))  # [BN, NB, 4]
    kb_d = k0 // 32 + gl.arange(0, NB, layout=gl.SliceLayout(0, L_nb))
    p_d = w_bytes + gl.expand_dims(row_b, 1) + SPLIT_AT + gl.expand_dims(gl.minimum(kb_d, N_BLOCKS - 1) * 2, 0)
    d = gl.load(p_d.to(gl.pointer_type(gl.float16))).to(gl.float32)
    return w, gl.where(gl.expand_dims(kb_d < N_BLOCKS, 0), d, 0.0)


@gluon.jit
def _tile_dot(acc, w, d, x_ptr, k0, N_BLOCKS: gl.constexpr, NB: gl.constexpr, L: gl.constexpr):
    """``acc`` [BN, NB] plus the tile's blocks (``_tile_words``' w and d) dotted with x at ``x_ptr``, each
    block's products summed in float32 and scaled."""
    L_bw: gl.constexpr = gl.SliceLayout(0, L)
    kb = gl.minimum(k0 // 32 + gl.arange(0, NB, layout=gl.SliceLayout(1, L_bw)), N_BLOCKS - 1)
    o_j = gl.arange(0, 4, layout=gl.SliceLayout(0, L_bw))
    col = gl.expand_dims(kb * 32, 1) + gl.expand_dims(o_j * 4, 0)  # [NB, 4]: column of word j's first code
    s = gl.zeros(w.shape, gl.float32, layout=L)
    for i in gl.static_range(4):  # shift 4i: columns (0, 2), (16, 18), (1, 3), (17, 19) past word j's first
        c = (i % 2) * 16 + i // 2
        x_a = gl.load(x_ptr + col + c).to(gl.float32)
        x_b = gl.load(x_ptr + col + (c + 2)).to(gl.float32)
        a, b = _code_pair(w >> (4 * i))
        s = gl.fma(a, gl.expand_dims(x_a, 0), s)
        s = gl.fma(b, gl.expand_dims(x_b, 0), s)
    return acc + d * gl.sum(s, axis=2)


@gluon.jit
def _tile(acc, x_ptr, w_words, w_bytes, row_w, row_b, k0, N_BLOCKS: gl.constexpr, NB: gl.constexpr,
          SPLIT_AT: gl.constexpr, L: gl.constexpr, PDL: gl.constexpr, FIRST: gl.constexpr):
    """``acc`` [BN, NB] plus the blocks ``k0 // 32 ..`` of the rows (word offsets ``row_w``, byte offsets
    ``row_b``, [BN]) dotted with x, each scaled. ``FIRST``: the weights are loaded before the wait for the
    kernel before (``engine.kernels.pdl``), x after it."""
    w, d = _tile_words(w_words, w_bytes, row_w, row_b, k0, N_BLOCKS, NB, SPLIT_AT, L)
    if FIRST:
        _wait_previous(PDL)
    return _tile_dot(acc, w, d, x_ptr, k0, N_BLOCKS, NB, L)


@gluon.jit
def _gemv_words_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn, K: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, SPLIT_AT: gl.constexpr, WARPS: gl.constexpr, PDL: gl.constexpr):
    _launch_next(PDL)
    NB: gl.constexpr = BLOCK_K // 32
    N_BLOCKS: gl.constexpr = K // 32
    L: gl.constexpr = _word_layout(BLOCK_N, WARPS)
    L_nb: gl.constexpr = gl.SliceLayout(2, L)
    o_n = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_nb))
    row = gl.minimum(o_n, N - 1).to(gl.int64)  # rows past N read the last row; their sums are not stored
    w_words = w_ptr.to(gl.pointer_type(gl.int32))
    acc = gl.zeros([BLOCK_N, NB], gl.float32, layout=L_nb)
    acc = _tile(acc, x_ptr, w_words, w_ptr, row * (stride_wn // 4), row * stride_wn, 0, N_BLOCKS, NB, SPLIT_AT, L,
                PDL, True)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        acc = _tile(acc, x_ptr, w_words, w_ptr, row * (stride_wn // 4), row * stride_wn, k0, N_BLOCKS, NB,
                    SPLIT_AT, L, PDL, False)
    gl.store(out_ptr + o_n, gl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=o_n < N)


def fits(qm: QuantMatrix, block_k: int, warps: int) -> bool:
    """Whether ``gemv_words`` reads ``qm`` with K tiles of ``block_k`` columns and ``warps`` warps: Q4_0 in the
    split layout with 16-byte aligned rows (each block's codes one vector load), K a multiple of the tile,
    and the tile at least one block for each lane."""
    return (qm.qtype == Q.Q4_0 and qm.layout == "split" and qm.raw.stride(0) % 16 == 0 and qm.k % block_k == 0
            and block_k % (32 * LANES * warps) == 0)


def gemv_words(x: torch.Tensor, qm: QuantMatrix, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    """``x @ W.T`` for one row of x [1, K] -> [1, N] in x.dtype, on CUDA: ``block_n`` rows and ``block_k``
    columns a program's tile (powers of two, ``fits``), ``warps`` warps."""
    for name, v in (("block_n", block_n), ("block_k", block_k), ("warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"gemv_words' {name} must be a power of two, got {v}")
    if not fits(qm, block_k, warps):
        raise ValueError(f"gemv_words reads Q4_0 in the split layout, rows 16-byte aligned, K a multiple of the "
                         f"tile, one block a lane or more ({LANES} a warp): got {qm.qtype.name} in {qm.layout}, "
                         f"K {qm.k}, rows of {qm.raw.stride(0)} bytes, {block_k} columns over {warps} warps")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != qm.k or not x.is_contiguous():
        raise ValueError(f"gemv_words takes one contiguous row of x of {qm.k} columns, got {tuple(x.shape)}")
    out = torch.empty(1, qm.n, dtype=x.dtype, device=x.device)
    pdl = launch(x.device, 1, "gemv")
    _gemv_words_kernel[(triton.cdiv(qm.n, block_n),)](
        x, qm.raw, out, qm.n, qm.raw.stride(0), K=qm.k, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_AT=qm.split_at,
        WARPS=warps, PDL=pdl["PDL"], num_warps=warps, launch_pdl=pdl["launch_pdl"])
    return out


@gluon.jit
def _store_shared_gate(p_x, gi_ptr, p_gate, K: gl.constexpr, BLOCK_H: gl.constexpr, WARPS: gl.constexpr):
    """``sigmoid(x . gate_inp)`` in float32 at ``p_gate``, x the ``K`` values at ``p_x``: a token's shared-expert
    gate, for the down launch (as ``engine.kernels.quant.rows.store_shared_gate``)."""
    L1: gl.constexpr = gl.BlockedLayout(size_per_thread=[BLOCK_H // (32 * WARPS)], threads_per_warp=[32],
                                        warps_per_cta=[WARPS], order=[0])
    h = gl.arange(0, BLOCK_H, layout=L1)
    xv = gl.load(p_x + h, mask=h < K, other=0.0).to(gl.float32)
    gi = gl.load(gi_ptr + h, mask=h < K, other=0.0).to(gl.float32)
    gl.store(p_gate, 1.0 / (1.0 + gl.exp(-gl.sum(xv * gi, axis=0))))


@gluon.jit
def _moe_gate_up_words_kernel(x_ptr, g_ptr, u_ptr, ids_ptr, act_ptr, sgu_ptr, gi_ptr, sgate_ptr, tg_ptr, tu_ptr, FFN,
                              N_ROUTED, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_ap, stride_sgu,
                              K: gl.constexpr, TOP_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              SPLIT_AT: gl.constexpr, HAS_SHARED: gl.constexpr, HAS_STAGE: gl.constexpr,
                              BLOCK_H: gl.constexpr, WARPS: gl.constexpr, PDL: gl.constexpr, WAIT_FIRST: gl.constexpr):
    """Pair ``p``, rows ``BLOCK_N`` of its expert's gate and up: ``act[p] = silu(gate x) * up x`` in float32,
    stored in act's dtype (zero for id -1), as ``engine.kernels.quant.triton._moe_gate_up_kernel`` computes
    it: pairs below ``N_ROUTED`` are routed (token ``p // TOP_K``); with ``HAS_SHARED`` pair ``N_ROUTED + t``
    is token t's shared expert (gate rows the first ``FFN`` of ``sgu``, up rows the next), whose first
    row block also stores ``sgate[t]``. With ``HAS_STAGE`` an id ``-2 - j`` reads expert ``j`` of the
    stage stacks ``tg``/``tu`` (the same row and expert strides). Which expert a pair reads comes from the
    router's launch, so the wait for the kernel before comes first; with ``WAIT_FIRST`` it also comes before
    the down launch may start, which may then read the ids before its own wait (``engine.kernels.pdl``)."""
    if WAIT_FIRST:
        _wait_previous(PDL)
        _launch_next(PDL)
    else:
        _launch_next(PDL)
        _wait_previous(PDL)
    NB: gl.constexpr = BLOCK_K // 32
    N_BLOCKS: gl.constexpr = K // 32
    L: gl.constexpr = _word_layout(BLOCK_N, WARPS)
    L_nb: gl.constexpr = gl.SliceLayout(2, L)
    p = gl.program_id(0)
    pid_n = gl.program_id(1)
    shared = p >= N_ROUTED
    e = gl.load(ids_ptr + gl.minimum(p, N_ROUTED - 1))
    live = (e >= 0) | shared
    staged = (e <= -2) & (p < N_ROUTED)
    j = gl.maximum(-2 - e, 0).to(gl.int64)
    e = gl.maximum(e, 0).to(gl.int64)
    tok = gl.where(shared, p - N_ROUTED, p // TOP_K)
    o_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_nb))
    row = gl.minimum(o_n, FFN - 1).to(gl.int64)  # rows past FFN read the last row; their sums are not stored
    p_x = x_ptr + tok * stride_xt
    g_base = g_ptr + e * stride_ge
    u_base = u_ptr + e * stride_ue
    r_g = row * stride_gn
    r_u = row * stride_un
    if HAS_STAGE:
        live = live | staged
        if staged:
            g_base = tg_ptr + j * stride_ge
            u_base = tu_ptr + j * stride_ue
    if HAS_SHARED:
        if shared:
            g_base = sgu_ptr
            u_base = sgu_ptr
            r_g = row * stride_sgu
            r_u = (row + FFN) * stride_sgu
            if pid_n == 0:
                _store_shared_gate(p_x, gi_ptr, sgate_ptr + tok, K, BLOCK_H, WARPS)
    g_words = g_base.to(gl.pointer_type(gl.int32))
    u_words = u_base.to(gl.pointer_type(gl.int32))
    acc_g = gl.zeros([BLOCK_N, NB], gl.float32, layout=L_nb)
    acc_u = gl.zeros([BLOCK_N, NB], gl.float32, layout=L_nb)
    if live:  # a pair routed nowhere reads nothing and stores zeros
        for k0 in range(0, K, BLOCK_K):
            w_g, d_g = _tile_words(g_words, g_base, r_g // 4, r_g, k0, N_BLOCKS, NB, SPLIT_AT, L)
            w_u, d_u = _tile_words(u_words, u_base, r_u // 4, r_u, k0, N_BLOCKS, NB, SPLIT_AT, L)
            acc_g = _tile_dot(acc_g, w_g, d_g, p_x, k0, N_BLOCKS, NB, L)
            acc_u = _tile_dot(acc_u, w_u, d_u, p_x, k0, N_BLOCKS, NB, L)
    g = gl.sum(acc_g, axis=1)
    act = g / (1.0 + gl.exp(-g)) * gl.sum(acc_u, axis=1)
    gl.store(act_ptr + p * stride_ap + o_n, act.to(act_ptr.dtype.element_ty), mask=o_n < FFN)


def stage_fits(experts: QuantExperts, stage: QuantExperts) -> bool:
    """Whether ``stage`` is read with ``experts``' row and expert strides, block type and layout (a stage
    stack of the expert launches: ids ``-2 - j`` read its expert ``j``)."""
    return (stage.qtype == experts.qtype and stage.layout == experts.layout and stage.n == experts.n
            and stage.k == experts.k and stage.split_at == experts.split_at and stage.raw.device == experts.raw.device
            and stage.raw.stride()[1:] == experts.raw.stride()[1:] and stage.raw.stride(0) == experts.raw.stride(0))


def experts_fit(gate: QuantExperts, up: QuantExperts, block_k: int, warps: int) -> bool:
    """Whether ``moe_gate_up_words`` reads these experts with K tiles of ``block_k`` columns and ``warps`` warps:
    what ``fits`` asks of a matrix, of every expert's rows and of the experts' strides."""
    return all(qe.qtype == Q.Q4_0 and qe.layout == "split" and qe.raw.stride(0) % 16 == 0
               and qe.raw.stride(1) % 16 == 0 for qe in (gate, up)) and (
        gate.k % block_k == 0 and block_k % (32 * LANES * warps) == 0)


def moe_gate_up_words(x: torch.Tensor, gate: QuantExperts, up: QuantExperts, ids: torch.Tensor, act: torch.Tensor,
                      n_routed: int, top_k: int, shared: tuple[QuantMatrix, torch.Tensor, torch.Tensor] | None,
                      block_n: int, block_k: int, warps: int, wait_first: bool = False,
                      stage: tuple[QuantExperts, QuantExperts] | None = None) -> None:
    """The experts' gate/up launch of ``engine.kernels.quant.triton.quantized_moe_triton`` with the word
    layout: ``act`` [pairs, ffn] gets ``silu(gate x) * up x`` per pair (routed pairs first, then each
    token's shared expert when ``shared`` = (gate and up merged [2 ffn, K], gate_inp [K] float32, sgate [T]
    float32, which the first row block of each shared pair fills)). ``experts_fit`` must hold; tiles are
    powers of two. ``wait_first``: the down launch that follows may start only once the kernel before this
    one has completed (it then reads the ids before its own wait). ``stage``: (gate, up) stacks read for ids
    ``-2 - j`` (``stage_fits``)."""
    for name, v in (("block_n", block_n), ("block_k", block_k), ("warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"moe_gate_up_words' {name} must be a power of two, got {v}")
    if not experts_fit(gate, up, block_k, warps):
        raise ValueError(f"moe_gate_up_words reads Q4_0 experts in the split layout, rows and experts 16-byte "
                         f"aligned, K a multiple of the tile, one block a lane or more: got {gate.qtype.name} in "
                         f"{gate.layout}, K {gate.k}, {block_k} columns over {warps} warps")
    s_gu, gate_inp, sgate = shared if shared is not None else (None, ids, ids)  # unread without one
    if s_gu is not None and (s_gu.qtype != Q.Q4_0 or s_gu.layout != "split" or s_gu.raw.stride(0) % 16
                             or s_gu.split_at != gate.split_at):
        raise ValueError(f"the shared expert's gate/up ({s_gu.qtype.name}, {s_gu.layout}) is not read as the "
                         f"routed experts are")
    if stage is not None and not (stage_fits(gate, stage[0]) and stage_fits(up, stage[1])):
        raise ValueError("the stage stacks are not read as the routed experts are (type, layout, strides)")
    t_g, t_u = (stage[0].raw, stage[1].raw) if stage is not None else (gate.raw, up.raw)  # unread without one
    pdl = launch(x.device, x.shape[0], "experts")
    _moe_gate_up_words_kernel[(act.shape[0], triton.cdiv(gate.n, block_n))](
        x, gate.raw, up.raw, ids, act, s_gu.raw if s_gu is not None else gate.raw, gate_inp, sgate, t_g, t_u, gate.n,
        n_routed, x.stride(0), gate.raw.stride(0), gate.raw.stride(1), up.raw.stride(0), up.raw.stride(1),
        act.stride(0), s_gu.raw.stride(0) if s_gu is not None else 0, K=gate.k, TOP_K=top_k, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_AT=gate.split_at, HAS_SHARED=s_gu is not None, HAS_STAGE=stage is not None,
        BLOCK_H=triton.next_power_of_2(gate.k), WARPS=warps, PDL=pdl["PDL"], WAIT_FIRST=wait_first,
        num_warps=warps, launch_pdl=pdl["launch_pdl"])


@gluon.constexpr_function
def _down_layout(rows_per_lane, lanes_k, warps):
    """[rows, blocks, words] for a short K (the experts' down launch, K = ffn): the ``lanes_k`` lanes of a
    group hold one block's four words each for ``rows_per_lane`` rows, 32 // ``lanes_k`` groups of a warp and
    the ``warps`` warps lie along the rows."""
    return gl.BlockedLayout(size_per_thread=[rows_per_lane, 1, 4], threads_per_warp=[32 // lanes_k, lanes_k, 1],
                            warps_per_cta=[warps, 1, 1], order=[2, 1, 0])


@gluon.jit
def _down_pair(acc, scale, act_row, base, r_b, N_BLOCKS: gl.constexpr, SPLIT_AT: gl.constexpr, L: gl.constexpr):
    """``acc + scale * (W act_row)`` for the rows at byte offsets ``r_b`` of the matrix at ``base``, K in one
    tile, one fused multiply-add a row (as the block kernels' pair sum)."""
    L_nb: gl.constexpr = gl.SliceLayout(2, L)
    w, d = _tile_words(base.to(gl.pointer_type(gl.int32)), base, r_b // 4, r_b, 0, N_BLOCKS, N_BLOCKS, SPLIT_AT, L)
    y = gl.sum(_tile_dot(gl.zeros(d.shape, gl.float32, layout=L_nb), w, d, act_row, 0, N_BLOCKS, N_BLOCKS, L),
               axis=1)
    return gl.fma(y, gl.full(y.shape, 0.0, gl.float32, layout=gl.SliceLayout(1, L_nb)) + scale, acc)


@gluon.jit
def _moe_down_words_kernel(act_ptr, d_ptr, ids_ptr, w_ptr, out_ptr, sd_ptr, sgate_ptr, H, N_ROUTED,
                           stride_ap, stride_de, stride_dn, stride_ot, stride_sd, FFN: gl.constexpr,
                           TOP_K: gl.constexpr, ROWS: gl.constexpr, LANES_K: gl.constexpr, SPLIT_AT: gl.constexpr,
                           HAS_SHARED: gl.constexpr, WARPS: gl.constexpr, PDL: gl.constexpr):
    """Token ``t``, rows ``ROWS * (32 // LANES_K) * WARPS`` of the output: the routing-weighted sum over its
    ``TOP_K`` pairs of ``down[e] act[p]``, added in pair order in float32, then with ``HAS_SHARED`` its
    shared expert's ``sd act[N_ROUTED + t]`` times ``sgate[t]``: ``_moe_down_kernel``'s sum, each pair's
    rows read in the word layout with K (the experts' ffn) in one tile, ``LANES_K`` = its blocks."""
    _launch_next(PDL)
    _wait_previous(PDL)  # the experts come from the router's launch, act from the gate/up launch
    N_BLOCKS: gl.constexpr = FFN // 32
    L: gl.constexpr = _down_layout(ROWS, LANES_K, WARPS)
    BLOCK_N: gl.constexpr = ROWS * (32 // LANES_K) * WARPS
    t = gl.program_id(0)
    o_n = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    row = gl.minimum(o_n, H - 1).to(gl.int64)  # rows past H read the last row; their sums are not stored
    acc = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    for j in gl.static_range(TOP_K):
        p = t * TOP_K + j
        e = gl.load(ids_ptr + p)
        if e >= 0:  # a pair routed nowhere adds nothing
            acc = _down_pair(acc, gl.load(w_ptr + p).to(gl.float32), act_ptr + p * stride_ap,
                             d_ptr + e.to(gl.int64) * stride_de, row * stride_dn, N_BLOCKS, SPLIT_AT, L)
    if HAS_SHARED:
        acc = _down_pair(acc, gl.load(sgate_ptr + t), act_ptr + (N_ROUTED + t) * stride_ap, sd_ptr,
                         row * stride_sd, N_BLOCKS, SPLIT_AT, L)
    gl.store(out_ptr + t * stride_ot + o_n, acc.to(out_ptr.dtype.element_ty), mask=o_n < H)


def down_fits(down: QuantExperts, rows: int, warps: int) -> bool:
    """Whether ``moe_down_words`` reads these down experts with ``rows`` output rows a program over ``warps``
    warps: Q4_0 in the split layout, rows and experts 16-byte aligned, K (ffn) 2 to 32 blocks, a power of
    two, and the rows a whole number of lane groups."""
    nb = down.k // 32
    groups = 32 // nb if down.k % 32 == 0 and 2 <= nb <= 32 and nb & (nb - 1) == 0 else 0
    return (down.qtype == Q.Q4_0 and down.layout == "split" and down.raw.stride(0) % 16 == 0
            and down.raw.stride(1) % 16 == 0 and groups > 0 and rows % (groups * warps) == 0)


def moe_down_words(act: torch.Tensor, down: QuantExperts, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                   n_routed: int, top_k: int, shared: tuple[QuantMatrix, torch.Tensor] | None, rows: int,
                   warps: int) -> None:
    """The experts' down launch of ``engine.kernels.quant.triton.quantized_moe_triton`` with the word layout,
    a program per token and ``rows`` output rows: ``out[t]`` = the routing-weighted sum of its pairs'
    ``down[e] act[p]`` (plus ``sgate[t] * s_down act[shared pair]`` with ``shared`` = (s_down, sgate)).
    ``down_fits`` must hold."""
    if rows < 1 or rows & (rows - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"moe_down_words' rows and warps must be powers of two, got {rows} and {warps}")
    if not down_fits(down, rows, warps):
        raise ValueError(f"moe_down_words reads Q4_0 down experts in the split layout, rows and experts 16-byte "
                         f"aligned, K a power of two of 2 to 32 blocks, rows a whole number of lane groups: got "
                         f"{down.qtype.name} in {down.layout}, K {down.k}, {rows} rows over {warps} warps")
    s_down, sgate = shared if shared is not None else (None, w)  # unread without one
    if s_down is not None and (s_down.qtype != Q.Q4_0 or s_down.layout != "split" or s_down.raw.stride(0) % 16
                               or s_down.split_at != down.split_at):
        raise ValueError(f"the shared expert's down ({s_down.qtype.name}, {s_down.layout}) is not read as the "
                         f"routed experts are")
    lanes_k = down.k // 32
    T = out.shape[0]
    pdl = launch(act.device, T, "experts")
    _moe_down_words_kernel[(T, triton.cdiv(down.n, rows))](
        act, down.raw, ids, w, out, s_down.raw if s_down is not None else down.raw, sgate, down.n, n_routed,
        act.stride(0), down.raw.stride(0), down.raw.stride(1), out.stride(0),
        s_down.raw.stride(0) if s_down is not None else 0, FFN=down.k, TOP_K=top_k,
        ROWS=rows // ((32 // lanes_k) * warps), LANES_K=lanes_k, SPLIT_AT=down.split_at, HAS_SHARED=s_down is not None,
        WARPS=warps, PDL=pdl["PDL"], num_warps=warps, launch_pdl=pdl["launch_pdl"])
