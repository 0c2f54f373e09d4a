"""Blocks proposed by copying the committed text (prompt lookup), beside the DFlash draft's.

Greedy continuations of the trained targets repeat themselves: about half the tokens of issue 4's
long-form continuations sit in a stretch whose last 16 tokens equal the 16 a period before, and
there the token a period back is right about 98% of the time, while the draft rarely copies a
period longer than 16 tokens (``docs/benchmarks.md``, sixteenth round). ``lookup_block`` finds the
latest earlier occurrence of the last ``min_match`` committed tokens and proposes what followed
it, repeating the period when the copy reaches the present. Verification is unchanged, so the
output stays the target's own.

Everything is a fixed-shape tensor operation on the device (no host read of the match), so the
device loop's captured draft step can carry it.
"""

from __future__ import annotations

import torch

MAX_MIN_MATCH = 16


def check_min_match(value: int) -> None:
    if not 0 <= value <= MAX_MIN_MATCH:
        raise ValueError(f"the lookup's match length must be 0 (off) .. {MAX_MIN_MATCH}, got {value}")


def lookup_block(history: torch.Tensor, length: torch.Tensor | int, min_match: int,
                 n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(found, tokens): ``n`` ids copied after the latest earlier match of the committed text's end.

    ``history[:length]`` holds the committed ids (the last one opens the next block); entries past
    ``length`` are ignored. A match is a position ``j < length - 1`` whose ``min_match`` ids ending
    at ``j`` equal the last ``min_match`` committed ones; the latest is taken, its period is
    ``p = length - 1 - j``, and ``tokens[i] = history[j + 1 + i % p]``. ``found`` is a bool
    scalar tensor; without a match ``tokens`` is meaningless.
    """
    if min_match < 1:
        raise ValueError(f"min_match must be at least 1, got {min_match}")
    size, dev = history.shape[0], history.device
    length = torch.as_tensor(length, dtype=torch.long, device=dev)
    idx = torch.arange(size, device=dev)
    match = (idx >= min_match - 1) & (idx <= length - 2)
    for m in range(min_match):
        last = history.gather(0, (length - 1 - m).clamp(min=0).view(1))
        match &= history.gather(0, (idx - m).clamp(min=0)) == last
    j = torch.where(match, idx, torch.full_like(idx, -1)).amax()
    period = (length - 1 - j).clamp(min=1)
    src = (j + 1 + torch.arange(n, device=dev) % period).clamp(0, size - 1)
    return j >= 0, history.gather(0, src)


def merge_lookup(drafted: torch.Tensor, history: torch.Tensor, length: torch.Tensor | int,
                 min_match: int) -> torch.Tensor:
    """The lookup's block where the committed text's end occurred before, else ``drafted`` (a new tensor)."""
    found, tokens = lookup_block(history, length, min_match, drafted.shape[0])
    return torch.where(found, tokens, drafted)
