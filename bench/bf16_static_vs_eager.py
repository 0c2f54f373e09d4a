"""Which kernel takes the captured bf16 step away from eager forwards: the static step against
eager forwards on the shipped target, teacher-forced, with each fused kernel switched off in turn.

    python bench/bf16_static_vs_eager.py [--model models/luce-target.gguf] [--tokens 32] [--block 1]

Prints the worst per-step distance (largest logit difference over the largest logit) for the
static step with torch kernels, with the Triton kernels, and with the Triton kernels less one
fused kernel at a time (then less the fused-MoE executor, then less the GDN decode kernel); and
the same for float32 as the floor.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.gguf.reader import GGUFFile
from engine.model import attention, decode_graph, gated_deltanet, moe, norm
from engine.model.decode_graph import DecodeGraph
from engine.model.qwen35moe import Qwen35MoE

SWITCHES = {"add+norm": (norm, "FUSED_ADD_NORM"), "norm+rope": (attention, "FUSED_ROPE"),
            "decode attention": (attention, "FUSED_DECODE_ATTENTION"), "gdn prologue": (gated_deltanet, "FUSED_PROLOGUE"),
            "moe gate": (moe, "FUSED_GATE")}


def logits_of(model: Qwen35MoE, T: int, n: int, kernels: str | None) -> list[torch.Tensor]:
    """Teacher-forced logits per step: eager forwards (``kernels`` None) or the static step."""
    ids = torch.randint(0, model.cfg.vocab, (7 + n,), generator=torch.Generator().manual_seed(9)).to(model.device)
    state = model.new_state(64)
    with torch.inference_mode():
        model.forward(ids[:7], state, logits="none")
        step = None if kernels is None else DecodeGraph(model, state, tokens=T, kernels=kernels, graph=False)
        return [(model.forward(ids[p:p + T], state, logits="all").logits if step is None
                 else step.step(ids[p:p + T])).double().clone() for p in range(7, 7 + n, T)]


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/luce-target.gguf"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--block", type=int, default=1)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models, eager = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        with GGUFFile(args.model) as f:
            models[dtype] = Qwen35MoE.from_gguf(f, device=device, dtype=dtype)
        eager[dtype] = logits_of(models[dtype], args.block, args.tokens, None)
    bf, ref = models[torch.bfloat16], eager[torch.float32]
    kernels = ("torch", "triton") if device == "cuda" else ("torch",)
    print(f"distance from float32 eager forwards: eager bf16 {distance(eager[torch.bfloat16], ref):.4f}, "
          + ", ".join(f"static bf16 ({k}) {distance(logits_of(bf, args.block, args.tokens, k), ref):.4f}"
                      for k in kernels), flush=True)

    for dtype, model in models.items():
        def vs_eager(kernels: str) -> float:
            return distance(logits_of(model, args.block, args.tokens, kernels), eager[dtype])

        print(f"{dtype}: static step (torch kernels) {vs_eager('torch'):.4f}", flush=True)
        if device != "cuda":
            continue
        print(f"{dtype}: static step (triton kernels) {vs_eager('triton'):.4f}", flush=True)
        for name, (module, flag) in SWITCHES.items():
            setattr(module, flag, False)
            try:
                print(f"{dtype}:   without the fused {name}: {vs_eager('triton'):.4f}", flush=True)
            finally:
                setattr(module, flag, None)
        # the two parts the Triton step swaps whole: the fused-MoE executor and the GDN decode rule
        executor, rule = decode_graph.static_executor, decode_graph.decode_delta_rule
        try:
            decode_graph.static_executor = lambda m, k: m.executor
            print(f"{dtype}:   without the fused-MoE executor: {vs_eager('triton'):.4f}", flush=True)
            decode_graph.static_executor = executor
            decode_graph.decode_delta_rule = lambda hk, hv, impl, in_place=True: rule(hk, hv, impl="torch",
                                                                                       in_place=in_place)
            print(f"{dtype}:   without the GDN decode kernel: {vs_eager('triton'):.4f}", flush=True)
        finally:
            decode_graph.static_executor, decode_graph.decode_delta_rule = executor, rule

if __name__ == "__main__":
    main()
