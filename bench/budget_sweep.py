"""Expert-budget sweep: decode tok/s, prefill tok/s and device memory at each budget.

    python bench/budget_sweep.py --model M.gguf [--points 0,10,25,50,75,100] [--decode 32]
        [--prefill 512] [--repeats 3] [--weights dense|quantized] [--cold-format dense|quantized]
        [--hot-format dense|quantized] [--cuda-graph] [--json out.json]

``--points`` are percentages of all routed experts' device bytes; the engine is loaded once
and re-placed in place between points (``Engine.set_expert_budget``), so the sweep also
reports how long each move took. Each figure is a median over ``--repeats`` after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import commit, machine, spread
from engine.engine import Engine
from engine.placement import min_nonzero_budget_mb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--points", default="0,10,25,50,75,100")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="dense", choices=("dense", "quantized"),
                    help="projection matrices dequantized at load, or kept as GGUF blocks")
    ap.add_argument("--cold-format", default="dense", choices=("dense", "quantized"),
                    help="cold experts on the CPU held dense or as GGUF blocks")
    ap.add_argument("--hot-format", default="dense", choices=("dense", "quantized"),
                    help="hot experts on the GPU held dense or as GGUF blocks (needs --cold-format quantized; "
                    "budgets then count quantized bytes)")
    ap.add_argument("--cold-device", default="cpu", choices=("cpu", "gpu"),
                    help="what computes the cold experts: CPU threads, or the GPU reading their pinned host copies")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="decode from a captured CUDA graph where the placement allows (every expert hot)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    eng = Engine.from_gguf(args.model, device=args.device, weights=args.weights, cold_format=args.cold_format,
                           hot_format=args.hot_format, cuda_graph=args.cuda_graph, cold_device=args.cold_device)
    cfg = eng.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab, (args.prefill,), generator=gen).tolist()
    short = prompt[:16]
    rows = []
    # all budgets are relative to the experts' device bytes, known once the tiers exist
    placement = eng.set_expert_budget(0)
    total_mb = (placement.hot_bytes + placement.cold_bytes) / 2**20
    floor_mb = min_nonzero_budget_mb(eng.hybrid.expert_bytes, cfg.n_expert_used)
    print(f"{args.model.name}: {cfg.n_layers} layers x {cfg.n_expert} experts, {total_mb:.0f} MB of experts "
          f"on the device when all are hot; smallest non-zero budget {floor_mb:.0f} MB", flush=True)
    for pct in [float(p) for p in args.points.split(",")]:
        budget = 0.0 if pct == 0 else max(total_mb * pct / 100, floor_mb)
        t0 = time.perf_counter()
        placement = eng.set_expert_budget(budget)
        move_s = time.perf_counter() - t0
        eng.generate(short, 4, ignore_eos=True)
        dec = [eng.generate(short, args.decode, ignore_eos=True) for _ in range(args.repeats)]
        pre = [eng.generate(prompt, 1, ignore_eos=True) for _ in range(args.repeats)]
        row = {
            "percent": pct, "budget_mb": budget, "move_s": move_s,
            "hot": placement.hot_count, "cold": placement.cold_count,
            "expected_cold_hit_rate": placement.expected_cold_hit_rate,
            "cold_hit_rate": statistics.median(g.timings.extra["cold_hit_rate"] for g in dec),
            "expert_vram_mb": dec[0].timings.extra["expert_vram_mb"],
            "decode_tok_s": spread([g.timings.decode_tok_s for g in dec]),
            "prefill_tok_s": spread([args.prefill / g.timings.prefill_s for g in pre]),
            "peak_mem_mb": max(g.timings.peak_mem_mb for g in dec + pre),
            "decode_path": dec[0].timings.extra.get("decode_path", "eager"),
        }
        rows.append(row)
        print(f"{pct:5.1f}% budget {budget:8.0f} MB  hot/cold {row['hot']:6d}/{row['cold']:6d}  "
              f"decode {row['decode_tok_s']['median']:8.2f} tok/s  prefill {row['prefill_tok_s']['median']:9.1f} tok/s  "
              f"peak {row['peak_mem_mb']:8.0f} MB  cold hits {row['cold_hit_rate']:.1%}  move {move_s:.1f} s",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "model": str(args.model), "weights": args.weights,
                                         "cold_format": args.cold_format, "hot_format": args.hot_format,
                                         "cold_device": args.cold_device, "cuda_graph": args.cuda_graph,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
