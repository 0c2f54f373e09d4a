"""The torch reference scorer against plain loops and full causal attention."""

import math

import pytest
import torch

from engine.pflash.score import chunk_means, lookahead_probs, smooth, token_scores


def full_causal_probs(q_all, k):
    """Softmax attention of every position over every earlier key: [H, T, T]."""
    n_head, t, d = q_all.shape
    kf = k.repeat_interleave(n_head // k.shape[0], dim=0)
    s = q_all @ kf.transpose(1, 2) / math.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


def test_lookahead_probs_are_the_last_rows_of_full_causal_attention():
    torch.manual_seed(0)
    q_all, k = torch.randn(6, 37, 20), torch.randn(3, 37, 20)
    expected = full_causal_probs(q_all, k)[:, -5:]
    got = lookahead_probs(q_all[:, -5:], k)
    assert (got - expected).abs().max() < 1e-6
    assert got[:, 0, 33:].abs().max() == 0  # query at position 32 sees nothing after it
    assert (got.sum(-1) - 1).abs().max() < 1e-5


def test_token_scores_max_over_layers_and_heads_then_mean_over_queries():
    torch.manual_seed(1)
    layers = [(torch.randn(4, 3, 8), torch.randn(2, 11, 8)) for _ in range(3)]
    probs = [lookahead_probs(q, k) for q, k in layers]  # [H, NL, T] each
    expected = torch.zeros(11)
    for j in range(11):
        for i in range(3):
            expected[j] += max(float(p[h, i, j]) for p in probs for h in range(4)) / 3
    got = token_scores([q for q, _ in layers], [k for _, k in layers])
    assert (got - expected).abs().max() < 1e-6


def test_smooth_is_a_centred_average_that_keeps_the_length():
    x = torch.arange(20, dtype=torch.float32)
    y = smooth(x, 5)
    assert y.shape == x.shape
    assert y[10] == pytest.approx(10.0)
    assert y[0] == pytest.approx((0 + 1 + 2) / 3)  # edges average only what exists
    assert torch.equal(smooth(x, 1), x)
    with pytest.raises(ValueError, match="odd"):
        smooth(x, 4)


def test_chunk_means_with_a_short_last_chunk():
    x = torch.arange(10, dtype=torch.float32)
    assert torch.allclose(chunk_means(x, 4), torch.tensor([1.5, 5.5, 8.5]))
    assert torch.allclose(chunk_means(x, 10), torch.tensor([4.5]))


@pytest.mark.parametrize("q_shape, k_shape, message", [
    ((4, 3, 8), (3, 11, 8), "multiple"),
    ((4, 3, 8), (2, 11, 6), "head dim"),
    ((4, 12, 8), (2, 11, 8), "lookahead"),
])
def test_bad_shapes_are_refused(q_shape, k_shape, message):
    with pytest.raises(ValueError, match=message):
        lookahead_probs(torch.randn(q_shape), torch.randn(k_shape))
