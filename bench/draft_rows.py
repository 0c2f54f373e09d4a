"""Where a DFlash draft's acceptance comes from, row by row, on the CPU or a GPU.

For each window of a corpus (the distillation's seeded windows of the training documents, or the
held-out documents' evaluation windows), the target continues it greedily; then the draft's
teacher-forced acceptance is measured on that row (the training loss's own count, every anchor of
the generated part) and, with ``--speculative``, the acceptance of speculative decoding of the same
prompt. The two agree when inference matches training; a per-row listing shows which rows carry a
mean (degenerate loops of the target are accepted almost whole).

The first drafted slot is looked at closely: how often the draft gets it, by how sure the target
was of that token (its top-1 probability), beside what predictors that read no target features get
on the same slots: the most frequent follower of the last two tokens in ``--ngram-docs`` documents of
``--ngram-corpus`` (default: the other side of the split), and the token that followed the last two tokens' latest earlier
occurrence in the row itself (prompt lookup).

The slots are also split by the loop the target is in at the anchor: the smallest period ``p`` such
that the last ``LOOP_WINDOW`` tokens equal those ``p`` before them (none when no period up to
``LOOP_MAX`` fits). Inside a loop, copying the token ``p`` back is right whenever the loop goes on;
the split shows at which periods the draft still gets the slot.

``--split workload`` takes the long-form prompts of issue 4's table (``tuner.workloads``, the same
seed: ``--corpus`` is then the held-out text itself, as ``bench/dflash.py`` reads it).

    python bench/draft_rows.py --draft D.gguf [--target models/luce-target.gguf] [--corpus train.txt]
        [--split train|held|workload] [--rows 24] [--prompt 64] [--new 96] [--speculative] [--ngram-corpus F]
        [--ngram-docs 1500] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
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


def teacher_forced(model: Qwen35MoE, draft, row: torch.Tensor, first: int) -> torch.Tensor:
    """Accepted lengths [anchors] (the training loss's count) at anchors ``first - 1 ..`` of ``row``."""
    feats, labels = target_pass(model, row, draft.cfg.target_layer_ids, "target")
    anchors = torch.arange(first - 1, row.shape[0] - 1, device=row.device)
    with torch.no_grad():
        _, acc = block_loss(draft, model.weights.embed, model.weights.output, feats.float(), row, labels, anchors,
                            default_gamma(draft.cfg.block_size))
    return acc


@torch.inference_mode()
def target_top1(model: Qwen35MoE, row: torch.Tensor) -> torch.Tensor:
    """[L] the target's top-1 probability at each position (for the token after it)."""
    logits = model.forward(row, model.new_state(row.shape[0]), logits="all").logits
    return logits.float().softmax(-1).amax(-1)


def follower_counts(tokenizer, docs: list[str]) -> dict[tuple[int, int], collections.Counter]:
    """Counts of the token after each pair of tokens in ``docs``."""
    counts: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for doc in docs:
        ids = tokenizer.encode(doc)
        for a, b, c in zip(ids, ids[1:], ids[2:]):
            counts[(a, b)][c] += 1
    return counts


def row_lookup(ids: list[int], a: int) -> int | None:
    """The token after the latest occurrence of ``ids[a - 1], ids[a]`` before ``a`` (prompt lookup)."""
    for j in range(a - 1, 0, -1):
        if ids[j - 1] == ids[a - 1] and ids[j] == ids[a]:
            return ids[j + 1]
    return None


P1_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0 + 1e-6)
LOOP_WINDOW = 16
LOOP_MAX = 128
PERIOD_BUCKETS = ((1, 4), (5, 16), (17, 64), (65, LOOP_MAX))


def loop_period(ids: list[int], a: int, window: int = LOOP_WINDOW, longest: int = LOOP_MAX) -> int | None:
    """The smallest p <= ``longest`` with ``ids[a - k] == ids[a - k - p]`` for k < ``window``, else None."""
    if a + 1 < window:
        return None
    tail = ids[a - window + 1:a + 1]
    for p in range(1, min(longest, a + 1 - window) + 1):
        if ids[a - window + 1 - p:a + 1 - p] == tail:
            return p
    return None


def loop_summary(slots: list[dict]) -> list[dict]:
    """Per period bucket (and none): the share of the slots, how often copying the token one period back is
    right, the draft's first-slot hit and its mean accepted length."""
    out = []
    for name, lo, hi in [("none", None, None)] + [(f"{lo}-{hi}", lo, hi) for lo, hi in PERIOD_BUCKETS]:
        sel = [s for s in slots if (s["period"] is None if lo is None
                                    else s["period"] is not None and lo <= s["period"] <= hi)]
        if sel:
            out.append({"period": name, "slots": len(sel), "share": round(len(sel) / len(slots), 3),
                        "copy_hit": None if lo is None else round(sum(s["copy"] for s in sel) / len(sel), 3),
                        "draft_hit": round(sum(s["draft"] for s in sel) / len(sel), 3),
                        "accepted": round(sum(s["accepted"] for s in sel) / len(sel), 3)})
    return out


def first_slot_summary(slots: list[dict]) -> dict:
    """Hit rates of the first drafted slot: the draft's overall and by the target's top-1 probability,
    and the feature-free predictors'."""
    n = len(slots)
    out = {"slots": n, "hit": {k: round(sum(s[k] for s in slots) / n, 3)
                               for k in ("draft", "pair_follower", "row_lookup", "draft_or_row_lookup")}}
    out["by_target_p1"] = []
    for lo, hi in zip(P1_EDGES, P1_EDGES[1:]):
        sel = [s for s in slots if lo <= s["p1"] < hi]
        if sel:
            out["by_target_p1"].append({"p1": f"{lo:g}-{min(hi, 1.0):g}", "share": round(len(sel) / n, 3),
                                        "draft_hit": round(sum(s["draft"] for s in sel) / len(sel), 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", default="models/luce-target.gguf")
    ap.add_argument("--corpus", default=None, help="the corpus's train.txt (default: built under /tmp/corpus)")
    ap.add_argument("--split", choices=("train", "held", "workload"), default="train")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--speculative", action="store_true", help="also decode each prompt speculatively")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--ngram-corpus", default=None,
                    help="text whose token pairs' followers are counted (default: the split's other side)")
    ap.add_argument("--ngram-docs", type=int, default=1500, help="documents of it counted (0: none)")
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
    elif args.split == "workload":  # issue 4's long-form prompts, as bench/dflash.py draws them
        from tuner.workloads import long_form_prompts

        prompts = [torch.tensor(tokenizer.encode(p.text))
                   for p in long_form_prompts(corpus, args.rows, args.prompt, tokenizer, args.seed).prompts]
        train_docs = []  # the follower counts come from --ngram-corpus (the training text) only here
    else:  # as the held-out report does
        prompts = eval_windows(stream, args.prompt, args.rows * args.prompt)[:args.rows]
    counted = (read_corpus(args.ngram_corpus) if args.ngram_corpus
               else held_docs if args.split == "train" else train_docs)
    pairs = follower_counts(tokenizer, counted[:args.ngram_docs])
    rows, slots = [], []
    for prompt in prompts:
        ids = prompt.tolist()
        new = greedy(model, ids, args.new)
        row = torch.tensor(ids + new, device=model.device)
        acc = teacher_forced(model, draft, row, len(ids))
        p1, full = target_top1(model, row).tolist(), ids + new
        for a, accepted in zip(range(len(ids) - 1, len(full) - 1), acc.tolist()):
            want = full[a + 1]  # greedy rows: the target's own choice after position a
            follower = pairs.get((full[a - 1], full[a]))
            look = row_lookup(full, a)
            period = loop_period(full, a)
            slots.append({"p1": p1[a], "draft": accepted >= 2, "row_lookup": look == want, "accepted": accepted,
                          "period": period, "copy": period is not None and full[a + 1 - period] == want,
                          "pair_follower": bool(follower) and follower.most_common(1)[0][0] == want,
                          "draft_or_row_lookup": accepted >= 2 or look == want})
        found = {"teacher_forced": round(float(acc.float().mean()), 3),
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
    summary = {"rows": len(rows), "mean": round(statistics.fmean(tf), 3), "median": round(statistics.median(tf), 3),
               "first_slot": first_slot_summary(slots), "by_loop_period": loop_summary(slots)}
    print(f"teacher-forced acceptance over {len(rows)} rows: mean {summary['mean']:.2f}, median {summary['median']:.2f}")
    hit = summary["first_slot"]["hit"]
    print(f"first drafted slot over {len(slots)} anchors: draft {hit['draft']:.3f}, follower of the last two tokens "
          f"{hit['pair_follower']:.3f}, row lookup {hit['row_lookup']:.3f}, draft or row lookup "
          f"{hit['draft_or_row_lookup']:.3f}")
    for b in summary["first_slot"]["by_target_p1"]:
        print(f"  target top-1 probability {b['p1']:>8}: {b['share']:.3f} of the slots, draft hit {b['draft_hit']:.3f}")
    print(f"by the loop the target is in (the last {LOOP_WINDOW} tokens repeat p back):")
    for b in summary["by_loop_period"]:
        copy = "" if b["copy_hit"] is None else f", copying p back right {b['copy_hit']:.3f}"
        print(f"  period {b['period']:>6}: {b['share']:.3f} of the slots{copy}, draft hit {b['draft_hit']:.3f}, "
              f"accepted {b['accepted']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
