"""The split launch of a decode-sized call's pairs (``engine.kernels.hybrid_split``) and the three-stack
gather (``engine.kernels.gather.gather_stacks``) against plain torch, on the CPU through Triton's
interpreter; the threads' share of the cold pairs and its publication on CUDA."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

pytest.importorskip("triton")
from engine.kernels.gather import gather_stacks  # noqa: E402
from engine.kernels.hybrid_split import select_prefetch, split_pairs  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[0, -1] = -1  # an unrouted pair
    hot = torch.randperm(E, generator=g)[:E // 2]
    slot_of = torch.full((E,), -1, dtype=torch.int64)
    slot_of[hot] = torch.arange(hot.numel())
    return ids.to(DEVICE), slot_of.to(DEVICE)


@pytest.mark.parametrize("T,k,E", [(1, 8, 16), (3, 5, 13), (2, 1, 4)])
def test_split_keeps_hot_slots_and_stages_every_cold_pair(T, k, E):
    """With no CPU share: a hot pair's slot, ``-2 - p`` and its expert to copy for each cold pair, -1 for an
    unrouted one; the layer's counter gains the hot pairs, and a second call adds to it."""
    ids, slot_of = case(T, k, E, seed=T * 10 + k)
    hits = torch.full((1,), 5, dtype=torch.int64, device=DEVICE)
    codes = torch.empty((T, k), dtype=torch.int32, device=DEVICE)
    stage = torch.empty(T * k, dtype=torch.int32, device=DEVICE)
    split_pairs(ids, slot_of, hits, codes, stage)
    flat = ids.reshape(-1).cpu()
    slots = torch.where(flat >= 0, slot_of.cpu()[flat.clamp(min=0)], -1)
    cold = (flat >= 0) & (slots < 0)
    p = torch.arange(T * k)
    want = torch.where(slots >= 0, slots, torch.where(cold, -2 - p, -1))
    assert torch.equal(codes.reshape(-1).cpu().long(), want)
    assert torch.equal(stage.cpu().long(), torch.where(cold, flat, -1))
    n_hot = int((slots >= 0).sum())
    assert int(hits) == 5 + n_hot
    split_pairs(ids, slot_of, hits, codes, stage)
    assert int(hits) == 5 + 2 * n_hot


def test_split_apart_gives_the_slots_and_the_stage_their_own_ids():
    """With ``stage_codes`` the slots' ids and the stage's come in two tensors that add up to the one of
    ``codes`` alone (each -1 where the other has the pair)."""
    ids, slot_of = case(2, 6, 12, seed=9)
    outs = []
    for apart in (False, True):
        hits = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        codes = torch.empty((2, 6), dtype=torch.int32, device=DEVICE)
        stage_codes = torch.empty((2, 6), dtype=torch.int32, device=DEVICE) if apart else None
        stage = torch.empty(12, dtype=torch.int32, device=DEVICE)
        split_pairs(ids, slot_of, hits, codes, stage, stage_codes=stage_codes)
        outs.append((codes.cpu(), stage_codes.cpu() if apart else None, stage.cpu(), int(hits)))
    (together, _, stage_a, hits_a), (slots, staged, stage_b, hits_b) = outs
    assert torch.equal(stage_a, stage_b) and hits_a == hits_b
    assert torch.equal(slots, torch.where(together >= 0, together, -1))
    assert torch.equal(staged, torch.where(together <= -2, together, -1))


def test_collect_into_adds_the_sums_without_threads():
    """``collect_into`` with no threads: ``dst = acc (+ acc2)`` in dst's dtype."""
    from engine.kernels.host_share_triton import collect_into

    g = torch.Generator().manual_seed(2)
    acc, acc2 = (torch.randn(3, 40, generator=g).to(DEVICE) for _ in range(2))
    dst = torch.empty(3, 40, device=DEVICE)
    collect_into(None, acc, dst, acc2)
    assert torch.equal(dst, acc + acc2)
    half = torch.empty(3, 40, dtype=torch.bfloat16, device=DEVICE)
    collect_into(None, acc, half)
    assert torch.allclose(half.float(), acc, rtol=2 ** -7, atol=0)  # one bf16 rounding
    with pytest.raises(ValueError, match="contiguous float32"):
        collect_into(None, acc.bfloat16(), dst)


@pytest.mark.parametrize("T,k,E,apart", [(1, 8, 16, True), (3, 5, 13, False), (1, 4, 9, False)])
def test_split_serves_fetched_experts_from_their_rows(T, k, E, apart):
    """Cold experts fetched ahead: every cold pair of one (in any token) reads its stage row ``-2 - (row0 +
    j)``, copies nothing and is counted; the other cold pairs are staged as without them, each by its own
    pair index; a fetched id that is hot, or -1, serves nothing."""
    ids, slot_of = case(T, k, E, seed=T * 7 + k)
    flat = ids.reshape(-1).cpu()
    slots = torch.where(flat >= 0, slot_of.cpu()[flat.clamp(min=0)], -1)
    cold_ids = [int(e) for e, s in zip(flat, slots) if e >= 0 and s < 0]
    hot_id = next(int(e) for e, s in zip(flat, slots) if s >= 0)
    fetched_list = [cold_ids[-1], -1, hot_id, cold_ids[0]]  # row 0 and row 3 serve
    row0 = 32
    fetched = torch.tensor(fetched_list, dtype=torch.int32, device=DEVICE)
    served = torch.full((1,), 3, dtype=torch.int64, device=DEVICE)
    hits = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    codes = torch.empty((T, k), dtype=torch.int32, device=DEVICE)
    stage_codes = torch.empty((T, k), dtype=torch.int32, device=DEVICE) if apart else None
    stage = torch.empty(T * k, dtype=torch.int32, device=DEVICE)
    split_pairs(ids, slot_of, hits, codes, stage, stage_codes=stage_codes, fetched=fetched, fetched_row=row0,
                fetched_hits=served)
    got = (stage_codes if apart else codes).reshape(-1).cpu().long()
    row_of = {}  # an expert fetched twice is read from its first row
    for j, e in enumerate(fetched_list):
        if e in cold_ids:
            row_of.setdefault(e, row0 + j)
    p = torch.arange(T * k)
    ahead = torch.tensor([int(e) in row_of and s < 0 for e, s in zip(flat, slots)])
    cold = (flat >= 0) & (slots < 0) & ~ahead
    want = torch.where(cold, -2 - p, torch.tensor([-2 - row_of.get(int(e), 0) for e in flat]))
    want = torch.where(cold | ahead, want, slots if not apart else torch.full_like(slots, -1))
    assert torch.equal(got, want)
    assert torch.equal(stage.cpu().long(), torch.where(cold, flat, -1))
    assert int(served) == 3 + int(ahead.sum()) and int(hits) == int((slots >= 0).sum())
    with pytest.raises(ValueError, match="stage rows from"):
        split_pairs(ids, slot_of, hits, codes, stage, fetched=fetched, fetched_row=T * k - 1, fetched_hits=served)


@pytest.mark.parametrize("M", [1, 2, 4])
def test_select_prefetch_takes_the_first_cold_predictions_in_order(M):
    """The first ``M`` cold experts of a predicted routing, most likely first; -1 past the cold ones; the
    counter gains how many were picked."""
    slot_of = torch.full((12,), -1, dtype=torch.int64)
    slot_of[[1, 4, 5, 9]] = torch.arange(4)
    predicted = torch.tensor([4, 7, 1, 2, 9, 11, 5, 0])  # cold in order: 7, 2, 11, 0
    sent = torch.full((1,), 1, dtype=torch.int64, device=DEVICE)
    out = torch.empty(M, dtype=torch.int32, device=DEVICE)
    select_prefetch(predicted.to(DEVICE), slot_of.to(DEVICE), out, sent)
    assert out.cpu().tolist() == [7, 2, 11, 0][:M] and int(sent) == 1 + M
    mostly_hot = torch.tensor([4, 1, 3, 9])  # one cold: 3
    out = torch.empty(M, dtype=torch.int32, device=DEVICE)
    select_prefetch(mostly_hot.to(DEVICE), slot_of.to(DEVICE), out, sent)
    assert out.cpu().tolist() == ([3] + [-1] * (M - 1)) and int(sent) == 2 + M
    with pytest.raises(ValueError, match="int32"):
        select_prefetch(predicted.to(DEVICE), slot_of.to(DEVICE), torch.empty(2, dtype=torch.int64, device=DEVICE),
                        sent)
    warmed = torch.empty(3, dtype=torch.int32, device=DEVICE)  # the cold ones after the bus's, no threads to tell
    select_prefetch(predicted.to(DEVICE), slot_of.to(DEVICE), torch.empty(1, dtype=torch.int32, device=DEVICE),
                    sent, warmed=warmed)
    assert warmed.cpu().tolist() == [2, 11, 0] and int(sent) == 2 + M + 4
    select_prefetch(predicted.to(DEVICE), slot_of.to(DEVICE), None, sent, warmed=warmed)
    assert warmed.cpu().tolist() == [7, 2, 11] and int(sent) == 2 + M + 7


def test_split_refuses_wrong_outputs():
    ids, slot_of = case(1, 4, 8, seed=0)
    with pytest.raises(ValueError, match="int64 counter"):
        split_pairs(ids, slot_of, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                    torch.empty((1, 4), dtype=torch.int32, device=DEVICE), torch.empty(4, dtype=torch.int32,
                                                                                       device=DEVICE))


@pytest.mark.parametrize("programs", [None, 1, 3, 7, 1000], ids=lambda p: f"programs{p}")
@pytest.mark.parametrize("shapes", [((5, 12), (5, 12), (12, 5)), ((3, 7), (2, 9), (4, 4))], ids=["expert", "odd"])
def test_gather_stacks_copies_three_stacks_at_once(shapes, programs):
    """Each routed pair's slab of all three stacks (word and byte slabs, unequal sizes, more blocks than one
    program's), untouched rows where the id is -1; the same with a bounded number of programs looping over the
    blocks (fewer than the pairs, an odd count, more than the blocks)."""
    import engine.kernels.gather as gather

    old = gather.BLOCK
    gather.BLOCK = 16  # several blocks a slab at these sizes
    try:
        g = torch.Generator().manual_seed(3)
        srcs = tuple(torch.randint(0, 255, (6, *s), generator=g, dtype=torch.uint8).to(DEVICE) for s in shapes)
        dsts = tuple(torch.zeros((4, *s), dtype=torch.uint8, device=DEVICE) for s in shapes)
        ids = torch.tensor([4, -1, 0, 5], dtype=torch.int32, device=DEVICE)
        gather_stacks(srcs, dsts, ids, programs=programs)
        for src, dst in zip(srcs, dsts):
            for p, e in enumerate(ids.tolist()):
                assert torch.equal(dst[p], src[e] if e >= 0 else torch.zeros_like(dst[p]))
    finally:
        gather.BLOCK = old
    with pytest.raises(ValueError, match="three stacks"):
        gather_stacks(srcs[:2], dsts[:2], ids)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="programs"):
            gather_stacks(srcs, dsts, ids, programs=bad)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction,cold,n_cpu", [(0.5, 4, 2), (0.5, 3, 2), (0.4, 1, 0), (1.0, 3, 3)])
def test_cuda_split_hands_the_threads_their_share_of_the_cold_pairs(fraction, cold, n_cpu):
    """One token of 8 pairs with ``cold`` of them cold: the threads get ``floor(cold * fraction + 1/2)`` of
    them (the last in pair order) in the mailbox, the bus the others; with none for the threads nothing is
    published (the sequence number unchanged) and ``pending`` is 0."""
    from engine.kernels.host_experts import HEADER, HostShare

    E, k, H = 16, 8, 64
    share = HostShare([None] * 2, hidden=H, ffn=32, threads=1, device="cuda")
    try:
        ids = torch.arange(k, device="cuda").view(1, k)
        slot_of = torch.full((E,), -1, dtype=torch.int64, device="cuda")
        slot_of[cold:k] = torch.arange(k - cold, device="cuda")  # experts 0 .. cold-1 are cold
        hits = torch.zeros(1, dtype=torch.int64, device="cuda")
        codes = torch.empty((1, k), dtype=torch.int32, device="cuda")
        stage = torch.empty(k, dtype=torch.int32, device="cuda")
        x = torch.randn(1, H, device="cuda")
        w = torch.rand(1, k, device="cuda")
        seq0 = int(share.seq)
        split_pairs(ids, slot_of, hits, codes, stage, share=share, fraction=fraction, layer=1, x=x, w=w)
        torch.cuda.synchronize()
        bus = cold - n_cpu
        assert codes.view(-1).tolist() == [-2 - p for p in range(bus)] + [-1] * n_cpu + list(range(k - cold))
        assert stage.tolist() == list(range(bus)) + [-1] * (k - bus)
        assert int(hits) == k - cold and int(share.pending) == (n_cpu > 0)
        if n_cpu:
            assert int(share.seq) == seq0 + 1 and int(share.mailbox[0]) == seq0 + 1
            mb = share.mailbox[HEADER:HEADER + k].tolist()
            assert mb == [-1] * bus + list(range(bus, cold)) + [-1] * (k - cold)
            xs = share.mailbox.view(torch.float32)[HEADER + 2 * share.max_pairs:HEADER + 2 * share.max_pairs + H]
            assert torch.equal(xs, x.view(-1).cpu())
        else:
            assert int(share.seq) == seq0
    finally:
        share.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_split_hands_the_threads_the_warmed_pairs_and_the_select_tells_them():
    """The threads were told to warm experts 1 and 5: their cold pairs are the threads' whatever the share
    (0 here), the other cold pairs the bus's; the select launch writes the warm-up's words into the mailbox
    and releases its number, and the threads fetch the experts' chunks."""
    import time

    from engine.kernels.host_experts import HEADER, WARM_IDS, WARM_LAYER, WARM_N, WARM_SEQ, HostShare
    from tests.engine.kernels.test_host_experts import layer

    from gguf import GGMLQuantizationType as Q

    E, k, H = 8, 4, 64
    mats = [layer(Q.Q4_0, "ggml", E, H, 32, seed=i)[0] for i in range(2)]
    share = HostShare(mats, hidden=H, ffn=32, threads=2, device="cuda")
    try:
        slot_of = torch.full((E,), -1, dtype=torch.int64, device="cuda")
        slot_of[[0, 2]] = torch.arange(2, device="cuda")  # 0 and 2 hot
        warmed = torch.empty(2, dtype=torch.int32, device="cuda")
        sent = torch.zeros(1, dtype=torch.int64, device="cuda")
        predicted = torch.tensor([0, 1, 2, 5], device="cuda")
        select_prefetch(predicted, slot_of, None, sent, warmed=warmed, share=share, layer=1)
        torch.cuda.synchronize()
        mb = share.mailbox
        assert warmed.tolist() == [1, 5] and int(sent) == 2
        assert (int(mb[WARM_SEQ]), int(mb[WARM_LAYER]), int(mb[WARM_N])) == (1, 1, 2)
        assert mb[WARM_IDS:WARM_IDS + 2].tolist() == [1, 5]
        deadline = time.perf_counter() + 10
        while share.warm_chunks == 0 and time.perf_counter() < deadline:
            time.sleep(0.001)
        assert share.warm_chunks > 0
        ids = torch.tensor([[1, 3, 5, 2]], device="cuda")
        hits, served = (torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2))
        codes = torch.empty((1, k), dtype=torch.int32, device="cuda")
        stage = torch.empty(k, dtype=torch.int32, device="cuda")
        x, w = torch.randn(1, H, device="cuda"), torch.rand(1, k, device="cuda")
        split_pairs(ids, slot_of, hits, codes, stage, share=share, fraction=1e-6, layer=1, x=x, w=w, warmed=warmed,
                    fetched_hits=served)
        torch.cuda.synchronize()
        assert codes.view(-1).tolist() == [-1, -3, -1, 1]  # 1 and 5 the threads', 3 the bus's, 2 hot in slot 1
        assert stage.tolist() == [-1, 3, -1, -1] and int(served) == 2 and int(share.pending) == 1
        assert share.mailbox[HEADER:HEADER + k].tolist() == [1, -1, 5, -1]
    finally:
        share.close()
