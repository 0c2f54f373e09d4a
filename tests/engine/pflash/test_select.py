"""Chunk selection: counts, forced head and tail chunks, ranking, config validation."""

import math

import pytest
import torch

from engine.errors import ConfigError
from engine.pflash.select import PFlashConfig, chunk_tokens, check_keep_ratio, n_kept_chunks, select_chunks


@pytest.mark.parametrize("n, ratio", [(128, 0.05), (100, 0.07), (257, 0.1), (512, 0.2), (7, 0.3), (3, 0.01),
                                      (40, 1.0)])
@pytest.mark.parametrize("head, tail", [(1, 3), (0, 1), (2, 2), (8, 24)])
def test_kept_chunks_are_sorted_unique_with_head_and_tail(n, ratio, head, tail):
    scores = torch.rand(n, generator=torch.Generator().manual_seed(n))
    kept = select_chunks(scores, ratio, head=head, tail=tail)
    want = max(1, min(n, math.ceil(round(n * ratio, 9))))
    assert kept.numel() == want == n_kept_chunks(n, ratio)
    assert torch.all(kept[1:] > kept[:-1])  # sorted and unique
    n_tail = min(tail, want)
    n_head = min(head, want - n_tail)
    assert set(range(n - n_tail, n)) <= set(kept.tolist())
    assert set(range(n_head)) <= set(kept.tolist())


def test_ceil_reads_through_float_noise():
    assert 100 * 0.07 > 7  # 7.000000000000001
    assert n_kept_chunks(100, 0.07) == 7
    assert n_kept_chunks(128, 0.05) == 7  # 6.4 rounds up


def test_free_chunks_go_by_score():
    scores = torch.zeros(50)
    scores[[7, 21, 33]] = torch.tensor([3.0, 2.0, 1.0])
    kept = select_chunks(scores, 0.12, head=1, tail=2)  # 6 chunks: 0, 48, 49 + the best three
    assert kept.tolist() == [0, 7, 21, 33, 48, 49]
    kept = select_chunks(scores, 0.1, head=1, tail=2)  # 5 chunks: room for the best two
    assert kept.tolist() == [0, 7, 21, 48, 49]


def test_tail_wins_when_head_and_tail_do_not_fit():
    kept = select_chunks(torch.rand(40), 0.05, head=3, tail=2)  # 2 chunks
    assert kept.tolist() == [38, 39]


def test_chunk_tokens_cover_kept_chunks_and_a_short_last_chunk():
    idx = chunk_tokens(torch.tensor([0, 2, 3]), 4, 14)
    assert idx.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_bad_keep_ratio_is_a_config_error(ratio):
    with pytest.raises(ConfigError, match="keep ratio"):
        check_keep_ratio(ratio)


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk": 0}, "chunk"), ({"tail_chunks": 0}, "tail_chunks"), ({"pool_kernel": 12}, "odd"),
    ({"threshold": -1}, "threshold"), ({"scorer": "cuda"}, "scorer"), ({"n_lookahead": 0}, "n_lookahead"),
])
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PFlashConfig(**kwargs)
