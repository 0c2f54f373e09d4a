"""Decode with part of the cold experts computed by CPU threads beside the bus (issue 9's half-cold row).

    python bench/cold_cpu_share.py --model /tmp/q35.gguf [--budget-mb 8640] [--shares 0,0.25,0.4,0.5]
                                   [--activations int8,float32] [--new-tokens 128] [--repeats 3] [--json out.json]

One engine (Q4_0 projections and experts, cold experts in pinned host memory read by the GPU, decoding
from the captured step); for each share, ``Engine.set_cold_cpu_share`` re-splits every layer's cold
experts between the bus and the threads, a warm-up generation captures the step, then ``--repeats``
generations of ``--new-tokens`` tokens are timed (median and spread of decode tok/s), for each of the
threads' activation widths (``--activations``: 8-bit rounding with integer products, or float32). Each
row's greedy tokens are compared with the first row's: float32 sums differ from the device's only in
rounding, 8-bit activations a little more, so they usually agree; a difference is reported, not hidden.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, machine, spread  # noqa: E402
from engine.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--budget-mb", type=float, default=8640.0, help="device MB for routed experts (8640: half at the 35B shapes)")
    ap.add_argument("--shares", default="0,0.25,0.4,0.5")
    ap.add_argument("--activations", default="int8", help="int8, float32 or both, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    t0 = time.perf_counter()
    eng = Engine.from_gguf(args.model, weights="quantized", cold_format="quantized", hot_format="quantized",
                           cold_device="gpu", expert_budget_mb=args.budget_mb, cuda_graph=True)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {eng.hybrid.placement.hot_count} hot / "
          f"{eng.hybrid.placement.cold_count} cold experts", flush=True)
    ids = eng.tokenizer.encode(args.prompt)
    rows, first = [], None
    acts = args.activations.split(",")
    runs = [(share, act) for share in shares if not share for act in acts[:1]]  # no threads: one row
    runs += [(share, act) for act in acts for share in shares if share]
    for share, act in runs:
        eng.set_cold_cpu_share(share, int8=act == "int8")
        warm = eng.generate(ids, 16, ignore_eos=True)
        rates, out = [], None
        for _ in range(args.repeats):
            out = eng.generate(ids, args.new_tokens, ignore_eos=True)
            rates.append(out.timings.decode_tok_s)
        first = first if first is not None else out.ids
        same = out.ids == first
        row = {"share": share, "activations": act if share else None, "decode_tok_s": spread(rates), "runs": rates,
               "same_tokens_as_first": same,
               "cpu_jobs": eng.hybrid._host_share.jobs if eng.hybrid._host_share else 0,
               "cold_hit_rate": out.timings.extra.get("cold_hit_rate"), "peak_mem_mb": out.timings.peak_mem_mb,
               "decode_path": out.timings.extra.get("decode_path"), "warm_up_path": warm.timings.extra.get("decode_path")}
        rows.append(row)
        print(f"share {share:.2f} {act if share else '':7s}: decode {statistics.median(rates):7.1f} tok/s "
              f"[{min(rates):.1f}-{max(rates):.1f}] ({row['decode_path']}), same tokens as the first row: {same}, "
              f"peak {out.timings.peak_mem_mb:,.0f} MB, CPU jobs so far {row['cpu_jobs']:,}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "model": str(args.model),
                                         "budget_mb": args.budget_mb, "new_tokens": args.new_tokens,
                                         "threads": eng.hybrid._host_share.threads if eng.hybrid._host_share else 0,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
