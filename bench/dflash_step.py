"""Where a DFlash step's time goes: device time of each captured graph against the step's wall time.

    python bench/dflash_step.py --target T.gguf --draft D.gguf [--spec-lens 4,8,16] [--new-tokens 200]
        [--prompt-tokens 256] [--replays 200] [--dtype float32] [--cold-device gpu] [--json out.json]
        [--trace 64 --trace-dir DIR] [--host-loop] [--restores states,replay] [--lags 1]

Needs CUDA. For each spec_len, one greedy generation of ``--new-tokens`` from a held-out prompt
with graph verify (pure speculation), whose wall time per verify step is the figure to explain;
then each graph the step replays is timed alone, ``--replays`` back-to-back replays between two
CUDA events (the graph's device time plus its launch, no host work between): the draft's proposal,
the target's verify block, the draft cache's extension, the state restore of a partial acceptance
(keep = 1), and the plain one-token step for comparison. ``host`` is the step's wall time less
the graphs' device time: Python, small launches outside the graphs, and the one host sync.
``--trace N`` then profiles a generation of N tokens per spec_len with torch.profiler, from its
first verify step on (no prefill), and writes two tables to ``--trace-dir``: device time by
kernel, and host time by op (what the Python around the graphs costs).

The generation runs the device loop (``engine.dflash.device_loop``) unless ``--host-loop``: its
three graphs move the loop's counters at every replay, so they are not replayed alone; their device
times are the generation's own spans between them (CUDA events between the launches of steps that
run back to back): ``draft``, ``verify`` (with the acceptance) and ``advance`` (the draft cache's
extension and the state restore, in the ``restore`` column). ``host`` is then the step's wall time
less those three: what the device waited for the host.

``--restores``: one row per spec_len and way of restoring the Gated DeltaNet states to the kept prefix
(``engine.model.decode_graph.RESTORES``: the per-token states the verify wrote, or a replay of the kept
tokens), so that both are timed in one run. ``--lags``: likewise per device-loop lag (the steps the host
launches past the one it waits for; ``host`` is what the device still waited for it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import commit, machine

from engine.dflash.compat import open_compatible
from engine.dflash.device_loop import MAX_LAG
from engine.dflash.speculative import SpecOptions, _Generation
from engine.engine import Engine
from engine.model.decode_graph import RESTORES, DecodeGraph
from engine.sampling import SamplingParams
from tuner.workloads import long_form_prompts


def replay_us(graph: torch.cuda.CUDAGraph, replays: int, repeats: int = 3) -> float:
    """Median over ``repeats`` of the mean device time of one replay, in microseconds."""
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end) / replays)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--spec-lens", default="4,8,16")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--corpus", type=Path, default=None, help="held-out text for the prompt")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cold-device", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--trace", type=int, default=0, help="new tokens of a profiled generation per spec_len (0: none)")
    ap.add_argument("--trace-dir", type=Path, default=Path("."))
    ap.add_argument("--host-loop", action="store_true", help="the host loop (each step's graphs replayed alone)")
    ap.add_argument("--restores", default="states,replay", help="comma-separated restores, a row each")
    ap.add_argument("--lags", default="1", help="comma-separated device-loop lags, a row each")
    args = ap.parse_args()
    try:
        lags = [int(x) for x in args.lags.split(",") if x]
    except ValueError:
        raise SystemExit(f"--lags takes comma-separated integers, got {args.lags!r}") from None
    if not lags or not all(0 <= lag <= MAX_LAG for lag in lags):
        raise SystemExit(f"--lags takes values 0..{MAX_LAG}, got {args.lags!r}")
    restores = [x for x in args.restores.split(",") if x]
    if not restores or any(r not in RESTORES for r in restores):
        raise SystemExit(f"--restores takes comma-separated values of {RESTORES}, got {args.restores!r}")
    if not torch.cuda.is_available():
        raise SystemExit("dflash_step.py times CUDA graphs: it needs a CUDA device")

    eng = Engine.from_gguf(args.target, device="cuda", dtype=args.dtype, cuda_graph=True,
                           cold_device=args.cold_device)
    draft = open_compatible(args.draft, eng.config, target_name=eng.path.name).load(device=eng.device,
                                                                                   dtype=eng.dtype)
    corpus = args.corpus
    if corpus is None:
        from engine.train.corpus import build_corpus

        corpus = build_corpus(tempfile.mkdtemp(prefix="dflash-step-"), n_retrieval=0, max_bytes=8_000_000).held_out
    ids = eng.tokenizer.encode(next(iter(long_form_prompts(corpus, 1, args.prompt_tokens, eng.tokenizer, 0))).text)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "commit": commit(), "target": str(args.target), "draft": str(args.draft), "dtype": str(eng.dtype),
              "new_tokens": args.new_tokens, "replays": args.replays, "rows": []}
    header = (f"{'spec':>4} {'how':>7} {'lag':>3} {'accept':>6} {'step':>7} {'draft':>7} {'verify':>7} {'extend':>7} "
              f"{'restore':>7} {'host':>7} {'plain':>7}   (us; step = wall time per verify step)")
    print(header, flush=True)
    for spec_len, how, lag in ((int(x), r, g) for x in args.spec_lens.split(",") if x for r in restores for g in lags):
        opts = SpecOptions(spec_len=spec_len, fallback_threshold=0.0, verify_path="graph",
                           device_loop=not args.host_loop, restore=how, lag=lag)
        for _ in range(2):  # the first run captures; the second is the one timed
            run = _Generation(eng.model, draft, ids, args.new_tokens, opts, SamplingParams(), set(), None)
            _, stats = run.run()
        steps = max(stats.verify_steps, 1)
        step_us = 1e6 * stats.decode_s / steps
        row = {"spec_len": spec_len, "restore": stats.restore, "lag": lag,
               "acceptance_length": stats.acceptance_length, "step_us": step_us,
               "draft_path": stats.draft_path, "verify_path": stats.verify_path, "device_loop": stats.device_loop}
        if stats.device_loop:
            if run.loop.graphs is None:
                raise SystemExit(f"spec_len {spec_len}: the steps were not captured ({stats.verify_path_note})")
            row |= {"draft_us": 1e6 * stats.draft_s / steps, "verify_us": 1e6 * stats.verify_s / steps,
                    "extend_us": 0.0, "restore_us": 1e6 * stats.rollback_s / steps}
        else:
            verify, draft_step = run.verify_step, run.draft_step
            if verify.graph is None or draft_step.graph is None:
                raise SystemExit(f"spec_len {spec_len}: the steps were not captured ({stats.verify_path_note})")
            row |= {"draft_us": replay_us(draft_step.graph, args.replays),
                    "verify_us": replay_us(verify.graph, args.replays),
                    "extend_us": replay_us(draft_step.extend_graph, args.replays) if draft_step.extend_graph else 0.0,
                    "restore_us": replay_us(verify._rollbacks[1], args.replays) if 1 in verify._rollbacks else 0.0}
        plain = DecodeGraph(eng.model, eng.model.new_state(len(ids) + args.new_tokens + 16), tokens=1)
        row["plain_us"] = replay_us(plain.graph, args.replays) if plain.graph is not None else float("nan")
        per_step = 1.0 if stats.device_loop else stats.rollbacks / steps  # the loop restores at every step
        row["host_us"] = step_us - row["draft_us"] - row["verify_us"] - row["extend_us"] - row["restore_us"] * per_step
        result["rows"].append(row)
        print(f"{spec_len:>4} {str(stats.restore):>7} {lag:>3} {row['acceptance_length']:>6.2f} {step_us:>7.0f} "
              f"{row['draft_us']:>7.0f} "
              f"{row['verify_us']:>7.0f} {row['extend_us']:>7.0f} {row['restore_us']:>7.0f} {row['host_us']:>7.0f} "
              f"{row['plain_us']:>7.0f}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        if args.trace:
            trace(eng, draft, ids, args.trace, opts, args.trace_dir / f"dflash_trace_spec{spec_len}_{how}_lag{lag}.txt")
            if plain.graph is not None and "plain" not in KERNELS:  # once: every row's plain step is the same
                trace_plain(plain.graph, args.trace, args.trace_dir / "plain_trace.txt")
    print_kernel_comparison()


KERNELS: dict[str, dict[str, tuple[float, float]]] = {}  # trace name -> kernel -> (launches, us) a step


def kernels_per_step(prof, steps: int) -> dict[str, tuple[float, float]]:
    """Device kernels of a profile: name -> (launches a step, device us a step)."""
    from torch.autograd import DeviceType

    table: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            row = table.setdefault(e.name, [0.0, 0.0])
            row[0] += 1
            row[1] += e.time_range.end - e.time_range.start
    return {k: (n / steps, us / steps) for k, (n, us) in table.items()}


def print_kernel_comparison() -> None:
    """The traced steps' kernels side by side, most device time a DFlash step first."""
    if "plain" not in KERNELS:
        return
    plain = KERNELS["plain"]
    for name, spec in KERNELS.items():
        if name == "plain":
            continue
        print(f"\nkernels a step, {name} against the plain step (launches, us):", flush=True)
        total = [0.0, 0.0, 0.0, 0.0]
        for k in sorted(set(spec) | set(plain), key=lambda k: -max(spec.get(k, (0, 0))[1], plain.get(k, (0, 0))[1])):
            (n, us), (pn, pus) = spec.get(k, (0.0, 0.0)), plain.get(k, (0.0, 0.0))
            total = [total[0] + n, total[1] + us, total[2] + pn, total[3] + pus]
            if max(us, pus) >= 1.0:
                print(f"  {n:6.1f} {us:8.1f}   {pn:6.1f} {pus:8.1f}   {k[:110]}", flush=True)
        print(f"  {total[0]:6.1f} {total[1]:8.1f}   {total[2]:6.1f} {total[3]:8.1f}   (all kernels)", flush=True)


def trace_plain(graph: torch.cuda.CUDAGraph, replays: int, out: Path) -> None:
    """The plain one-token step's kernels, ``replays`` replays under the profiler: the base that a
    verify step's kernels are compared with."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    KERNELS["plain"] = kernels_per_step(prof, replays)
    text = (f"plain one-token step: {replays} replays\n\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"trace of the plain step in {out}", flush=True)


def trace(eng: Engine, draft, ids: list[int], new_tokens: int, opts: SpecOptions, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    run = _Generation(eng.model, draft, ids, new_tokens, opts, SamplingParams(), set(), None)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    name = "_loop_steps" if run.loop is not None else "_spec_step"  # the device loop's steps, or the host loop's
    first_step = getattr(run, name)

    started = []

    def step(*args, **kwargs):  # the profile starts at the first verify step: no prefill in it
        setattr(run, name, first_step)
        prof.start()
        started.append(True)
        return first_step(*args, **kwargs)

    setattr(run, name, step)
    try:
        _, stats = run.run()
    finally:
        if started:
            prof.stop()
    if not started:
        print(f"trace of spec_len {opts.spec_len}: no verify step ran", flush=True)
        return
    steps = max(stats.verify_steps, 1)
    KERNELS[f"spec_len {opts.spec_len} ({out.stem})"] = kernels_per_step(prof, steps)
    events = prof.key_averages()
    text = (f"spec_len {opts.spec_len}: {stats.verify_steps} verify steps, {stats.new_tokens} tokens, "
            f"{1e3 * stats.decode_s / steps:.3f} ms per step under the profiler\n\n"
            + events.table(sort_by="cuda_time_total", row_limit=40) + "\n\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=40))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"trace of spec_len {opts.spec_len} in {out}", flush=True)


if __name__ == "__main__":
    main()
