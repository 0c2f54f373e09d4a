"""A DFlash verify block's Gated DeltaNet restore alone, per way: the per-token states against the replay.

    python bench/restore.py --target T.gguf [--spec-lens 4,8,16] [--ways states,replay] [--replays 200]
        [--device cuda|cpu] [--json out.json]

For each spec_len T (a verify block of T tokens) and way (``engine.model.decode_graph.RESTORES``): the
fixed-shape verify step (``DecodeGraph(rollback=True, restore=way)``) after a short prefill, then the time of
its step alone and of the device loop's restore (``restore_at(keep)``, ``keep`` = 1, a device value) alone.
On CUDA both are captured in CUDA graphs and timed as back-to-back replays between two events (the step's
graph is the verify's; ``graph`` needs the configuration to allow capture); elsewhere they run eagerly,
timed with the wall clock. Medians of ``--repeats`` runs of ``--replays`` each, in microseconds. The step's
column shows what writing the per-token states costs the verify; the restore's what it saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import commit, machine

from engine.model.decode_graph import MAX_TOKENS, RESTORES, DecodeGraph, capture_graph
from engine.model.qwen35moe import Qwen35MoE


def time_us(run, device: torch.device, replays: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of one ``run()`` over ``replays`` back to back (CUDA events on a
    CUDA device, the wall clock elsewhere), after one warm-up run."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                run()
            end.record()
            end.synchronize()
            times.append(1000 * start.elapsed_time(end) / replays)
        else:
            t = time.perf_counter()
            for _ in range(replays):
                run()
            times.append(1e6 * (time.perf_counter() - t) / replays)
    return statistics.median(times)


@torch.inference_mode()
def measure(model: Qwen35MoE, tokens: int, way: str, *, replays: int = 200, repeats: int = 3,
            prompt: int = 32) -> dict:
    """The verify step's and the restore's time for a block of ``tokens`` restored ``way``."""
    dev = model.device
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.cfg.vocab, (prompt + tokens,), generator=gen).to(dev)
    state = model.new_state(prompt + 2 * tokens)
    model.forward(ids[:prompt], state, logits="none")
    graph = dev.type == "cuda"
    step = DecodeGraph(model, state, tokens=tokens, rollback=True, restore=way, graph=None if graph else False)
    step.step(ids[prompt:])
    keep = torch.ones((), dtype=torch.long, device=dev)
    if step.graph is not None:
        run_step = step.graph.replay
        restore_graph = capture_graph(lambda: step.restore_at(keep), dev)
        run_restore = restore_graph.replay
    else:
        run_step, run_restore = step._run, (lambda: step.restore_at(keep))
    row = {"spec_len": tokens, "restore": step.restore, "path": step.path,
           "states_mb": 0.0 if step._states is None else step._states.numel() * 4 / 1e6}
    row["step_us"] = time_us(run_step, dev, replays, repeats)
    row["restore_us"] = time_us(run_restore, dev, replays, repeats)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--spec-lens", default="4,8,16")
    ap.add_argument("--ways", default="states,replay")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ways = [x for x in args.ways.split(",") if x]
    if not ways or any(w not in RESTORES for w in ways):
        raise SystemExit(f"--ways takes comma-separated values of {RESTORES}, got {args.ways!r}")
    try:
        spec_lens = [int(x) for x in args.spec_lens.split(",") if x]
    except ValueError:
        raise SystemExit(f"--spec-lens takes comma-separated integers, got {args.spec_lens!r}") from None
    if not spec_lens or not all(1 <= t <= MAX_TOKENS for t in spec_lens):
        raise SystemExit(f"--spec-lens takes blocks of 1..{MAX_TOKENS} tokens, got {args.spec_lens!r}")
    if args.replays < 1 or args.repeats < 1:
        raise SystemExit("--replays and --repeats must be at least 1")

    from engine.engine import Engine

    eng = Engine.from_gguf(args.target, device=args.device, dtype=args.dtype, cuda_graph=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "target": str(args.target), "device": str(eng.device), "dtype": str(eng.dtype),
              "replays": args.replays, "rows": []}
    print(f"{'spec':>4} {'restore':>7} {'path':>10} {'states MB':>9} {'step us':>8} {'restore us':>10}", flush=True)
    for tokens in spec_lens:
        for way in ways:
            row = measure(eng.model, tokens, way, replays=args.replays, repeats=args.repeats)
            result["rows"].append(row)
            print(f"{tokens:>4} {row['restore']:>7} {row['path']:>10} {row['states_mb']:>9.1f} {row['step_us']:>8.1f} "
                  f"{row['restore_us']:>10.1f}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
