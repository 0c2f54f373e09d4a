"""Our engine against llama.cpp's llama-bench on the same GGUF, side by side.

    python bench/vs_llamacpp.py --model M.gguf (--llama-bench BIN | --llama-src SRC | --fetch-sdist DIR)
        [--build-dir build/llama.cpp] [--cuda auto|on|off] [--cuda-arch 90] [--jobs N] [--cmake-arg -DX=Y]
        [--prompts 512,8192] [--gen 128] [--depths 0,16384] [--repeats 3] [--ncmoe N]
        [--weights dense|quantized] [--experts dense|quantized] [--cuda-graph] [--no-prefill-graph] [--device auto]
        [--cold-device cpu|gpu] [--placement-unit expert|layer|alternate] [--cold-cpu-share 0.6] [--cold-prefetch 1]
        [--cold-warm 2] [--threads N] [--interleave [all|ncmoe]] [--host-probe-mib 1024] [--json out.json]

llama.cpp comes from an existing llama-bench binary, or is built (llama-bench target only,
CUDA when nvcc and a GPU are there) from a llama.cpp tree or the llama-cpp-python sdist, which
vendors it; ``--fetch-sdist`` downloads that sdist first. Each measurement runs as its own
llama-bench process (all layers on the GPU, flash attention on, ``-r`` repeats) so its GPU
memory can be sampled alone; ours runs through ``Engine`` with one warm-up and the same repeats.
Prompt processing is tokens/s over the prompt; generation is tokens/s over ``--gen`` tokens
after ``depth`` tokens of context. ``--ncmoe N`` repeats everything with llama.cpp's experts of
the first N layers on the CPU, and ours with an expert budget of the device bytes of the other
layers' experts (the same share of experts on the GPU, placed by routing statistics).
VRAM: ours is torch's peak allocated memory (no CUDA context or allocator slack); llama.cpp's
is the GPU's memory in use above the level before it started (NVML or nvidia-smi, sampled every
0.1 s), which includes its CUDA context. llama-bench sees only the GPU ours runs on.
--interleave runs each test's repeats in turns, a llama-bench process of one repeat and then one run of ours (ours
loaded first, both in device memory at once): the ratio column adds the range of the pairs' ratios. Each of those
processes loads the file (on the 35B file a run of 5 repeats of two tests took over 260 s against 85 s plain);
--interleave ncmoe does so for the -ncmoe pass only and measures the other tests back to back, llama.cpp's repeats
in one process right before ours.
Host: before each measurement a sum over --host-probe-mib of host memory gives its read rate (GB/s), and the
kernel's counters give other processes' CPU use while it runs ("others' cores") and, in the JSON, how often the
side's own threads were taken off a core that they could have kept (preempted_per_s); rows whose two sides saw a
different host get a note (half-cold decode, ours and llama.cpp's CPU layers, reads host memory).
Decode rows without -ncmoe also show the bandwidth floor: active weight bytes per token (GGUF sizes) over
the device's measured copy bandwidth; "x floor" is time per token over the floor's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from common import HostLoad, commit, machine
from decode_floor import active_bytes, copy_bandwidth
from llamacpp import (BenchTest, LlamaCppError, bench_command, build_llama_bench, cuda_visible_entry, fetch_sdist,
                      llama_source, plan_build, probe_features, run_llama_bench)

from engine.engine import Engine, blocking_wait_setting, resolve_device
from engine.errors import ConfigError, EngineError
from engine.hybrid import PREFETCH_MAX, WARM_MAX
from engine.kernels.host_experts import CFLAGS_ENV
from engine.placement import MB


@dataclass(frozen=True)
class Ours:
    tok_s: list[float]
    peak_mem_mb: float
    host: dict[str, float]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)

    def as_dict(self) -> dict[str, Any]:
        return {"samples_ts": self.tok_s, "median_ts": self.median,
                "stddev_ts": statistics.stdev(self.tok_s) if len(self.tok_s) > 1 else 0.0,
                "peak_mem_mb": self.peak_mem_mb, "host": self.host}


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} needs at least one value, none negative")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--llama-bench", type=Path, help="an existing llama-bench binary")
    src.add_argument("--llama-src", type=Path, help="llama.cpp tree, or llama-cpp-python sdist (.tar.gz or unpacked)")
    src.add_argument("--fetch-sdist", type=Path, metavar="DIR", help="pip download the llama-cpp-python sdist here")
    ap.add_argument("--build-dir", type=Path, default=Path("build/llama.cpp"))
    ap.add_argument("--cuda", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--cuda-arch", default=None, help="CMAKE_CUDA_ARCHITECTURES, read from the GPU when left out")
    ap.add_argument("--jobs", type=int, default=None, help="build jobs (default: CPU count)")
    ap.add_argument("--cmake-arg", action="append", default=[], metavar="-DNAME=VALUE",
                    help="extra llama.cpp configure definition (repeatable), e.g. -DGGML_NATIVE=OFF")
    ap.add_argument("--prompts", type=int_list, default=[512, 8192])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--depths", type=int_list, default=[0, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ncmoe", type=int, default=None, help="also compare with the first N layers' experts on the CPU")
    ap.add_argument("--weights", default="dense", choices=("dense", "quantized"))
    ap.add_argument("--experts", default="dense", choices=("dense", "quantized"),
                    help="quantized: routed experts stay Q4_0 blocks on both tiers (GPU slots and CPU), every "
                    "expert placed on the GPU for the all-GPU rows")
    ap.add_argument("--cuda-graph", action="store_true", help="our decoding replays a captured CUDA graph where it can")
    ap.add_argument("--no-prefill-graph", action="store_true",
                    help="our prompts prefill eagerly (with --cuda-graph, by default, prompts up to 2,048 tokens "
                         "prefill through the captured padded prefill)")
    ap.add_argument("--cold-device", default="cpu", choices=("cpu", "gpu"),
                    help="our cold experts (--ncmoe): CPU threads, or the GPU reading their pinned host copies")
    ap.add_argument("--placement-unit", default="expert", choices=("expert", "layer", "alternate"),
                    help="our hot set at --ncmoe's budget: the most-routed experts of any layer, or whole layers "
                         "(llama.cpp's -ncmoe places whole layers), or whole layers every other one first")
    ap.add_argument("--cold-cpu-share", type=float, default=None,
                    help="with --ncmoe, --cold-device gpu and --experts quantized: the share of the cold experts' "
                         "pairs our native CPU threads compute beside the bus in decode (default: "
                         "LUCE_TUNE_COLD_CPU_SHARE, else 0; 0.6 was the fastest on the H200's 16-core host)")
    ap.add_argument("--cold-prefetch", type=int, default=None,
                    help="half-cold rows: cold experts a layer the bus fetches ahead of its router from the predicted "
                         "routing (0-4; needs --cold-cpu-share)")
    ap.add_argument("--cold-warm", type=int, default=None,
                    help="half-cold rows: cold experts a layer the CPU threads warm ahead of its router (0-8; needs "
                         "--cold-cpu-share)")
    ap.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu (cpu: llama.cpp gets -ngl 0)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both")
    ap.add_argument("--bw-mib", type=int, default=None, help="copy size for the bandwidth (default 1024 GPU, 256 CPU)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per llama-bench run")
    ap.add_argument("--interleave", nargs="?", const="all", default=None, choices=INTERLEAVE_SCOPES,
                    help="each test's repeats in turns, a llama-bench process of one repeat then one run of ours "
                         "(both in device memory at once), so that slow changes of the host fall on both sides; "
                         "'ncmoe': only the -ncmoe pass's tests, the others back to back (llama.cpp's repeats in one "
                         "process, then ours): each llama-bench process loads the file, which makes a test in "
                         "turns several times slower")
    ap.add_argument("--host-probe-mib", type=int, default=1024,
                    help="host memory read before each measurement to probe its read rate (0: none)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.host_probe_mib < 0:
        ap.error(f"--host-probe-mib must be 0 or more, got {args.host_probe_mib}")
    for name in ("gen", "repeats", "jobs", "threads", "bw_mib"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.ncmoe is not None and args.ncmoe < 1:
        ap.error(f"--ncmoe must be at least 1, got {args.ncmoe}")
    if args.cold_cpu_share is not None:
        if not 0 <= args.cold_cpu_share <= 1:
            ap.error(f"--cold-cpu-share must be between 0 and 1, got {args.cold_cpu_share}")
        if args.ncmoe is None or args.cold_device != "gpu" or args.experts != "quantized":
            ap.error("--cold-cpu-share needs --ncmoe, --cold-device gpu and --experts quantized")
    for name, top in (("cold_prefetch", PREFETCH_MAX), ("cold_warm", WARM_MAX)):
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is None:
            continue
        if not 0 <= value <= top:
            ap.error(f"{flag} must be from 0 to {top}, got {value}")
        if not args.cold_cpu_share:
            ap.error(f"{flag} needs --cold-cpu-share above 0 (the fetches ride the CPU share's second stream)")
    if not args.model.is_file():
        ap.error(f"--model {args.model} is not a file")
    return args


def get_llama_bench(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    if args.llama_bench is not None:
        return args.llama_bench, {"binary": str(args.llama_bench), "built": False}
    source = args.llama_src if args.llama_src is not None else fetch_sdist(args.fetch_sdist)
    root = llama_source(source, args.build_dir / "source")
    plan = plan_build(root, args.build_dir, cuda=args.cuda, cuda_arch=args.cuda_arch, jobs=args.jobs,
                      extra=tuple(args.cmake_arg))
    binary = build_llama_bench(plan, say=lambda s: print(s, flush=True))
    return binary, {"binary": str(binary), "built": True, "source": str(source), "cuda_arch": plan.cuda_arch,
                    "configure": plan.configure_cmd()}


def tests_for(args: argparse.Namespace, ncmoe: int) -> list[BenchTest]:
    tail = f" ncmoe{ncmoe}" if ncmoe else ""
    return ([BenchTest(f"pp{p}{tail}", p, 0, 0, ncmoe) for p in args.prompts if p > 0]
            + [BenchTest(f"tg{args.gen}@d{d}{tail}", 0, args.gen, d, ncmoe) for d in args.depths])


def ours_runner(eng: Engine, test: BenchTest, gen: torch.Generator) -> Callable[[], tuple[float, float]]:
    """One warm-up run of ``test``, then a function that times one more: (tok/s, peak MB).

    Prefill: prompt tokens over time to first token. Decode: ``n_gen`` single-token steps
    after a prompt of ``depth`` tokens (one token at depth 0), tokens over decode time, each step
    fed a random token as llama-bench's are (``Engine.generate(feed=)``): a random-weight model's
    greedy output repeats one token, routed the same way at every step, which would let the
    host's caches hold the CPU's share of the cold experts from one step to the next."""
    vocab = eng.config.vocab
    if test.n_prompt:
        ids = torch.randint(0, vocab, (test.n_prompt,), generator=gen).tolist()
        eng.generate(ids, 1, ignore_eos=True)  # warm-up

        def prefill_once() -> tuple[float, float]:
            t = eng.generate(ids, 1, ignore_eos=True).timings
            return test.n_prompt / t.prefill_s, t.peak_mem_mb

        return prefill_once
    ids = torch.randint(0, vocab, (max(test.depth, 1),), generator=gen).tolist()

    def feed() -> list[int]:
        return torch.randint(0, vocab, (test.n_gen + 1,), generator=gen).tolist()

    eng.generate(ids, test.n_gen + 1, ignore_eos=True, feed=feed())

    def decode_once() -> tuple[float, float]:
        t = eng.generate(ids, test.n_gen + 1, ignore_eos=True, feed=feed()).timings
        return t.decode_tok_s, t.peak_mem_mb

    return decode_once


def time_ours(eng: Engine, test: BenchTest, repeats: int, gen: torch.Generator,
              probe: torch.Tensor | None = None) -> Ours:
    """``repeats`` timed runs of ``test`` after its warm-up (``ours_runner``), with the host's load over them
    (``HostLoad``, ``probe`` read just before them)."""
    once = ours_runner(eng, test, gen)
    with HostLoad(probe) as load:
        runs = [once() for _ in range(repeats)]
    return Ours([r for r, _ in runs], max(m for _, m in runs), load.result)


def merge_host(loads: list[dict[str, float]]) -> dict[str, float]:
    """Several ``HostLoad`` results as one: the read rates' median, the times summed, the rest weighted by time."""
    wall = sum(h["wall_s"] for h in loads)
    merged = {"wall_s": wall} | {k: sum(h[k] * h["wall_s"] for h in loads) / wall
                                 for k in ("cores", "own_cores", "others_cores", "steal_pct", "preempted_per_s")}
    rates = [h["read_gbs"] for h in loads if "read_gbs" in h]
    return merged | ({"read_gbs": statistics.median(rates)} if rates else {})


def merge_llama(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's side of a row from several llama-bench processes (interleaved with ours): their samples
    together, the peak memory the highest, the times summed."""
    samples = [t for p in parts for t in p["samples_ts"]]
    vram = [p["peak_vram_mib"] for p in parts if p["peak_vram_mib"] is not None]
    return parts[0] | {"samples_ts": samples, "median_ts": statistics.median(samples),
                       "avg_ts": statistics.fmean(samples),
                       "stddev_ts": statistics.stdev(samples) if len(samples) > 1 else 0.0,
                       "peak_vram_mib": max(vram) if vram else None, "wall_s": sum(p["wall_s"] for p in parts),
                       "host": merge_host([p["host"] for p in parts]), "processes": len(parts)}


def time_interleaved(eng: Engine, test: BenchTest, repeats: int, gen: torch.Generator,
                     llama_once: Callable[[], dict[str, Any]], probe: torch.Tensor | None = None
                     ) -> tuple[Ours, dict[str, Any], list[float]]:
    """``test`` timed ``repeats`` times in turns: a llama-bench process of one repeat (``llama_once``), then one
    run of ours, so that both sides of each pair see the host as it is then. Returns ours, llama.cpp's side
    (``merge_llama``) and each pair's ratio, ours over llama.cpp's."""
    once = ours_runner(eng, test, gen)
    runs, loads, parts = [], [], []
    for _ in range(repeats):
        parts.append(llama_once())
        with HostLoad(probe) as load:
            runs.append(once())
        loads.append(load.result)
    ours = Ours([r for r, _ in runs], max(m for _, m in runs), merge_host(loads))
    pairs = [r / p["median_ts"] for (r, _), p in zip(runs, parts)]
    return ours, merge_llama(parts), pairs


def ncmoe_budget_mb(eng: Engine, ncmoe: int) -> tuple[float, dict[str, Any]]:
    """Device bytes of the routed experts of layers ``ncmoe``.. (all experts leave the GPU first)."""
    placement = eng.set_expert_budget(0)
    per_layer = [placement.n_expert * b for b in placement.expert_bytes]
    budget = sum(per_layer[ncmoe:]) / MB
    return budget, {"budget_mb": budget, "all_experts_mb": sum(per_layer) / MB}


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def pairs_range(pairs: list[float] | None) -> str:
    return f" ({min(pairs):.2f}-{max(pairs):.2f})" if pairs else ""


def host_field(side: dict[str, Any] | None, key: str) -> str:
    return fmt((side or {}).get("host", {}).get(key))


INTERLEAVE_SCOPES = ("all", "ncmoe")
HOST_RATE_MOVED = 0.15  # the probe's read rate moving this much between a row's two sides is noted
HOST_OTHERS_CORES = 1.0  # other processes' CPU use (cores) during a side's measurement that is noted


def host_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Notes on rows whose two measurements ran on a host in different states: the probe's read rate of host
    memory moved more than ``HOST_RATE_MOVED`` between them, other processes took ``HOST_OTHERS_CORES`` or more,
    or the hypervisor stole CPU time. Such a row's ratio measures the host as much as the engines."""
    notes = []
    for r in rows:
        sides = {name: (r.get(key) or {}).get("host") for name, key in (("ours", "ours"), ("llama.cpp", "llama"))}
        rates = {name: h["read_gbs"] for name, h in sides.items() if h and "read_gbs" in h}
        if len(rates) == 2 and abs(rates["ours"] - rates["llama.cpp"]) > HOST_RATE_MOVED * max(rates.values()):
            notes.append(f"{r['name']}: the host's read rate was {rates['ours']:.1f} GB/s before ours and "
                         f"{rates['llama.cpp']:.1f} before llama.cpp's; the host changed between the two")
        for name, h in sides.items():
            if h and h["others_cores"] >= HOST_OTHERS_CORES:
                notes.append(f"{r['name']}: other processes kept {h['others_cores']:.1f} cores busy while "
                             f"{name} ran")
            if h and h["steal_pct"] >= 1.0:
                notes.append(f"{r['name']}: the hypervisor took {h['steal_pct']:.1f}% of the CPUs' time while "
                             f"{name} ran")
    return notes


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("test", "ours tok/s", "llama.cpp tok/s", "ours/llama", "floor tok/s", "ours x floor",
                "llama x floor", "VRAM ours MiB", "VRAM llama MiB", "host GB/s ours/llama", "others' cores"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for r in rows:
        ours, llama = r.get("ours"), r.get("llama")
        o = ours["median_ts"] if ours else None
        ll = llama["median_ts"] if llama else None
        floor = r.get("floor_tok_s")
        table.add_row(
            r["name"],
            "-" if o is None else f"{o:,.1f} ± {ours['stddev_ts']:,.1f}",
            "-" if ll is None else f"{ll:,.1f} ± {llama['stddev_ts']:,.1f}",
            fmt(o / ll if o and ll else None, 2) + pairs_range(r.get("pair_ratios")), fmt(floor),
            fmt(floor / o if floor and o else None, 2), fmt(floor / ll if floor and ll else None, 2),
            fmt(ours.get("peak_vram_mib") if ours else None, 0), fmt(llama.get("peak_vram_mib") if llama else None, 0),
            f"{host_field(ours, 'read_gbs')}/{host_field(llama, 'read_gbs')}",
            f"{host_field(ours, 'others_cores')}/{host_field(llama, 'others_cores')}")
    Console(width=None if sys.stdout.isatty() else 210).print(table)  # a log file keeps whole rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        dev = resolve_device(args.device)
    except RuntimeError:
        raise ConfigError(f"--device {args.device!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    on_gpu = dev.type == "cuda"
    gpu = cuda_visible_entry(dev.index or 0) if on_gpu else None  # llama.cpp gets our GPU alone
    notes: list[str] = []
    binary, llama_info = get_llama_bench(args)
    features = probe_features(binary)
    llama_info["features"] = {"depth": features.depth, "ncmoe": features.ncmoe, "fa_on": features.fa_on}
    if not features.depth and any(args.depths):
        notes.append("this llama-bench has no -d/--n-depth option: llama.cpp's decode at depth > 0 is not measured")
    if args.ncmoe is not None and not features.ncmoe:
        notes.append("this llama-bench has no -ncmoe/--n-cpu-moe option: llama.cpp's -ncmoe rows are not measured")

    bw = copy_bandwidth(dev, (args.bw_mib or (1024 if on_gpu else 256)) * MB)
    if on_gpu:
        torch.cuda.empty_cache()
    active = active_bytes(args.model)
    floor = active.floor_tok_s(bw)
    print(f"{args.model.name}: {active.per_token / MB:.2f} MiB of weights per decoded token; copy bandwidth "
          f"{bw / 1e9:.1f} GB/s on {dev}; floor {floor:,.1f} tok/s", flush=True)

    probe = torch.ones(args.host_probe_mib * MB // 4) if args.host_probe_mib else None
    passes = [0] + ([args.ncmoe] if args.ncmoe is not None else [])
    rows: dict[str, dict[str, Any]] = {}
    for ncmoe in passes:
        for test in tests_for(args, ncmoe):
            row = rows.setdefault(test.name, {"name": test.name, "n_prompt": test.n_prompt, "n_gen": test.n_gen,
                                              "depth": test.depth, "ncmoe": ncmoe, "ours": None, "llama": None})
            if test.n_gen and not ncmoe:  # with experts in host memory the device floor does not apply
                row["floor_tok_s"] = floor

    def llama_measurable(test: BenchTest) -> bool:
        return not ((test.depth and not features.depth) or (test.ncmoe and not features.ncmoe))

    def measure_llama(test: BenchTest, repeats: int) -> dict[str, Any]:
        cmd = bench_command(binary, args.model, test, features, n_gpu_layers=99 if on_gpu else 0,
                            repeats=repeats, threads=args.threads)
        print(f"llama.cpp {test.name}: {' '.join(cmd)}", flush=True)
        with HostLoad(probe) as load:
            result = run_llama_bench(cmd, timeout_s=args.timeout, gpu=gpu)
        llama_info.setdefault("build_commit", result.record.build_commit)
        llama_info.setdefault("backends", result.record.backends)
        print(f"  {result.record.median_ts:,.1f} tok/s", flush=True)
        return result.record.as_dict() | {"peak_vram_mib": result.peak_vram_mib, "command": result.command,
                                          "wall_s": result.wall_s, "host": load.result}

    def llama_rows(ncmoe: int) -> None:  # llama.cpp's rows of one pass, each in one llama-bench process
        for test in filter(llama_measurable, tests_for(args, ncmoe)):
            rows[test.name]["llama"] = measure_llama(test, args.repeats)

    if not args.interleave:  # llama.cpp's rows first, with nothing of ours in memory
        for ncmoe in passes:
            llama_rows(ncmoe)

    quantized_experts = args.experts == "quantized"
    eng = Engine.from_gguf(args.model, device=dev, weights=args.weights, threads=args.threads,
                           cold_format=args.experts, hot_format=args.experts, cuda_graph=args.cuda_graph,
                           expert_budget_mb=0 if quantized_experts else None, cold_device=args.cold_device)
    if quantized_experts:  # every expert hot, as Q4_0 blocks
        eng.set_expert_budget(ncmoe_budget_mb(eng, 0)[0])
    eng.prefill_graph = not args.no_prefill_graph
    eng.prefill_capture_after = 0  # the steady state: each length's warm-up run captures
    gen = torch.Generator().manual_seed(0)
    ours_info: dict[str, Any] = {"device": str(eng.device), "dtype": str(eng.dtype), "weights": args.weights,
                                 "experts": args.experts, "cuda_graph": args.cuda_graph,
                                 "prefill_graph": eng.prefill_graph and args.cuda_graph,
                                 "cold_device": args.cold_device, "load_s": eng.load_s,
                                 "interleaved": args.interleave or False}
    for ncmoe in passes:
        if ncmoe:
            budget, info = ncmoe_budget_mb(eng, ncmoe)
            try:
                placement = eng.set_expert_budget(budget, unit=args.placement_unit)
            except EngineError as exc:
                notes.append(f"ours with the experts of layers {ncmoe}.. on the device ({budget:.0f} MB) "
                             f"could not be placed: {exc}")
                if args.interleave:  # llama.cpp's rows of this pass alone
                    llama_rows(ncmoe)
                continue
            if args.cold_cpu_share is not None:
                eng.set_cold_cpu_share(args.cold_cpu_share)
            if args.cold_prefetch is not None or args.cold_warm is not None:
                eng.set_cold_prefetch(eng.hybrid.cold_prefetch if args.cold_prefetch is None else args.cold_prefetch,
                                      warm=args.cold_warm)
            share = eng.hybrid.cpu_share if eng.hybrid is not None else 0.0
            ours_info["ncmoe"] = info | placement.summary() | {"placement_unit": args.placement_unit,
                                                               "cold_cpu_share": share,
                                                               "cold_prefetch": eng.hybrid.cold_prefetch,
                                                               "cold_warm": eng.hybrid.cold_warm,
                                                               "cold_ahead": eng.hybrid.cold_ahead,
                                                               "ahead_route": eng.hybrid.ahead_route,
                                                               "fetch_programs": eng.hybrid.fetch_programs or 0,
                                                               "fetch_copier": eng.hybrid.fetch_copier,
                                                               "pool_cflags": os.environ.get(CFLAGS_ENV, ""),
                                                               "blocking_wait": blocking_wait_setting()}
        for test in tests_for(args, ncmoe):
            row = rows[test.name]
            in_turns = args.interleave == "all" or (args.interleave == "ncmoe" and ncmoe > 0)
            if in_turns and llama_measurable(test):
                ours, row["llama"], row["pair_ratios"] = time_interleaved(
                    eng, test, args.repeats, gen, lambda: measure_llama(test, 1), probe)
            else:
                if args.interleave and llama_measurable(test):  # back to back: llama.cpp's repeats, then ours
                    row["llama"] = measure_llama(test, args.repeats)
                ours = time_ours(eng, test, args.repeats, gen, probe)
            row["ours"] = ours.as_dict() | {"peak_vram_mib": ours.peak_mem_mb if on_gpu else None}
            print(f"ours {test.name}: {ours.median:,.1f} tok/s", flush=True)

    notes += host_notes(list(rows.values()))
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(), "commit": commit(),
        "model": str(args.model), "model_bytes": args.model.stat().st_size,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bandwidth_bytes_s": bw, "active_bytes": {"per_token": active.per_token, "non_expert": active.non_expert,
                                                  "embedding_row": active.embedding_row,
                                                  "experts_active": active.experts_active},
        "llama_cpp": llama_info, "ours": ours_info, "rows": list(rows.values()), "notes": notes,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = run(args)
    except (LlamaCppError, EngineError) as exc:
        sys.exit(f"error: {exc}")
    print_table(result["rows"], f"{args.model.name} on {result['machine']}: ours ({args.weights}) vs llama.cpp "
                                f"{result['llama_cpp'].get('build_commit', '')}")
    for note in result["notes"]:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
