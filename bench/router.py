"""The one-launch router (``engine.kernels.moe_gate.route_triton``) at the 35B shapes, per setting.

    python bench/router.py [--tokens 1,4] [--experts 256] [--hidden 2048] [--top-k 8] [--json out.json]

Each number of warps per program is first checked against torch's softmax and top-k on the
same logits, then timed as a captured decode step runs it (``common.graph_time_ms``:
calls captured in a CUDA graph, median over replays). A decode step calls the router once per
layer, so each microsecond here is 40 per token on qwen3.6-35b-a3b. The warps split the
programs' logits over more lanes, but the last program's top-k (K rounds of a maximum and a
minimum over the row) reduces across warps through shared memory, within one warp by shuffles.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from common import graph_time_ms

from engine.kernels.moe_gate import WARPS, route_triton


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4", help="rows of x per call (decode 1, verify blocks more)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"bench/router.py needs a CUDA device, got {args.device!r}")
    g = torch.Generator(device=dev).manual_seed(0)
    router = torch.randn(args.experts, args.hidden, device=dev, generator=g) * args.hidden ** -0.5 * 4
    rows = []
    print(f"{'tokens':>6} {'warps':>5} {'us':>7} {'p20':>7} {'p80':>7}")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, args.hidden, device=dev, generator=g).bfloat16()
        ref_w, ref_ids = torch.softmax(F.linear(x.float(), router), -1).topk(args.top_k, -1)
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        for warps in (1, 2, 4, 8):
            ids, w = route_triton(x, router, args.top_k, num_warps=warps)
            if not torch.equal(ids, ref_ids) or not torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6):
                raise SystemExit(f"T={T} warps={warps}: the router differs from torch's top-k")
            t = graph_time_ms(lambda: route_triton(x, router, args.top_k, num_warps=warps), args.warmup,
                              args.repeats)
            rows.append({"tokens": T, "warps": warps, "us": t["ms"] * 1e3, "p20_us": t["p20_ms"] * 1e3,
                         "p80_us": t["p80_ms"] * 1e3, "default": warps == WARPS})
            r = rows[-1]
            print(f"{T:>6} {warps:>5} {r['us']:7.2f} {r['p20_us']:7.2f} {r['p80_us']:7.2f}"
                  f"{'  (default)' if r['default'] else ''}", flush=True)
        best = min((r for r in rows if r["tokens"] == T), key=lambda r: r["us"])
        print(f"fastest at T={T}: {best['warps']} warps, {best['us']:.2f} us")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "experts": args.experts,
                                         "hidden": args.hidden, "top_k": args.top_k, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
