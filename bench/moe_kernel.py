"""Fused-MoE Triton kernel against the torch reference at the real Qwen3.6-35B-A3B expert shapes.

    python bench/moe_kernel.py [--tokens 1,2,8,16,64,512] [--rep-ms 200] [--sweep] [--json out.json]

For each token count: random top-8 routing over 256 experts (hidden 2048, FFN 512, bf16),
time per call of the Triton kernel (auto path, and the per-pair decode and expert-grouped
prefill paths forced) and of the torch reference, and the memory-bandwidth floor: bytes of
the distinct routed experts' weights divided by the HBM bandwidth measured here by a large
device-to-device copy (read + write bytes over time). Times are medians of
``triton.testing.do_bench`` (which flushes L2 between runs), with the 20th-80th percentile
beside them. Every kernel is checked against the float32 reference before it is timed.
``--sweep`` also times a grid of tile sizes per path and prints the fastest for each token
count (configurations that do not compile on the device are skipped).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
from pathlib import Path

import torch
import triton
import triton.testing

from engine.kernels.moe import moe_reference
from engine.kernels.moe.triton import MoEKernelConfig, fused_moe_triton

E, H, FFN, K = 256, 2048, 512, 8
QUANTILES = [0.5, 0.2, 0.8]
PATHS = {"auto": MoEKernelConfig(), "decode": MoEKernelConfig(gemv_max_tokens=10**9),
         "prefill": MoEKernelConfig(gemv_max_tokens=0)}


def copy_bandwidth(dev: torch.device, rep_ms: int, gib: int = 4) -> float:
    """Bytes per second of a device copy of ``gib`` GiB, counting the read and the write."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=rep_ms, return_mode="median")
    return 2 * gib * 2**30 / (ms * 1e-3)


def timed(fn, rep_ms: int) -> dict[str, float]:
    med, lo, hi = triton.testing.do_bench(fn, rep=rep_ms, quantiles=QUANTILES)
    return {"us": med * 1e3, "p20_us": lo * 1e3, "p80_us": hi * 1e3}


def sweep_configs(T: int) -> list[MoEKernelConfig]:
    """Per-pair decode tiles up to 16 tokens, expert-grouped tiles from 4 tokens: the overlap
    shows where one path overtakes the other."""
    configs = []
    if T <= 16:
        configs += [MoEKernelConfig(gemv_max_tokens=T, gemv_block_n=bn, gemv_block_k=bk, gemv_num_warps=nw)
                    for bn, bk, nw in itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8))]
    if T >= 4:
        configs += [MoEKernelConfig(gemv_max_tokens=0, block_m=bm, block_m_small=bm, block_n=bn, block_k=bk,
                                    num_warps=nw, num_stages=ns)
                    for bm, bn, bk, (nw, ns) in itertools.product((16, 64), (64, 128), (64, 128),
                                                                  ((4, 3), (8, 3), (4, 4)))]
    return configs


def sweep(T: int, args_kernel: tuple, ref: torch.Tensor, rep_ms: int) -> list[tuple[float, MoEKernelConfig]]:
    """(median us, config) for every tile configuration that compiles and is correct, fastest first."""
    results = []
    for cfg in sweep_configs(T):
        try:
            out = fused_moe_triton(*args_kernel, cfg)
        except Exception as exc:  # out of shared memory or registers on this device
            print(f"  skip {cfg}: {type(exc).__name__}")
            continue
        if not ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2:
            raise SystemExit(f"config {cfg} at T={T} differs from the reference")
        us = timed(lambda cfg=cfg: fused_moe_triton(*args_kernel, cfg), rep_ms)["us"]
        results.append((us, cfg))
    return sorted(results, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,8,16,64,512")
    ap.add_argument("--rep-ms", type=int, default=200, help="time spent repeating each measurement")
    ap.add_argument("--no-reference-timing", action="store_true", help="skip timing the slow torch reference")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sweep", action="store_true", help="also search tile sizes per token count")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"bench/moe_kernel.py needs a CUDA device, got {args.device!r}")

    torch.manual_seed(0)
    gate = (torch.randn(E, FFN, H, device=dev) / H**0.5).bfloat16()
    up = (torch.randn(E, FFN, H, device=dev) / H**0.5).bfloat16()
    down = (torch.randn(E, H, FFN, device=dev) / FFN**0.5).bfloat16()
    expert_bytes = 3 * FFN * H * gate.element_size()
    bandwidth = copy_bandwidth(dev, args.rep_ms)
    print(f"{torch.cuda.get_device_name(dev)}: device copy {bandwidth / 1e12:.2f} TB/s (read + write); "
          f"one expert {expert_bytes / 2**20:.1f} MiB")
    header = (f"{'T':>4} {'experts':>7} {'MB read':>8} {'floor us':>9} {'auto us':>9} {'% floor':>7} "
              f"{'decode us':>10} {'prefill us':>10} {'torch us':>10} {'rel err':>8}")
    print(header)

    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, H, device=dev).bfloat16()
        ids = torch.rand(T, E, device=dev).topk(K, dim=-1).indices
        w = torch.softmax(torch.randn(T, K, device=dev), -1)
        distinct = int(torch.unique(ids).numel())
        floor_us = distinct * expert_bytes / bandwidth * 1e6
        ref = moe_reference(x.float(), gate.float(), up.float(), down.float(), ids, w)
        row: dict = {"tokens": T, "distinct_experts": distinct, "bytes": distinct * expert_bytes,
                     "floor_us": floor_us}
        errors = []
        for name, cfg in PATHS.items():
            out = fused_moe_triton(x, gate, up, down, ids, w, cfg)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                raise SystemExit(f"{name} kernel at T={T} differs from the reference by {err:.2e} (bound 1e-2)")
            errors.append(err)
            row[name] = timed(lambda cfg=cfg: fused_moe_triton(x, gate, up, down, ids, w, cfg), args.rep_ms)
        row["max_rel_err"] = max(errors)
        if not args.no_reference_timing:
            row["torch"] = timed(lambda: moe_reference(x, gate, up, down, ids, w), args.rep_ms)
        rows.append(row)
        torch_us = f"{row['torch']['us']:10.1f}" if "torch" in row else f"{'-':>10}"
        print(f"{T:4d} {distinct:7d} {row['bytes'] / 1e6:8.1f} {floor_us:9.1f} {row['auto']['us']:9.1f} "
              f"{100 * floor_us / row['auto']['us']:6.1f}% {row['decode']['us']:10.1f} "
              f"{row['prefill']['us']:10.1f} {torch_us} {row['max_rel_err']:8.1e}")

    if args.sweep:
        print("tile sweep (fastest first; default config for comparison):")
        for row in rows:
            T = row["tokens"]
            x = torch.randn(T, H, device=dev).bfloat16()
            ids = torch.rand(T, E, device=dev).topk(K, dim=-1).indices
            w = torch.softmax(torch.randn(T, K, device=dev), -1)
            ref = moe_reference(x.float(), gate.float(), up.float(), down.float(), ids, w)
            ranked = sweep(T, (x, gate, up, down, ids, w), ref, args.rep_ms)
            default_us = timed(lambda: fused_moe_triton(x, gate, up, down, ids, w), args.rep_ms)["us"]
            row["sweep"] = [{"us": us, **asdict(cfg)} for us, cfg in ranked]
            best_us, best = ranked[0]
            print(f"T={T:4d}: default {default_us:8.1f} us, best {best_us:8.1f} us "
                  f"({100 * row['floor_us'] / best_us:.1f}% of floor) with {best}")

    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_bandwidth_Bps": bandwidth,
                                         "triton": triton.__version__, "torch": torch.__version__,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
