"""The rows a draft-training step learns from, with the frozen target's features and labels.

Corpus rows are fresh windows every step, each sent through the target once. Distilled rows
are the target's own greedy continuations (``engine.dflash.distill``): a fixed set, drawn
epoch by epoch, whose target passes are kept after the first, so once every sequence has
been seen a step costs only the draft. A step's rows share one length and go through the
target together (``Qwen35MoE.forward_rows``), not one forward per row. Anchors of distilled
rows lie in the generated part, where each block's labels are what the target itself goes on
to generate.
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
    return _features_labels(model, ids, out.final_hidden, out.hidden, layer_ids, labels)


PASS_TOKENS = 8192  # tokens per batched target pass (rows of one length, ``target_passes``)


@torch.inference_mode()
def target_passes(model: Qwen35MoE, ids: torch.Tensor, layer_ids: tuple[int, ...],
                  labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_pass`` of every row of ``ids`` [R, L], as few target forwards as ``PASS_TOKENS``
    allows (``Qwen35MoE.forward_rows``): features [R, L, n_features * hidden], labels [R, L]."""
    per = max(1, PASS_TOKENS // ids.shape[1])
    features, labels_out = [], []
    for r in range(0, ids.shape[0], per):
        part = ids[r:r + per]
        final, hidden = model.forward_rows(part, capture_layers=layer_ids)
        f, lab = _features_labels(model, part.reshape(-1), final.reshape(-1, final.shape[-1]),
                                  {i: t.reshape(-1, t.shape[-1]) for i, t in hidden.items()}, layer_ids, labels,
                                  rows=part.shape[0])
        features.append(f.view(*part.shape, -1))
        labels_out.append(lab.view(part.shape))
    return torch.cat(features), torch.cat(labels_out)


def _features_labels(model: Qwen35MoE, ids: torch.Tensor, final: torch.Tensor, hidden: dict[int, torch.Tensor],
                     layer_ids: tuple[int, ...], labels: str, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels of ``rows`` rows of equal length laid end to end (ids [rows * L])."""
    features = torch.cat([hidden[i] for i in layer_ids], dim=-1)
    if labels == "corpus":
        return features, ids
    chunk = 1024  # the logits of 1024 positions at a time: [1024, vocab] float32
    choice = torch.cat([linear(final[r:r + chunk], model.weights.output).argmax(-1)
                        for r in range(0, ids.shape[0], chunk)]).view(rows, -1)
    by_row = ids.view(rows, -1)
    return features, torch.cat([by_row[:, :1], choice[:, :-1]], dim=1).reshape(-1)


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
        features, labels = target_passes(self.model, ids, self.layer_ids, self.labels)
        return Rows(ids, features.clone(), labels.clone(), 1)  # clones leave inference mode, so autograd may save them


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
        new = index[~self.done[index]].unique()
        if new.numel():  # the sequences drawn for the first time, in batched target passes
            at = new.to(self.model.device)
            features, labels = target_passes(self.model, self.sequences[at], self.layer_ids, self.labels)
            with torch.no_grad():
                self.features[at] = features
                self.labels_of[at] = labels
            if self.labels == "target":
                for row, ids in zip(labels, self.sequences[at]):
                    same, total = agreement(row, ids, self.prompt_len)
                    self.agree, self.compared = self.agree + same, self.compared + total
            self.done[new] = True
        at = index.to(self.model.device)
        return Rows(self.sequences[at], self.features[at], self.labels_of[at], self.prompt_len)
