"""How much of a decode step's routing the step before already had, per layer: the share of a step's
experts that the previous step routed to, and the hit rate of a per-layer LRU cache of recently routed
experts, for greedy decoding and for random tokens fed to each step (as llama-bench feeds them).

    python bench/routing_reuse.py --model M.gguf [--new-tokens 32] [--feeds greedy,random] [--json out.json]

Runs on any device (the CPU with a file cut to fewer layers: ``luce-tune make-model --preset
qwen3.6-35b-a3b --layers 20 --quant q4_0``, experts kept in their blocks). A random-weight model's greedy
output can repeat one token, whose routing then repeats every step: benchmarks timing decode that way let
caches (the host's for a CPU share of the experts, any cache of recently used experts) hold what a real
workload's varied tokens would not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, machine  # noqa: E402
from engine.engine import Engine  # noqa: E402

CACHE_SIZES = (4, 8, 16, 32)


def reuse_of(steps: list[dict[int, list[int]]], n_layers: int) -> dict:
    """Mean over layers of the share of a step's experts the previous step had, and LRU hit rates."""
    shares = []
    for layer in range(n_layers):
        seq = [s[layer] for s in steps if layer in s]
        pairs = [len(set(a) & set(b)) / len(b) for a, b in zip(seq, seq[1:])]
        shares.append(sum(pairs) / max(1, len(pairs)))
    lru = {}
    for size in CACHE_SIZES:
        hits = total = 0
        for layer in range(n_layers):
            cache: OrderedDict[int, None] = OrderedDict()
            for s in steps:
                for e in s.get(layer, []):
                    total += 1
                    if e in cache:
                        hits += 1
                        cache.move_to_end(e)
                    else:
                        cache[e] = None
                        if len(cache) > size:
                            cache.popitem(last=False)
        lru[size] = hits / max(1, total)
    return {"previous_step_share": sum(shares) / n_layers, "min_layer": min(shares), "max_layer": max(shares),
            "lru_hit_rate": lru}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--feeds", default="greedy,random")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    eng = Engine.from_gguf(args.model, device=args.device, weights="quantized", cold_format="quantized",
                           expert_budget_mb=0)
    cfg = eng.config
    ids = eng.tokenizer.encode(args.prompt)
    gen = torch.Generator().manual_seed(0)
    out = {"machine": machine(), "commit": commit(), "model": str(args.model), "layers": cfg.n_layers,
           "experts": cfg.n_expert, "top_k": cfg.n_expert_used, "new_tokens": args.new_tokens, "feeds": {}}
    for feed in args.feeds.split(","):
        steps: list[dict[int, list[int]]] = []
        current: dict[int, list[int]] = {}

        def observe(layer: int, topk: torch.Tensor) -> None:
            if topk.shape[0] != 1:  # the prompt's prefill
                return
            current[layer] = topk.reshape(-1).tolist()
            if layer == cfg.n_layers - 1:
                steps.append(dict(current))
                current.clear()

        tokens = (torch.randint(0, cfg.vocab, (args.new_tokens,), generator=gen).tolist()
                  if feed == "random" else None)
        eng.model.set_routing_observer(observe)
        try:
            g = eng.generate(ids, args.new_tokens, ignore_eos=True, feed=tokens)
        finally:
            eng.model.set_routing_observer(None)
        r = reuse_of(steps, cfg.n_layers) | {"distinct_tokens": len(set(g.ids)), "steps": len(steps)}
        out["feeds"][feed] = r
        print(f"{feed:6s}: {r['distinct_tokens']} distinct tokens in {len(g.ids)}; a step's experts that the step "
              f"before had: {r['previous_step_share']:.3f} (layers {r['min_layer']:.3f}-{r['max_layer']:.3f}; "
              f"random routing {cfg.n_expert_used / cfg.n_expert:.3f}); LRU hit rate "
              + ", ".join(f"{n} a layer {h:.3f}" for n, h in r["lru_hit_rate"].items()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
