"""The launches each part of a DFlash device-loop step makes, and a plain one-token step, counted on the CPU.

    python bench/dflash_launches.py --target T.gguf --draft D.gguf [--spec-lens 4,16] [--json out.json]

The shipped target's and draft's steps are bound by launch latency on the H200 (the target's plain step and
the draft's proposal both take a few microseconds a launch), so the number of launches a step makes is a
proxy for its device time that can be counted anywhere. Here the device loop's three parts (``draft``,
``verify``, ``advance``: the draft cache's extension and the state restore) run once each on the CPU with
the engine's fused kernels forced where CUDA would take them (Triton's interpreter runs them), and every
operation that would be a device launch is counted: each Triton kernel launch, and each torch operation
outside them (views, reshapes and other metadata-only operations, no-op conversions and copies of a tensor
onto itself excluded). A count on the CPU is not a CUDA graph's node count (cuBLAS may take two launches
for one product, and torch's operations on CUDA sometimes more); it compares ways of running one step, not
devices.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from common import commit, machine  # noqa: E402

# operations that only describe a tensor: no launch on a device
METADATA = frozenset({"view", "unbind", "select", "slice", "alias", "lift_fresh", "detach", "_unsafe_view",
                      "expand", "t", "transpose", "unsqueeze", "squeeze", "reshape", "as_strided", "permute",
                      "split", "split_with_sizes", "chunk", "empty", "empty_like", "empty_strided", "new_empty",
                      "_to_copy_meta", "is_same_size", "_reshape_alias", "unflatten", "flatten", "narrow",
                      "contiguous", "movedim", "view_as", "expand_as", "diagonal", "_local_scalar_dense"})
FUSED_FLAGS = (("engine.model.attention", "FUSED_ROPE"), ("engine.model.attention", "FUSED_DECODE_ATTENTION"),
               ("engine.model.norm", "FUSED_ADD_NORM"), ("engine.model.norm", "FUSED_NORM"),
               ("engine.model.moe", "FUSED_GATE"),
               ("engine.model.gated_deltanet", "FUSED_PROLOGUE"))


class Launches(TorchDispatchMode):
    """Counts the torch operations that would launch on a device, and (``triton``) Triton kernel launches;
    operations inside a Triton launch (the interpreter's own) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.torch: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # a conversion to what the tensor already is, a copy of a tensor onto itself: no launch
        aliased = (name == "to" and args and out is args[0]) or (name == "copy_" and len(args) > 1
                                                                and args[0] is args[1])
        if not self._inside and name not in METADATA and not aliased:
            self.torch[name] += 1
        return out

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._run = InterpretedFunction.run
        counter = self

        def run(fn, *args, **kwargs):
            counter.triton[fn.fn.__name__] += 1
            counter._inside += 1
            try:
                return counter._run(fn, *args, **kwargs)
            finally:
                counter._inside -= 1

        InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._run
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.torch.values()) + sum(self.triton.values())


def force_fused() -> None:
    """The engine's fused kernels where CUDA would take them, on any device (the interpreter runs them): the
    fused norms, RoPE, attention, gate and prologue, and the fixed-shape steps' Triton kernels (``auto``
    resolves to them as on CUDA: the fused-MoE executor, the delta rule's decode kernel)."""
    import importlib

    from engine.model import decode_graph

    for module, name in FUSED_FLAGS:
        setattr(importlib.import_module(module), name, True)
    resolve = decode_graph.resolve_kernels
    decode_graph.resolve_kernels = lambda kernels, device: "triton" if kernels == "auto" else resolve(kernels, device)


@torch.inference_mode()
def count_parts(model, draft, spec_len: int, prompt: int = 48) -> dict[str, Launches]:
    """One device-loop step's three parts after a prefill of ``prompt`` tokens, each counted once (after one
    uncounted run, which compiles and warms)."""
    from engine.dflash.speculative import SpecOptions, _Generation
    from engine.sampling import SamplingParams

    ids = list(range(100, 100 + prompt))
    opts = SpecOptions(spec_len=spec_len, fallback_threshold=0.0, verify_path="static")
    run = _Generation(model, draft, ids, 4 * spec_len, opts, SamplingParams(), set(), None)
    loop = run.loop
    if loop is None:
        raise SystemExit("the device loop does not apply to this draft (it must attend in its cache)")
    out = model.forward(torch.tensor(ids), run.state, capture_layers=run.layer_ids, logits="last")
    run._extend_context(out.hidden, len(ids), 0)
    loop.load(out.logits[-1].argmax(), 2 * spec_len)
    counts = {}
    for name, part in (("draft", loop._draft), ("verify", loop._verify), ("advance", loop._advance)):
        part()
    for name, part in (("draft", loop._draft), ("verify", loop._verify), ("advance", loop._advance)):
        with Launches() as launches:
            part()
        counts[name] = launches
    return counts


@torch.inference_mode()
def count_plain(model, prompt: int = 48) -> Launches:
    """A plain one-token decode step (``DecodeGraph`` with one token, as plain decoding runs it) after a prefill
    of ``prompt`` tokens, counted once after one uncounted run: what a verify block's count compares with."""
    from engine.model.decode_graph import DecodeGraph

    state = model.new_state(prompt + 8)
    model.forward(torch.arange(100, 100 + prompt), state, logits="last")
    step = DecodeGraph(model, state, tokens=1, graph=False)
    step.step(torch.tensor([5]))
    with Launches() as launches:
        step.step(torch.tensor([6]))
    return launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--draft", required=True, help="draft GGUF, or 'random'")
    ap.add_argument("--spec-lens", default="4,16")
    ap.add_argument("--top", type=int, default=8, help="operations listed per part")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from dflash import load_draft
    from engine.engine import Engine

    force_fused()
    from engine.dflash.compat import check_spec_len
    from engine.errors import ConfigError

    eng = Engine.from_gguf(args.target, device="cpu", dtype="float32")
    draft = load_draft(eng, args.draft)
    try:
        spec_lens = [int(x) for x in args.spec_lens.split(",") if x]
        for spec_len in spec_lens:
            check_spec_len(spec_len, draft.cfg)
    except (ValueError, ConfigError) as exc:
        raise SystemExit(f"--spec-lens: {exc}") from None
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "target": str(args.target), "draft": args.draft, "rows": []}
    parts = [(0, "plain", count_plain(eng.model))]
    for spec_len in spec_lens:
        parts += [(spec_len, part, c) for part, c in count_parts(eng.model, draft, spec_len).items()]
    for spec_len, part, c in parts:  # spec_len 0: the plain one-token step
        row = {"spec_len": spec_len, "part": part, "launches": c.total, "triton": dict(c.triton),
               "torch": dict(c.torch)}
        result["rows"].append(row)
        top = (c.torch + c.triton).most_common(args.top)
        label = "plain step" if part == "plain" else f"spec_len {spec_len:>2} {part:>7}"
        print(f"{label:>18}: {c.total:>4} launches ({sum(c.triton.values())} Triton); "
              + ", ".join(f"{k} {v}" for k, v in top), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
