"""How well a layer's routing is predicted at the layer's start, before its mixer has run: the measure behind
fetching and warming cold experts ahead of the router (``HybridExperts.set_cold_prefetch``).

    python bench/route_prediction.py --model /tmp/q35.gguf [--tokens 32] [--cold 0.5] [--text FILE] [--ahead [N]]
                                     [--json out.json]

The model runs one forward over ``--tokens`` tokens (random ids, as llama-bench feeds them, or the start of
``--text`` through the model's tokenizer) on the CPU, its projections in their GGUF blocks and its routed
experts read from the file as the tokens route to them (``BlockExperts``: a 35B file needs no more memory
than its other weights). At each layer's start
the executor's ``begin_layer`` hook sees the mixer's input x; the prediction is the top-k of the router over
``x * post / attn`` (``HybridExperts.set_predictors``), and the truth is the routing the layer then takes; with
``--ahead`` each layer but the first is predicted a layer earlier, from the layer before's mixer input (its
``attn`` under this layer's ``post``), as ``HybridExperts.set_cold_prefetch(ahead=True)`` does; ``--ahead N``
N layers earlier, from the mixer input of the layer N before (the first N layers at their own start).
Each layer gets a cold set of ``--cold`` of its experts (seeded, as a placement with uniform routing counts
would leave them). Reported per layer and overall:

- ``overlap``: the share of the routed experts that the prediction names;
- ``hit[m]``: of the first m cold experts the prediction names (those the bus and the threads fetch ahead),
  the share that the token then routes to;
- ``distinct``: how many experts the tokens route to in the layer, together (k where every token routes
  alike: a random-weight file's deep layers do, so that any prediction is right there);
- ``previous``: the share of each token's routed experts (the first excepted) that the token before it routed to in
  the same layer: how often the CPU share's warm-ups ahead of their warm-up, which fetch what the layer's last
  warm-up named (``engine/kernels/host_experts.c``, ``LT_SPEC``), fetch an expert the token then uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, machine  # noqa: E402

MAX_FETCH = 4


def cold_hits(predicted: torch.Tensor, actual: torch.Tensor, cold: torch.Tensor, m: int) -> tuple[int, int]:
    """(hits, picks): of the first ``m`` cold experts (``cold`` bool [E]) of each row of ``predicted`` [T, k]
    (most likely first), how many the same row of ``actual`` [T, k] routes to, and how many were picked."""
    hits = picks = 0
    for pred, act in zip(predicted.tolist(), actual.tolist()):
        chosen = [e for e in pred if cold[e]][:m]
        picks += len(chosen)
        hits += len(set(chosen) & set(act))
    return hits, picks


class BlockExperts:
    """An expert executor that dequantizes each routed expert from the file's blocks when a call needs it
    (``raw_experts``): slow, and light on memory."""

    def __init__(self, raw: list[tuple[Any, Any, Any]]):
        self.raw = raw

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        from engine.gguf.quants import dequantize

        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
            gate, up, down = (dequantize(m.data[e], m.qtype, (m.rows, m.cols)) for m in self.raw[layer_idx])
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            xs = x[tok].float()
            h = torch.nn.functional.silu(xs @ gate.T) * (xs @ up.T)
            out.index_add_(0, tok, (h @ down.T) * topk_w[tok, slot, None].float())
        return out.to(x.dtype)


class RecordingExecutor:
    """Wraps a model's expert executor: predicts each layer's routing at its start and records it beside
    the routing the layer takes (``run_layers``' ``begin_layer`` hook, then the executor's call)."""

    def __init__(self, inner: Any, predictors: list[tuple[torch.Tensor, torch.Tensor]], k: int,
                 ahead: list[Any] | None = None):
        self.inner, self.predictors, self.k, self.ahead = inner, predictors, k, ahead
        self.predicted: dict[int, torch.Tensor] = {}
        self.actual: dict[int, torch.Tensor] = {}

    def begin_layer(self, layer_idx: int, x: torch.Tensor) -> None:
        by = 0 if self.ahead is None else sum(p is None for p in self.ahead)  # layers ahead
        if layer_idx < by or self.ahead is None:  # no layer that far before it
            self.predicted[layer_idx] = self._top(self.predictors[layer_idx], x)
        if self.ahead is not None and layer_idx + by < len(self.ahead):  # that layer, from this one's input
            self.predicted[layer_idx + by] = self._top(self.ahead[layer_idx + by], x)

    def _top(self, predictor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ predictor.to(x.device).T).topk(self.k, dim=-1).indices.cpu()

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        self.actual[layer_idx] = topk_ids.cpu()
        return self.inner(layer_idx, x, topk_ids, topk_w)


def measure(model: Any, predictors: list[torch.Tensor], ids: torch.Tensor, cold_share: float,
            seed: int = 0, ahead: list[Any] | None = None) -> dict[str, Any]:
    """One forward of ``model`` (a ``Qwen35MoE``) over ``ids`` with its routing recorded; the table. With
    ``ahead`` (a predictor a layer from the mixer input of the layer N before, None for the first N) every layer
    but the first N is predicted at the start of the layer N before."""
    cfg = model.cfg
    inner = model.executor
    rec = RecordingExecutor(inner, predictors, cfg.n_expert_used, ahead)
    model.set_expert_executor(rec)
    try:
        model.forward(ids, model.new_state(len(ids)), logits="none")
    finally:
        model.set_expert_executor(inner)
    g = torch.Generator().manual_seed(seed)
    layers, totals = [], {"routed": 0, "named": 0, "hits": [0] * MAX_FETCH, "picks": [0] * MAX_FETCH, "again": 0,
                          "later": 0}
    for i in range(cfg.n_layers):
        pred, act = rec.predicted[i], rec.actual[i]
        cold = torch.zeros(cfg.n_expert, dtype=torch.bool)
        cold[torch.randperm(cfg.n_expert, generator=g)[:round(cold_share * cfg.n_expert)]] = True
        named = sum(len(set(p) & set(a)) for p, a in zip(pred.tolist(), act.tolist()))
        rows = act.tolist()
        again = sum(len(set(a) & set(b)) for a, b in zip(rows, rows[1:]))
        row = {"layer": i, "overlap": named / act.numel(), "hit": [], "distinct": len(set(act.reshape(-1).tolist())),
               "previous": again / (act.numel() - act.shape[1]) if act.shape[0] > 1 else None}
        totals["again"] += again
        totals["later"] += act.numel() - act.shape[1]
        totals["routed"] += act.numel()
        totals["named"] += named
        for m in range(1, MAX_FETCH + 1):
            hits, picks = cold_hits(pred, act, cold, m)
            row["hit"].append(hits / picks if picks else None)
            totals["hits"][m - 1] += hits
            totals["picks"][m - 1] += picks
        layers.append(row)
    overall = {"overlap": totals["named"] / totals["routed"],
               "distinct": sum(r["distinct"] for r in layers) / len(layers),
               "hit": [h / p if p else None for h, p in zip(totals["hits"], totals["picks"])],
               "previous": totals["again"] / totals["later"] if totals["later"] else None}
    return {"layers": layers, "overall": overall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cold", type=float, default=0.5, help="share of each layer's experts taken as cold")
    ap.add_argument("--text", type=Path, default=None, help="tokens from the start of this file (default: random)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ahead", type=int, nargs="?", const=1, default=0, help="predict each layer at the start of "
                    "the layer this many before (1 without a number: HybridExperts.set_cold_prefetch(ahead=True)) "
                    "rather than at its own")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.tokens < 1 or not 0 < args.cold <= 1 or args.ahead < 0:
        ap.error("--tokens must be at least 1, --cold in (0, 1] and --ahead at least 0")
    from engine.gguf.reader import GGUFFile
    from engine.hybrid import ahead_predictors, routing_predictor
    from engine.model.qwen35moe import Qwen35MoE
    from engine.model.weights import raw_experts
    from engine.tokenizer import Tokenizer

    gguf = GGUFFile(args.model)
    model = Qwen35MoE.from_gguf(gguf, device="cpu", dtype=torch.float32, quantized=True, expert_device="meta")
    cfg = model.cfg
    model.set_expert_executor(BlockExperts(raw_experts(gguf, cfg)))
    layers = model.weights.layers
    norms = [(layer.moe.router, layer.attn_norm, layer.post_norm) for layer in layers]
    predictors = [routing_predictor(*layer, device="cpu") for layer in norms]
    ahead = ahead_predictors(norms, device="cpu", by=args.ahead) if args.ahead else None
    if args.text is not None:
        ids = Tokenizer.from_gguf(args.model).encode(args.text.read_text(errors="replace"))[:args.tokens]
    else:
        ids = torch.randint(0, cfg.vocab, (args.tokens,), generator=torch.Generator().manual_seed(args.seed))
    ids = torch.as_tensor(ids, dtype=torch.long)
    table = measure(model, predictors, ids, args.cold, args.seed, ahead)
    print(f"{args.model.name}: {len(ids)} tokens ({'text' if args.text else 'random'}), "
          f"{f'{args.ahead} layer(s) ahead' if args.ahead else 'at the layer start'}, "
          f"{round(args.cold * cfg.n_expert)} of {cfg.n_expert} experts cold a layer")
    print(f"{'layer':>5} {'overlap':>8} " + " ".join(f"{f'hit[{m}]':>7}" for m in range(1, MAX_FETCH + 1))
          + f" {'distinct':>9} {'previous':>8}")
    fmt = lambda v: f"{v:7.3f}" if v is not None else f"{'-':>7}"  # noqa: E731
    for row in table["layers"]:
        print(f"{row['layer']:5d} {row['overlap']:8.3f} " + " ".join(fmt(v) for v in row["hit"])
              + f" {row['distinct']:9d} {fmt(row['previous']):>8}")
    o = table["overall"]
    print(f"{'all':>5} {o['overlap']:8.3f} " + " ".join(fmt(v) for v in o["hit"]) + f" {o['distinct']:9.1f}"
          f" {fmt(o['previous']):>8}")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "model": str(args.model),
                                         "tokens": len(ids), "text": str(args.text) if args.text else None,
                                         "cold": args.cold, "ahead": args.ahead, **table}, indent=1))


if __name__ == "__main__":
    main()
