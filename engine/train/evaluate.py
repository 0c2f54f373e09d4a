"""Held-out measures of a trained model: loss, a unigram baseline on the same tokens, routing skew."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    counts: tuple[int, ...]  # routed (token, slot) assignments per expert

    @property
    def top_quarter_share(self) -> float:
        """Share of routed assignments taken by the busiest quarter of the experts (uniform: 0.25)."""
        ranked = sorted(self.counts, reverse=True)
        total = sum(ranked)
        return sum(ranked[:max(1, len(ranked) // 4)]) / total if total else 0.0

    @property
    def unused_experts(self) -> int:
        return sum(1 for c in self.counts if c == 0)

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "top_quarter_share": round(self.top_quarter_share, 4),
                "unused_experts": self.unused_experts, "counts": list(self.counts)}


@dataclass(frozen=True)
class HeldOut:
    tokens: int
    loss: float  # nats/token
    unigram_loss: float  # nats/token of a unigram model fitted on the training tokens
    unigram_entropy: float  # nats/token of the held-out tokens' own unigram distribution
    routing: tuple[LayerRouting, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["routing"] = [r.as_dict() for r in self.routing]
        d["perplexity"] = math.exp(self.loss)
        return d


def unigram_log_probs(train_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] float64 log-probabilities from token counts, add-one smoothed."""
    counts = torch.bincount(train_ids.long(), minlength=vocab)[:vocab].double() + 1.0
    return counts.log() - counts.sum().log()


def unigram_entropy(targets: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(targets.long().flatten(), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, *, unigram: torch.Tensor, device: torch.device,
             batch_rows: int, autocast: bool) -> HeldOut:
    """Next-token loss of ``model`` over ``rows`` [n, L + 1] and the routing of every position.

    The unigram baseline scores exactly the targets the model scored.
    """
    model.eval()
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.int64, device=device)
    total_nll = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, len(rows), batch_rows):
        chunk = rows[i:i + batch_rows].to(device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=inputs, output_router_logits=True, use_cache=False)
        total_nll += F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(),
                                     reduction="sum").double()
        for layer, logits in enumerate(out.router_logits):
            top = logits.float().topk(cfg.num_experts_per_tok, dim=-1).indices
            counts[layer] += torch.bincount(top.flatten(), minlength=cfg.num_experts)
    model.train()
    targets = rows[:, 1:]
    n = targets.numel()
    routing = tuple(LayerRouting(layer, tuple(int(c) for c in row)) for layer, row in enumerate(counts.cpu()))
    return HeldOut(tokens=n, loss=float(total_nll) / n,
                   unigram_loss=float(-unigram[targets.long()].sum()) / n,
                   unigram_entropy=unigram_entropy(targets, len(unigram)), routing=routing)


@dataclass(frozen=True)
class RetrievalScore:
    """Held-out retrieval: loss over the answer tokens and greedy exact match, by context length."""

    cases: int
    answer_loss: float  # nats/token over answer tokens
    exact_match: float  # share of cases whose every answer token is the argmax (greedy decoding's answer)
    by_length: tuple[tuple[int, int, float], ...]  # (context tokens up to, cases, exact match)

    def as_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "answer_loss": self.answer_loss, "exact_match": self.exact_match,
                "by_length": [{"up_to_tokens": e, "cases": n, "exact_match": m} for e, n, m in self.by_length]}


@torch.no_grad()
def evaluate_retrieval(model, cases, *, device: torch.device, autocast: bool, max_len: int,
                       edges: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)) -> RetrievalScore | None:
    """Score the cases (``engine.train.data.RetrievalCase``) no longer than ``max_len`` tokens.

    With the answer fed in (teacher forcing), all answer tokens being the argmax is exactly
    the condition for greedy decoding to write the answer.
    """
    fitting = [c for c in cases if len(c.ids) <= max_len]
    if not fitting:
        return None
    model.eval()
    nll, n_tokens, hits = 0.0, 0, []
    for case in fitting:
        ids = torch.tensor(case.ids, dtype=torch.long, device=device)[None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0].float()
        span = logits[case.answer_start - 1:]  # predictions of the answer tokens
        target = ids[0, case.answer_start:]
        nll += float(F.cross_entropy(span, target, reduction="sum"))
        n_tokens += len(target)
        hits.append(bool((span.argmax(-1) == target).all()))
    model.train()
    by_length = []
    lower = 0
    for edge in edges:
        chosen = [h for c, h in zip(fitting, hits) if lower < len(c.ids) <= edge]
        if chosen:
            by_length.append((edge, len(chosen), sum(chosen) / len(chosen)))
        lower = edge
    return RetrievalScore(cases=len(fitting), answer_loss=nll / n_tokens, exact_match=sum(hits) / len(hits),
                          by_length=tuple(by_length))
