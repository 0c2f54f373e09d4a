"""Where does speculative decoding leave plain decoding? A step-by-step check of losslessness.

    python bench/dflash_lossless.py --target T.gguf --draft D.gguf [--device cuda] [--dtype bfloat16]
        [--spec-lens 4,8] [--rollbacks capture,recompute] [--verify-paths eager,static,graph] [--prompts 2]
        [--new-tokens 128] [--corpus HELD_OUT.txt] [--short-kernel on|off]

Runs greedy DFlash on each prompt with a shadow state that plain-decodes every token the
speculative state holds, one forward per token. After every verify step it compares the
speculative state with the shadow (KV caches up to their length, Gated DeltaNet recurrent and
conv states) and the committed tokens with the shadow's greedy choices, and prints the first
step where either departs, with the shadow's top-2 logit margin there: a margin near zero is a
numerical near-tie, a large one a fault in the verify or the rollback. Prompts are long-form
windows of ``--corpus`` (default: random token ids). ``--short-kernel off`` sends short Gated
DeltaNet calls back to the chunk and recurrent kernels (on CUDA: fla's), to compare the two. The
check runs the host loop (``device_loop=False``): the device loop's state is only the host's again
after its last step (``engine.dflash.device_loop``), and tests/engine/dflash/test_device_loop.py holds
that state to plain decoding's.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from engine.dflash.gguf_io import load_draft
from engine.dflash.speculative import SpecOptions, _Generation
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE
from engine.model.state import ModelState
from engine.sampling import SamplingParams


def state_gap(a: ModelState, b: ModelState) -> tuple[float, str]:
    """Largest relative difference between two states over what both hold, and where it is."""
    worst, where = 0.0, "-"

    def see(x: torch.Tensor, y: torch.Tensor, name: str) -> None:
        nonlocal worst, where
        gap = float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
        if gap > worst:
            worst, where = gap, name

    for i, c in a.kv.items():
        n = c.length
        see(c.k[:, :n], b.kv[i].k[:, :n], f"kv{i}.k")
        see(c.v[:, :n], b.kv[i].v[:, :n], f"kv{i}.v")
    for i in a.recurrent:
        see(a.recurrent[i], b.recurrent[i], f"recurrent{i}")
        see(a.conv[i], b.conv[i], f"conv{i}")
    return worst, where


class Shadowed(_Generation):
    """The speculative loop, with a plain-decoded shadow checked at every commit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shadow = self.model.new_state(self.state.max_len)
        self.shadow_logits: torch.Tensor | None = None
        self.events: list[str] = []
        self.token_fault: str | None = None
        self.state_fault: str | None = None
        self.tol = 1e-2 if self.model.dtype != torch.float32 else 1e-4

    def _commit(self, tokens: list[int]) -> bool:
        held = self.prompt.tolist() + self.new + tokens  # the state holds the first seq_len of these
        model, shadow = self.model, self.shadow
        while shadow.seq_len < self.state.seq_len:
            t = held[shadow.seq_len]
            if self.shadow_logits is not None and shadow.seq_len >= len(self.prompt):
                self._check_token(t, shadow.seq_len - len(self.prompt))
            ids = torch.tensor(held[:len(self.prompt)] if shadow.seq_len == 0 else [t], device=model.device)
            self.shadow_logits = model.forward(ids, shadow, logits="last").logits[-1]
        if self.state.seq_len > len(self.prompt) and self.state_fault is None:
            gap, where = state_gap(self.state, shadow)
            if gap > self.tol:
                self.state_fault = (f"state departs after {len(self.new)} new tokens: {where} off by {gap:.2e} "
                                    f"(tolerance {self.tol:.0e})")
        return super()._commit(tokens)

    def _check_token(self, t: int, index: int) -> None:
        top = self.shadow_logits.float().topk(2)
        if self.token_fault is None and int(top.indices[0]) != t:
            margin = float(top.values[0] - top.values[1])
            self.token_fault = f"token {index} differs from plain greedy (plain top-2 margin {margin:.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the engine's for the device)")
    ap.add_argument("--spec-lens", default="4,8")
    ap.add_argument("--rollbacks", default="capture,recompute")
    ap.add_argument("--verify-paths", default="eager", help="eager, static, graph (comma-separated)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--short-kernel", choices=("on", "off"), default="on")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype) if args.dtype else None
    with GGUFFile(args.target) as f:
        model = Qwen35MoE.from_gguf(f, device=args.device, dtype=dtype)
        if args.corpus is not None:
            from engine.tokenizer import Tokenizer

            ids = Tokenizer.from_metadata(f.metadata, source=str(args.target)).encode(args.corpus.read_text())
    if args.corpus is None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, model.cfg.vocab, (args.prompts * args.prompt_tokens,), generator=gen).tolist()
    prompts = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    if args.short_kernel == "off":
        model.delta_rule = dataclasses.replace(model.delta_rule, short=None, short_head_dim=0)
    draft = load_draft(args.draft, device=model.device, dtype=model.dtype)
    print(f"{args.target.name} on {model.device} {model.dtype}, delta rule {model.delta_rule.name}; "
          f"draft {args.draft.name}", flush=True)
    runs = [(s, r, v) for v in args.verify_paths.split(",") for s in [int(x) for x in args.spec_lens.split(",")]
            for r in (args.rollbacks.split(",") if v == "eager" else ["own"])]
    for spec_len, rollback, verify in runs:
        for p, prompt in enumerate(prompts):
            opts = SpecOptions(spec_len=spec_len, rollback="capture" if rollback == "own" else rollback,
                               fallback_threshold=0.0, verify_path=verify, device_loop=False)
            run = Shadowed(model, draft, prompt, args.new_tokens, opts, SamplingParams(), set(), None)
            _, stats = run.run()
            verdict = "; ".join(x for x in (run.token_fault, run.state_fault) if x) or "lossless, states agree"
            print(f"spec {spec_len:>2} {stats.verify_path:>10} rollback {rollback:>9} prompt {p}: "
                  f"accept {stats.acceptance_length:.2f}; {verdict}", flush=True)


if __name__ == "__main__":
    main()
