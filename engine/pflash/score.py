"""Token importance for speculative prefill: plain torch reference.

The queries of the last ``n_look`` prompt tokens attend to every prompt key of each
attention layer of the drafter (causal among the lookahead tokens). A token's score is the
attention probability it receives, maxed over layers and heads, then averaged over the
lookahead queries; scores are then smoothed (average pooling) and averaged per chunk.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F


def check_lookahead(q: torch.Tensor, k: torch.Tensor) -> None:
    """Shapes of one layer's lookahead queries ``q`` [H, NL, D] and keys ``k`` [Hkv, T, D]."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"queries must be [H, NL, D] and keys [Hkv, T, D], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"query head dim {q.shape[2]} differs from key head dim {k.shape[2]}")
    if q.shape[0] % k.shape[0]:
        raise ValueError(f"{q.shape[0]} query heads are not a multiple of {k.shape[0]} key heads")
    if not 0 < q.shape[1] <= k.shape[1]:
        raise ValueError(f"{q.shape[1]} lookahead queries for {k.shape[1]} keys: need 1..{k.shape[1]}")
    if q.device != k.device or q.dtype != k.dtype:
        raise ValueError(f"queries ({q.dtype} on {q.device}) and keys ({k.dtype} on {k.device}) differ")


def lookahead_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [H, NL, T] float32 of the last NL positions over all T keys.

    q: [H, NL, D] (query i sits at position T - NL + i); k: [Hkv, T, D]; GQA by head groups.
    """
    check_lookahead(q, k)
    n_head, n_look, head_dim = q.shape
    n_kv, t, _ = k.shape
    kf = k.float().repeat_interleave(n_head // n_kv, dim=0)  # [H, T, D]
    s = torch.einsum("hid,htd->hit", q.float(), kf) / math.sqrt(head_dim)
    pos = torch.arange(t - n_look, t, device=q.device)
    visible = torch.arange(t, device=q.device)[None, :] <= pos[:, None]  # [NL, T]
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)


def token_scores(queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-token score [T] float32: max over layers and heads, mean over lookahead queries.

    ``queries[l]`` [H, NL, D] and ``keys[l]`` [Hkv, T, D] belong to attention layer l.
    """
    if not queries or len(queries) != len(keys):
        raise ValueError(f"need one key tensor per query tensor and at least one layer, got "
                         f"{len(queries)} and {len(keys)}")
    best = None
    for q, k in zip(queries, keys):
        p = lookahead_probs(q, k).amax(dim=0)  # [NL, T]
        best = p if best is None else torch.maximum(best, p)
    return best.mean(dim=0)


def smooth(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average pooling [T] -> [T] over a centred odd window; the edges average what exists."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"smoothing kernel must be a positive odd number, got {kernel}")
    if kernel == 1:
        return scores
    return F.avg_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False)[0, 0]


def chunk_means(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean score of each run of ``chunk`` tokens [ceil(T / chunk)]; the last run may be short."""
    if chunk < 1:
        raise ValueError(f"chunk size must be positive, got {chunk}")
    t = scores.shape[0]
    n = -(-t // chunk)
    sums = F.pad(scores, (0, n * chunk - t)).reshape(n, chunk).sum(dim=1)
    counts = torch.full((n,), float(chunk), device=scores.device)
    counts[-1] = t - (n - 1) * chunk
    return sums / counts
