"""Decode speed with the projections that read one input merged into one matrix, against the
same model with them split again (one matrix product per projection, as before the merge).

    python bench/merged_projections.py --model M.gguf [--device cpu] [--tokens 64] [--repeats 5]
        [--weights dense|quantized] [--cuda-graph] [--json out.json]

Both variants share the weights (the split one uses the merged matrices' row views); each
decodes ``--tokens`` greedy tokens after a 32-token prompt, one warm-up then ``--repeats``
alternating runs, and reports the median tok/s with its range and whether both decoded the
same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from common import commit, machine

from engine.engine import Engine
from engine.model.weights import AttentionWeights, GDNWeights, ModelWeights


def split(weights: ModelWeights) -> ModelWeights:
    """The same weights without the merged matrices: every projection multiplied on its own."""
    layers = []
    for layer in weights.layers:
        mixer = layer.mixer
        if isinstance(mixer, GDNWeights):
            mixer = dataclasses.replace(mixer, in_proj=None)
        elif isinstance(mixer, AttentionWeights):
            mixer = dataclasses.replace(mixer, qkv=None)
        moe = layer.moe
        if moe.shared is not None:
            moe = dataclasses.replace(moe, shared=dataclasses.replace(moe.shared, gate_up=None))
        layers.append(dataclasses.replace(layer, mixer=mixer, moe=moe))
    return dataclasses.replace(weights, layers=tuple(layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="dense", choices=("dense", "quantized"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cuda-graph", action="store_true", help="decode through the captured step")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    eng = Engine.from_gguf(args.model, device=args.device, weights=args.weights, cuda_graph=args.cuda_graph)
    merged = eng.model.weights
    variants = {"merged": merged, "split": split(merged)}
    prompt = [(i * 37) % eng.config.vocab for i in range(32)]
    rates: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, list[int]] = {}
    for r in range(args.repeats + 1):
        for name, w in variants.items():
            eng.model.weights = w
            eng._graphs.clear()  # a captured step holds the other variant's matrices
            g = eng.generate(prompt, args.tokens, ignore_eos=True)
            if r:  # the first round warms up
                rates[name].append(g.timings.decode_tok_s)
            outputs[name] = g.ids
    eng.model.weights = merged
    same = outputs["merged"] == outputs["split"]
    report = {"machine": machine(), "commit": commit(), "model": args.model.name, "device": str(eng.device),
              "weights": args.weights, "tokens": args.tokens, "repeats": args.repeats, "same_tokens": same}
    for name, values in rates.items():
        report[name] = {"median": statistics.median(values), "low": min(values), "high": max(values)}
        print(f"{name:>7}: {report[name]['median']:.2f} tok/s [{report[name]['low']:.2f}, {report[name]['high']:.2f}]")
    print(f"speed-up of merged: {report['merged']['median'] / report['split']['median']:.3f}x; same tokens: {same}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
