"""Float32 projections of a few rows (a DFlash verify block at spec_len 4, a draft block): each way of
computing ``x @ w.T`` timed inside a CUDA graph at the shipped target's and draft's shapes.

    python bench/few_rows.py [--rows 4,5] [--calls 50] [--replays 20] [--json out.json]

Ways: ``F.linear`` through cuBLAS and through cuBLASLt (``torch.backends.cuda.preferred_blas_library``),
the one-row GEMV (``F.linear`` of one row, the plain decode step's; for scale), from ``FEW_M`` rows the
``tl.dot`` kernel that ``skinny.skinny_linear`` takes there, and ``skinny.rows_linear`` per output tile,
K chunk and warps.
Each is checked against the float64 product first; the time is a graph of ``--calls`` back-to-back
calls replayed ``--replays`` times (median over replays, per call). Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from common import commit, graph_time_ms, machine

from engine.kernels import skinny

# (N, K) of the dense float32 projections a DFlash step at spec_len 4 runs through ``linear`` with the
# shipped target (hidden 256) and the 8192 x 960 draft, read from an eager generation's calls
SHAPES = [(776, 256), (256, 256), (512, 256), (256, 128), (4096, 256), (768, 256), (1536, 256), (256, 768),
          (384, 256), (64, 256), (32, 256)]
ROWS_TILES = list(itertools.product((2, 4, 8, 16), (256,), (1, 2, 4)))  # block_n, block_k, warps


def graph_us(fn, calls: int, replays: int) -> float:
    """Median device time per call, in us, of a graph of ``calls`` calls of ``fn``."""
    return 1e3 * graph_time_ms(fn, warmup=3, repeats=replays, calls=calls)["ms"]


def blas(name: str, x: torch.Tensor, w: torch.Tensor):
    def run():
        return F.linear(x, w)

    torch.backends.cuda.preferred_blas_library(name)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,5")
    ap.add_argument("--tiles", default="", help="rows_linear tiles to time, 'n,k,w;n,k,w' (default: twelve)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("few_rows.py times CUDA graphs: it needs a CUDA device")
    dev = torch.device("cuda")
    tiles_timed = ([tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";") if t] if args.tiles
                   else ROWS_TILES)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "calls": args.calls, "replays": args.replays, "rows": []}
    best_tiles: dict[tuple[int, int, int], list[float]] = {t: [] for t in tiles_timed}
    for M in (int(r) for r in args.rows.split(",") if r):
        print(f"\n{M} rows: us a call (best rows_linear tile: block_n, block_k, warps)", flush=True)
        print(f"{'N':>5} {'K':>4} {'gemv 1 row':>10} {'cublas':>7} {'cublasLt':>8} {'tl.dot':>7} "
              f"{'rows best':>9}  tile", flush=True)
        for N, K in SHAPES:
            g = torch.Generator(device=dev).manual_seed(N * 7 + K + M)
            x = torch.randn(M, K, device=dev, generator=g)
            w = torch.randn(N, K, device=dev, generator=g) / K ** 0.5
            ref = (x.double() @ w.double().T).float()
            row = {"rows": M, "N": N, "K": K}
            row["gemv_1_row"] = graph_us(blas("cublas", x[:1], w), args.calls, args.replays)
            row["cublas"] = graph_us(blas("cublas", x, w), args.calls, args.replays)
            row["cublaslt"] = graph_us(blas("cublaslt", x, w), args.calls, args.replays)
            torch.backends.cuda.preferred_blas_library("cublas")
            row["dot"] = float("nan")
            if M >= skinny.FEW_M:  # the tl.dot kernel, which skinny_linear takes from FEW_M rows
                assert torch.allclose(skinny.skinny_linear(x, w), ref, atol=1e-4, rtol=1e-4)
                row["dot"] = graph_us(lambda: skinny.skinny_linear(x, w), args.calls, args.replays)
            tiles = {}
            for bn, bk, nw in tiles_timed:
                out = skinny.rows_linear(x, w, bn, bk, nw)
                if not torch.allclose(out, ref, atol=1e-4, rtol=1e-4):
                    raise SystemExit(f"rows_linear {bn},{bk},{nw} at {M}x{N}x{K}: "
                                     f"max error {(out - ref).abs().max().item():.3g}")
                tiles[(bn, bk, nw)] = graph_us(lambda: skinny.rows_linear(x, w, bn, bk, nw), args.calls,
                                               args.replays)
                best_tiles[(bn, bk, nw)].append(tiles[(bn, bk, nw)] / row["gemv_1_row"])
            best = min(tiles, key=tiles.get)
            row["rows_best"], row["rows_best_tile"] = tiles[best], list(best)
            row["rows_tiles"] = {",".join(map(str, t)): us for t, us in tiles.items()}
            result["rows"].append(row)
            print(f"{N:>5} {K:>4} {row['gemv_1_row']:>10.2f} {row['cublas']:>7.2f} {row['cublaslt']:>8.2f} "
                  f"{row['dot']:>7.2f} {row['rows_best']:>9.2f}  {best}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    ranked = sorted(best_tiles, key=lambda t: statistics.fmean(best_tiles[t]))
    print("\nrows_linear tiles by their mean time over every shape and row count, in one-row GEMVs:", flush=True)
    for t in ranked[:8]:
        print(f"  {t}: {statistics.fmean(best_tiles[t]):.2f} (max {max(best_tiles[t]):.2f})", flush=True)
    result["tiles_ranked"] = [[list(t), statistics.fmean(best_tiles[t])] for t in ranked]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
