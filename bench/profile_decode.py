"""Where one decode step's time goes: torch.profiler over a few decode steps of one model.

    python bench/profile_decode.py --model M.gguf [--steps 8] [--weights dense|quantized]
        [--experts dense|quantized] [--budget-mb MB | --budget-percent P] [--cold-device cpu|gpu]
        [--no-graph] [--trace out.json] [--rows 30] [--depth N] [--attention-chunks 64,128,256]
        [--pdl-variants on,off,no-experts,no-experts+router] [--no-profile]
        [--kernel-variants "router-warps=4+tiles=old.json,router-warps=1,norm-warps=1,gdn-norm=apart"]
        [--timeline] [--ops] [--no-eager]

Prints the wall time per step (median of ``--steps`` after a warm-up) of the eager step
(``Qwen35MoE.forward``) and of the static step replayed from a CUDA graph (``DecodeGraph``,
where the engine can capture it), then for each the operators sorted by device time and by
host time, so that launch-bound and kernel-bound steps read differently. ``--trace`` writes a
Chrome trace of the eager step for a closer look. ``--depth`` prefills that many tokens before
the timed steps (the cache then holds them). ``--attention-chunks`` then captures the step once per
chunk size of the split-key decode attention (``engine.kernels.decode_attention``) and prints each
one's median, before the profiles (which use the last size). ``--pdl-variants`` likewise captures
it once per programmatic-dependent-launch setting (``engine.kernels.pdl``: ``on``, ``off``, or
``no-`` and kernel families joined by ``+``, launched without it) and prints each median over at
least 32 steps. ``--kernel-variants`` captures it once per setting of a small kernel's warps
(``NAME-warps=N``, NAME a kernel of ``engine.kernels.warps``: router, norm, gated_norm, rope,
gdn_prologue, delta_rule, attention_chunk, attention_combine), of the decode tile table
(``tiles=PATH``, read in place of ``engine/kernels/quant/tuned.json``), of Gated DeltaNet's gated
norm (``gdn-norm=apart``: its own launch; ``inside``: in the delta rule's,
``engine.model.gated_deltanet.NORM_IN_RULE``) and of the residual add + norm before the experts
(``norm-route=inside``: in the router's launch, ``engine.model.moe.NORM_IN_ROUTER``), settings
joined by ``+``, so that a change is timed against the tree before it in one process.
``--no-profile`` stops after the medians. ``--timeline`` reads the captured step's kernels from a trace of
its replays, in the order they ran on the device: per kernel name its launches, time and the idle time before
it, and every launch that is not one of ours (torch's own kernels inside the graph) with the one before it.
``--ops`` lists the torch operators the static step runs (run once eagerly, views left out), by count.
``--no-eager`` leaves the eager step out (at the 35B shapes its first steps compile for a minute or more).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from engine.engine import Engine
from engine.model.decode_graph import DecodeGraph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--weights", default="dense", choices=("dense", "quantized"))
    ap.add_argument("--experts", default="dense", choices=("dense", "quantized"),
                    help="routed experts dense, or as GGUF blocks on both tiers (budgets in quantized bytes)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--budget-mb", type=float, default=None,
                        help="expert budget (default: every expert on the GPU)")
    budget.add_argument("--budget-percent", type=float, default=None,
                        help="expert budget as a share of all the experts' device bytes")
    ap.add_argument("--cold-device", default="cpu", choices=("cpu", "gpu"),
                    help="what computes the experts outside the budget")
    ap.add_argument("--no-graph", action="store_true", help="time and profile the eager step only")
    ap.add_argument("--trace", type=Path, default=None, help="Chrome trace of the eager step")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--depth", type=int, default=16, help="prompt tokens in the cache before the timed steps")
    ap.add_argument("--pdl-variants", default="", help="on, off, no-FAMILY[+FAMILY...], comma-separated")
    ap.add_argument("--no-profile", action="store_true", help="only the step medians")
    ap.add_argument("--kernel-variants", default="", help="prefetch=on|off, NAME-warps=N, tiles=PATH, "
                    "gdn-norm=inside|apart and "
                    "norm-route=inside|apart joined by +, comma-separated")
    ap.add_argument("--timeline", action="store_true", help="the captured step's kernels in device order")
    ap.add_argument("--ops", action="store_true", help="the torch operators of the static step, by count")
    ap.add_argument("--no-eager", action="store_true", help="time and profile the captured step only")
    ap.add_argument("--attention-chunks", default="",
                    help="comma-separated keys per program of the decode attention, each timed in its own capture")
    args = ap.parse_args()
    try:
        chunks = [int(c) for c in args.attention_chunks.split(",") if c]
    except ValueError:
        raise SystemExit(f"--attention-chunks takes comma-separated integers, got {args.attention_chunks!r}") from None
    bad = [c for c in chunks if c < 32 or c & (c - 1)]  # decode_attention.BLOCK_S, read without importing Triton
    if bad:
        raise SystemExit(f"--attention-chunks must be powers of two of at least 32 keys, got {bad}")
    if args.depth < 1:
        raise SystemExit(f"--depth must be at least 1, got {args.depth}")

    quantized = args.experts == "quantized"
    placed = quantized or args.budget_mb is not None or args.budget_percent is not None
    eng = Engine.from_gguf(args.model, weights=args.weights, cuda_graph=True, cold_device=args.cold_device,
                           cold_format=args.experts, hot_format=args.experts,
                           expert_budget_mb=0 if placed else None)
    if placed:
        placement = eng.set_expert_budget(0)
        total_mb = placement.n_expert * sum(placement.expert_bytes) / 2**20
        budget = args.budget_mb if args.budget_mb is not None else total_mb * (args.budget_percent or 100) / 100
        placement = eng.set_expert_budget(budget)
        print(f"experts ({args.experts}): {placement.hot_count} hot, {placement.cold_count} cold "
              f"({args.cold_device}), {budget:,.1f} of {total_mb:,.1f} MB", flush=True)
    model, device = eng.model, eng.device
    prompt = torch.arange(args.depth, device=device) % eng.config.vocab
    capacity = args.depth + 64 + 3 * args.steps

    def eager() -> Callable[[torch.Tensor], torch.Tensor]:
        state = model.new_state(capacity)
        model.forward(prompt, state, logits="none")
        return lambda tok: model.forward(tok, state, logits="last").logits[-1].argmax().reshape(1)

    def static() -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        state = model.new_state(capacity)
        model.forward(prompt, state, logits="none")
        t0 = time.perf_counter()
        step = DecodeGraph(model, state)
        print(f"static step: {step.path}, built in {time.perf_counter() - t0:.2f} s", flush=True)
        return step.path, lambda tok: step.step(tok)[-1].argmax().reshape(1)

    if args.no_eager and args.no_graph:
        raise SystemExit("--no-eager and --no-graph leave nothing to time")
    paths = {} if args.no_eager else {"eager": eager()}
    first = torch.zeros(1, dtype=torch.long, device=device)
    blocker = "--no-graph" if args.no_graph else eng.decode_graph_blocker()
    if blocker is None:
        for chunk in chunks:  # the profiles below use the last one's step
            from engine.kernels import decode_attention  # needs Triton: only where chunks are asked for

            decode_attention.CHUNK = chunk
            name, step = static()
            print(f"attention chunk {chunk}: {timed(step, first, args.steps)}", flush=True)
        if args.pdl_variants:
            pdl_variants(args.pdl_variants, static, first, max(args.steps, 32))
        if args.kernel_variants:
            kernel_variants(args.kernel_variants, static, first, max(args.steps, 32))
        if not chunks:
            name, step = static()
        paths[name] = step
    else:
        print(f"decode graph: not used ({blocker})", flush=True)
    for name, step in paths.items():
        print(f"decode step, {name}: {timed(step, first, args.steps)}", flush=True)
    if args.ops:
        static_ops(model, capacity, prompt)
    if args.timeline and "cuda_graph" in paths:
        timeline(paths["cuda_graph"], first, args.steps, args.rows)
    if args.no_profile:
        return
    for name, step in paths.items():
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        token = first
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                token = step(token)
                int(token)
        events = prof.key_averages()
        if device.type == "cuda":
            print(f"\n{name}: by device time ({args.steps} steps)")
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        print(f"\n{name}: by host time ({args.steps} steps)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if args.trace and name == "eager":
            prof.export_chrome_trace(str(args.trace))


def pdl_variants(spec: str, static: Callable[[], tuple[str, Callable[[torch.Tensor], torch.Tensor]]],
                 token: torch.Tensor, steps: int) -> None:
    """The captured step's median under each programmatic-dependent-launch setting of ``spec``; the
    process's own setting is restored after."""
    from engine.kernels import pdl

    saved = pdl.ENABLED, os.environ.get(pdl.SKIP_ENV)
    try:
        for variant in spec.split(","):
            skip = variant[3:].split("+") if variant.startswith("no-") else []
            if variant not in ("on", "off") and (not skip or set(skip) - set(pdl.FAMILIES)):
                raise SystemExit(f"--pdl-variants: {variant!r} is not on, off or no-FAMILY[+FAMILY] "
                                 f"(families: {', '.join(pdl.FAMILIES)})")
            pdl.ENABLED = variant != "off"
            os.environ[pdl.SKIP_ENV] = ",".join(skip)
            _, step = static()
            print(f"PDL {variant}: {timed(step, token, steps)}", flush=True)
    finally:
        pdl.ENABLED = saved[0]
        if saved[1] is None:
            os.environ.pop(pdl.SKIP_ENV, None)
        else:
            os.environ[pdl.SKIP_ENV] = saved[1]


def kernel_variants(spec: str, static: Callable[[], tuple[str, Callable[[torch.Tensor], torch.Tensor]]],
                    token: torch.Tensor, steps: int) -> None:
    """The captured step's median under each warps and tile-table setting of ``spec``; the settings are
    restored after each."""
    from engine.kernels import pdl, warps
    from engine.kernels.quant import tuned
    from engine.model import gated_deltanet, moe

    for variant in spec.split(","):
        saved = dict(warps.WARPS), tuned.TABLE, gated_deltanet.NORM_IN_RULE, moe.NORM_IN_ROUTER, pdl.PREFETCH
        try:
            for setting in variant.split("+"):
                key, _, value = setting.partition("=")
                if key.endswith("-warps") and value.isdigit():
                    try:
                        warps.set_warps(key[:-len("-warps")], int(value))
                    except ValueError as exc:
                        raise SystemExit(f"--kernel-variants: {exc}") from None
                elif key == "tiles" and Path(value).is_file():
                    tuned.TABLE = Path(value)
                elif key == "gdn-norm" and value in ("inside", "apart"):
                    gated_deltanet.NORM_IN_RULE = value == "inside"
                elif key == "norm-route" and value in ("inside", "apart"):
                    moe.NORM_IN_ROUTER = value == "inside"
                elif key == "prefetch" and value in ("on", "off"):
                    pdl.PREFETCH = value == "on"
                else:
                    raise SystemExit(f"--kernel-variants: {setting!r} is not NAME-warps=N, tiles=FILE, "
                                     f"gdn-norm=inside|apart, norm-route=inside|apart or prefetch=on|off")
            _, step = static()
            print(f"kernels {variant}: {timed(step, token, steps)}", flush=True)
        finally:
            warps.WARPS.update(saved[0])
            tuned.TABLE, gated_deltanet.NORM_IN_RULE, moe.NORM_IN_ROUTER, pdl.PREFETCH = saved[1:]


# torch operators that launch nothing: left out of --ops
VIEW_OPS = frozenset({"view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "select", "slice", "transpose", "t",
                      "permute", "expand", "as_strided", "split", "split_with_sizes", "alias", "detach", "_unsafe_view",
                      "unbind", "empty", "empty_like", "empty_strided", "narrow", "diagonal", "lift_fresh"})


def static_ops(model, capacity: int, prompt: torch.Tensor) -> None:
    """The torch operators one static step runs (eagerly, on a state of its own), views left out: each
    one that is not a Triton kernel of ours is a launch of torch's inside the captured graph."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in VIEW_OPS:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    state = model.new_state(capacity)
    model.forward(prompt, state, logits="none")
    step = DecodeGraph(model, state, graph=False)
    step.step(torch.zeros(1, dtype=torch.long, device=model.device))  # compiled and warm
    log = Log()
    with log, torch.inference_mode():
        step._run()
    counts: dict[str, int] = {}
    for op in log.ops:
        counts[op] = counts.get(op, 0) + 1
    print(f"\nstatic step: {len(log.ops)} torch operators (views left out)")
    for op, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {op}")
    print("  in order: " + " ".join(log.ops[:120]))


def timeline(step: Callable[[torch.Tensor], torch.Tensor], token: torch.Tensor, steps: int, rows: int,
             anchor: str = "_select_kernel") -> None:
    """The captured step's kernels in device order, from a trace of ``steps`` replays (the last one
    read): per kernel name its launches, summed time and the idle time before its launches; then each
    launch not of ours (a name without a leading underscore: torch's kernels) and the kernel before it;
    then, where ``anchor`` repeats, the stretch between its launches (``cycle_anatomy``)."""
    import json
    import tempfile

    for _ in range(3):
        token = step(token)
    int(token)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(token)
            int(token)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    graphs = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch")
    if not kernels or not graphs:
        print("timeline: no kernels or graph launches in the trace")
        return
    last = [k for k in kernels if k["ts"] >= graphs[-1]]
    ours = [k for k in last if k["name"].startswith("_")]
    if not ours:
        print("timeline: none of our kernels after the last graph launch")
        return
    end_of_ours = max(k["ts"] + k["dur"] for k in ours)
    last = [k for k in last if k["ts"] < end_of_ours]  # the replay, not the argmax after it
    span = last[-1]["ts"] + last[-1]["dur"] - last[0]["ts"]
    per: dict[str, list[float]] = {}
    busy_to = last[0]["ts"]
    idle_total = 0.0
    foreign = []
    for i, k in enumerate(last):
        idle = max(0.0, k["ts"] - busy_to)
        idle_total += idle
        busy_to = max(busy_to, k["ts"] + k["dur"])
        row = per.setdefault(k["name"][:48], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += k["dur"]
        row[2] += idle
        if not k["name"].startswith("_"):
            foreign.append((k["name"][:70], last[i - 1]["name"][:40] if i else "-", k["dur"]))
    print(f"\ncaptured step on the device: {len(last)} kernels over {span:.1f} us, idle between them "
          f"{idle_total:.1f} us")
    print(f"  {'kernel':48s} {'n':>4s} {'us':>8s} {'idle us':>8s}")
    for name, (n, dur, idle) in sorted(per.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"  {name:48s} {n:4d} {dur:8.1f} {idle:8.1f}")
    print(f"  torch's kernels inside the step: {len(foreign)}")
    for name, before, dur in foreign[:rows]:
        print(f"    {dur:6.1f} us  {name}  (after {before})")
    cycle = cycle_anatomy(last, anchor)
    if cycle:
        print_cycle(cycle, anchor)


def cycle_anatomy(kernels: list[dict], anchor: str) -> list[dict] | None:
    """The step's repeating stretch from one launch of ``anchor`` to the next (a cold layer and the hot one
    before it, at half cold with the select launch as the anchor), as medians over its repeats: each
    launch's start and end in microseconds after the anchor's start, its stream, and the stretch's length.

    ``kernels`` are trace events (``name``, ``ts``, ``dur``, ``tid``) in device order. Stretches are
    compared by their launches' names in order and the most common sequence is the one described; None
    where the anchor runs fewer than three times."""
    starts = [i for i, k in enumerate(kernels) if k["name"].startswith(anchor)]
    if len(starts) < 3:
        return None
    spans = [kernels[a:b] for a, b in zip(starts, starts[1:])]
    signature = [tuple(k["name"][:48] for k in span) for span in spans]
    common = max(set(signature), key=signature.count)
    chosen = [span for span, sig in zip(spans, signature) if sig == common]
    nxt = [kernels[b]["ts"] for b, sig in zip(starts[1:], signature) if sig == common]
    rows = []
    for j, name in enumerate(common):
        rows.append({
            "name": name,
            "stream": chosen[0][j].get("tid"),
            "start_us": statistics.median(s[j]["ts"] - s[0]["ts"] for s in chosen),
            "end_us": statistics.median(s[j]["ts"] + s[j]["dur"] - s[0]["ts"] for s in chosen),
        })
    length = statistics.median(n - s[0]["ts"] for n, s in zip(nxt, chosen))
    return [{"repeats": len(chosen), "of": len(spans), "length_us": length}] + rows


def print_cycle(cycle: list[dict], anchor: str) -> None:
    head, rows = cycle[0], cycle[1:]
    print(f"\n  from one {anchor} to the next: {head['length_us']:.1f} us (median of {head['repeats']} of "
          f"{head['of']} stretches alike), launches by start")
    streams = {tid: i for i, tid in enumerate(sorted({r["stream"] for r in rows}, key=str))}
    print(f"  {'kernel':48s} {'stream':>6s} {'start':>8s} {'end':>8s}")
    for r in rows:
        print(f"  {r['name']:48s} {streams[r['stream']]:6d} {r['start_us']:8.1f} {r['end_us']:8.1f}")


def timed(step: Callable[[torch.Tensor], torch.Tensor], token: torch.Tensor, steps: int) -> str:
    """Median wall time of one step (token read back each time), after as many warm-up steps."""
    for _ in range(steps):  # warm-up: kernels compiled, caches filled
        token = step(token)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = step(token)
        int(token)
        walls.append(time.perf_counter() - t0)
    med = statistics.median(walls)
    return f"median {med * 1e3:.2f} ms (min {min(walls) * 1e3:.2f}, max {max(walls) * 1e3:.2f}) -> {1 / med:.1f} tok/s"


if __name__ == "__main__":
    main()
