"""Calibrated against uniform expert placement: measured cold-hit rate on held-out text.

    python bench/placement_calibration.py [--model models/luce-target.gguf] [--budgets 25,50]
        [--window 256] [--calibration-prompts 48] [--held-out-prompts 16] [--json out.json]

Routing statistics come from windows of the corpus's training split; the cold-hit rate
(routed token-expert pairs served by cold experts) is measured by the hybrid executor while
the model runs windows of the held-out split, at each budget (percent of all experts' bytes),
once with the calibrated hot set and once with the uniform one. Runs on the CPU (both tiers
in host memory, the real code paths).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from engine.engine import Engine
from engine.hybrid import attach_hybrid
from engine.placement import RoutingStats, calibrate_routing, min_nonzero_budget_mb
from engine.train.corpus import build_corpus


def windows(engine: Engine, path: Path, window: int, count: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(path.read_text(encoding="utf-8"))
    step = max(window, (len(ids) - window) // max(count, 1))
    return [ids[i:i + window] for i in range(0, len(ids) - window, step)][:count]


def measured_cold_hit_rate(engine: Engine, stats: RoutingStats, budget_mb: float,
                           prompts: list[list[int]]) -> tuple[float, float]:
    """(measured, expected) cold-hit rate of the placement ``stats`` gives at ``budget_mb``."""
    model = engine.model
    hybrid = attach_hybrid(model, budget_mb, stats, threads=1)
    try:
        hybrid.reset_counters()
        for p in prompts:
            model.forward(torch.tensor(p), model.new_state(len(p)), logits="none")
        snap = hybrid.stats_snapshot()
        return snap.cold_hit_rate, snap.expected_cold_hit_rate
    finally:
        hybrid.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/luce-target.gguf"))
    ap.add_argument("--budgets", default="25,50")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--calibration-prompts", type=int, default=48)
    ap.add_argument("--held-out-prompts", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_corpus(tmp, n_retrieval=0)
        rows = []
        with torch.inference_mode():
            eng = Engine.from_gguf(args.model, device="cpu")
            cfg = eng.config
            calib = calibrate_routing(eng.model, windows(eng, corpus.train, args.window, args.calibration_prompts))
            held = windows(eng, corpus.held_out, args.window, args.held_out_prompts)
            uniform = RoutingStats.uniform(cfg.n_layers, cfg.n_expert)
            per_expert = [sum(t[0].numel() * t.element_size() for t in (e.gate, e.up, e.down))
                          for e in (layer.moe.experts for layer in eng.model.weights.layers)]
            total_mb = sum(per_expert) * cfg.n_expert / 2**20
            floor = min_nonzero_budget_mb(per_expert, cfg.n_expert_used)
            for pct in [float(p) for p in args.budgets.split(",")]:
                budget = max(total_mb * pct / 100, floor)
                row = {"percent": pct, "budget_mb": budget}
                for name, stats in (("calibrated", calib), ("uniform", uniform)):
                    row[name], row[f"{name}_expected"] = measured_cold_hit_rate(eng, stats, budget, held)
                rows.append(row)
                print(f"{pct:4.0f}% of experts ({budget:6.2f} MB): held-out cold-hit rate calibrated "
                      f"{row['calibrated']:.1%} (expected {row['calibrated_expected']:.1%}), uniform "
                      f"{row['uniform']:.1%} (expected {row['uniform_expected']:.1%})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
