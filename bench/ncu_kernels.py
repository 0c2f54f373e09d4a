"""One token's quantized decode launches at the 35B shapes, each run a few times, for Nsight Compute.

    python bench/ncu_kernels.py [--shapes gdn_in,experts,lm_head] [--calls 8]
    ncu --clock-control none -k regex:'_gemv_kernel|_moe_' --launch-skip 4 --launch-count 8 \\
        --section SpeedOfLight --section WarpStateStats ... python3 bench/ncu_kernels.py

The launches a captured decode step makes for the named shapes of ``quant_matmul.decode_shapes``
(GEMVs with the tile table's tiles, or the experts' gate/up and down launches of 8 routed pairs
and the shared expert), on random Q4_0 weights in the layout the loader gives them, each
checked once against its float32 reference and then called ``--calls`` times, one shape after
another, with a device sync between calls. Under ``ncu`` (``bench/gpu/40_ncu_kernels.sh``) that
gives each launch's counters: where its time goes (memory throughput against the ceiling,
warp stall reasons, occupancy), which CUDA events cannot show; ncu flushes the caches before each
launch it measures by default, so the weights come from HBM as in a step. Without it, the script
prints each call's median time from CUDA events (launch included, weights warm in L2 after the
first call), as a check that the launches run.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from engine.gguf.quants import random_quantized
from engine.kernels.quant import QuantMatrix, qmatmul_reference
from engine.kernels.quant.reference import SPLIT_QTYPES, split_layout_on
from engine.kernels.quant.triton import qmatmul, quantized_moe_triton
from quant_matmul import decode_shapes, expert_case, rel_err


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="gdn_in,experts", help="names of quant_matmul.decode_shapes")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    return ap.parse_args(argv)


def launches(label: str, kind: str, n: int, k: int, dev: torch.device, rng: np.random.Generator):
    """(call, reference output) of one shape's decode launches."""
    qtype = Q.Q4_0
    layout = "split" if qtype in SPLIT_QTYPES and split_layout_on(dev) else "ggml"
    if kind == "gemv":
        x = torch.randn(1, k, device=dev).bfloat16()
        qm = QuantMatrix.from_gguf_bytes(random_quantized((n, k), qtype, rng, 0.02), qtype, n, k).to(dev)
        qm = qm.with_layout(layout)
        return (lambda: qmatmul(x, qm)), qmatmul_reference(x, qm.ggml_raw, qtype, n, k)
    stack, shared, x, ids, w, ref = expert_case(n, k, qtype, layout, dev, rng)
    return (lambda: quantized_moe_triton(x, *stack, ids, w, shared=shared)), ref


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shapes = {label: (kind, n, k) for label, kind, n, k in decode_shapes()}
    unknown = [s for s in args.shapes.split(",") if s not in shapes]
    if unknown:
        raise SystemExit(f"--shapes: {', '.join(unknown)} not among {', '.join(shapes)}")
    dev = torch.device(args.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"bench/ncu_kernels.py needs a CUDA device, got {args.device!r}")
    rng = np.random.default_rng(0)
    for label in args.shapes.split(","):
        call, ref = launches(label, *shapes[label], dev, rng)
        err = rel_err(call(), ref)
        if not err < 2e-2:
            raise SystemExit(f"{label}: the launches differ from the reference by {err:.2e}")
        times = []
        for _ in range(args.calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        print(f"{label}: {args.calls} calls, median {statistics.median(times):.1f} us (events, launch included), "
              f"error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
