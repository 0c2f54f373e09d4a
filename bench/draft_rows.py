"""Where a DFlash draft's acceptance comes from, row by row, on the CPU or a GPU.

For each window of a corpus (the distillation's seeded windows of the training documents, or the
held-out documents' evaluation windows), the target continues it greedily; then the draft's
teacher-forced acceptance is measured on that row (the training loss's own count, every anchor of
the generated part) and, with ``--speculative``, the acceptance of speculative decoding of the same
prompt. The two agree when inference matches training; a per-row listing shows which rows carry a
mean (degenerate loops of the target are accepted almost whole).

    python bench/draft_rows.py --draft D.gguf [--target models/luce-target.gguf] [--corpus train.txt]
        [--split train|held] [--rows 24] [--prompt 64] [--new 96] [--speculative] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.dflash.block_loss import block_loss, default_gamma  # noqa: E402
from engine.dflash.distill import draw_prompts  # noqa: E402
from engine.dflash.gguf_io import load_draft  # noqa: E402
from engine.dflash.speculative import speculative_generate  # noqa: E402
from engine.dflash.train import read_corpus, split_documents  # noqa: E402
from engine.dflash.train_rows import target_pass  # noqa: E402
from engine.gguf.reader import GGUFFile  # noqa: E402
from engine.model.qwen35moe import Qwen35MoE  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.train.batches import TokenStream, eval_windows  # noqa: E402


def greedy(model: Qwen35MoE, ids: list[int], n: int) -> list[int]:
    """The target's greedy continuation of ``ids``, one token per forward."""
    state = model.new_state(len(ids) + n + 1)
    logits = model.forward(torch.tensor(ids, device=model.device), state, logits="last").logits
    new: list[int] = []
    for _ in range(n):
        new.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(new[-1:], device=model.device), state, logits="last").logits
    return new


def teacher_forced(model: Qwen35MoE, draft, row: torch.Tensor, first: int) -> float:
    """Mean accepted length (the training loss's count) over anchors ``first - 1 ..`` of ``row``."""
    feats, labels = target_pass(model, row, draft.cfg.target_layer_ids, "target")
    anchors = torch.arange(first - 1, row.shape[0] - 1, device=row.device)
    with torch.no_grad():
        _, acc = block_loss(draft, model.weights.embed, model.weights.output, feats.float(), row, labels, anchors,
                            default_gamma(draft.cfg.block_size))
    return float(acc.float().mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", default="models/luce-target.gguf")
    ap.add_argument("--corpus", default=None, help="the corpus's train.txt (default: built under /tmp/corpus)")
    ap.add_argument("--split", choices=("train", "held"), default="train")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--speculative", action="store_true", help="also decode each prompt speculatively")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    corpus = args.corpus
    if corpus is None:
        from engine.train.corpus import build_corpus

        corpus = str(build_corpus("/tmp/corpus", n_retrieval=0).train)
    model = Qwen35MoE.from_gguf(GGUFFile(args.target), device=args.device, dtype=torch.float32)
    tokenizer = Tokenizer.from_gguf(args.target)
    draft = load_draft(args.draft, device=args.device)
    train_docs, held_docs = split_documents(read_corpus(corpus), 0.05)
    docs = train_docs if args.split == "train" else held_docs
    stream = TokenStream.from_documents(tokenizer.encode(d) for d in docs)
    if args.split == "train":  # as the distillation draws its prompts
        prompts = draw_prompts(stream, args.rows, args.prompt, args.seed)
    else:  # as the held-out report does
        prompts = eval_windows(stream, args.prompt, args.rows * args.prompt)[:args.rows]
    rows = []
    for prompt in prompts:
        ids = prompt.tolist()
        new = greedy(model, ids, args.new)
        row = torch.tensor(ids + new, device=model.device)
        found = {"teacher_forced": round(teacher_forced(model, draft, row, len(ids)), 3),
                 "distinct_new": len(set(new)), "text": tokenizer.decode(new)[:80]}
        if args.speculative:
            _, stats = speculative_generate(model, draft, ids, args.new, spec_len=draft.cfg.block_size,
                                            fallback_threshold=0.0)
            found["speculative"] = round(stats.acceptance_length, 3)
        rows.append(found)
        spec = f"  speculative {found['speculative']:5.2f}" if args.speculative else ""
        print(f"teacher-forced {found['teacher_forced']:5.2f}{spec}  distinct {found['distinct_new']:3d}  "
              f"{found['text']!r}", flush=True)
    tf = [r["teacher_forced"] for r in rows]
    summary = {"rows": len(rows), "mean": round(statistics.fmean(tf), 3), "median": round(statistics.median(tf), 3)}
    print(f"teacher-forced acceptance over {len(rows)} rows: mean {summary['mean']:.2f}, median {summary['median']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
