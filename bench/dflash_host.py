"""The device loop's host work per DFlash step, with the device's share taken out.

    python bench/dflash_host.py --target T.gguf --draft D.gguf [--spec-lens 4,16] [--steps 1000] [--lags 1]
        [--device cpu] [--json out.json]

``bench/dflash_step.py`` splits a step's wall time into the device loop's three launches (draft, verify,
advance) and ``host``, the time the device waited between steps. This script measures the other side: a
greedy generation through the device loop (``engine.dflash.device_loop``) whose three launches are replaced
by stand-ins that only write a report accepting one drafted token (keep = 2), so the wall time per step is
the Python around the launches alone: the report's copy and event, reading it back, committing the tokens,
the fallback's bookkeeping, the clock's marks. A real step adds its three launches' host cost (CUDA graph
replays on CUDA, the eager ops elsewhere), which this does not count. Where this figure is far under a
step's device time, the host keeps ``lag`` steps ahead and ``host`` in the step bench is not its Python.
Any device; ``--draft random`` takes an untrained draft of the default shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import commit, machine

from engine.dflash.compat import check_spec_len
from engine.dflash.device_loop import MAX_LAG
from engine.dflash.draft import DFlashDraft
from engine.dflash.speculative import SpecOptions, _Generation
from engine.errors import ConfigError
from engine.model.qwen35moe import Qwen35MoE
from engine.sampling import SamplingParams


def host_us(model: Qwen35MoE, draft: DFlashDraft, spec_len: int, steps: int, lag: int = 1,
            repeats: int = 3) -> dict:
    """Median over ``repeats`` generations of ``2 * steps + 1`` tokens of the wall time per device-loop step
    with the launches stood in for (each step commits two tokens); ``{"steps", "us", "runs_us"}``."""
    runs = []
    for _ in range(repeats):
        opts = SpecOptions(spec_len=spec_len, fallback_threshold=0.0, verify_path="static", lag=lag)
        run = _Generation(model, draft, [1, 2, 3, 4], 2 * steps + 1, opts, SamplingParams(), set(), None)
        loop = run.loop
        if loop is None:
            raise SystemExit("the device loop does not apply to this draft (it must attend in its cache)")

        def accept_one() -> None:  # keep = 2: the opening token and one drafted token
            loop.keep.fill_(2)
            loop.report[:1].fill_(2)

        loop._draft = loop._advance = lambda: None
        loop._verify = accept_one
        _, stats = run.run()
        if stats.verify_steps != steps:
            raise RuntimeError(f"expected {steps} steps, the loop ran {stats.verify_steps}")
        runs.append(1e6 * stats.decode_s / stats.verify_steps)
    return {"steps": steps, "us": statistics.median(runs), "runs_us": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--draft", required=True, help="draft GGUF, or 'random'")
    ap.add_argument("--spec-lens", default="4,16")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lags", default="1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    try:
        lags = [int(x) for x in args.lags.split(",") if x]
        spec_lens = [int(x) for x in args.spec_lens.split(",") if x]
    except ValueError:
        raise SystemExit("--lags and --spec-lens take comma-separated integers") from None
    if not lags or not all(0 <= lag <= MAX_LAG for lag in lags):
        raise SystemExit(f"--lags takes values 0..{MAX_LAG}, got {args.lags!r}")
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit("--steps and --repeats must be at least 1")

    from dflash import load_draft
    from engine.engine import Engine

    eng = Engine.from_gguf(args.target, device=args.device, dtype="float32")
    draft = load_draft(eng, args.draft)
    for spec_len in spec_lens:
        try:
            check_spec_len(spec_len, draft.cfg)
        except ConfigError as exc:
            raise SystemExit(f"--spec-lens: {exc}") from None
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "target": str(args.target), "draft": args.draft, "device": str(eng.device),
              "rows": []}
    print(f"{'spec':>4} {'lag':>3} {'steps':>6} {'host us/step':>12}", flush=True)
    for spec_len in spec_lens:
        for lag in lags:
            row = {"spec_len": spec_len, "lag": lag} | host_us(eng.model, draft, spec_len, args.steps, lag,
                                                              args.repeats)
            result["rows"].append(row)
            print(f"{spec_len:>4} {lag:>3} {row['steps']:>6} {row['us']:>12.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
