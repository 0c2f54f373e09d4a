"""Chunk selection for speculative prefill: which prompt tokens the target gets to see.

Scores come from the drafter (``Drafter.lookahead`` -> ``score.token_scores`` or its
Triton twin); the top ``keep_ratio`` of chunks survive, with the head and tail chunks
always among them. Short prompts (at most ``threshold`` tokens) are left whole.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.pflash.drafter import Drafter
from engine.pflash.score import chunk_means, smooth, token_scores

SCORERS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class PFlashConfig:
    """Everything about speculative prefill but the keep ratio (the knob the tuner turns).

    Lucebox keeps 8 head and 24 tail chunks of 32 tokens above 32,000 tokens; scaled down
    by 8 here, so that a 4K-token prompt kept at 5% (7 chunks) still has room for
    chunks chosen by score. Below ``threshold`` tokens the drafter pass costs about as much
    as the prefill it would save, so such prompts are prefilled whole.
    """

    threshold: int = 2048  # compress only prompts longer than this many tokens
    chunk: int = 32
    n_lookahead: int = 8
    pool_kernel: int = 13
    head_chunks: int = 1
    tail_chunks: int = 3  # at least 1: the prompt's last token must be prefilled
    renumber: bool = False  # kept tokens get positions 0..n-1 instead of their original ones
    scorer: str = "auto"  # "triton" on CUDA and "torch" elsewhere, or either one by name

    def __post_init__(self) -> None:
        for name in ("threshold", "head_chunks"):
            if getattr(self, name) < 0:
                raise ValueError(f"pflash {name} must be >= 0, got {getattr(self, name)}")
        for name in ("chunk", "n_lookahead", "tail_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"pflash {name} must be >= 1, got {getattr(self, name)}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pflash pool_kernel must be a positive odd number, got {self.pool_kernel}")
        if self.scorer not in SCORERS:
            raise ValueError(f"pflash scorer must be one of {SCORERS}, got {self.scorer!r}")


@dataclass(frozen=True)
class Selection:
    """The prompt tokens the target prefills, in prompt order."""

    kept_ids: torch.Tensor  # [n] int64
    kept_positions: torch.Tensor  # [n] int64: original positions, or 0..n-1 when renumbered
    kept_index: torch.Tensor  # [n] int64: where the kept tokens sit in the prompt
    total: int  # prompt tokens before selection
    drafter_s: float  # drafter prefill + scoring + selection, 0 when the prompt was kept whole

    @property
    def kept(self) -> int:
        return self.kept_ids.shape[0]


def check_keep_ratio(keep_ratio: float) -> None:
    if not 0.0 < keep_ratio <= 1.0:
        raise ConfigError(f"pflash keep ratio must be in (0, 1], got {keep_ratio}")


def n_kept_chunks(n_chunks: int, keep_ratio: float) -> int:
    """ceil(n_chunks * keep_ratio), read through float noise (0.07 * 100 is 7, not 8)."""
    return max(1, min(n_chunks, math.ceil(round(n_chunks * keep_ratio, 9))))


def select_chunks(scores: torch.Tensor, keep_ratio: float, *, head: int, tail: int) -> torch.Tensor:
    """Sorted indices [n_kept_chunks] of the chunks to keep, given chunk scores [n_chunks].

    The last ``tail`` and first ``head`` chunks come first (the tail wins when they do not
    both fit: it holds the question); the rest go by score, ties to the earlier chunk.
    """
    n = scores.shape[0]
    n_keep = n_kept_chunks(n, keep_ratio)
    forced = torch.zeros(n, dtype=torch.bool, device=scores.device)
    n_tail = min(tail, n_keep)
    forced[n - n_tail:] = True
    forced[:min(head, n_keep - n_tail)] = True
    rest = n_keep - int(forced.sum())
    ranked = torch.argsort(scores.float().masked_fill(forced, float("-inf")), descending=True, stable=True)
    keep = forced.clone()
    keep[ranked[:rest]] = True
    return keep.nonzero().reshape(-1)


def chunk_tokens(chunks: torch.Tensor, chunk: int, total: int) -> torch.Tensor:
    """Sorted token indices covered by the sorted chunk indices ``chunks`` (the last chunk may be short)."""
    idx = (chunks[:, None] * chunk + torch.arange(chunk, device=chunks.device)[None, :]).reshape(-1)
    return idx[idx < total]


def token_scores_for(queries: list[torch.Tensor], keys: list[torch.Tensor], scorer: str) -> torch.Tensor:
    if scorer == "triton" or (scorer == "auto" and queries[0].is_cuda):
        from engine.pflash.score_triton import token_scores_triton  # Triton is only needed here

        return token_scores_triton(queries, keys)
    return token_scores(queries, keys)


def pflash_select(drafter: Drafter, ids: torch.Tensor, keep_ratio: float,
                  config: PFlashConfig = PFlashConfig()) -> Selection:
    """Score the prompt ``ids`` [T] with the drafter and keep the best chunks.

    Prompts of at most ``config.threshold`` tokens are kept whole without running the drafter.
    """
    check_keep_ratio(keep_ratio)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"the prompt must be a non-empty 1-D list of token ids, got shape {tuple(ids.shape)}")
    total = ids.shape[0]
    if total <= config.threshold:
        positions = torch.arange(total, device=ids.device)
        return Selection(kept_ids=ids, kept_positions=positions, kept_index=positions, total=total, drafter_s=0.0)

    _sync(drafter.device)
    t0 = time.perf_counter()
    queries, keys = drafter.lookahead(ids, min(config.n_lookahead, total))
    scores = smooth(token_scores_for(queries, keys, config.scorer), config.pool_kernel)
    chunks = select_chunks(chunk_means(scores, config.chunk), keep_ratio,
                           head=config.head_chunks, tail=config.tail_chunks)
    kept = chunk_tokens(chunks, config.chunk, total).to(ids.device)
    kept_ids = ids[kept]
    positions = torch.arange(kept.shape[0], device=ids.device) if config.renumber else kept
    _sync(drafter.device)
    return Selection(kept_ids=kept_ids, kept_positions=positions, kept_index=kept, total=total,
                     drafter_s=time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
