"""Dense float32 projections of a few rows in one Triton launch: ``x @ w.T`` for x [M, K] with
M up to ``MAX_M`` (a DFlash verify block of spec_len + 1 tokens, a draft block) and w [N, K].

cuBLAS picks its float32 kernel for such calls by heuristics that go badly for some of them: on the
H200, verifying blocks of 17 tokens with the shipped float32 target spent 48% of its device time in
one cuBLAS kernel at 29 us a call, for matrices of 256 columns that take a few microseconds to read
(docs/benchmarks.md, 2026-12-02). Here one program computes a tile of BLOCK_M rows by BLOCK_N
outputs over the whole of K (compiled in: a model has few), products and sums in float32
(``input_precision="ieee"``: no TF32), so the result is that of a float32 matmul up to the order of
its sums. The torch definition is ``F.linear``.

Blocks of fewer than ``FEW_M`` rows (a verify block at spec_len 4, a draft block of 4) take ``_rows_kernel``
instead: many narrow programs over the outputs, as a GEMV has (two weight rows a program by default), each
reading its weight tile once per K chunk and dotting every row of the block against it. cuBLAS takes blocks of
2-7 float32 rows as a split-K GEMM plus its reduction, two launches of 4-6 us where a one-row call takes one
GEMV of about 2.3 us; this kernel takes 1.5-3 us for them (``bench/few_rows.py``; an H100, docs/benchmarks.md,
fourteenth round). ``engine.model.linear`` decides from how many rows on it sends blocks here
(``skinny_min_rows``). Since the seventeenth round the bound is 18, so the verify blocks of spec_len 8 and 16 (9 and
17 rows) take this kernel too: on an H100 it takes 2.2-5.2 us for the shipped shapes at 17 rows where cuBLAS takes
4.3-7.9 and the ``tl.dot`` kernel 6.2-30 (``bench/few_rows.py``), and a DFlash step at spec_len 16 went from 916 to
740 us. ``LUCE_TUNE_FEW_ROWS`` moves the bound between the two kernels (``few_rows``; 8 was the earlier bound).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.errors import ConfigError
from engine.kernels.fused import check_device

MAX_M = 32  # rows; longer calls go to cuBLAS, whose large-tile kernels suit them
FEW_M = 18  # blocks of fewer rows (spec_len 16's verify block of 17 and less) take ``_rows_kernel``
ROWS_TILE_ENV = "LUCE_TUNE_ROWS_TILE"
FEW_ROWS_ENV = "LUCE_TUNE_FEW_ROWS"
# (outputs a program, K chunk, warps) of ``_rows_kernel``: the fastest on average over the shipped target's and
# draft's shapes at 4 and 5 rows on an H100 (0.79 one-row GEMVs; at most 1.2, the 4096-output LM head)
ROWS_TILE = (2, 256, 1)
MAX_K = 16384


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # tl.dot over row tiles of 16 or more
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _rows_kernel(x_ptr, w_ptr, out_ptr, N, stride_xm, stride_wn, M: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A few rows (M < few_rows(), compiled in): each program reads a [BLOCK_N, BLOCK_K] tile of weight rows once per
    # K chunk and dots every row of x against it, one row at a time; many narrow programs over N, as a GEMV has
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        for m in tl.static_range(M):
            x = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0)
            part = tl.sum(w * x[None, :], axis=1)
            acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def rows_tiles() -> tuple[int, int, int]:
    """(outputs a program, K chunk, warps) of ``_rows_kernel``: ``LUCE_TUNE_ROWS_TILE`` ("2,256,1") when set,
    else ``ROWS_TILE``."""
    text = os.environ.get(ROWS_TILE_ENV, "").strip()
    if not text:
        return ROWS_TILE
    try:
        bn, bk, nw = (int(v) for v in text.split(","))
    except ValueError:
        bn = bk = nw = 0
    if not all(v >= 1 and v & (v - 1) == 0 for v in (bn, bk, nw)) or bk < 16 or nw > 8:
        raise ConfigError(f"{ROWS_TILE_ENV} takes three powers of two, 'outputs,K chunk,warps' with a K chunk of "
                         f"16 or more and at most 8 warps (the default is '2,256,1'), got {text!r}")
    return bn, bk, nw


def few_rows() -> int:
    """Blocks of fewer rows than this take ``_rows_kernel``, the others the ``tl.dot`` kernel:
    ``LUCE_TUNE_FEW_ROWS`` (2 to ``MAX_M + 1``) when set, else ``FEW_M``."""
    text = os.environ.get(FEW_ROWS_ENV, "").strip()
    if not text:
        return FEW_M
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if not 2 <= rows <= MAX_M + 1:
        raise ConfigError(f"{FEW_ROWS_ENV} must be a whole number from 2 to {MAX_M + 1} (blocks of fewer rows take "
                          f"the few-row kernel; the default is {FEW_M}), got {text!r}")
    return rows


_in_use: tuple[tuple[int, int, int], int] | None = None  # ``rows_tiles()`` and ``few_rows()``, read at the first call


def rows_linear(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int) -> torch.Tensor:
    """``x @ w.T`` for float32 x [M, K] of a few rows (``few_rows``; contiguous last dimension) and w [N, K]
    (contiguous rows) through ``_rows_kernel`` with the given tile (``rows_tiles``): a new contiguous
    float32 [M, N]."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    _rows_kernel[(triton.cdiv(N, block_n),)](x, w, out, N, x.stride(0), w.stride(0), M=M, K=K,
                                             BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n,
                                             BLOCK_K=min(block_k, triton.next_power_of_2(K)), num_warps=num_warps)
    return out


def applies(x: torch.Tensor, w: torch.Tensor, min_rows: int = 1) -> bool:
    """Whether ``skinny_linear`` takes ``x @ w.T``: float32 rows of x (``min_rows`` to ``MAX_M`` of them, the
    last dimension contiguous) against a float32 [N, K] weight with contiguous rows, outside autograd."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and w.dim() == 2 and x.shape[-1] == w.shape[1]
            and max(min_rows, 1) <= rows <= MAX_M and w.shape[1] <= MAX_K and x.stride(-1) == 1 and w.stride(1) == 1
            and x.device == w.device
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def tiles(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for ``m`` rows and ``n`` outputs: one row tile covering the rows
    (``tl.dot`` wants 16 at least), narrow output tiles where N is small so that the launch has
    programs enough to spread over the GPU."""
    block_m = 16 if m <= 16 else 32
    block_n = 16 if n <= 2048 else 32
    return block_m, block_n, 64


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for float32 x [..., K] of 1 to ``MAX_M`` rows and w [N, K] (``applies``):
    a new contiguous float32 [..., N]."""
    global _in_use
    check_device(x, "skinny_linear")
    if not applies(x, w):
        raise ValueError(f"skinny_linear takes 1-{MAX_M} float32 rows against a float32 [N, K] weight with "
                         f"contiguous rows, K <= {MAX_K}; got x {tuple(x.shape)} {x.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype}")
    K, N = w.shape[1], w.shape[0]
    flat = x.reshape(-1, K)
    M = flat.shape[0]
    if _in_use is None:
        _in_use = rows_tiles(), few_rows()
    tile, few = _in_use
    if M < few:
        return rows_linear(flat, w, *tile).view(*x.shape[:-1], N)
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    bm, bn, bk = tiles(M, N)
    _skinny_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        flat, w, out, M, N, flat.stride(0), w.stride(0), K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out.view(*x.shape[:-1], N)
