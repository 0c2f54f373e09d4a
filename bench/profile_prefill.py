"""Where a prefill's time goes: wall time per prompt length, its fixed and per-token parts, and a
torch.profiler view of one prompt length.

    python bench/profile_prefill.py --model M.gguf [--lens 128,512,2048,8192] [--profile-len 512]
        [--repeats 5] [--weights dense|quantized] [--experts dense|quantized] [--rows 30]
        [--trace out.json] [--json out.json] [--dequant-min-m 256,0]

For each length: the median wall time of ``Qwen35MoE.forward`` (last-token logits, a fresh state,
synchronised) after one warm-up, next to the device time of the launches it made (CUDA events around
the forward). A least-squares line through the medians splits the time into a fixed part (host
launches, work that does not grow with the prompt) and a per-token part. The profile of
``--profile-len`` then lists the operators by device time and by host time, with the host's total
against the device's, so a host-bound prefill reads as such. ``--dequant-min-m`` times the lengths once
per setting of the quantized matmuls' ``dequant_min_m`` (from that many rows the weight is dequantized
into a temporary for a dense matmul; 0: never, the Triton GEMM throughout); the profile uses the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common import commit, machine, spread
from engine.engine import Engine


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b); one point gives (0, y / x)."""
    if len(xs) < 2:
        return 0.0, ys[0] / xs[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--lens", default="128,512,2048,8192", help="comma-separated prompt lengths to time")
    ap.add_argument("--profile-len", type=int, default=512, help="prompt length to profile (0: none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weights", default="quantized", choices=("dense", "quantized"))
    ap.add_argument("--experts", default="quantized", choices=("dense", "quantized"),
                    help="quantized: every routed expert on the device in its GGUF blocks")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--trace", type=Path, default=None, help="Chrome trace of the profiled prefill")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--dequant-min-m", default="", help="comma-separated dequant_min_m settings to time")
    args = ap.parse_args()
    try:
        lens = [int(n) for n in args.lens.split(",") if n]
    except ValueError:
        raise SystemExit(f"--lens takes comma-separated integers, got {args.lens!r}") from None
    if not lens or min(lens) < 1 or args.repeats < 1 or args.profile_len < 0:
        raise SystemExit("--lens must name positive lengths, --repeats be at least 1, --profile-len at least 0")

    quantized = args.experts == "quantized"
    eng = Engine.from_gguf(args.model, weights=args.weights, cold_format=args.experts, hot_format=args.experts,
                           expert_budget_mb=0 if quantized else None)
    if quantized:  # every expert hot, in its blocks
        placement = eng.set_expert_budget(0)
        eng.set_expert_budget(placement.n_expert * sum(placement.expert_bytes) / 2**20)
    model, device = eng.model, eng.device
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> torch.Tensor:
        return torch.randint(0, eng.config.vocab, (n,), generator=gen).to(device)

    def prefill(ids: torch.Tensor) -> tuple[float, float]:
        """(wall ms, device ms between events around the forward) of one prefill from a fresh state."""
        state = model.new_state(ids.numel() + 1)
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        model.forward(ids, state, logits="last").logits[-1].argmax().item()
        wall = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
            end.synchronize()
            return wall, start.elapsed_time(end)
        return wall, wall

    result = {"machine": machine(), "commit": commit(), "model": str(args.model), "weights": args.weights,
              "experts": args.experts, "settings": {}}
    try:
        settings = [int(m) for m in args.dequant_min_m.split(",") if m] or [None]
    except ValueError:
        raise SystemExit(f"--dequant-min-m takes comma-separated integers, got {args.dequant_min_m!r}") from None
    for setting in settings:
        if setting is not None:
            from engine.kernels.quant import triton as tq  # only here: it needs Triton

            tq.PREFILL = replace(tq.PREFILL, dequant_min_m=setting)
            print(f"dequant_min_m {setting}", flush=True)
        timed = result["settings"][str(setting)] = {"lens": {}}
        for n in lens:
            ids = prompt(n)
            prefill(ids)  # warm-up: Triton compiles, the allocator grows
            runs = [prefill(ids) for _ in range(args.repeats)]
            wall = spread([r[0] for r in runs])
            dev = spread([r[1] for r in runs])
            timed["lens"][n] = {"wall_ms": wall, "events_ms": dev, "tok_s": n / wall["median"] * 1e3}
            print(f"prefill {n:>6} tokens: {wall['median']:9.2f} ms wall (min {wall['min']:.2f}, "
                  f"max {wall['max']:.2f}) -> {n / wall['median'] * 1e3:10.1f} tok/s", flush=True)
        if len(lens) > 1:
            a, b = fit_line([float(n) for n in lens], [timed["lens"][n]["wall_ms"]["median"] for n in lens])
            timed["fit"] = {"fixed_ms": a, "per_token_us": b * 1e3}
            print(f"fit: {a:.2f} ms fixed + {b * 1e3:.3f} us a token", flush=True)

    if args.profile_len:
        ids = prompt(args.profile_len)
        prefill(ids)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            wall, _ = prefill(ids)
        events = prof.key_averages()
        host = sum(e.self_cpu_time_total for e in events) / 1e3
        dev = sum(e.self_device_time_total for e in events) / 1e3 if cuda else 0.0
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
        result["profile"] = {"len": args.profile_len, "wall_ms": wall, "host_self_ms": host, "device_ms": dev,
                             "launches": launches}
        print(f"\nprofile of {args.profile_len} tokens: {wall:.2f} ms wall under the profiler, host self time "
              f"{host:.2f} ms, device time {dev:.2f} ms, {launches} launches", flush=True)
        if cuda:
            print("\nby device time")
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        print("\nby host time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if args.trace:
            prof.export_chrome_trace(str(args.trace))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
