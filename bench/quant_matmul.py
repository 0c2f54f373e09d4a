"""Quantized-weight matmul kernels against dequantized-bf16 torch matmuls, at the real shapes.

    python bench/quant_matmul.py [--qtypes Q4_0,Q8_0,Q4_K,Q5_K,Q6_K] [--m 1,512] [--repeats 50] [--json out.json]
    python bench/quant_matmul.py --sweep [--qtypes Q4_0] [--write-tuned engine/kernels/quant/tuned.json]

Shapes (N x K): attention-sized 2048x2048, expert gate/up 512x2048, expert down 2048x512 and
the LM head 248320x2048 (Q6_K and Q8_0 only), plus the routed-expert kernel at decode: 8 pairs
over 256 stacked experts, gate/up and down shapes. For each case the kernel is first checked
against the float32 reference, then timed as a captured decode step runs it: ``--warmup``
calls, then 20 calls captured in a CUDA graph and the graph replayed ``--repeats`` times, each
replay's CUDA-event time over 20 (``common.graph_time_ms``: a loop of launches would time the
host's launch cost, not the kernel), median and 20th/80th percentiles reported. Weight bytes read per
call over the median time gives GB/s, shown as a percentage of the HBM bandwidth measured
here (a large device-to-device copy, read + write bytes over time). Small weights are
rotated through enough copies to exceed the L2 cache, so every call reads from HBM.

``--sweep`` times the single-token decode kernels (GEMV and the fused routed-expert launches)
at the shapes qwen3.6-35b-a3b decodes with (the merged projections, the LM head, the experts)
over a grid of tiles, prints the fastest per shape against the default tiles, and with
``--write-tuned`` writes them as the table the kernels read on this GPU
(``engine.kernels.quant.tuned``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from common import graph_time_ms, time_ms
from gguf import GGMLQuantizationType as Q

from engine.gguf.quants import random_quantized
from engine.kernels.quant import QTYPES, QuantExperts, QuantMatrix, qmatmul_experts_reference, qmatmul_reference
from engine.hybrid import quantized_moe
from engine.kernels.quant.triton import QuantKernelConfig, qmatmul, qmatmul_experts, quantized_moe_triton

SHAPES = {"attn": (2048, 2048), "gate_up": (512, 2048), "down": (2048, 512), "lm_head": (248320, 2048)}
LM_HEAD_QTYPES = (Q.Q6_K, Q.Q8_0)
EXPERTS, PAIRS = 256, 8
ROTATE_BYTES = 512 * 2**20  # well above the L2 of current GPUs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qtypes", default=",".join(q.name for q in QTYPES))
    ap.add_argument("--m", default="1,512", help="rows of x (tokens) per call")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {', '.join(SHAPES)}")
    ap.add_argument("--no-experts", action="store_true", help="skip the routed-expert kernel")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true", help="time decode tiles at the 35B shapes instead")
    ap.add_argument("--write-tuned", type=Path, default=None, help="with --sweep: write the fastest tiles here")
    ap.add_argument("--grid", choices=("blocks", "rows", "both", "words", "all", "none"), default="both",
                    help="with --sweep: the block tiles, the row kernels' warps and unroll "
                         "(engine.kernels.quant.rows), both, the word GEMV's tiles (engine.kernels.quant.words, "
                         "Q4_0 GEMV shapes), all three, or none (the defaults and the table's tiles only); "
                         "the table's current tiles for a shape are always among the candidates")
    ap.add_argument("--verbose", action="store_true", help="with --sweep: print every candidate's time")
    ap.add_argument("--sweep-shapes", type=lambda s: s.split(","), default=None,
                    help="with --sweep: only these shapes (attn_qkv, attn_out, gdn_in, gdn_out, shared_gate_up, "
                         "shared_down, lm_head, experts); the table keeps its other entries")
    args = ap.parse_args(argv)
    if args.write_tuned and not args.sweep:
        ap.error("--write-tuned needs --sweep")
    try:
        args.qtypes = [Q[name.strip()] for name in args.qtypes.split(",")]
    except KeyError as exc:
        ap.error(f"--qtypes: unknown quant type {exc.args[0]!r}")
    if bad := [q.name for q in args.qtypes if q not in QTYPES]:
        ap.error(f"--qtypes: {', '.join(bad)} not supported (supported: {', '.join(q.name for q in QTYPES)})")
    args.m = [int(m) for m in args.m.split(",")]
    if any(m < 1 for m in args.m):
        ap.error(f"--m: every row count must be positive, got {args.m}")
    args.shapes = [s.strip() for s in args.shapes.split(",")]
    if bad := [s for s in args.shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {bad} (known: {', '.join(SHAPES)})")
    if args.warmup < 0 or args.repeats < 1:
        ap.error(f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup} and {args.repeats}")
    return args


def copy_bandwidth(dev: torch.device, warmup: int, repeats: int, gib: int = 4) -> float:
    """Bytes per second of a device copy of ``gib`` GiB, counting the read and the write."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, repeats)["ms"]
    return 2 * gib * 2**30 / (ms * 1e-3)


def rotating(items: list):
    """A function returning the next item on each call (cycles through the L2-defeating copies)."""
    state = {"i": -1}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return nxt


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_matrix(qtype: Q, n: int, k: int, ms: list[int], args, rng) -> list[dict]:
    dev = torch.device(args.device)
    qm = QuantMatrix.from_gguf_bytes(random_quantized((n, k), qtype, rng, 0.02), qtype, n, k).to(dev)
    copies = max(1, -(-ROTATE_BYTES // (n * k * 2)))  # sized by the bf16 weight, the larger one
    quant = rotating([qm] + [QuantMatrix(qm.raw.clone(), qtype, n, k) for _ in range(copies - 1)])
    w = qm.dequantize(torch.bfloat16)
    dense = rotating([w] + [w.clone() for _ in range(copies - 1)])
    rows = []
    for M in ms:
        x = torch.randn(M, k, device=dev).bfloat16()
        err = rel_err(qmatmul(x, qm), qmatmul_reference(x, qm.raw, qtype, n, k))
        if not err < 2e-2:
            raise SystemExit(f"{qtype.name} {n}x{k} M={M}: kernel differs from the reference by {err:.2e}")
        t_q = graph_time_ms(lambda: qmatmul(x, quant()), args.warmup, args.repeats)
        t_d = graph_time_ms(lambda: x @ dense().T, args.warmup, args.repeats)
        rows.append({"qtype": qtype.name, "n": n, "k": k, "m": M, "bytes": qm.nbytes, "rel_err": err,
                     "quant": t_q, "bf16": t_d, "bf16_bytes": w.numel() * 2})
    del w
    return rows


def bench_experts(qtype: Q, n: int, k: int, args, rng) -> dict:
    dev = torch.device(args.device)
    raw = random_quantized((EXPERTS, n, k), qtype, rng, 0.02)
    qe = QuantExperts.from_gguf_bytes(raw, qtype, EXPERTS, n, k).to(dev)
    x = torch.randn(PAIRS, k, device=dev).bfloat16()
    ids = torch.randperm(EXPERTS, device=dev)[:PAIRS]
    err = rel_err(qmatmul_experts(x, qe, ids), qmatmul_experts_reference(x, qe.raw, ids, qtype, n, k))
    if not err < 2e-2:
        raise SystemExit(f"{qtype.name} experts {n}x{k}: kernel differs from the reference by {err:.2e}")
    draws = rotating([torch.randperm(EXPERTS, device=dev)[:PAIRS] for _ in range(64)])  # cold experts
    t = graph_time_ms(lambda: qmatmul_experts(x, qe, draws()), args.warmup, args.repeats)
    return {"qtype": qtype.name, "n": n, "k": k, "pairs": PAIRS, "bytes": PAIRS * qe.nbytes // EXPERTS,
            "rel_err": err, "quant": t}


def decode_shapes() -> list[tuple[str, str, int, int]]:
    """(name, kind, N, K) of every quantized matrix a qwen3.6-35b-a3b decode step multiplies: the
    projections as the engine merges them (``engine.model.weights.merge_rows``), the LM head
    and the routed experts (kind ``moe``: the fused gate/up and down launches of 8 pairs)."""
    from engine.gguf.make_model import preset_config

    c = preset_config("qwen3.6-35b-a3b", vocab=248320)
    gdn_v = c.gdn_v_heads * c.gdn_head_v
    return [
        ("attn_qkv", "gemv", 2 * c.n_head * c.head_dim + 2 * c.n_head_kv * c.head_dim, c.hidden),
        ("attn_out", "gemv", c.hidden, c.n_head * c.head_dim),
        ("gdn_in", "gemv", 2 * c.gdn_k_heads * c.gdn_head_k + 2 * gdn_v + 2 * c.gdn_v_heads, c.hidden),
        ("gdn_out", "gemv", c.hidden, gdn_v),
        ("shared_gate_up", "gemv", 2 * c.shared_ffn, c.hidden),
        ("shared_down", "gemv", c.hidden, c.shared_ffn),
        ("lm_head", "gemv", c.vocab, c.hidden),
        ("experts", "moe", c.expert_ffn, c.hidden),  # gate/up [ffn, hidden] and down [hidden, ffn]
    ]


# K tiles up to the whole of K (2048 at most shapes, 4096 at the output projections): such a tile
# issues every weight load of a program before any use, which may keep more bytes in flight. A tile
# holds at most 32 x 1024 weights, the largest of the grid before K tiles of 2048 and 4096 came in
# (16 x 4096 and 32 x 2048 would take twice its registers, 32 x 4096 four times), and ``tile_grid``
# leaves out K tiles past a launch's K: 21 points at K 4096, 19 at 2048, 12 at 512, so the small K
# tiles stay (128, which has not won a shape on the H200, is the first to drop should it pass ~24).
MAX_TILE = 32 * 1024
TILE_GRID = [dict(gemv_block_n=bn, gemv_block_k=bk) for bn in (4, 8, 16, 32)
             for bk in (128, 256, 512, 1024, 2048, 4096) if bn * bk <= MAX_TILE]
TILE_VARIANTS = [dict(gemv_num_warps=2), dict(gemv_num_warps=8), dict(gemv_num_warps=16), dict(gemv_split_k=1)]
# the row kernels: warps (splitting K; in the experts' down launch one pair each, so at least top-k) x unroll
ROWS_GRID = {kind: [dict(gemv_rows_warps=w, gemv_rows_unroll=u) for w in warps for u in (2, 4, 8)]
             for kind, warps in (("gemv", (2, 4, 8)), ("moe_gate_up", (2, 4, 8)), ("moe_down", (8, 16)))}
ROWS_VARIANTS = [dict(gemv_split_k=1), dict(gemv_split_k=2)]
# the word GEMV (Q4_0, one token): rows a program x (K tile, warps), the tile holding a block for every lane
WORDS_TILES = [(bk, w) for bk in (1024, 2048, 4096) for w in (1, 2, 4) if bk >= 32 * 32 * w]
FIELDS = ("gemv_block_n", "gemv_block_k", "gemv_num_warps", "gemv_split_k", "gemv_rows_warps", "gemv_rows_unroll",
          "gemv_pair_split", "gemv_words")


def words_grid(k: int, kind: str = "gemv") -> list[dict]:
    """The word kernels' candidates for a launch over ``k`` columns: K tiles that divide K (the GEMV and the
    experts' gate/up), or output rows a program that fill the lane groups (the experts' down, K in one
    tile: 32 // (k // 32) lanes groups a warp)."""
    if kind == "moe_down":
        nb = k // 32
        groups = 32 // nb if k % 32 == 0 and 2 <= nb <= 32 and nb & (nb - 1) == 0 else 0
        return [dict(gemv_words=1, gemv_block_n=r, gemv_num_warps=w)
                for r in (2, 4, 8, 16) for w in (1, 2, 4) if groups and r % (groups * w) == 0]
    return [dict(gemv_words=1, gemv_block_n=bn, gemv_block_k=bk, gemv_num_warps=w)
            for bn in (4, 8, 16, 32) for bk, w in WORDS_TILES if k % bk == 0]


def tile_grid(k: int, kind: str = "gemv") -> list[dict]:
    """``TILE_GRID`` for a launch over ``k`` columns: K tiles up to the smallest power of two covering
    K, as larger ones only add masked blocks (whose loads still issue, on blocks in bounds). The
    experts' down launch tries each tile both ways: a program per token, or per pair
    (``gemv_pair_split``)."""
    whole = 1 << (k - 1).bit_length()
    grid = [t for t in TILE_GRID if t["gemv_block_k"] <= whole]
    return grid + [t | {"gemv_pair_split": 1} for t in grid] if kind == "moe_down" else grid


def expert_case(n: int, k: int, qtype: Q, layout: str, dev: torch.device, rng: np.random.Generator):
    """One token's experts as a decode step runs them: ``EXPERTS`` stacked gate, up [n, k] and down
    [k, n] with ``PAIRS`` of them routed, and a shared expert of the same shape riding in the same two
    launches; random blocks in ``layout``. Returns (stack, shared, x, ids, w, float32 reference)."""
    stack = [QuantExperts.from_gguf_bytes(random_quantized((EXPERTS, a, b), qtype, rng, 0.02), qtype, EXPERTS, a, b)
             .to(dev).with_layout(layout) for a, b in ((n, k), (n, k), (k, n))]
    x = torch.randn(1, k, device=dev).bfloat16()
    ids = torch.randperm(EXPERTS, device=dev)[:PAIRS].reshape(1, PAIRS)
    w = torch.softmax(torch.randn(1, PAIRS, device=dev), -1)
    s_gu = QuantMatrix.from_gguf_bytes(random_quantized((2 * n, k), qtype, rng, 0.02), qtype, 2 * n, k).to(dev)
    s_down = QuantMatrix.from_gguf_bytes(random_quantized((k, n), qtype, rng, 0.02), qtype, k, n).to(dev)
    shared = (s_gu.with_layout(layout), s_down.with_layout(layout), torch.randn(k, device=dev) * 0.05)
    gu = qmatmul_reference(x.float(), s_gu.ggml_raw, qtype, 2 * n, k)
    act = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    gate = torch.sigmoid(x.float() @ shared[2])[:, None]
    ref = (quantized_moe(x, stack, ids, w, impl="torch").float()
           + gate * qmatmul_reference(act, s_down.ggml_raw, qtype, k, n))
    return stack, shared, x, ids, w, ref


def sweep(args, rng) -> None:
    """The fastest decode tiles per 35B shape: the grid at 4 warps, then warps and no-split
    variants of the grid's best, each checked against the reference before timing."""
    from datetime import datetime, timezone

    from dataclasses import replace

    from engine.kernels.quant.reference import SPLIT_QTYPES, split_layout_on
    from engine.kernels.quant.tuned import TABLE, chip_of, load_table, read_tables, write_table

    dev = torch.device(args.device)
    name, chip = torch.cuda.get_device_name(dev), chip_of(dev)
    before = dict(load_table(TABLE))  # the table as it stands: each shape's current tiles are a candidate
    entries = []
    if args.sweep_shapes and args.write_tuned is not None:  # keep this GPU's shapes not swept
        for kept in read_tables(args.write_tuned):
            if kept["device"] == name:
                entries = [e for e in kept["entries"] if e.get("shape") not in args.sweep_shapes]
    print(f"{'qtype':>5} {'shape':>16} {'kind':>7} {'MB':>7} {'default us':>10} {'best us':>8} {'GB/s':>6} "
          f"{'speedup':>7}  tiles")
    for qtype in args.qtypes:
        for label, kind, n, k in decode_shapes():
            if (k % 256 and qtype not in (Q.Q4_0, Q.Q8_0)) or (args.sweep_shapes and label not in args.sweep_shapes):
                continue
            # the layout the loader gives these weights on this device (``split_layout_on``)
            layout = "split" if qtype in SPLIT_QTYPES and split_layout_on(dev) else "ggml"
            if kind == "gemv":
                qm = QuantMatrix.from_gguf_bytes(random_quantized((n, k), qtype, rng, 0.02), qtype, n, k).to(dev)
                qm = qm.with_layout(layout)
                copies = max(1, -(-ROTATE_BYTES // qm.nbytes))
                mats = rotating([qm] + [replace(qm, raw=qm.raw.clone()) for _ in range(copies - 1)])
                x = torch.randn(1, k, device=dev).bfloat16()
                ref = qmatmul_reference(x, qm.ggml_raw, qtype, n, k)
                nbytes = qm.nbytes
            else:
                stack, shared, x, ids, w, ref = expert_case(n, k, qtype, layout, dev, rng)
                draws = rotating([torch.randperm(EXPERTS, device=dev)[:PAIRS].reshape(1, PAIRS) for _ in range(64)])
                nbytes = PAIRS * sum(e.nbytes for e in stack) // EXPERTS + shared[0].nbytes + shared[1].nbytes

            def timed(tiles, down=None, kind=kind, label=label):
                """Milliseconds per call with these tiles (for ``moe``: the gate/up launch's, and the
                down launch's when given), after a check against the reference."""
                cfg = QuantKernelConfig(**tiles)
                down_cfg = QuantKernelConfig(**down) if down is not None else None
                if kind == "gemv":
                    fn = lambda: qmatmul(x, mats(), cfg)  # noqa: E731
                    try:
                        out = qmatmul(x, mats(), cfg)
                    except Exception as exc:  # noqa: BLE001 - a candidate kernel that does not build or run
                        if not tiles.get("gemv_words"):
                            raise
                        print(f"    {label} {tiles}: the word GEMV failed ({exc!r:.300}); skipped", flush=True)
                        return float("inf")
                else:
                    fn = lambda: quantized_moe_triton(x, *stack, draws(), w, cfg, down_cfg, shared)  # noqa: E731
                    try:
                        out = quantized_moe_triton(x, *stack, ids, w, cfg, down_cfg, shared)
                    except Exception as exc:  # noqa: BLE001 - as above
                        if not tiles.get("gemv_words"):
                            raise
                        print(f"    {label} {tiles}: the word launch failed ({exc!r:.300}); skipped",
                              flush=True)
                        return float("inf")
                err = rel_err(out, ref)
                if not err < 2e-2 and tiles.get("gemv_words"):  # a candidate kernel: reported, never picked
                    print(f"    {label} {tiles}: the word kernel differs from the reference by {err:.2e}; skipped",
                          flush=True)
                    return float("inf")
                if not err < 2e-2:
                    raise SystemExit(f"{qtype.name} {label} {tiles} {down}: kernel differs from the reference "
                                     f"by {err:.2e}")
                ms = graph_time_ms(fn, args.warmup, args.repeats)["ms"]
                if args.verbose:
                    print(f"    {label} {kind} {tiles} {down or ''}: {ms * 1e3:.1f} us", flush=True)
                return ms

            def current(kind_, n_, k_):
                """The tiles the table gave this launch when the sweep began, by the GPU's name or else its chip
                (the defaults where it had none)."""
                return {f: getattr(QuantKernelConfig(), f) for f in FIELDS} | (
                    before.get((name, kind_, qtype.name, n_, k_)) or before.get((chip, kind_, qtype.name, n_, k_), {}))

            def fastest(time_of, kind_, n_, k_):
                """Among the defaults and the table's current tiles: the block grid at 4 warps (K tiles up
                to the launch's K), then warps and no-split variants of its best; the row kernels' grid,
                then (GEMV) K-split variants of its best (each as ``--grid`` says): (ms, tiles)."""
                results = [(time_of({}), {}), (time_of(current(kind_, n_, k_)), current(kind_, n_, k_))]
                words_on = args.grid in ("words", "all") and qtype == Q.Q4_0
                blocks_on = args.grid in ("blocks", "both", "all")
                for on, grid, variants in ((blocks_on, tile_grid(k_, kind_), TILE_VARIANTS),
                                           (words_on, words_grid(k_, kind_), []),
                                           (args.grid in ("rows", "both", "all"), ROWS_GRID[kind_],
                                            ROWS_VARIANTS if kind_ == "gemv" else [])):
                    if not on:
                        continue
                    part = [(time_of(t), t) for t in grid]
                    best = min(part, key=lambda r: r[0])[1]
                    part += [(time_of(best | v), best | v) for v in variants]
                    results += part
                return min(results, key=lambda r: r[0])

            default = timed({})
            if kind == "gemv":
                best_ms, best = fastest(timed, "gemv", n, k)
                launches = [(kind, n, k, best)]
            else:  # the gate/up launch's tiles (the down launch's as the table has them), then the down
                # launch's own with the gate/up launch's best
                _, best = fastest(lambda t: timed(t, current("moe_down", k, n)), "moe_gate_up", n, k)
                best_ms, down = fastest(lambda t: timed(best, t), "moe_down", k, n)
                launches = [("moe_gate_up", n, k, best), ("moe_down", k, n, down)]
            measured = {"shape": label, "us": best_ms * 1e3, "default_us": default * 1e3, "bytes": nbytes}
            for kind_, n_, k_, tiles in launches:
                cfg = QuantKernelConfig(**tiles)
                entries.append({"kind": kind_, "qtype": qtype.name, "n": n_, "k": k_, **measured,
                                **{f: getattr(cfg, f) for f in FIELDS}})
            print(f"{qtype.name:>5} {f'{n}x{k}':>16} {kind:>7} {nbytes / 1e6:7.2f} {default * 1e3:10.1f} "
                  f"{best_ms * 1e3:8.1f} {gbps(nbytes, best_ms):6.0f} {default / best_ms:6.2f}x  "
                  f"{[t for *_, t in launches]}", flush=True)
            torch.cuda.empty_cache()
            # written after every shape (atomically), so that a sweep cut short keeps what it measured
            meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
                    "chip": chip, "warmup": args.warmup, "repeats": args.repeats}
            if args.json is not None:
                args.json.write_text(json.dumps({"device": name, **meta, "entries": entries}, indent=1))
            if args.write_tuned is not None:
                write_table(args.write_tuned, name, entries, meta)
    if args.write_tuned is not None:
        print(f"wrote {len(entries)} tile entries for {name} to {args.write_tuned}")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"bench/quant_matmul.py needs a CUDA device, got {args.device!r}")
    rng = np.random.default_rng(0)
    if args.sweep:
        return sweep(args, rng)
    bandwidth = copy_bandwidth(dev, args.warmup, args.repeats)
    print(f"{torch.cuda.get_device_name(dev)}: device copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(f"{'qtype':>5} {'shape':>12} {'M':>4} {'MB':>7} {'quant us':>9} {'GB/s':>7} {'% HBM':>6} "
          f"{'bf16 us':>9} {'GB/s':>7} {'speedup':>7} {'rel err':>8}")
    rows, expert_rows = [], []
    for qtype in args.qtypes:
        for name in args.shapes:
            if name == "lm_head" and qtype not in LM_HEAD_QTYPES:
                continue
            n, k = SHAPES[name]
            for r in bench_matrix(qtype, n, k, args.m, args, rng):
                rows.append(r)
                q, d = r["quant"]["ms"], r["bf16"]["ms"]
                print(f"{qtype.name:>5} {f'{n}x{k}':>12} {r['m']:4d} {r['bytes'] / 1e6:7.2f} {q * 1e3:9.1f} "
                      f"{gbps(r['bytes'], q):7.0f} {100 * gbps(r['bytes'], q) * 1e9 / bandwidth:5.1f}% "
                      f"{d * 1e3:9.1f} {gbps(r['bf16_bytes'], d):7.0f} {d / q:6.2f}x {r['rel_err']:8.1e}")
            torch.cuda.empty_cache()
        if not args.no_experts:
            for n, k in (SHAPES["gate_up"], SHAPES["down"]):
                r = bench_experts(qtype, n, k, args, rng)
                expert_rows.append(r)
                q = r["quant"]["ms"]
                print(f"{qtype.name:>5} {f'E{n}x{k}':>12} {PAIRS:4d} {r['bytes'] / 1e6:7.2f} {q * 1e3:9.1f} "
                      f"{gbps(r['bytes'], q):7.0f} {100 * gbps(r['bytes'], q) * 1e9 / bandwidth:5.1f}% "
                      f"{'-':>9} {'-':>7} {'-':>7} {r['rel_err']:8.1e}")
            torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_bandwidth_Bps": bandwidth,
                                         "torch": torch.__version__, "rows": rows, "experts": expert_rows},
                                        indent=2))


if __name__ == "__main__":
    main()
