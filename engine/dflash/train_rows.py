"""The rows a draft-training step learns from, with the frozen target's features and labels.

Corpus rows are fresh windows every step, each sent through the target once. Distilled rows
are the target's own greedy continuations (``engine.dflash.distill``): a fixed set, drawn
epoch by epoch, whose target passes are kept after the first, so once every sequence has
been seen a step costs only the draft. Anchors of distilled rows lie in the generated part,
where each block's labels are what the target itself goes on to generate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.dflash.distill import agreement
from engine.model.linear import linear
from engine.model.qwen35moe import Qwen35MoE
from engine.train.batches import BatchSampler


@torch.inference_mode()
def target_pass(model: Qwen35MoE, ids: torch.Tensor, layer_ids: tuple[int, ...],
                labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Context features [L, n_features * hidden] and labels [L] (the token expected at each position)."""
    out = model.forward(ids, model.new_state(ids.shape[0]), capture_layers=layer_ids, logits="none")
    features = torch.cat([out.hidden[i] for i in layer_ids], dim=-1)
    if labels == "corpus":
        return features, ids
    rows = 1024  # the logits of 1024 positions at a time: [1024, vocab] float32
    choice = torch.cat([linear(out.final_hidden[r:r + rows], model.weights.output).argmax(-1)
                        for r in range(0, ids.shape[0], rows)])
    return features, torch.cat([ids[:1], choice[:-1]])


@dataclass(frozen=True)
class Rows:
    ids: torch.Tensor  # [R, L] int64
    features: torch.Tensor  # [R, L, n_features * hidden]
    labels: torch.Tensor  # [R, L] int64
    first_anchor: int  # anchors are drawn from first_anchor .. L - 2


class CorpusRows:
    """``batch`` corpus windows of ``seq_len`` tokens per step (``BatchSampler``'s seeded draw)."""

    def __init__(self, model: Qwen35MoE, sampler: BatchSampler, seq_len: int, layer_ids: tuple[int, ...],
                 labels: str) -> None:
        self.model, self.sampler, self.seq_len = model, sampler, seq_len
        self.layer_ids, self.labels = layer_ids, labels

    def batch(self, step: int) -> Rows:
        ids = self.sampler.batch(step, self.seq_len - 1).to(self.model.device)
        passes = [target_pass(self.model, row, self.layer_ids, self.labels) for row in ids]
        # clones leave inference mode, so autograd may save them
        return Rows(ids, torch.stack([f for f, _ in passes]).clone(), torch.stack([l for _, l in passes]).clone(), 1)


class DistilledRows:
    """``batch`` of the distilled ``sequences`` [N, P + G] per step, every one once per epoch in a
    seeded order; each sequence's target pass runs when it is first drawn and is kept
    ([N, L, n_features * hidden] in the target's dtype on its device)."""

    def __init__(self, model: Qwen35MoE, sequences: torch.Tensor, prompt_len: int, layer_ids: tuple[int, ...],
                 labels: str, batch: int, seed: int) -> None:
        self.model, self.prompt_len, self.layer_ids, self.labels = model, prompt_len, layer_ids, labels
        self.rows, self.seed = batch, seed
        self.sequences = sequences.to(model.device)
        n, length = sequences.shape
        width = len(layer_ids) * model.cfg.hidden
        self.features = torch.zeros(n, length, width, dtype=model.dtype, device=model.device)
        self.labels_of = torch.zeros(n, length, dtype=torch.long, device=model.device)
        self.done = torch.zeros(n, dtype=torch.bool)
        self.agree = self.compared = 0

    @property
    def passes(self) -> int:
        """Target passes run so far."""
        return int(self.done.sum())

    @property
    def agreement(self) -> float:
        """Share of generated positions where the engine's greedy choice is the generated token."""
        return self.agree / self.compared if self.compared else float("nan")

    def indices(self, step: int) -> torch.Tensor:
        n = self.sequences.shape[0]
        flat = torch.arange(step * self.rows, (step + 1) * self.rows)
        out = torch.empty(self.rows, dtype=torch.long)
        for epoch in flat.div(n, rounding_mode="floor").unique().tolist():
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            here = flat // n == epoch
            out[here] = order[flat[here] % n]
        return out

    def batch(self, step: int) -> Rows:
        index = self.indices(step)
        for i in index[~self.done[index]].unique().tolist():
            ids = self.sequences[i]
            features, labels = target_pass(self.model, ids, self.layer_ids, self.labels)
            with torch.no_grad():
                self.features[i].copy_(features)
                self.labels_of[i].copy_(labels)
            if self.labels == "target":
                same, total = agreement(labels, ids, self.prompt_len)
                self.agree, self.compared = self.agree + same, self.compared + total
            self.done[i] = True
        at = index.to(self.model.device)
        return Rows(self.sequences[at], self.features[at], self.labels_of[at], self.prompt_len)
