"""The decode step's small Triton launches at the 35B shapes, one token, per number of warps.

    python bench/small_kernels.py [--kernels router,norm,...] [--tokens 1] [--depth 4096] [--json out.json]

Each kernel of ``engine.kernels.warps.WARPS`` (the router, the RMSNorms, the norm + RoPE launches,
the Gated DeltaNet prologue and delta rule, the split-key attention's two launches) runs at
qwen3.6-35b-a3b's decode shapes with 1, 2, 4 and 8 warps per program. Each count's output is
first compared with the table's own count's (the router's with torch's top-k too), then timed as
a captured decode step runs it (``common.graph_time_ms``: calls captured in a CUDA graph, median
over replays). A step runs the router and the gated norm 40 and 30 times, the residual add + norm
80: each microsecond here is that many per token. The fastest count per kernel is printed; the
table is changed by hand, and the step confirmed with ``bench/profile_decode.py --kernel-variants``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from common import graph_time_ms

from engine.kernels import warps as warps_table
from engine.model import gated_deltanet

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=",".join(warps_table.WARPS), help="kernels of engine.kernels.warps")
    ap.add_argument("--tokens", type=int, default=1, help="rows per call (decode 1, verify blocks more)")
    ap.add_argument("--depth", type=int, default=4096, help="cache slots the attention reads")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def cases(name: str, T: int, depth: int, dev: torch.device, g: torch.Generator) -> list[tuple[str, int, Callable]]:
    """(label, launches per decode step, call) of the kernel ``name`` at the 35B decode shapes; each call
    returns its outputs."""
    from engine.gguf.make_model import preset_config

    c = preset_config("qwen3.6-35b-a3b", vocab=1)
    H, bf16 = c.hidden, torch.bfloat16

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    if name == "router":
        from engine.kernels.moe_gate import route_triton

        x, router = rand(T, H, dtype=bf16), rand(c.n_expert, H) * H ** -0.5 * 4
        ref_w, ref_ids = torch.softmax(F.linear(x.float(), router), -1).topk(c.n_expert_used, -1)
        ids, w = route_triton(x, router, c.n_expert_used)  # the table's warps, which the others are held to
        if not torch.equal(ids, ref_ids) or not torch.allclose(w, ref_w / ref_w.sum(-1, keepdim=True), 1e-5, 1e-6):
            raise SystemExit("the router differs from torch's softmax and top-k")
        from engine.kernels.moe_gate import add_norm_route_triton
        from engine.model import moe

        h, r, nw = rand(T, H, dtype=bf16), rand(T, H, dtype=bf16), rand(H)
        inside = 40 if moe.NORM_IN_ROUTER else 0  # else the add + norm's own launch (kernel "norm") and the router
        return [("router", 40 - inside, lambda: route_triton(x, router, c.n_expert_used)),
                ("add + norm + router", inside,
                 lambda: add_norm_route_triton(h, r, nw, 1e-6, router, c.n_expert_used))]
    if name == "norm":
        from engine.kernels.rms_norm import add_rms_norm_triton

        h, r, w = rand(T, H, dtype=bf16), rand(T, H, dtype=bf16), rand(H)
        from engine.model import moe

        return [("add + norm", 40 if moe.NORM_IN_ROUTER else 80, lambda: add_rms_norm_triton(h, r, w, 1e-6))]
    if name == "gated_norm":
        from engine.kernels.rms_norm import rms_norm_triton

        o, z, wv = rand(T, c.gdn_v_heads, c.gdn_head_v), rand(T, c.gdn_v_heads, c.gdn_head_v, dtype=bf16), \
            rand(c.gdn_head_v)
        apart = 0 if gated_deltanet.NORM_IN_RULE else 30  # else in the delta rule's launch
        return [("gated norm", apart, lambda: rms_norm_triton(o, wv, 1e-6, gate=z, out_dtype=bf16))]
    if name == "rope":
        from engine.kernels.rope_norm import norm_rope_to_cache_triton, norm_rope_triton

        D, half = c.head_dim, c.rope_dim // 2
        q, k, v = rand(T, c.n_head, D, dtype=bf16), rand(T, c.n_head_kv, D, dtype=bf16), \
            rand(T, c.n_head_kv, D, dtype=bf16)
        w, cos, sin = rand(D), rand(T, half), rand(T, half)
        cache_k = torch.zeros(c.n_head_kv, depth, D, dtype=bf16, device=dev)
        cache_v = torch.zeros_like(cache_k)
        slots = torch.arange(T, device=dev)
        return [("q norm + rope", 10, lambda: norm_rope_triton(q, w, cos, sin, 1e-6)),
                ("k norm + rope to cache", 10,
                 lambda: norm_rope_to_cache_triton(k, v, w, cos, sin, 1e-6, cache_k, cache_v, slots)[:, :T])]
    if name == "gdn_prologue":
        from engine.kernels.gdn_prologue import gdn_prologue_triton

        hk, hv, dk, dv = c.gdn_k_heads, c.gdn_v_heads, c.gdn_head_k, c.gdn_head_v
        C = 2 * hk * dk + hv * dv
        qkv, w = rand(T, C, dtype=bf16), rand(C, c.conv_kernel)
        start = rand(C, c.conv_kernel - 1, dtype=bf16)
        state = start.clone()
        b, alpha, a, dt = rand(T, hv, dtype=bf16), rand(T, hv, dtype=bf16), rand(hv), rand(hv)

        def prologue():
            state.copy_(start)  # the same inputs every call
            return gdn_prologue_triton(qkv, state, w, b, alpha, a, dt, k_heads=hk, v_heads=hv, head_k=dk, head_v=dv)
        return [("gdn prologue", 30, prologue)]
    if name == "delta_rule":
        from engine.kernels.gdn_decode import delta_rule_decode_triton

        hv, dk, dv = c.gdn_v_heads, c.gdn_head_k, c.gdn_head_v
        q, k = F.normalize(rand(T, hv, dk), dim=-1), F.normalize(rand(T, hv, dk), dim=-1)
        v, gg, beta = rand(T, hv, dv, dtype=bf16), -torch.rand(T, hv, device=dev), torch.rand(T, hv, device=dev)
        state = rand(hv, dk, dv) * 0.1
        norm = (rand(T, hv, dv, dtype=bf16), rand(dv), 1e-6, bf16) if gated_deltanet.NORM_IN_RULE else None
        return [("delta rule" + (" + gated norm" if norm else ""), 30,
                 lambda: delta_rule_decode_triton(q, k, v, gg, beta, state, dk ** -0.5, norm=norm))]
    if name.startswith("attention"):
        from engine.kernels.decode_attention import decode_attention_triton

        D = c.head_dim
        cache = bf16 if dev.type == "cuda" else torch.float32  # the interpreter's tl.dot needs float32 there
        q, gate = rand(T, c.n_head, D, dtype=cache), rand(T, c.n_head, D, dtype=cache)
        keys, values = rand(c.n_head_kv, depth, D, dtype=cache), rand(c.n_head_kv, depth, D, dtype=cache)
        visible = torch.ones(T, depth, dtype=torch.bool, device=dev)
        slots = torch.arange(depth - T, depth, device=dev)
        return [(f"attention at {depth}", 10,
                 lambda: decode_attention_triton(q, keys, values, visible, slots, gate=gate))]
    raise SystemExit(f"--kernels: {name!r} is not one of {', '.join(warps_table.WARPS)}")


def as_list(out) -> list[torch.Tensor]:
    return [t.float() for t in (out if isinstance(out, (tuple, list)) else [out])]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = args.kernels.split(",")
    if set(names) - set(warps_table.WARPS):
        raise SystemExit(f"--kernels: {', '.join(sorted(set(names) - set(warps_table.WARPS)))} not among "
                         f"{', '.join(warps_table.WARPS)}")
    dev = torch.device(args.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"bench/small_kernels.py needs a CUDA device, got {args.device!r}")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'kernel':>8} {'launch':>24} {'warps':>5} {'us':>7} {'p20':>7} {'p80':>7}")
    for name in names:
        table = warps_table.warps(name)
        for label, per_step, call in cases(name, args.tokens, args.depth, dev, g):
            want = as_list(call())
            for n in warps_table.CHOICES:
                warps_table.set_warps(name, n)
                try:
                    got = as_list(call())
                    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.allclose(a, b, rtol=1e-3, atol=1e-3)]
                    if bad:
                        raise SystemExit(f"{label} at {n} warps: output {bad} differs from {table} warps'")
                    t = graph_time_ms(call, args.warmup, args.repeats)
                finally:
                    warps_table.set_warps(name, table)
                rows.append({"kernel": name, "launch": label, "per_step": per_step, "tokens": args.tokens, "warps": n,
                             "us": t["ms"] * 1e3, "p20_us": t["p20_ms"] * 1e3, "p80_us": t["p80_ms"] * 1e3,
                             "table": n == table})
                r = rows[-1]
                print(f"{name:>8} {label:>24} {n:>5} {r['us']:7.2f} {r['p20_us']:7.2f} {r['p80_us']:7.2f}"
                      f"{'  (table)' if r['table'] else ''}", flush=True)
        mine = [r for r in rows if r["kernel"] == name]
        step = {n: sum(r["us"] * r["per_step"] for r in mine if r["warps"] == n) for n in warps_table.CHOICES}
        best = min(step, key=step.get)
        print(f"{name}: fastest at {best} warps, {step[best]:.0f} us a step (each alone) against {step[table]:.0f} "
              f"at the table's {table}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "tokens": args.tokens,
                                         "depth": args.depth, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
