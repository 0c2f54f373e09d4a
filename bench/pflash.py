"""PFlash on needle-in-a-haystack: retrieval accuracy and time to first token (TTFT) of the
whole prompt and of PFlash-compressed prompts, per context length and expert budget.

    python bench/pflash.py --target T.gguf --drafter D.gguf [--contexts 4096,8192,16384]
        [--ratios 0.05,0.1,0.2,0.3] [--cases 20] [--budgets all,50%] [--json out.json]

Cases come from ``tuner.workloads.niah_grid`` (one per needle depth, evenly spread over the
context). Every run prefills from an empty state, then decodes ``--max-new`` greedy tokens,
which ``score_niah`` checks for the needle's value. TTFT runs from the prompt ids on the
device to the first token id on the host: the drafter pass (scoring, selection) and the
target prefill for PFlash, the target prefill alone without it. ``needle kept`` is the
share of cases whose needle value tokens all survived selection. A budget is ``all`` (every
expert on the GPU), megabytes, or a percentage of the target's expert bytes. The JSON file
is rewritten after each context length, so an interrupted run keeps what it measured.
On CUDA the Triton scorer is first checked against and timed beside its torch reference on
the drafter's attention shapes at each context length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import commit, machine, spread

from engine.engine import Engine
from engine.pflash import Drafter, PFlashConfig, compressed_prefill
from tuner.workloads import NiahCase, haystack_text, niah_grid, score_niah


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expert_mb(eng: Engine) -> float:
    return sum(t.numel() * t.element_size() for layer in eng.model.weights.layers
               for t in (layer.moe.experts.gate, layer.moe.experts.up, layer.moe.experts.down)) / 2**20


def parse_budget(text: str, eng: Engine) -> float | None:
    """``all`` -> None (no budget), ``N%`` -> that share of the expert bytes, else megabytes."""
    if text == "all":
        return None
    if text.endswith("%"):
        return expert_mb(eng) * float(text[:-1]) / 100
    return float(text)


def needle_span(eng: Engine, case: NiahCase) -> tuple[int, int]:
    """Token indices [start, end) of the needle value; the needle sits at a line start."""
    at = case.prompt.index(case.needle_value, case.prompt.index(case.needle))
    start = len(eng.tokenizer.encode(case.prompt[:at]))
    return start, len(eng.tokenizer.encode(case.prompt[:at + len(case.needle_value)]))


def greedy_tail(model, state, first: int, n: int) -> list[int]:
    tokens = [first]
    for _ in range(n - 1):
        out = model.forward(torch.tensor([tokens[-1]], device=model.device), state, logits="last")
        tokens.append(int(out.logits[-1].argmax()))
    return tokens


@torch.inference_mode()
def run_full(eng: Engine, ids: torch.Tensor, max_new: int) -> dict:
    model = eng.model
    sync(eng.device)
    t0 = time.perf_counter()
    state = model.new_state(ids.shape[0] + max_new)
    first = int(model.forward(ids, state, logits="last").logits[-1].argmax())
    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "tokens": greedy_tail(model, state, first, max_new), "kept": ids.shape[0]}


@torch.inference_mode()
def run_pflash(eng: Engine, drafter: Drafter, ids: torch.Tensor, ratio: float, config: PFlashConfig,
               max_new: int) -> dict:
    sync(eng.device)
    t0 = time.perf_counter()
    res = compressed_prefill(eng.model, ids, drafter=drafter, keep_ratio=ratio, config=config, reserve=max_new)
    first = int(res.logits.argmax())
    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "tokens": greedy_tail(eng.model, res.state, first, max_new),
            "kept": res.selection.kept, "kept_index": res.selection.kept_index,
            "drafter_s": res.selection.drafter_s, "target_prefill_s": res.target_prefill_s}


def summarise(runs: list[dict], baseline_ttft: float | None) -> dict:
    ttft = spread([r["ttft_s"] for r in runs])
    row = {"accuracy": sum(r["correct"] for r in runs) / len(runs), "ttft_s": ttft,
           "kept_tokens": statistics.median(r["kept"] for r in runs),
           "speedup": baseline_ttft / ttft["median"] if baseline_ttft else 1.0}
    if "drafter_s" in runs[0]:
        row["drafter_s"] = statistics.median(r["drafter_s"] for r in runs)
        row["target_prefill_s"] = statistics.median(r["target_prefill_s"] for r in runs)
        row["needle_kept"] = sum(r["needle_kept"] for r in runs) / len(runs)
    return row


def time_scorers(drafter: Drafter, contexts: list[int], n_look: int) -> list[dict]:
    """Torch reference against the Triton scorer on random queries/keys of the drafter's shapes,
    checked against each other before timing (CUDA only)."""
    import triton.testing

    from engine.pflash.score import token_scores
    from engine.pflash.score_triton import token_scores_triton

    cfg, rows = drafter.cfg, []
    gen = torch.Generator(device=drafter.device).manual_seed(0)
    for t in contexts:
        qs = [torch.randn(cfg.n_head, n_look, cfg.head_dim, device=drafter.device, generator=gen,
                          dtype=drafter.model.dtype) for _ in cfg.attention_layers]
        ks = [torch.randn(cfg.n_head_kv, t, cfg.head_dim, device=drafter.device, generator=gen,
                          dtype=drafter.model.dtype) for _ in cfg.attention_layers]
        ref, got = token_scores(qs, ks), token_scores_triton(qs, ks)
        err = ((got - ref).abs() / ref.clamp_min(1e-12)).max().item()
        if err > 1e-2:
            raise SystemExit(f"Triton scorer differs from the reference by {err:.3g} (relative) at {t} tokens")
        row = {"context": t, "max_rel_err": err,
               "torch_ms": triton.testing.do_bench(lambda: token_scores(qs, ks), return_mode="median"),
               "triton_ms": triton.testing.do_bench(lambda: token_scores_triton(qs, ks), return_mode="median")}
        print(f"scorer at {t:>6} tokens: torch {row['torch_ms']:.3f} ms, triton {row['triton_ms']:.3f} ms "
              f"(max rel err {err:.2g})", flush=True)
        rows.append(row)
    return rows


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--drafter", required=True, type=Path)
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--ratios", default="0.05,0.1,0.2,0.3")
    ap.add_argument("--cases", type=int, default=20, help="cases per context length (needle depths)")
    ap.add_argument("--budgets", default="all,50%")
    ap.add_argument("--max-new", type=int, default=10, help="greedy tokens decoded for the answer")
    ap.add_argument("--threshold", type=int, default=1024, help="PFlash compresses prompts longer than this")
    ap.add_argument("--head-chunks", type=int, default=PFlashConfig.head_chunks)
    ap.add_argument("--tail-chunks", type=int, default=PFlashConfig.tail_chunks)
    ap.add_argument("--renumber", action="store_true", help="renumber kept positions instead of keeping them")
    ap.add_argument("--haystack-file", type=Path, default=None, help="held-out corpus file (default: stdlib)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",") if x]
    ratios = [float(x) for x in args.ratios.split(",") if x]
    if args.cases < 2:
        raise SystemExit("--cases must be at least 2 (needle depths from 0 to 1)")
    config = PFlashConfig(threshold=args.threshold, head_chunks=args.head_chunks, tail_chunks=args.tail_chunks,
                          renumber=args.renumber)

    eng = Engine.from_gguf(args.target, device=args.device, dtype=args.dtype)
    drafter = Drafter.from_gguf(args.drafter, target_vocab=eng.tokenizer, device=eng.device, dtype=eng.dtype)
    print(f"target {args.target.name} ({eng.config.n_layers} layers, {expert_mb(eng):.1f} MiB of experts), "
          f"drafter {args.drafter.name} ({drafter.cfg.n_layers} layers) on {eng.device}", flush=True)
    text = haystack_text(6 * max(contexts) + 4096, args.haystack_file)
    depths = [i / (args.cases - 1) for i in range(args.cases)]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "target": str(args.target), "drafter": str(args.drafter),
              "device": str(eng.device), "dtype": str(eng.dtype), "config": asdict(config),
              "max_new": args.max_new, "cases": args.cases, "rows": []}
    if eng.device.type == "cuda":
        result["scorer"] = time_scorers(drafter, contexts, config.n_lookahead)

    header = (f"{'budget':>8} {'context':>7} {'keep':>5} {'acc':>5} {'needle':>6} {'kept':>6} "
              f"{'TTFT s':>8} {'min':>7} {'max':>7} {'drafter':>7} {'speedup':>7}")
    lines = [header]
    print(header, flush=True)
    for budget_text in args.budgets.split(","):
        budget = parse_budget(budget_text, eng)
        if budget is not None:
            eng.set_expert_budget(budget)
        for context in contexts:
            cases = niah_grid(eng.tokenizer, text, context_lengths=[context], depths=depths, seed=args.seed)
            prompts = [torch.tensor(eng.tokenizer.encode(c.prompt), device=eng.device) for c in cases]
            spans = [needle_span(eng, c) for c in cases]
            run_full(eng, prompts[0], 2)  # warm-up: allocator, kernels, caches
            run_pflash(eng, drafter, prompts[0], ratios[0], config, 2)
            baseline = None
            for ratio in [None] + ratios:
                runs = []
                for case, ids, (a, b) in zip(cases, prompts, spans):
                    if ratio is None:
                        r = run_full(eng, ids, args.max_new)
                    else:
                        r = run_pflash(eng, drafter, ids, ratio, config, args.max_new)
                        kept = set(r.pop("kept_index").tolist())
                        r["needle_kept"] = all(p in kept for p in range(a, b))
                    r["correct"] = score_niah(case, eng.tokenizer.decode(r.pop("tokens")))
                    runs.append(r)
                row = summarise(runs, baseline)
                if ratio is None:
                    baseline = row["ttft_s"]["median"]
                row |= {"budget": budget_text, "budget_mb": budget, "context": context, "keep_ratio": ratio,
                        "prompt_tokens": statistics.median(ids.shape[0] for ids in prompts)}
                result["rows"].append(row)
                line = (f"{budget_text:>8} {context:>7} {'-' if ratio is None else ratio:>5} "
                        f"{row['accuracy']:>5.2f} {_cell(row.get('needle_kept')):>6} {row['kept_tokens']:>6.0f} "
                        f"{row['ttft_s']['median']:>8.3f} {row['ttft_s']['min']:>7.3f} {row['ttft_s']['max']:>7.3f} "
                        f"{row.get('drafter_s', 0.0):>7.3f} {row['speedup']:>7.2f}")
                lines.append(line)
                print(line, flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    print("\n".join(["", "summary"] + lines))


if __name__ == "__main__":
    main()
