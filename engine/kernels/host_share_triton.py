"""The device's two launches of ``engine.kernels.host_experts``: publish a layer's CPU pairs into the mailbox
in mapped host memory, and wait for the threads' reply and add it. CUDA only (system-scope fences and
acquire/release accesses in inline PTX); both are plain launches, so a CUDA graph captures them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine.kernels import host_experts
from engine.kernels.host_experts import BUS_STATUS, HEADER, REPLY_HEADER

if TYPE_CHECKING:
    from engine.kernels.host_experts import HostBus, HostShare

BLOCK = 1024


@triton.jit
def _fence_sys(v):
    return tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _store_release_sys(ptr, v):
    return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.b32 $0, $2;", "=r,l,r", [ptr, v],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_acquire_sys(ptr):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _publish_kernel(mb_i, mb_f, seq_ptr, x_ptr, ids_ptr, w_ptr, mine_ptr, layer, T, N,
                    K: tl.constexpr, MAX_PAIRS: tl.constexpr, HEADER: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK: tl.constexpr):
    s = tl.load(seq_ptr) + 1
    s = tl.where(s < 0, 1, s)  # the host side's numbers stay positive
    tl.store(mb_i + 16, layer)
    tl.store(mb_i + 17, T)
    tl.store(mb_i + 18, K)
    p = tl.arange(0, BLOCK_P)
    pm = p < T * K
    e = tl.load(ids_ptr + p, mask=pm, other=0)
    mine = tl.load(mine_ptr + e, mask=pm & (e >= 0), other=0)
    tl.store(mb_i + HEADER + p, tl.where(mine != 0, e, -1).to(tl.int32), mask=pm)
    tl.store(mb_f + HEADER + MAX_PAIRS + p, tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32), mask=pm)
    for off in range(0, N, BLOCK):
        o = off + tl.arange(0, BLOCK)
        m = o < N
        tl.store(mb_f + HEADER + 2 * MAX_PAIRS + o, tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32), mask=m)
    _fence_sys(s)  # every thread's payload visible to the host before any thread's sequence number
    tl.debug_barrier()
    tl.store(seq_ptr, s)
    _store_release_sys(mb_i, s)


_STATUS_EVERY = tl.constexpr(4096)  # a bounded wait's loads between two looks at the status word


@triton.jit
def _spin_for(word_ptr, s, status_ptr, SPINS: tl.constexpr):
    """Acquire loads of ``word_ptr`` until it holds ``s``, at most ``SPINS``; past them a status still 0 is
    marked -1 (a timeout: the host's check raises). Every ``_STATUS_EVERY`` loads the status word is read too,
    and one already set ends the spinning: once a wait has given up, the waits after it in the same step give
    up within those loads rather than after ``SPINS`` each, so a dead pool or copier costs the step one bound,
    not one a layer. A wait whose word comes within those loads never reads the status."""
    d = _load_acquire_sys(word_ptr)
    i = 0
    while (d != s) & (i < SPINS):
        d = _load_acquire_sys(word_ptr)
        i += 1
        if i % _STATUS_EVERY == 0:
            if _load_acquire_sys(status_ptr) != 0:
                i = SPINS
    if d != s:
        if _load_acquire_sys(status_ptr) == 0:
            tl.store(status_ptr, -1)


@triton.jit
def _wait_reply(reply_i, seq_ptr, SPINS: tl.constexpr):
    """Until the reply's number is the last one published (bounded, ``_spin_for``; past the bound this
    call's sum is not the threads')."""
    _spin_for(reply_i, tl.load(seq_ptr), reply_i + 1, SPINS)


@triton.jit
def _collect_kernel(reply_i, reply_f, seq_ptr, out_ptr, N, SPINS: tl.constexpr, REPLY_HEADER: tl.constexpr,
                    BLOCK: tl.constexpr):
    _wait_reply(reply_i, seq_ptr, SPINS)
    for off in range(0, N, BLOCK):
        o = off + tl.arange(0, BLOCK)
        m = o < N
        y = tl.load(reply_f + REPLY_HEADER + o, mask=m, other=0.0, cache_modifier=".cv")
        tl.store(out_ptr + o, tl.load(out_ptr + o, mask=m, other=0.0) + y, mask=m)


@triton.jit
def _collect_into_kernel(reply_i, reply_f, seq_ptr, pending_ptr, acc_ptr, acc2_ptr, dst_ptr, N: tl.constexpr,
                         SPINS: tl.constexpr,
                         REPLY_HEADER: tl.constexpr, BLOCK: tl.constexpr, POOL: tl.constexpr, TWO: tl.constexpr):
    """``dst = acc (+ acc2 with TWO) + the threads' sum`` where the split launch published a job (``pending``,
    with ``POOL``)."""
    if POOL:
        pending = tl.load(pending_ptr)
    else:
        pending = 0
    if pending != 0:
        _wait_reply(reply_i, seq_ptr, SPINS)
    for off in range(0, N, BLOCK):
        o = off + tl.arange(0, BLOCK)
        m = o < N
        y = tl.load(acc_ptr + o, mask=m, other=0.0)
        if TWO:
            y += tl.load(acc2_ptr + o, mask=m, other=0.0)
        if pending != 0:
            y += tl.load(reply_f + REPLY_HEADER + o, mask=m, other=0.0, cache_modifier=".cv")
        tl.store(dst_ptr + o, y.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bus_wait_kernel(flag_ptr, seq_ptr, bus_i, SPINS: tl.constexpr, BUS_STATUS: tl.constexpr):
    """Until the device word the copier's last copy writes holds the last number published (bounded,
    ``_spin_for``, the copier's status word marking a timeout)."""
    _spin_for(flag_ptr, tl.load(seq_ptr), bus_i + BUS_STATUS, SPINS)


def bus_wait(bus: "HostBus") -> None:
    """One launch on the current stream that returns once the copies of the copier's last job have landed
    (``hybrid_split.select_prefetch(bus=)`` published it): the expert launches after it read the stage's rows."""
    _bus_wait_kernel[(1,)](bus.flag, bus.seq, bus.mailbox_dev, SPINS=host_experts.TIMEOUT_SPINS,
                           BUS_STATUS=BUS_STATUS, num_warps=1)


def publish(share: "HostShare", layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
            mine: torch.Tensor) -> None:
    T, k = ids.shape
    x, ids, w = x.contiguous(), ids.contiguous(), w.contiguous()
    _publish_kernel[(1,)](share.mailbox_dev, share.mailbox_dev.view(torch.float32), share.seq, x, ids, w, mine,
                          layer, T, T * share.hidden, K=k, MAX_PAIRS=share.max_pairs, HEADER=HEADER,
                          BLOCK_P=triton.next_power_of_2(max(T * k, 16)), BLOCK=BLOCK, num_warps=4)


def collect(share: "HostShare", out: torch.Tensor) -> None:
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape[-1] != share.hidden:
        raise ValueError(f"collect adds into a contiguous float32 [T, {share.hidden}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    _collect_kernel[(1,)](share.reply_dev, share.reply_dev.view(torch.float32), share.seq, out, out.numel(),
                          SPINS=host_experts.TIMEOUT_SPINS, REPLY_HEADER=REPLY_HEADER, BLOCK=BLOCK, num_warps=4)


def collect_into(share: "HostShare | None", acc: torch.Tensor, dst: torch.Tensor,
                 acc2: torch.Tensor | None = None) -> None:
    """``dst = acc (+ acc2)`` plus the threads' sum when ``engine.kernels.hybrid_split.split_pairs`` handed
    ``share`` a job (``share.pending``; None: no threads): acc and acc2 float32 [T, H], dst [T, H] of any float
    dtype, all contiguous."""
    for a in (acc, acc2) if acc2 is not None else (acc,):
        if (a.dtype != torch.float32 or not a.is_contiguous() or not dst.is_contiguous() or a.shape != dst.shape
                or (share is not None and a.shape[-1] != share.hidden)):
            raise ValueError(f"collect_into reads contiguous float32 [T, H] tensors into one of their shape, got "
                             f"{a.dtype} {tuple(a.shape)} and {dst.dtype} {tuple(dst.shape)}")
    reply = share.reply_dev if share is not None else acc
    _collect_into_kernel[(1,)](reply, reply.view(torch.float32), share.seq if share is not None else acc,
                               share.pending if share is not None else acc, acc, acc2 if acc2 is not None else acc,
                               dst, acc.numel(), SPINS=host_experts.TIMEOUT_SPINS, REPLY_HEADER=REPLY_HEADER,
                               BLOCK=BLOCK, POOL=share is not None, TWO=acc2 is not None, num_warps=4)
