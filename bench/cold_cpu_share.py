"""Decode with part of the cold experts computed by CPU threads beside the bus (issue 9's half-cold row).

    python bench/cold_cpu_share.py --model /tmp/q35.gguf [--budget-mb 8640] [--shares 0,0.25,0.4,0.5]
                                   [--activations int8,float32] [--threads 15,12] [--new-tokens 128] [--repeats 3]
                                   [--placement-units expert,layer] [--feed random|greedy] [--also-greedy]
                                   [--timeline] [--prefetch 0,1,2] [--warm 0,2] [--ahead 0,1]
                                   [--routes main,side] [--fetch-programs 0,8,16] [--fetch-copiers kernel,engine]
                                   [--cflags "-DLT_STATS=1;-DLT_STATS=1 -DLT_CHUNK1=16"]
                                   [--json out.json]

One engine (Q4_0 projections and experts, cold experts in pinned host memory read by the GPU, decoding
from the captured step); for each share, ``Engine.set_cold_cpu_share`` re-splits every layer's cold
experts between the bus and the threads, a warm-up generation captures the step, then ``--repeats``
generations of ``--new-tokens`` tokens are timed (median and spread of decode tok/s), for each of the
threads' activation widths (``--activations``: 8-bit rounding with integer products, or float32). The
timed steps decode random tokens (``--feed random``, as llama-bench does; ``--feed greedy`` feeds the model's
own output, which repeats one token). On the random-weight 35B file both route every token to the same 8-10
experts a layer past layer 0 (``bench/route_prediction.py``; docs/benchmarks.md, 2026-12-05 eighth round), so
neither varies the routing: the threads read the same experts every step, as llama.cpp's CPU layers do. Each row's warm-up (16 greedy
tokens) is compared with the first row's: float32 sums differ from the device's only in rounding, 8-bit
activations a little more, so they usually agree; a difference is reported, not hidden.

``--threads`` repeats each share per thread count (default: one per core but one). With the pool built
with ``LUCE_TUNE_HOST_EXPERTS_CFLAGS=-DLT_STATS=1`` each row also reports the threads' own time a layer's
job (from the first thread's look to the reply) over the timed generations, and ``--timeline`` prints
each row's captured step as kernels in device order (``bench/profile_decode.py``'s): the collect launch's
time is the device's wait for the threads. ``--cflags`` repeats the rows with threads per build of the pool
(``;`` between builds, as ``LUCE_TUNE_HOST_EXPERTS_CFLAGS`` takes them), restarting the threads for each; a row
with threads reports the chunks they fetched for warm-ups over its timed runs and, built with ``-DLT_SPEC=1``, the
chunks fetched ahead of their warm-up (``engine/kernels/host_experts.c``);
``--placement-units`` repeats every row per placement unit (``Engine.set_expert_budget(unit=)``: the hot set
grown by experts or by whole layers). ``--prefetch`` repeats the rows with threads per count of cold experts a
layer the bus fetches ahead of its router (``Engine.set_cold_prefetch``), ``--warm`` per count the CPU threads
warm ahead, ``--ahead`` per way of predicting a cold layer after an all-hot one (at that layer's start, or at its own),
and each such row reports how many were fetched or warmed and how many of the cold pairs they served;
``--routes`` per place of the predicting router (the step's stream or the second one), ``--fetch-programs`` per
bound on the bus's fetch's programs (0: one a block) and ``--fetch-copiers`` per copier of that fetch (a copy
launch, or the copy engine queued by a host thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, joined_values, machine, spread  # noqa: E402
from engine.engine import Engine, blocking_wait_setting  # noqa: E402
from engine.kernels.host_experts import CFLAGS_ENV  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--budget-mb", type=float, default=8640.0, help="device MB for routed experts (8640: half at the 35B shapes)")
    ap.add_argument("--shares", default="0,0.25,0.4,0.5")
    ap.add_argument("--activations", default="int8", help="int8, float32 or both, comma-separated")
    ap.add_argument("--threads", default="", help="thread counts, comma-separated (default: one per core but one)")
    ap.add_argument("--timeline", action="store_true", help="each row's captured step in device order")
    ap.add_argument("--prefill", type=int, default=0, help="also time prefill of this many tokens per row")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--placement-units", default="expert",
                    help="what the hot set grows by, per row: expert, layer or both (comma-separated)")
    ap.add_argument("--feed", choices=("random", "greedy"), default="random",
                    help="decode random tokens fed to each step, as llama-bench does (default), or the greedy output")
    ap.add_argument("--also-greedy", action="store_true",
                    help="with --feed random, also time each row on the greedy output (the routing repeated)")
    ap.add_argument("--cflags", default=None, help="builds of the pool for the rows with threads, ';' between them")
    ap.add_argument("--prefetch", default="", help="cold experts fetched ahead a layer, per row with threads "
                    "(comma-separated; default: the engine's)")
    ap.add_argument("--warm", default="", help="cold experts the CPU threads warm ahead a layer, per row with threads "
                    "(comma-separated; default: the engine's)")
    ap.add_argument("--ahead", default="", help="1, 0 or both: a cold layer after an all-hot one predicted at "
                    "that layer's start (default: the engine's, LUCE_TUNE_COLD_AHEAD or on)")
    ap.add_argument("--routes", default="", help="main, side or both: where the predicting router runs (default: "
                    "the engine's, LUCE_TUNE_AHEAD_ROUTE or main)")
    ap.add_argument("--fetch-programs", default="", help="programs of the bus's fetch ahead, per row with threads "
                    "(comma-separated; 0: one a block; default: the engine's)")
    ap.add_argument("--fetch-copiers", default="", help="kernel, engine or both: what copies the bus's fetch ahead "
                    "(a copy launch, or the copy engine queued by a host thread; default: the engine's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(joined_values(sys.argv[1:] if argv is None else argv, ("--cflags",)))
    fetches = [int(n) for n in args.prefetch.split(",") if n] or [None]
    warms = [int(n) for n in args.warm.split(",") if n] or [None]
    aheads = [n == "1" for n in args.ahead.split(",") if n] or [None]
    routes = [r for r in args.routes.split(",") if r] or [None]
    programs = [int(n) for n in args.fetch_programs.split(",") if n] or [None]
    copiers = [c for c in args.fetch_copiers.split(",") if c] or [None]
    ways = [(r, g, c) for r in routes for g in programs for c in copiers]
    shares = [float(s) for s in args.shares.split(",")]
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()  # off CUDA (the tests' tiny model) the same rows run eagerly, fetching nothing
    eng = Engine.from_gguf(args.model, weights="quantized", cold_format="quantized", hot_format="quantized",
                           cold_device="gpu", expert_budget_mb=args.budget_mb, cuda_graph=cuda,
                           device="cuda" if cuda else "cpu")
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {eng.hybrid.placement.hot_count} hot / "
          f"{eng.hybrid.placement.cold_count} cold experts", flush=True)
    ids = eng.tokenizer.encode(args.prompt)
    rows, first = [], None
    gen = torch.Generator().manual_seed(0)
    acts = args.activations.split(",")
    counts = [int(t) for t in args.threads.split(",") if t] or [None]
    builds = args.cflags.split(";") if args.cflags is not None else [os.environ.get(CFLAGS_ENV, "")]
    units = args.placement_units.split(",")
    runs = [(u, share, act, None, builds[0], None, None, None, (None, None, None)) for u in units for share in shares
            if not share for act in acts[:1]]  # no threads: one row
    runs += [(u, share, act, n, b, f, wm, a, way) for u in units for b in builds for n in counts for act in acts
             for share in shares for f in fetches for wm in warms for a in aheads for way in ways if share]
    runs.sort(key=lambda r: units.index(r[0]))  # one placement after the other
    for unit, share, act, n, build, fetch, warm_n, ahead, (route, progs, copier) in runs:
        if unit != eng.hybrid.unit:
            eng.set_expert_budget(args.budget_mb, unit=unit)
        if build != os.environ.get(CFLAGS_ENV, "") and eng.hybrid._host_share is not None:
            eng.set_cold_cpu_share(0.0)  # the threads restart with the next share, built with these flags
            eng.hybrid._host_share.close()
            eng.hybrid._host_share = None
        os.environ[CFLAGS_ENV] = build
        eng.set_cold_cpu_share(share, int8=act == "int8", threads=n)
        if not share:
            eng.set_cold_prefetch(0, warm=0)
        else:
            eng.set_cold_prefetch(eng.hybrid.cold_prefetch if fetch is None else fetch, warm=warm_n, ahead=ahead,
                                  route=route, programs=progs, copier=copier)
        warm = eng.generate(ids, 16, ignore_eos=True)
        pool = eng.hybrid._host_share
        before = pool.stats() if share and pool is not None else None
        chunks0 = (pool.warm_chunks, pool.spec_chunks) if share and pool is not None else None
        rates, out = [], None
        for _ in range(args.repeats):
            feed = (torch.randint(0, eng.config.vocab, (args.new_tokens,), generator=gen).tolist()
                    if args.feed == "random" else None)
            out = eng.generate(ids, args.new_tokens, ignore_eos=True, feed=feed)
            rates.append(out.timings.decode_tok_s)
        after = pool.stats() if before is not None else None
        job_us = job_time(before, after) if before is not None else None
        phases = thread_phases(before, after) if before is not None else None
        warm_chunks = spec_chunks = None
        if chunks0 is not None:  # chunks the threads fetched for warm-ups, and ahead of them, over the timed runs
            warm_chunks = pool.warm_chunks - chunks0[0]
            spec_chunks = None if chunks0[1] is None else pool.spec_chunks - chunks0[1]
        extra = out.timings.extra  # the last generation's counters (its prompt and decode)
        sent, served, cold_pairs = extra.get("prefetched", 0), extra.get("prefetch_served", 0), extra.get("cold_hits", 0)
        greedy = None
        if args.also_greedy and args.feed == "random":
            greedy = spread([eng.generate(ids, args.new_tokens, ignore_eos=True).timings.decode_tok_s
                             for _ in range(args.repeats)])
        prefill = None
        if args.prefill:
            long_ids = [(i * 7919) % (eng.config.vocab - 1) + 1 for i in range(args.prefill)]
            for _ in range(2):  # the first captures (or warms) the prefill of this length
                eng.generate(long_ids, 1, ignore_eos=True)
            prefill = spread([args.prefill / eng.generate(long_ids, 1, ignore_eos=True).timings.prefill_s
                              for _ in range(args.repeats)])
        first = first if first is not None else warm.ids  # the warm-up's greedy tokens
        same = warm.ids == first
        row = {"placement_unit": unit, "feed": args.feed, "share": share, "activations": act if share else None, "threads": pool.threads if share else 0,
               "cold_prefetch": eng.hybrid.cold_prefetch, "cold_warm": eng.hybrid.cold_warm,
               "cold_ahead": eng.hybrid.cold_ahead, "ahead_route": eng.hybrid.ahead_route,
               "fetch_programs": eng.hybrid.fetch_programs or 0, "fetch_copier": eng.hybrid.fetch_copier,
               "prefetched": sent, "prefetch_served_pairs": served,
               "cold_pairs": cold_pairs,
               "cflags": build if share else None, "blocking_wait": blocking_wait_setting(),
               "decode_tok_s": spread(rates), "runs": rates, "greedy_decode_tok_s": greedy, "pool_job_us": job_us, "pool_phases_us": phases,
               "warm_chunks": warm_chunks, "spec_chunks": spec_chunks,
               "prefill_tokens": args.prefill, "prefill_tok_s": prefill,
               "same_tokens_as_first": same,
               "cpu_jobs": eng.hybrid._host_share.jobs if eng.hybrid._host_share else 0,
               "cold_hit_rate": out.timings.extra.get("cold_hit_rate"), "peak_mem_mb": out.timings.peak_mem_mb,
               "decode_path": out.timings.extra.get("decode_path"),
               "warm_up_path": warm.timings.extra.get("decode_path")}
        rows.append(row)
        step_ms = 1e3 / statistics.median(rates)
        print((f"[{unit}] " if len(units) > 1 else "") + (f"[{build}] " if share and len(builds) > 1 else "")
              + (f"fetch {row['cold_prefetch']} warm {row['cold_warm']} " if len(fetches) + len(warms) > 2 else "")
              + (f"ahead {int(row['cold_ahead'])} " if len(aheads) > 1 else "")
              + (f"route {row['ahead_route']} " if len(routes) > 1 else "")
              + (f"programs {row['fetch_programs']} " if len(programs) > 1 else "")
              + (f"copier {row['fetch_copier']} " if len(copiers) > 1 else "")
              + f"share {share:.2f} {act if share else '':7s} {row['threads']:2d} threads: decode "
              f"{statistics.median(rates):7.1f} tok/s [{min(rates):.1f}-{max(rates):.1f}] ({row['decode_path']}), "
              f"step {step_ms:.2f} ms, same tokens as the first row: {same}, peak {out.timings.peak_mem_mb:,.0f} MB, "
              f"CPU jobs so far {row['cpu_jobs']:,}"
              + (f", ahead a layer: {eng.hybrid.cold_prefetch} fetched, {eng.hybrid.cold_warm} warmed; "
                 f"{served:,} of {cold_pairs:,} cold pairs served by {sent:,}"
                 if eng.hybrid.cold_prefetch or eng.hybrid.cold_warm else "")
              + (f", the threads' job {job_us:.1f} us (x {eng.config.n_layers} layers: "
                 f"{job_us * eng.config.n_layers / 1e3:.2f} ms)" if job_us is not None else "")
              + (f", a thread's gate/up {phases['gate_up']['mean']:.1f} us (slowest {phases['gate_up']['max']:.1f}), "
                 f"wait {phases['wait']['mean']:.1f} (longest {phases['wait']['max']:.1f}), down "
                 f"{phases['down']['mean']:.1f} (slowest {phases['down']['max']:.1f})" if phases else "")
              + (f", chunks warmed {warm_chunks:,} and ahead of their warm-up {spec_chunks:,}"
                 if spec_chunks is not None else "")
              + (f", greedy (routing repeated) {greedy['median']:.1f} tok/s" if greedy else "")
              + (f", prefill {args.prefill}: {prefill['median']:,.1f} tok/s" if prefill else ""), flush=True)
        if args.timeline:
            captured_timeline(eng, ids)
        if args.json is not None:  # after every row: a run cut short by its time box keeps the rows it measured
            args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "model": str(args.model),
                                             "budget_mb": args.budget_mb, "new_tokens": args.new_tokens,
                                             "threads": eng.hybrid._host_share.threads if eng.hybrid._host_share
                                             else 0, "rows": rows}, indent=1))


def job_time(before: dict, after: dict | None) -> float | None:
    """Mean microseconds of the threads' jobs between two ``HostShare.stats()`` readings."""
    if after is None or after["jobs"] <= before["jobs"]:
        return None
    return (after["jobs"] * after["job_us"] - before["jobs"] * before["job_us"]) / (after["jobs"] - before["jobs"])


def thread_phases(before: dict | None, after: dict | None) -> dict | None:
    """Per phase of a job (gate/up, the wait after it, down), the mean and the largest over the threads of each
    thread's mean microseconds a job between two ``HostShare.stats()`` readings."""
    if before is None or after is None or after["jobs"] <= before["jobs"]:
        return None
    n = after["jobs"] - before["jobs"]
    per = [[(after["jobs"] * a - before["jobs"] * b) / n for a, b in zip(ta, tb)]
           for ta, tb in zip(after["threads"], before["threads"])]
    return {name: {"mean": statistics.fmean(t[j] for t in per), "max": max(t[j] for t in per)}
            for j, name in enumerate(("gate_up", "wait", "down"))}


def captured_timeline(eng: Engine, ids: list[int]) -> None:
    """The engine's captured step over a state holding the prompt, as kernels in device order."""
    import torch

    from bench.profile_decode import timeline
    from engine.model.decode_graph import DecodeGraph

    with torch.inference_mode():
        state = eng.model.new_state(len(ids) + 64)
        eng.model.forward(torch.tensor(ids, device=eng.device), state, logits="none")
        step = DecodeGraph(eng.model, state)
        timeline(lambda tok: step.step(tok)[-1].argmax().reshape(1),
                 torch.zeros(1, dtype=torch.long, device=eng.device), 8, 24)


if __name__ == "__main__":
    main()
