"""Token streams and the seeded batches a training step draws from them.

Documents are packed into one stream; a training row is a window of ``seq_len + 1`` tokens
(inputs and next-token targets). Rows that must see a whole example, such as a retrieval
example whose answer sits thousands of tokens after its fact, start at an example's first
token. Each step's batch depends only on (seed, step), so a resumed run sees the batches it
would have seen without the interruption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True)
class TokenStream:
    """Documents packed end to end: ``ids`` [n] int32, ``starts`` [n_docs] int64 offsets."""

    ids: torch.Tensor
    starts: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.starts.dim() != 1:
            raise ValueError(f"token stream needs 1-D ids and starts, got {tuple(self.ids.shape)} "
                             f"and {tuple(self.starts.shape)}")
        if len(self.starts) and (int(self.starts[0]) != 0 or int(self.starts[-1]) >= len(self.ids)):
            raise ValueError("token stream document starts must begin at 0 and lie inside the stream")

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int]], *, separator: int | None = None) -> "TokenStream":
        """Pack token lists, each followed by ``separator`` when one is given; empty ones are dropped."""
        chunks, starts, offset = [], [], 0
        for doc in docs:
            if not len(doc):
                continue
            t = torch.as_tensor(list(doc) + ([] if separator is None else [separator]), dtype=torch.int32)
            starts.append(offset)
            chunks.append(t)
            offset += len(t)
        ids = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32)
        return cls(ids=ids, starts=torch.tensor(starts, dtype=torch.int64))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_docs(self) -> int:
        return len(self.starts)

    @property
    def lengths(self) -> torch.Tensor:
        """[n_docs] int64 tokens per document, its separator included."""
        ends = torch.cat([self.starts[1:], torch.tensor([len(self.ids)], dtype=torch.int64)])
        return ends - self.starts

    def windows(self, offsets: torch.Tensor, length: int) -> torch.Tensor:
        """Rows ``ids[o : o + length]`` [len(offsets), length] int64; rows past the end wrap around."""
        index = (offsets[:, None] + torch.arange(length)[None, :]) % len(self.ids)
        return self.ids[index].long()


@dataclass(frozen=True)
class Curriculum:
    """Sequence length by training progress: ``short_len`` first, ``long_len`` for the last ``long_fraction``."""

    short_len: int = 512
    long_len: int = 4096
    long_fraction: float = 0.3

    def __post_init__(self) -> None:
        if not 0 < self.short_len <= self.long_len:
            raise ValueError(f"curriculum lengths must satisfy 0 < short {self.short_len} <= long {self.long_len}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must lie in [0, 1], got {self.long_fraction}")

    def seq_len(self, step: int, total_steps: int) -> int:
        return self.long_len if step >= round((1.0 - self.long_fraction) * total_steps) else self.short_len


@dataclass(frozen=True)
class BatchSampler:
    """Draws the batch of one step: ``batch_tokens // seq_len`` rows, part of them from examples.

    Example rows start at an example that fits the row whole, so no row asks for a fact that
    was cut off; when none fits, every row is plain text.
    """

    stream: TokenStream
    examples: TokenStream | None
    batch_tokens: int
    example_share: float
    seed: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.example_share <= 1.0:
            raise ValueError(f"example_share must lie in [0, 1], got {self.example_share}")
        if len(self.stream) < 2:
            raise ValueError(f"the training stream holds {len(self.stream)} tokens, too few to train on")

    def rows(self, seq_len: int) -> int:
        return max(1, self.batch_tokens // seq_len)

    def batch(self, step: int, seq_len: int) -> torch.Tensor:
        """[rows, seq_len + 1] int64 token ids for ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = self.rows(seq_len)
        fitting = self._fitting(seq_len + 1)
        n_examples = int(round(rows * self.example_share)) if len(fitting) else 0
        parts = [self.stream.windows(torch.randint(0, len(self.stream), (rows - n_examples,), generator=gen),
                                     seq_len + 1)]
        if n_examples:
            pick = fitting[torch.randint(0, len(fitting), (n_examples,), generator=gen)]
            parts.append(self.examples.windows(self.examples.starts[pick], seq_len + 1))
        return torch.cat(parts)

    def _fitting(self, length: int) -> torch.Tensor:
        if self.examples is None or not self.examples.n_docs:
            return torch.zeros(0, dtype=torch.int64)
        return (self.examples.lengths <= length).nonzero().flatten()


def eval_windows(stream: TokenStream, length: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping rows of ``length + 1`` tokens from the start of ``stream``, up to ``max_tokens`` targets."""
    n = min((len(stream) - 1) // length, max(1, max_tokens // length))
    if n < 1:
        raise ValueError(f"the held-out stream holds {len(stream)} tokens, fewer than one window of {length + 1}")
    offsets = torch.arange(n, dtype=torch.int64) * length
    return stream.windows(offsets, length + 1)
