"""Where one decode step's time goes: torch.profiler over a few decode steps of one model.

    python bench/profile_decode.py --model M.gguf [--steps 8] [--weights dense|quantized]
        [--budget-mb MB] [--trace out.json] [--rows 30]

Prints the wall time per step (median of ``--steps`` after a warm-up), then the operators
sorted by device time and by host time, so that launch-bound and kernel-bound steps read
differently. ``--trace`` writes a Chrome trace for a closer look.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--weights", default="dense", choices=("dense", "quantized"))
    ap.add_argument("--budget-mb", type=float, default=None, help="expert budget (default: every expert on the GPU)")
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()

    eng = Engine.from_gguf(args.model, weights=args.weights, expert_budget_mb=args.budget_mb)
    model, device = eng.model, eng.device
    state = model.new_state(64 + 3 * args.steps)
    prompt = torch.arange(16, device=device) % eng.config.vocab
    token = model.forward(prompt, state, logits="last").logits[-1].argmax().reshape(1)

    def step(tok: torch.Tensor) -> torch.Tensor:
        return model.forward(tok, state, logits="last").logits[-1].argmax().reshape(1)

    for _ in range(args.steps):  # warm-up: kernels compiled, caches filled
        token = step(token)
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        token = step(token)
        int(token)
        walls.append(time.perf_counter() - t0)
    print(f"decode step: median {statistics.median(walls) * 1e3:.2f} ms (min {min(walls) * 1e3:.2f}, "
          f"max {max(walls) * 1e3:.2f}) -> {1 / statistics.median(walls):.1f} tok/s", flush=True)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            token = step(token)
            int(token)
    events = prof.key_averages()
    if device.type == "cuda":
        print(f"\nby device time ({args.steps} steps)")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    print(f"\nby host time ({args.steps} steps)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
