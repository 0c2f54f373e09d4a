"""The hybrid executor's cold tier on the CPU: one expert matmul at the real Qwen3.6-35B-A3B
shapes (gate/up [512, 2048], down [2048, 512]), dense bf16 and fp32 against the GGUF-quantized
matrices of ``engine.kernels.cpu_quant``.

    python bench/cpu_cold_tier.py [--threads 2] [--tokens 1,4,16] [--qtypes q4_k,q4_0,q5_k,q8_0,q6_k]
                                  [--warmup 5] [--repeats 30] [--json out.json]

Weights are random valid blocks; each quantized matrix is checked against its dequantized
float64 product before it is timed (bound 1e-2 of the largest output; int8 requantization of
Q6_K 2e-2). Times are medians over ``--repeats`` calls after ``--warmup`` calls, with the
min and max beside them; bytes are the host memory one matrix holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, machine, spread  # noqa: E402
from engine.gguf import quants  # noqa: E402
from engine.gguf.make_model import parse_quant  # noqa: E402
from engine.kernels.cpu_quant import CpuQuantMatrix  # noqa: E402

SHAPES = {"gate/up": (512, 2048), "down": (2048, 512)}  # [N, K]: x [M, K] -> [M, N]


def timed(fn, warmup: int, repeats: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return spread(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,4,16", help="rows M of x")
    ap.add_argument("--qtypes", default="q4_k,q4_0,q5_k,q8_0,q6_k")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--threads and --repeats must be at least 1, --warmup at least 0")
    tokens = [int(t) for t in args.tokens.split(",")]
    qtypes = [parse_quant(q) for q in args.qtypes.split(",")]
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{machine()}, torch {torch.__version__}, {args.threads} threads, commit {commit()}; "
          f"median [min-max] us over {args.repeats} calls")
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) / k**0.5
        matrices = {"dense fp32": (w, w.numel() * 4), "dense bf16": (w.bfloat16(), w.numel() * 2)}
        for qtype in qtypes:
            raw = quants.random_quantized((n, k), qtype, rng, std=k**-0.5)
            t0 = time.perf_counter()
            mat = CpuQuantMatrix.from_raw(raw, qtype, n, k)
            build_ms = (time.perf_counter() - t0) * 1e3
            x = torch.randn(3, k)
            ref = x.double() @ quants.dequantize(raw, qtype, (n, k)).double().T
            err = ((mat.matmul(x).double() - ref).abs().max() / ref.abs().max()).item()
            if err > (2e-2 if mat.layout == "int8" else 1e-2):
                raise SystemExit(f"{qtype.name}: quantized matmul is off by {err:.2e} of the largest output")
            matrices[f"{qtype.name} {mat.layout}"] = (mat, mat.nbytes)
            print(f"  {shape_name} {qtype.name}: layout {mat.layout}, built in {build_ms:.1f} ms, "
                  f"max error {err:.1e}")
        for m in tokens:
            x = torch.randn(m, k).bfloat16()
            for name, (mat, nbytes) in matrices.items():
                if isinstance(mat, torch.Tensor):
                    xm = x.to(mat.dtype)
                    stat = timed(lambda: xm @ mat.T, args.warmup, args.repeats)
                else:
                    stat = timed(lambda: mat.matmul(x), args.warmup, args.repeats)
                rows.append({"shape": shape_name, "n": n, "k": k, "m": m, "format": name, "bytes": nbytes,
                             "us": stat})
    width = max(len(r["format"]) for r in rows)
    print(f"{'shape':8} {'M':>3} {'format':{width}} {'KiB':>7} {'median us':>10} {'min-max us':>16} {'vs bf16':>8}")
    for r in rows:
        base = next(b for b in rows if b["shape"] == r["shape"] and b["m"] == r["m"] and b["format"] == "dense bf16")
        s = r["us"]
        print(f"{r['shape']:8} {r['m']:3d} {r['format']:{width}} {r['bytes'] / 1024:7.0f} {s['median']:10.1f} "
              f"{s['min']:7.1f}-{s['max']:<8.1f} {base['us']['median'] / s['median']:7.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "threads": args.threads,
                                         "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
