"""One launch that splits a decode-sized call's routed pairs between the three places an expert is computed
with ``cold_device="gpu"`` (``engine.hybrid``), so that the experts' two launches read every pair the device
computes from one id tensor:

- a hot pair keeps its device slot (id >= 0);
- a cold pair the bus carries gets ``-2 - p`` (p its pair index): ``engine.kernels.gather.gather_stacks``
  copies its expert into row ``p`` of the stage stacks, which the expert launches read for such ids;
- a cold pair the CPU threads compute (``engine.kernels.host_experts``) gets -1 here and is handed to them
  in the same launch: the mailbox's ids, weights and token rows, then its sequence number (system-scope
  release), as ``host_share_triton``'s publish does.

Of a call's ``c`` cold pairs the threads take the last ``floor(c * share + 1/2)`` in pair order (the router
orders each token's pairs by weight; which ones does not change the cost: every cold expert is the same
bytes), the bus the others, so each layer's two sides get their share of this call's pairs rather than of
the experts' routed mass on average. With none for the threads nothing is published and ``pending`` says so:
``host_share_triton.collect_into`` then waits for nothing. The layer's hot pairs are added to its hit counter.

Cold experts fetched ahead (``select_prefetch``): before a layer's router has run, its routing is predicted
from the layer's input (the residual stream changes little over one mixer), and the bus copies the predicted
cold experts into rows of their own of the stage stacks while the mixer runs. The split then gives a cold pair
whose expert was fetched that row's ``-2 - row``; the next predicted cold experts are named to the CPU threads
as a warm-up (they fetch the blocks into their caches meanwhile), and the split hands those experts' pairs to
the threads; only the cold pairs left are shared between the threads and the bus at the set fraction, and the
layer's prefetch counter gains the pairs served by fetched or warmed experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine.kernels.fused import check_device
from engine.kernels.host_experts import (BUS_IDS, BUS_LAYER, BUS_N, HEADER, WARM_IDS, WARM_LAYER, WARM_MAX, WARM_N,
                                        WARM_SEQ)
from engine.kernels.host_share_triton import _fence_sys, _store_release_sys

if TYPE_CHECKING:
    from engine.kernels.host_experts import HostBus, HostShare

BLOCK = 1024  # token-row floats a loop step of the mailbox's copy


@triton.jit
def _split_kernel(ids_ptr, slot_ptr, codes_ptr, stage_codes_ptr, stage_ptr, hits_ptr, pending_ptr, mb_i, mb_f,
                  seq_ptr, x_ptr, w_ptr, pf_ptr, pf_hits_ptr, pf_row, warm_ptr, layer, T, N, share, P: tl.constexpr,
                  K: tl.constexpr, MAX_PAIRS: tl.constexpr, HEADER: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK: tl.constexpr, PUBLISH: tl.constexpr, APART: tl.constexpr, M: tl.constexpr,
                  MW: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    e = tl.load(ids_ptr + p, mask=pm, other=-1)
    slot = tl.load(slot_ptr + tl.maximum(e, 0), mask=pm & (e >= 0), other=-1)
    hot = slot >= 0
    fetched = tl.full([BLOCK_P], -1, tl.int32)  # the stage row a prefetched cold pair reads, else -1
    for j in tl.static_range(M):
        f = tl.load(pf_ptr + j)
        fetched = tl.where((fetched < 0) & (f >= 0) & (e == f) & pm & (slot < 0), pf_row + j, fetched)
    ahead = fetched >= 0
    cold = pm & (e >= 0) & (slot < 0) & (fetched < 0)
    warmed = tl.zeros([BLOCK_P], dtype=tl.int1)  # cold pairs of experts the threads were told to warm: theirs
    if PUBLISH:
        for j in tl.static_range(MW):
            f = tl.load(warm_ptr + j)
            warmed = warmed | (cold & (f >= 0) & (e == f))
    rest = (cold & (warmed == 0)).to(tl.int32)
    c = tl.sum(rest, axis=0)
    if PUBLISH:
        n_rest = tl.floor(c.to(tl.float32) * share + 0.5).to(tl.int32)
    else:
        n_rest = c * 0
    rank = tl.cumsum(rest, axis=0) - rest  # the other cold pairs before this one
    cpu = warmed | ((rest != 0) & (rank >= c - n_rest))
    bus = (rest != 0) & (rank < c - n_rest)
    n_cpu = tl.sum(cpu.to(tl.int32), axis=0)
    if M + MW > 0:  # pairs served by what was fetched or warmed ahead
        tl.atomic_add(pf_hits_ptr, tl.sum(ahead.to(tl.int64), axis=0) + tl.sum(warmed.to(tl.int64), axis=0))
    staged = tl.where(bus, -2 - p, tl.where(ahead, -2 - fetched, -1))
    if APART:  # the slots' ids and the stage's in two tensors
        tl.store(codes_ptr + p, tl.where(hot, slot, -1).to(codes_ptr.dtype.element_ty), mask=pm)
        tl.store(stage_codes_ptr + p, staged.to(stage_codes_ptr.dtype.element_ty), mask=pm)
    else:
        tl.store(codes_ptr + p, tl.where(hot, slot, staged).to(codes_ptr.dtype.element_ty), mask=pm)
    tl.store(stage_ptr + p, tl.where(bus, e, -1).to(stage_ptr.dtype.element_ty), mask=pm)  # what the bus copies
    tl.atomic_add(hits_ptr, tl.sum(hot.to(tl.int64), axis=0))
    if PUBLISH:
        if n_cpu > 0:
            s = tl.load(seq_ptr) + 1
            s = tl.where(s < 0, 1, s)  # the host side's numbers stay positive
            tl.store(mb_i + 16, layer)
            tl.store(mb_i + 17, T)
            tl.store(mb_i + 18, K)
            tl.store(mb_i + HEADER + p, tl.where(cpu, e, -1).to(tl.int32), mask=pm)
            tl.store(mb_f + HEADER + MAX_PAIRS + p, tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32), mask=pm)
            for off in range(0, N, BLOCK):
                o = off + tl.arange(0, BLOCK)
                m = o < N
                tl.store(mb_f + HEADER + 2 * MAX_PAIRS + o, tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32),
                         mask=m)
            _fence_sys(s)  # every thread's payload visible to the host before any thread's sequence number
            tl.debug_barrier()
            tl.store(seq_ptr, s)
            _store_release_sys(mb_i, s)
            tl.store(pending_ptr, 1)
        else:
            tl.store(pending_ptr, 0)


def split_pairs(ids: torch.Tensor, slot_of: torch.Tensor, hits: torch.Tensor, codes: torch.Tensor,
                stage_ids: torch.Tensor, *, share: "HostShare | None" = None, fraction: float = 0.0, layer: int = 0,
                x: torch.Tensor | None = None, w: torch.Tensor | None = None,
                stage_codes: torch.Tensor | None = None, fetched: torch.Tensor | None = None, fetched_row: int = 0,
                fetched_hits: torch.Tensor | None = None, warmed: torch.Tensor | None = None) -> None:
    """Split ``ids`` [T, k] (-1: unrouted) by ``slot_of`` [E] (a device slot, -1 where cold) into ``codes``
    [T, k] (the slot; ``-2 - p`` for a cold pair the bus carries, copied by ``stage_ids[p]`` = its expert;
    -1 for the threads' pairs and unrouted ones) and ``stage_ids`` [T k] (-1 where nothing is copied);
    ``hits`` (a one-element int64 tensor) gains the hot pairs. With ``share`` (CUDA), ``fraction`` of the
    cold pairs go to its threads, published with ``x`` [T, H] and ``w`` [T, k] for ``layer``. With
    ``stage_codes`` [T, k] the ids come apart: ``codes`` the slots (-1 elsewhere), ``stage_codes`` the stage's
    ``-2 - p`` (-1 elsewhere), for expert launches of their own. ``fetched`` [M] (int32, -1: none) names cold
    experts already copied to stage rows ``fetched_row + j``: their pairs read those rows (``-2 - row``, no
    copy), are left out of the share, and are added to ``fetched_hits`` (int64 [1]). ``warmed`` [MW] (int32, -1:
    none) names cold experts the threads were told to warm (``select_prefetch``): with a share, their other
    cold pairs go to the threads whatever the fraction, which then applies to the cold pairs left."""
    check_device(ids, "split_pairs")
    T, k = ids.shape
    P = T * k
    if (codes.shape != ids.shape or stage_ids.numel() < P or hits.dtype != torch.int64 or hits.numel() != 1
            or (stage_codes is not None and stage_codes.shape != ids.shape)):
        raise ValueError(f"split_pairs writes codes {tuple(ids.shape)}, {P} stage ids and an int64 counter, got "
                         f"{tuple(codes.shape)}, {stage_ids.numel()} and {hits.dtype} [{hits.numel()}]")
    ids = ids.contiguous()
    M = 0 if fetched is None else fetched.numel()
    MW = 0 if warmed is None else warmed.numel()
    if MW and warmed.dtype != torch.int32:
        raise ValueError(f"warmed experts are int32 ids, got {warmed.dtype}")
    if M and (fetched.dtype != torch.int32 or fetched_row < P):
        raise ValueError(f"fetched experts are int32 ids at stage rows from {P} on, got {fetched.dtype} at row "
                         f"{fetched_row}")
    if (M or MW) and (fetched_hits is None or fetched_hits.dtype != torch.int64 or fetched_hits.numel() != 1):
        raise ValueError("experts fetched or warmed ahead need an int64 counter of the pairs they serve")
    publish = share is not None and fraction > 0
    if publish:
        if not share.fits(T, k) or x is None or w is None:
            raise ValueError(f"{T} tokens of {k} pairs do not fit the mailbox, or x or w is missing")
        x, w = x.contiguous(), w.contiguous()
        mb, seq, pending, n = share.mailbox_dev, share.seq, share.pending, T * share.hidden
        max_pairs = share.max_pairs
    else:
        mb, seq, pending, n, max_pairs = codes, hits, hits, 0, 1  # unread without publishing
        x = w = ids
    _split_kernel[(1,)](ids, slot_of, codes, stage_codes if stage_codes is not None else codes, stage_ids, hits,
                        pending, mb, mb.view(torch.float32) if publish else mb, seq, x, w,
                        fetched if M else ids, fetched_hits if M or MW else hits, fetched_row,
                        warmed if MW else ids, layer, T, n,
                        float(fraction), P=P, K=k, MAX_PAIRS=max_pairs, HEADER=HEADER,
                        BLOCK_P=triton.next_power_of_2(max(P, 16)), BLOCK=BLOCK, PUBLISH=publish,
                        APART=stage_codes is not None, M=M, MW=MW, num_warps=4)


@triton.jit
def _nth(e, cold, rank, j):
    """The id of the ``j``-th cold prediction (``rank`` counts those before each), -1 past the last."""
    return (tl.sum(tl.where((cold != 0) & (rank == j), e + 1, 0), axis=0) - 1).to(tl.int32)


@triton.jit
def _select_kernel(pred_ptr, slot_ptr, out_ptr, sent_ptr, warm_ptr, mb_i, wseq_ptr, bus_i, bseq_ptr, layer,
                   K: tl.constexpr, M: tl.constexpr, MW: tl.constexpr, PUBLISH: tl.constexpr, BUS: tl.constexpr,
                   BLOCK_K: tl.constexpr, WARM_SEQ: tl.constexpr, WARM_LAYER: tl.constexpr, WARM_N: tl.constexpr,
                   WARM_IDS: tl.constexpr, BUS_LAYER: tl.constexpr, BUS_N: tl.constexpr, BUS_IDS: tl.constexpr):
    o = tl.arange(0, BLOCK_K)
    m = o < K
    e = tl.load(pred_ptr + o, mask=m, other=-1)
    slot = tl.load(slot_ptr + tl.maximum(e, 0), mask=m & (e >= 0), other=0)
    cold = (m & (e >= 0) & (slot < 0)).to(tl.int32)
    rank = tl.cumsum(cold, axis=0) - cold  # cold predictions before this one
    n = tl.sum(cold, axis=0)
    for j in tl.static_range(M):
        v = _nth(e, cold, rank, j)
        tl.store(out_ptr + j, v)
        if BUS:
            tl.store(bus_i + BUS_IDS + j, v)
    for j in tl.static_range(MW):
        v = _nth(e, cold, rank, M + j)
        tl.store(warm_ptr + j, v)
        if PUBLISH:
            tl.store(mb_i + WARM_IDS + j, v)
    n_warm = tl.minimum(tl.maximum(n - M, 0), MW)
    tl.atomic_add(sent_ptr, (tl.minimum(n, M) + n_warm).to(tl.int64))
    if PUBLISH:
        if n_warm > 0:  # the threads' warm-up: its names, then its number (as the split publishes a job)
            s = tl.load(wseq_ptr) + 1
            s = tl.where(s < 0, 1, s)
            tl.store(mb_i + WARM_LAYER, layer)
            tl.store(mb_i + WARM_N, MW)
            _fence_sys(s)
            tl.debug_barrier()
            tl.store(wseq_ptr, s)
            _store_release_sys(mb_i + WARM_SEQ, s)
    if BUS:  # the copier's job (host_experts.HostBus): its names, then its number, every time (it always answers)
        b = tl.load(bseq_ptr) + 1
        b = tl.where(b < 0, 1, b)
        tl.store(bus_i + BUS_LAYER, layer)
        tl.store(bus_i + BUS_N, M)
        _fence_sys(b)
        tl.debug_barrier()
        tl.store(bseq_ptr, b)
        _store_release_sys(bus_i, b)


def select_prefetch(predicted: torch.Tensor, slot_of: torch.Tensor, out: torch.Tensor | None, sent: torch.Tensor, *,
                    warmed: torch.Tensor | None = None, share: "HostShare | None" = None, layer: int = 0,
                    bus: "HostBus | None" = None) -> None:
    """``out`` [M] int32: the first ``M`` cold experts (``slot_of`` -1) of ``predicted`` [k] (a token's
    predicted routing, most likely first), -1 past the cold ones there are; for the bus to fetch ahead, named
    with ``bus`` (CUDA) to its copier for ``layer`` (``HostBus``'s words, written and released from the device;
    its rows 0 .. M-1 take them and ``host_share_triton.bus_wait`` waits for them).
    ``warmed`` [MW] int32: the next ``MW`` cold ones, which ``share``'s threads (CUDA) are told to warm for
    ``layer`` (``HostShare.warm``'s words, written and released from the device) when there is one. ``sent``
    (int64 [1]) gains how many were picked."""
    check_device(predicted, "select_prefetch")
    M = 0 if out is None else out.numel()
    MW = 0 if warmed is None else warmed.numel()
    if (predicted.dim() != 1 or M + MW < 1 or any(t is not None and (t.dim() != 1 or t.dtype != torch.int32)
                                                  for t in (out, warmed))
            or sent.dtype != torch.int64 or sent.numel() != 1):
        raise ValueError(f"select_prefetch takes one token's [k] ids into int32 vectors and an int64 counter, got "
                         f"{tuple(predicted.shape)}, {None if out is None else (out.dtype, tuple(out.shape))} and "
                         f"{sent.dtype}")
    if MW > WARM_MAX:
        raise ValueError(f"the threads warm up to {WARM_MAX} experts at a time, got {MW}")
    if bus is not None and not 1 <= M <= bus.rows:
        raise ValueError(f"the copier fetches 1 to {bus.rows} experts, got {M}")
    k = predicted.numel()
    publish = share is not None and MW > 0
    mb = share.mailbox_dev if publish else sent
    bus_mb = bus.mailbox_dev if bus is not None else sent
    _select_kernel[(1,)](predicted.contiguous(), slot_of, out if M else sent, sent, warmed if MW else sent, mb,
                         share.warm_seq if publish else sent, bus_mb, bus.seq if bus is not None else sent, layer,
                         K=k, M=M, MW=MW, PUBLISH=publish, BUS=bus is not None,
                         BLOCK_K=triton.next_power_of_2(max(k, 2)), WARM_SEQ=WARM_SEQ, WARM_LAYER=WARM_LAYER,
                         WARM_N=WARM_N, WARM_IDS=WARM_IDS, BUS_LAYER=BUS_LAYER, BUS_N=BUS_N, BUS_IDS=BUS_IDS,
                         num_warps=1)
