"""Gated delta rule decode step at the real Qwen3.6-35B-A3B shape: torch reference, fla's
fused_recurrent (when importable) and the Triton decode kernel.

    python bench/gdn_decode.py [--tokens 1,2,3,4] [--v-dtype bf16] [--repeats 200] [--sweep] [--json out.json]

Per token count: 32 value heads, dk = dv = 128, random unit q/k rows, v in --v-dtype, a
float32 state. Each sample times --inner back-to-back calls from Python between two CUDA
events and divides, so the wrapper and launch cost a decode step pays is included; the
median, min and max over --repeats samples are reported after --warmup untimed calls. The
kernel is also timed replayed from a CUDA graph (launch cost gone) and against its traffic
floor: the state read and written once. Every implementation is checked against the torch
reference before it is timed. ``--sweep`` times a grid of value-block sizes and warp counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, machine, spread  # noqa: E402
from engine.model.gated_deltanet import DeltaRule, delta_rule_recurrent, l2norm  # noqa: E402

HEADS, HEAD_K, HEAD_V = 32, 128, 128
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TOL = {"kernel": 1e-4, "fla": 2e-2}  # fla casts q and k to v's dtype


def make_inputs(T: int, v_dtype: torch.dtype, dev: torch.device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, HEADS, HEAD_K, generator=gen))
    k = l2norm(torch.randn(T, HEADS, HEAD_K, generator=gen))
    v = torch.randn(T, HEADS, HEAD_V, generator=gen).to(v_dtype)
    g = -torch.rand(T, HEADS, generator=gen) * 2.0
    beta = torch.rand(T, HEADS, generator=gen)
    state = torch.randn(HEADS, HEAD_K, HEAD_V, generator=gen)
    return [t.to(dev) for t in (q, k, v, g, beta, state)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def time_calls(fn, warmup: int, repeats: int, inner: int) -> dict[str, float]:
    """Microseconds per call: each sample is ``inner`` calls between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner)
    return spread(samples)


def graphed(fn, inner: int):
    """``fn`` called ``inner`` times captured in one CUDA graph; replaying it is one launch."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return graph.replay


def time_graphed(fn, args) -> dict[str, float]:
    """Microseconds per call of ``fn`` replayed from a graph of ``args.inner`` calls."""
    stats = time_calls(graphed(fn, args.inner), args.warmup, args.repeats, 1)
    return {key: val if key == "n" else val / args.inner for key, val in stats.items()}


def checked(name: str, fn, ref: tuple[torch.Tensor, torch.Tensor], tol: float):
    o, s = fn()
    errs = rel_err(o, ref[0]), rel_err(s, ref[1])
    if max(errs) > tol:
        raise SystemExit(f"{name} differs from the torch reference: output {errs[0]:.2e}, state {errs[1]:.2e}")
    return errs


def bench_tokens(T: int, args, kernel) -> dict:
    dev = torch.device("cuda")
    q, k, v, g, beta, s0 = make_inputs(T, DTYPES[args.v_dtype], dev, seed=T)
    scale = HEAD_K ** -0.5
    ref = delta_rule_recurrent(q, k, v, g, beta, s0, scale)
    timing = dict(warmup=args.warmup, repeats=args.repeats, inner=args.inner)
    row = {"tokens": T}

    row["torch"] = time_calls(lambda: delta_rule_recurrent(q, k, v, g, beta, s0, scale), **timing)
    rule = DeltaRule.select(dev)
    if rule.backend == "fla":
        fla = lambda: rule.recurrent(q, k, v, g, beta, s0, scale)  # noqa: E731
        row["fla_err"] = checked("fla fused_recurrent", fla, ref, TOL["fla"])
        row["fla"] = time_calls(fla, **timing)

    out_state = torch.empty_like(s0)
    run = lambda: kernel(q, k, v, g, beta, s0, scale, out_state=out_state)  # noqa: E731
    row["kernel_err"] = checked("triton decode kernel", run, ref, TOL["kernel"])
    row["kernel"] = time_calls(run, **timing)
    row["kernel_graph"] = time_graphed(run, args)

    state_bytes = 2 * s0.numel() * s0.element_size()
    row["floor_us"] = state_bytes / (args.bandwidth_tbs * 1e12) * 1e6
    if args.sweep:
        row["sweep"] = []
        for block_v, warps in itertools.product((8, 16, 32, 64, 128), (1, 2, 4, 8)):
            cfg = lambda: kernel(q, k, v, g, beta, s0, scale, out_state=out_state,  # noqa: E731
                                 block_v=block_v, num_warps=warps)
            checked(f"kernel block_v={block_v} num_warps={warps}", cfg, ref, TOL["kernel"])
            us = time_graphed(cfg, args)["median"]
            row["sweep"].append({"block_v": block_v, "num_warps": warps, "graph_us": us})
        row["sweep"].sort(key=lambda r: r["graph_us"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,2,3,4", help="comma-separated token counts per step")
    parser.add_argument("--v-dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--inner", type=int, default=10, help="calls per timed sample")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.27,
                        help="device copy bandwidth, read + write, for the traffic floor (H200: 4.27 TB/s)")
    parser.add_argument("--sweep", action="store_true", help="also time value-block sizes and warp counts")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if min(tokens + [args.repeats, args.inner]) < 1 or args.warmup < 0:
        raise SystemExit("--tokens, --repeats and --inner must be >= 1 and --warmup >= 0")
    if not torch.cuda.is_available():
        raise SystemExit("bench/gdn_decode.py needs a CUDA device")
    from engine.kernels.gdn_decode import delta_rule_decode_triton

    rows = [bench_tokens(T, args, delta_rule_decode_triton) for T in tokens]
    print(f"{machine()}  commit {commit()}  H={HEADS} dk={HEAD_K} dv={HEAD_V} v={args.v_dtype}  us per call (median)")
    print(f"{'T':>3} {'torch':>9} {'fla':>9} {'kernel':>9} {'graphed':>9} {'floor':>7}")
    for r in rows:
        fla = f"{r['fla']['median']:9.1f}" if "fla" in r else f"{'-':>9}"
        print(f"{r['tokens']:>3} {r['torch']['median']:9.1f} {fla} {r['kernel']['median']:9.1f} "
              f"{r['kernel_graph']['median']:9.2f} {r['floor_us']:7.2f}")
        if "sweep" in r:
            best = r["sweep"][0]
            print(f"    fastest tile: block_v={best['block_v']} num_warps={best['num_warps']} "
                  f"{best['graph_us']:.2f} us graphed")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "v_dtype": args.v_dtype,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
