"""Routed experts copied from host memory into a device buffer in one Triton launch.

The cold tier of ``engine.hybrid`` with ``cold_device="gpu"`` keeps its experts in pinned host memory
mapped into the device's address space. The expert launches reading them in place fetch a few dozen
bytes per row from scattered rows, and the bus carried about 13 GB/s that way on the H200, against
50 GB/s for a kernel reading mapped memory in long contiguous runs (docs/benchmarks.md, 2026-12-01).
An expert's matrix is one contiguous slab, so this kernel copies each routed pair's slab into its own
row of a device buffer in chunks of contiguous 32-bit words, and the expert launches then read device
memory. Pairs routed nowhere (id -1) copy nothing.

A copy that runs beside other work (the experts fetched ahead of a layer's router, beside the layer before) can take
a bounded number of programs (``gather_stacks(programs=)``): each then loops over the blocks, so that the copy holds
a few SMs for its whole length instead of queueing one program per block in front of the other stream's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device

BLOCK = 4096  # words a program copies: 16 KiB, four 16-byte vectors a thread at 8 warps


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, ids_ptr, SLAB: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    if e >= 0:
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < SLAB
        v = tl.load(src_ptr + e.to(tl.int64) * SLAB + o, mask=m)
        tl.store(dst_ptr + p.to(tl.int64) * SLAB + o, v, mask=m)


@triton.jit
def _copy_block(src_ptr, dst_ptr, e, p, b, SLAB: tl.constexpr, BLOCK: tl.constexpr):
    o = b * BLOCK + tl.arange(0, BLOCK)
    m = o < SLAB
    tl.store(dst_ptr + p.to(tl.int64) * SLAB + o, tl.load(src_ptr + e.to(tl.int64) * SLAB + o, mask=m), mask=m)


@triton.jit
def _copy_stacks_block(s0, d0, s1, d1, s2, d2, e, p, b, SLAB0: tl.constexpr, SLAB1: tl.constexpr, SLAB2: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Block ``b`` of pair ``p``'s three slabs (gate's blocks, then up's, then down's) copied from expert ``e``;
    nothing where ``e`` is -1."""
    NB0: tl.constexpr = (SLAB0 + BLOCK - 1) // BLOCK
    NB1: tl.constexpr = (SLAB1 + BLOCK - 1) // BLOCK
    if e >= 0:
        if b < NB0:
            _copy_block(s0, d0, e, p, b, SLAB0, BLOCK)
        elif b < NB0 + NB1:
            _copy_block(s1, d1, e, p, b - NB0, SLAB1, BLOCK)
        else:
            _copy_block(s2, d2, e, p, b - NB0 - NB1, SLAB2, BLOCK)


@triton.jit
def _gather3_kernel(s0, d0, s1, d1, s2, d2, ids_ptr, SLAB0: tl.constexpr, SLAB1: tl.constexpr,
                    SLAB2: tl.constexpr, BLOCK: tl.constexpr):
    """``_gather_kernel`` for three stacks at once (an expert's gate, up and down): the second grid axis
    runs over the three slabs' blocks in turn."""
    p = tl.program_id(0)
    _copy_stacks_block(s0, d0, s1, d1, s2, d2, tl.load(ids_ptr + p), p, tl.program_id(1), SLAB0, SLAB1, SLAB2, BLOCK)


@triton.jit
def _gather3_loop_kernel(s0, d0, s1, d1, s2, d2, ids_ptr, P: tl.constexpr, SLAB0: tl.constexpr, SLAB1: tl.constexpr,
                         SLAB2: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """``_gather3_kernel`` in ``PROGRAMS`` programs: program ``g`` copies blocks ``g``, ``g + PROGRAMS``, ... of the
    ``P`` pairs' blocks taken in pair order."""
    NB: tl.constexpr = (SLAB0 + BLOCK - 1) // BLOCK + (SLAB1 + BLOCK - 1) // BLOCK + (SLAB2 + BLOCK - 1) // BLOCK
    ITERS: tl.constexpr = (P * NB + PROGRAMS - 1) // PROGRAMS
    for i in range(0, ITERS):
        w = tl.program_id(0) + i * PROGRAMS
        p = w // NB
        b = w % NB
        _copy_stacks_block(s0, d0, s1, d1, s2, d2, tl.load(ids_ptr + p, mask=p < P, other=-1), p, b, SLAB0, SLAB1,
                           SLAB2, BLOCK)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` [E, ...] as [E, slab] of 32-bit words where its slabs hold whole words, else of bytes."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def _check(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, what: str) -> None:
    check_device(dst, what)
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"{what} copies experts of one dtype and shape between contiguous stacks, got "
                         f"{src.dtype} {tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}")
    if ids.dim() != 1 or ids.shape[0] > dst.shape[0] or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an int vector of at most {dst.shape[0]} pairs, got {ids.dtype} "
                         f"{tuple(ids.shape)}")


def gather_experts(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor) -> None:
    """``dst[p] = src[ids[p]]`` for every ``p`` with ``ids[p] >= 0`` (``dst[p]`` untouched otherwise): src
    [E, ...] (a mapped view of host memory, or any device tensor), dst [P', ...] of its dtype and expert
    shape with P' >= len(ids), both contiguous; ids [P] int on dst's device."""
    _check(src, dst, ids, "gather_experts")
    if ids.numel() == 0:
        return
    s, d = _words(src), _words(dst)
    slab = s.shape[1]
    _gather_kernel[(ids.shape[0], triton.cdiv(slab, BLOCK))](s, d, ids, SLAB=slab, BLOCK=BLOCK, num_warps=8)


def gather_stacks(srcs: tuple[torch.Tensor, ...], dsts: tuple[torch.Tensor, ...], ids: torch.Tensor, *,
                  programs: int | None = None) -> None:
    """``gather_experts`` for three stacks (an expert's gate, up and down) in one launch: ``dsts[i][p] =
    srcs[i][ids[p]]`` for every ``p`` with ``ids[p] >= 0``. ``programs``: at most that many programs, each looping
    over blocks (None: one program a block)."""
    if len(srcs) != 3 or len(dsts) != 3:
        raise ValueError(f"gather_stacks copies three stacks, got {len(srcs)} and {len(dsts)}")
    if programs is not None and (not isinstance(programs, int) or isinstance(programs, bool) or programs < 1):
        raise ValueError(f"programs must be a whole number of at least 1 or None, got {programs!r}")
    for src, dst in zip(srcs, dsts):
        _check(src, dst, ids, "gather_stacks")
    if ids.numel() == 0:
        return
    views = [(_words(s), _words(d)) for s, d in zip(srcs, dsts)]
    slabs = [s.shape[1] for s, _ in views]
    blocks = sum(triton.cdiv(n, BLOCK) for n in slabs)
    if programs is not None:
        n = min(programs, ids.shape[0] * blocks)
        _gather3_loop_kernel[(n,)](*(t for pair in views for t in pair), ids, P=ids.shape[0], SLAB0=slabs[0],
                                   SLAB1=slabs[1], SLAB2=slabs[2], BLOCK=BLOCK, PROGRAMS=n, num_warps=8)
        return
    _gather3_kernel[(ids.shape[0], blocks)](*(t for pair in views for t in pair), ids, SLAB0=slabs[0],
                                            SLAB1=slabs[1], SLAB2=slabs[2], BLOCK=BLOCK, num_warps=8)
