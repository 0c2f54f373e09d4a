"""Write a draft of another draft's configuration with seeded random weights: the control for the lookup's
share of a speed-up (its blocks are the lookup's copies where the lookup matches, noise elsewhere).

    python bench/random_draft.py bench/targets/luce-draft-more-8192x960.gguf /tmp/draft-random.gguf [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.dflash.gguf_io import load_draft, write_draft_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("like", type=Path, help="the draft whose configuration the random one takes")
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    draft = load_draft(args.like).init_random(torch.Generator().manual_seed(args.seed))
    write_draft_gguf(draft, args.out, extra_metadata={"general.description": f"random weights, seed {args.seed}"})
    print(f"wrote {args.out}: {args.like.name}'s configuration, random weights (seed {args.seed})")


if __name__ == "__main__":
    main()
