"""Does a verify block see the same logits as token-by-token decoding? A diagnostic for lossless DFlash.

    python bench/verify_consistency.py --model T.gguf [--device cuda] [--prefix 64] [--blocks 2,5,8,9,16,17] [--dtypes bfloat16,float32]

For each block length T, after the same prefix, runs T tokens in one forward and the same
tokens one forward at a time, and prints the largest logit difference relative to the largest
logit and the share of positions whose argmax agrees, for each dtype and for the Gated
DeltaNet and attention back ends that the engine can use (fla or torch delta rule; flash,
memory-efficient or math attention). A variant that disagrees where the others agree names
the faulty path.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from engine.gguf.reader import GGUFFile
from engine.model import attention
from engine.model.qwen35moe import Qwen35MoE


def compare(model: Qwen35MoE, ids: torch.Tensor, prefix: int, T: int) -> tuple[float, float]:
    a, b = model.new_state(prefix + T + 1), model.new_state(prefix + T + 1)
    model.forward(ids[:prefix], a, logits="none")
    model.forward(ids[:prefix], b, logits="none")
    block = model.forward(ids[prefix:prefix + T], a, logits="all").logits
    seq = torch.cat([model.forward(ids[prefix + t:prefix + t + 1], b, logits="all").logits for t in range(T)])
    err = float((block - seq).abs().max() / seq.abs().max())
    agree = float((block.argmax(-1) == seq.argmax(-1)).float().mean())
    return err, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--blocks", default="2,4,5,8,9,16,17")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    blocks = [int(x) for x in args.blocks.split(",")]
    backends = {"default": attention.SDPA_BACKENDS, "math": [SDPBackend.MATH]}
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for force_torch in (False, True):
            with GGUFFile(args.model) as f:
                model = Qwen35MoE.from_gguf(f, device=args.device, dtype=dtype, force_torch_gdn=force_torch)
            ids = torch.randint(0, model.cfg.vocab, (args.prefix + max(blocks),),
                                generator=torch.Generator().manual_seed(0)).to(args.device)
            for name, chosen in backends.items():
                attention.SDPA_BACKENDS = chosen
                row = [f"{str(dtype)[6:]:>8} gdn={model.delta_rule.name:<10} attn={name:<7}"]
                for T in blocks:
                    err, agree = compare(model, ids, args.prefix, T)
                    row.append(f"T={T}: {err:.1e} {agree:.2f}")
                print("  ".join(row), flush=True)
            attention.SDPA_BACKENDS = backends["default"]


if __name__ == "__main__":
    main()
