"""Load time, prefill tok/s at given prompt lengths, decode tok/s and peak memory of one model.

    python bench/engine_bench.py --model M.gguf [--prompt-lens 512,4096] [--decode 64]
        [--repeats 3] [--weights dense|quantized] [--experts dense|quantized] [--no-graph | --graph-only]
        [--prefill-graph on|off|both]
        [--json out.json]

Prompts are random token ids (the figures are about speed, not text). Each figure is the
median of ``--repeats`` runs after one warm-up run, with min and max beside it. Decoding is
measured eagerly and, where the engine can capture it, replayed from a CUDA graph (the
capture happens in the graph path's warm-up run); ``--no-graph`` measures eager only, ``--graph-only``
the graph only (an eager decode of the 35B shapes takes seconds a run).
Prompts prefill as the engine does by default (through the captured padded prefill where decoding is
captured, ``--prefill-graph on``); ``off`` prefills eagerly; ``both`` measures each prompt length both
ways, in alternating runs, under ``prefill`` (eager) and ``prefill_graph``.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import commit, machine, spread

from engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--prompt-lens", default="512,4096")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded per decode run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--weights", default="dense", choices=("dense", "quantized"),
                    help="projection matrices dequantized at load, or kept as GGUF blocks")
    ap.add_argument("--cold-format", default="dense", choices=("dense", "quantized"),
                    help="cold experts on the CPU held dense or as GGUF blocks")
    ap.add_argument("--experts", default="dense", choices=("dense", "quantized"),
                    help="quantized: every routed expert on the device in its GGUF blocks (the appliance's form)")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--no-graph", action="store_true", help="measure eager decoding only")
    only.add_argument("--graph-only", action="store_true", help="measure decoding from the CUDA graph only")
    ap.add_argument("--prefill-graph", default="on", choices=("off", "on", "both"),
                    help="on (the engine's default): prefill through the captured padded prefill "
                         "(engine.model.prefill_graph) where it applies; off: eagerly; both: each length "
                         "both ways, in alternating runs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    quantized = args.experts == "quantized"
    eng = Engine.from_gguf(args.model, device=args.device, dtype=args.dtype, weights=args.weights,
                           cold_format="quantized" if quantized else args.cold_format,
                           hot_format=args.experts, expert_budget_mb=0 if quantized else None,
                           cuda_graph=not args.no_graph)
    if quantized:  # every expert hot, in its blocks
        placement = eng.set_expert_budget(0)
        eng.set_expert_budget(placement.n_expert * sum(placement.expert_bytes) / 2**20)
    eng.prefill_graph = args.prefill_graph == "on"
    eng.prefill_capture_after = 0  # the steady state: each length's warm-up run captures
    load_s = time.perf_counter() - t0
    load_mem = torch.cuda.memory_allocated() / 2**20 if eng.device.type == "cuda" else 0.0
    vocab = eng.config.vocab
    gen = torch.Generator().manual_seed(0)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "commit": commit(), "model": str(args.model), "weights": args.weights, "experts": args.experts,
        "model_bytes": args.model.stat().st_size,
        "device": str(eng.device), "dtype": str(eng.dtype), "load_s": load_s,
        "weights_mem_mb": load_mem, "prefill": {}, "decode": {},
    }
    print(f"loaded {args.model.name} in {load_s:.1f} s on {eng.device} ({load_mem:.0f} MiB)", flush=True)

    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.prefill_graph]
    if len(modes) > 1:
        result["prefill_graph"] = {}
    for n in [int(x) for x in args.prompt_lens.split(",") if x]:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        runs, capture = {}, {}
        for captured in modes:  # warm-up (and capture)
            eng.prefill_graph = captured
            capture[captured] = eng.generate(ids, 1, ignore_eos=True).timings.extra.get("prefill_graph_capture_s")
            runs[captured] = []
        for _ in range(args.repeats):
            for captured in modes:
                eng.prefill_graph = captured
                runs[captured].append(eng.generate(ids, 1, ignore_eos=True).timings)
        for captured in modes:
            key = "prefill_graph" if captured and len(modes) > 1 else "prefill"
            got = runs[captured]
            fig = result[key][n] = {
                "tok_s": spread([n / t.prefill_s for t in got]),
                "peak_mem_mb": max(t.peak_mem_mb for t in got),
                "path": got[0].extra.get("prefill_path", "eager"),
            }
            blocker = got[0].extra.get("prefill_graph_blocker")
            if blocker:
                fig["blocker"] = blocker
            if capture[captured] is not None:
                fig["capture_s"] = capture[captured]
            print(f"prefill {n:>6} tokens: {fig['tok_s']['median']:10.1f} tok/s "
                  f"(peak {fig['peak_mem_mb']:.0f} MiB, {fig['path']}{f': {blocker}' if blocker else ''}"
                  f"{f'; captured in {capture[captured]:.2f} s' if capture[captured] is not None else ''})", flush=True)
    eng.prefill_graph = args.prefill_graph == "on"

    ids = torch.randint(0, vocab, (16,), generator=gen).tolist()
    blocker = eng.decode_graph_blocker()
    if blocker is not None:
        print(f"decode graph: not used ({blocker})", flush=True)
    if args.graph_only and blocker is not None:
        raise SystemExit(f"--graph-only: the decode graph cannot be used here ({blocker})")
    for graph in (False, True):
        if graph and (args.no_graph or blocker is not None) or not graph and args.graph_only:
            continue
        eng.cuda_graph = graph
        warm = eng.generate(ids, args.decode, ignore_eos=True).timings
        runs = []
        for _ in range(args.repeats):
            g = eng.generate(ids, args.decode, ignore_eos=True)
            if g.timings.new_tokens != args.decode:
                raise SystemExit(f"decode stopped early ({g.stop_reason}) after {g.timings.new_tokens} tokens")
            runs.append(g.timings)
        path = runs[0].extra["decode_path"]
        result["decode"][path] = {"tokens": args.decode, "tok_s": spread([t.decode_tok_s for t in runs]),
                                  "peak_mem_mb": max(t.peak_mem_mb for t in runs)}
        capture = warm.extra.get("decode_graph_capture_s")
        if capture is not None:
            result["decode"][path]["capture_s"] = capture
        fig = result["decode"][path]
        print(f"decode {args.decode} tokens, {path}: {fig['tok_s']['median']:.2f} tok/s "
              f"(min {fig['tok_s']['min']:.2f}, max {fig['tok_s']['max']:.2f}; peak {fig['peak_mem_mb']:.0f} MiB"
              f"{f'; captured in {capture:.2f} s' if capture is not None else ''})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
