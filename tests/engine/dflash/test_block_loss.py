"""The block loss: blocks of many rows, packed into groups, give the weighted cross-entropy of
lone blocks run one at a time through the draft's own cache path."""

import pytest
import torch
import torch.nn.functional as F

from engine.dflash.block_loss import _groups, block_loss, rows_per_forward, slot_weights, usable_anchors
from engine.dflash.draft import DFlashDraft, DraftCache, block_hidden
from engine.dflash.train import new_draft_config


def _lone_blocks(draft, embed, output, features, ids, labels, anchors, gamma):
    """(sum of weighted cross-entropies, sum of weights, accepted lengths) of blocks run one by one."""
    cfg = draft.cfg
    B, L = cfg.block_size, ids.shape[0]
    num = den = 0.0
    accepted = []
    for a in anchors.tolist():
        cache = DraftCache.empty(draft, L)
        cache.extend(draft, features[:a], torch.arange(a))
        block = torch.tensor([int(ids[a])] + [cfg.mask_token_id] * (B - 1))
        logits = F.linear(block_hidden(draft, cache, F.embedding(block, embed), a)[1:], output)
        run = 1
        for k in range(1, B):
            if a + k < L:
                w = torch.exp(torch.tensor(-(k - 1) / gamma))
                num = num + w * F.cross_entropy(logits[k - 1:k], labels[a + k:a + k + 1])
                den = den + w
                if run == k and int(logits[k - 1].argmax()) == int(labels[a + k]):
                    run += 1
        accepted.append(run)
    return num, den, torch.tensor(accepted)


def _setup(target, L, R, block_size):
    cfg = new_draft_config(target.cfg, n_layers=1, block_size=block_size, layer_ids=(0, 3))
    draft = DFlashDraft(cfg).init_random(torch.Generator().manual_seed(0), std=0.1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (R, L), generator=gen)
    labels = ids.roll(-1, 1)  # labels the draft can partly learn, so accepted lengths vary
    features = torch.randn(R, L, 2 * cfg.hidden, generator=gen)
    return draft, ids, labels, features


def test_one_row_is_the_weighted_cross_entropy_of_lone_blocks(target):
    draft, ids, labels, features = _setup(target, 10, 1, 4)
    anchors = torch.tensor([2, 7])  # the block at 7 runs past the end: its last slot carries no loss
    w = target.weights
    loss, accepted = block_loss(draft, w.embed, w.output, features[0], ids[0], labels[0], anchors, 2.0)
    num, den, ref_accepted = _lone_blocks(draft, w.embed, w.output, features[0], ids[0], labels[0], anchors, 2.0)
    torch.testing.assert_close(loss, (num / den).reshape(()), atol=1e-5, rtol=1e-5)
    assert torch.equal(accepted, ref_accepted)


def test_rows_and_groups_equal_lone_blocks(target):
    R, L, B = 3, 26, 4  # groups of 26 // 4 = 6 blocks: 12 anchors per row make 2 groups
    draft, ids, labels, features = _setup(target, L, R, B)
    gen = torch.Generator().manual_seed(2)
    anchors = torch.stack([torch.randperm(L - 2, generator=gen)[:12] + 1 for _ in range(R)]).sort(-1).values
    assert _groups(12, L, B) == 2
    w = target.weights
    loss, accepted = block_loss(draft, w.embed, w.output, features, ids, labels, anchors, 3.0)
    num = den = 0.0
    for r in range(R):
        n_r, d_r, acc_r = _lone_blocks(draft, w.embed, w.output, features[r], ids[r], labels[r], anchors[r], 3.0)
        num, den = num + n_r, den + d_r
        assert torch.equal(accepted[r], acc_r), r
    torch.testing.assert_close(loss, (num / den).reshape(()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(den.reshape(()), slot_weights(anchors, L, B, 3.0).sum(), atol=1e-5, rtol=1e-5)


def test_slot_weights_decay_and_stop_at_the_end():
    w = slot_weights(torch.tensor([[0, 5]]), 8, 4, 2.0)
    e = torch.exp(torch.tensor(-0.5))
    torch.testing.assert_close(w, torch.tensor([[[1.0, e, e * e], [1.0, e, 0.0]]]))


@pytest.mark.parametrize("n, length, block, groups", [(2, 10, 4, 1), (12, 26, 4, 2), (256, 512, 16, 8),
                                                      (7, 16, 4, 7), (32, 55, 8, 8)])
def test_groups_divide_the_blocks_and_stay_near_the_row_length(n, length, block, groups):
    assert _groups(n, length, block) == groups and n % groups == 0


def test_usable_anchors_lose_fewer_than_one_per_group():
    for n, length, block in [(191, 256, 16), (63, 128, 16), (500, 2048, 16), (5, 64, 16), (33, 40, 4)]:
        m = usable_anchors(n, length, block)
        groups = -(-n // max(1, length // block))
        assert n - groups < m <= n
        assert m // _groups(m, length, block) * block <= max(block, length)  # a group's queries fit the row length


def test_rows_per_forward_keeps_mask_and_logits_under_the_budget():
    n, L, B, vocab = 256, 512, 16, 4096
    rows = rows_per_forward(n, L, B, vocab, budget=1 << 28)
    group = n // _groups(n, L, B) * B
    assert rows * n * B * (L + group) <= 1 << 28 and rows * n * (B - 1) * vocab <= 1 << 28
    assert (rows + 1) * n * (B - 1) * vocab > 1 << 28  # the logits are the binding limit here
    assert rows_per_forward(n, L, B, 248320) == 1  # never fewer than one row
