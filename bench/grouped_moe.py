"""The prefill (grouped) quantized-expert launches at the Qwen3.6-35B-A3B expert shapes, per tile setting.

    python bench/grouped_moe.py [--tokens 512,2048,8192] [--qtype Q4_0] [--grid small|wide] [--json out.json]

For each token count: random top-8 routing over 256 experts of hidden 2048 and FFN 512 in split-layout
blocks on CUDA, bf16 activations, and ``engine.kernels.quant.triton.quantized_moe_triton``'s grouped path
timed (``triton.testing.do_bench``, median with the 20th-80th percentile) with whole-block tiles
(``WHOLE_BLOCK_TILES``) and per-weight tiles, for each tile setting of the grid. Each setting's output is
checked against the first one's before it is timed. Prints the weight bytes over time (every expert's
blocks are read at least once at these token counts) and the fastest setting per token count.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton.testing
from gguf import GGMLQuantizationType as Q

from common import commit, machine

E, H, FFN, TOP_K = 256, 2048, 512, 8
GRIDS = {
    "small": [(64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (32, 64, 128, 4, 3), (128, 64, 64, 8, 3)],
    "wide": [(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product(
        (16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (2, 3, 4)) if bm * bn <= 128 * 128],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--qtype", default="Q4_0", choices=("Q4_0", "Q8_0"))
    ap.add_argument("--grid", default="small", choices=sorted(GRIDS))
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_moe.py times CUDA launches: no CUDA device here")
    from engine.gguf.quants import random_quantized
    from engine.kernels.quant import triton as tq
    from engine.kernels.quant.reference import QuantExperts
    import numpy as np

    qtype = Q[args.qtype]
    rng = np.random.default_rng(0)
    stack = [QuantExperts.from_gguf_bytes(random_quantized((E, n, k), qtype, rng, 0.05), qtype, E, n, k)
             .to("cuda").with_layout("split") for n, k in ((FFN, H), (FFN, H), (H, FFN))]
    weight_bytes = sum(qe.raw.numel() for qe in stack)
    g = torch.Generator("cuda").manual_seed(1)
    result = {"machine": machine(), "commit": commit(), "qtype": args.qtype, "runs": []}
    for T in (int(t) for t in args.tokens.split(",") if t):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=g).topk(TOP_K, dim=-1).indices
        w = torch.softmax(torch.randn(T, TOP_K, device="cuda", generator=g), -1)
        first = None
        best = None
        for (bm, bn, bk, warps, stages), halves in itertools.product(GRIDS[args.grid], (True, False)):
            config = tq.QuantKernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            tq.WHOLE_BLOCK_TILES = halves
            fn = lambda: tq.quantized_moe_triton(x, *stack, ids, w, config)  # noqa: E731
            try:
                out = fn().float()
            except Exception as exc:  # a tile that does not fit the device's shared memory
                print(f"T={T} {bm}x{bn}x{bk} w{warps} s{stages} halves={halves}: skipped ({type(exc).__name__})")
                continue
            if first is None:
                first = out
            err = ((out - first).norm() / first.norm()).item()
            if err > 2e-2:
                raise SystemExit(f"T={T} {bm}x{bn}x{bk} w{warps} s{stages} halves={halves}: relative error {err:.2e}")
            ms, lo, hi = triton.testing.do_bench(fn, rep=args.rep_ms, quantiles=[0.5, 0.2, 0.8])
            run = {"tokens": T, "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                   "num_stages": stages, "halves": halves, "ms": ms, "p20_ms": lo, "p80_ms": hi,
                   "weight_gb_s": weight_bytes / ms / 1e6}
            result["runs"].append(run)
            print(f"T={T:>5} {bm:>3}x{bn:>3}x{bk:>3} w{warps} s{stages} halves={halves!s:5}: {ms:8.3f} ms "
                  f"({lo:.3f}-{hi:.3f}), weights {run['weight_gb_s']:7.0f} GB/s", flush=True)
            if best is None or ms < best["ms"]:
                best = run
        tq.WHOLE_BLOCK_TILES = True
        if best is not None:
            print(f"fastest at T={T}: {best}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
