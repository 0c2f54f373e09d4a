"""Prefill with half the experts cold on the device's side of the bus: how a prompt's cold experts cross it.

    python bench/cold_prefill.py --model /tmp/q35.gguf [--budget-mb 8640] [--tokens 512,2048,8192]
                                 [--repeats 3] [--json out.json]

One engine (Q4_0 projections and experts, cold experts in pinned host memory read by the GPU). For each
setting, each prompt length is prefilled once to warm up, then ``--repeats`` times, timed (median and
spread of prefill tok/s):

- ``runs``: ``LUCE_TUNE_COLD_GATHER=0``, each layer's cold experts copied in runs of consecutive experts,
  one copy and two expert launches a run (as before the groups);
- ``groups``: ``LUCE_TUNE_COLD_PREFETCH=0``, one gather launch per group of ``STREAM_EXPERTS`` cold experts,
  the next group's gather on a second stream while a group is computed;
- ``groups+prefetch``: as ``groups``, and each layer's last gather fetches the next cold layer's first group;
- ``captured``: the default setting through the captured padded prefill (lengths up to its largest bucket),
  as ``bench/vs_llamacpp.py`` times ours.

The eager rows switch the captured prefill off, so that the settings (read at each call) apply in one
process. Each row's first sampled token is compared with the first row's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, machine, spread  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.hybrid import COLD_GATHER_ENV, COLD_PREFETCH_ENV  # noqa: E402

SETTINGS = {"runs": {COLD_GATHER_ENV: "0", COLD_PREFETCH_ENV: "1"},
            "groups": {COLD_GATHER_ENV: "1", COLD_PREFETCH_ENV: "0"},
            "groups+prefetch": {COLD_GATHER_ENV: "1", COLD_PREFETCH_ENV: "1"},
            "captured": {COLD_GATHER_ENV: "1", COLD_PREFETCH_ENV: "1"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--budget-mb", type=float, default=8640.0,
                    help="device MB for routed experts (8640: half at the 35B shapes)")
    ap.add_argument("--tokens", default="512,2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    t0 = time.perf_counter()
    eng = Engine.from_gguf(args.model, weights="quantized", cold_format="quantized", hot_format="quantized",
                           cold_device="gpu", expert_budget_mb=args.budget_mb, cuda_graph=True)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {eng.hybrid.placement.hot_count} hot / "
          f"{eng.hybrid.placement.cold_count} cold experts", flush=True)
    from engine.model.prefill_graph import BUCKETS

    rows, first = [], {}
    for name in settings:
        os.environ.update(SETTINGS[name])
        eng.prefill_graph = name == "captured"
        for n in lengths:
            if name == "captured" and n > BUCKETS[-1]:
                continue
            ids = [(i * 7919) % (eng.config.vocab - 1) + 1 for i in range(n)]
            warm = [eng.generate(ids, 1, ignore_eos=True) for _ in range(3 if name == "captured" else 1)]
            outs = [eng.generate(ids, 1, ignore_eos=True) for _ in range(args.repeats)]
            rates = [n / o.timings.prefill_s for o in outs]
            token = outs[-1].ids[-1]
            first.setdefault(n, token)
            row = {"setting": name, "tokens": n, "prefill_tok_s": spread(rates), "runs": rates,
                   "prefill_path": outs[-1].timings.extra.get("prefill_path"),
                   "warm_up_path": warm[0].timings.extra.get("prefill_path"),
                   "same_token_as_first": token == first[n], "peak_mem_mb": outs[-1].timings.peak_mem_mb}
            rows.append(row)
            print(f"{name:16s} {n:6d} tokens: prefill {statistics.median(rates):9,.1f} tok/s "
                  f"[{min(rates):,.1f}-{max(rates):,.1f}] ({row['prefill_path']}), same token as the first "
                  f"setting: {row['same_token_as_first']}, peak {row['peak_mem_mb']:,.0f} MB", flush=True)
            if args.json is not None:  # after every row: a run cut short keeps what it measured
                args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "model": str(args.model),
                                                 "budget_mb": args.budget_mb, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
