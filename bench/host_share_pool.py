"""The CPU share's native pool alone (no GPU): jobs of one token's pairs at the 35B expert shapes (Q4_0,
gate/up [512, 2048], down [2048, 512], split layout), the mailbox written and read from Python as on a
CPU device, per thread count; GB/s of expert blocks read per job.

    python bench/host_share_pool.py [--threads 1,8,15] [--pairs 2,4,8] [--jobs 200] [--pinned]
        [--cflags "-DLT_STATS=1;-DLT_STATS=1 -DLT_PIN=1"] [--bus] [--warm] [--again] [--json out.json]

Each job picks new random experts among 128 per layer over 40 layers (5.1 GB of blocks, far over the
caches), as decode does. Median of ``--jobs`` jobs after 20 warm-up jobs; the Python side's write and
wait (a few microseconds) are inside the time. ``--cflags`` builds the pool once per variant (``;``
between them); a build with ``-DLT_STATS=1`` also reports, as means over the timed jobs, the pool's own time a
job (from the first thread's look at the mailbox to its reply), the threads' mean time in gate/up, in the wait
after it and in down, and the slowest thread's gate/up. ``--bus`` keeps host -> device copies of 256 MiB of
other pinned memory running the whole time (needs CUDA), as the bus's share reads beside the threads in the
half-cold step. ``--warm`` repeats each row with the job's experts named to the pool as a warm-up first
(``HostShare.warm``) and the job published once the threads have fetched every chunk of them (that wait not
timed): the job's time with its experts in the caches, the most a warm-up ahead of the router can give.
``--again`` repeats each row with every job published twice in a row on the same experts and input, timing the
second: what the threads read where the first job left it. Beside ``--warm`` it tells a warm-up that does not
land (the second job fast, the warmed one not) from caches that cannot hold a job's blocks (both at memory speed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import commit, joined_values, machine  # noqa: E402
from engine.kernels.host_experts import HostShare  # noqa: E402

H, FFN, E, LAYERS, K = 2048, 512, 128, 40, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,8,15")
    ap.add_argument("--pairs", default="2,4,8")
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--pinned", action="store_true", help="pinned host memory, as the cold tier holds it (needs CUDA)")
    ap.add_argument("--cflags", default="", help="build variants of the pool, separated by ';'")
    ap.add_argument("--activations", default="float32", help="float32, int8 or both (comma-separated)")
    ap.add_argument("--bus", action="store_true", help="host -> device copies running beside the threads (needs CUDA)")
    ap.add_argument("--warm", action="store_true", help="also each row with the job's experts warmed first")
    ap.add_argument("--again", action="store_true", help="also each row with every job run twice, the second timed")
    ap.add_argument("--json", type=Path, default=None, help="the rows, for scripts that pick a build")
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of blocks (fewer fill faster; keep their bytes "
                    "well over the host's caches)")
    args = ap.parse_args(joined_values(sys.argv[1:], ("--cflags",)))
    rows = []
    g = torch.Generator().manual_seed(0)
    stop_bus = threading.Event()
    bus = threading.Thread(target=bus_copies, args=(stop_bus,), daemon=True) if args.bus else None
    if bus is not None:
        bus.start()
    rb_in, rb_down = H // 32 * 18, FFN // 32 * 18

    def stack(rows, rb):
        t = torch.empty((E, rows, rb), dtype=torch.uint8, pin_memory=args.pinned)
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        t.view(E, rows, -1)[..., -(rb // 9):].copy_(torch.full((1,), 0.01, dtype=torch.float16).view(torch.uint8).repeat(rb // 9 // 2))
        return t

    layers = [[(stack(FFN, rb_in), Q.Q4_0, FFN, H, "split"), (stack(FFN, rb_in), Q.Q4_0, FFN, H, "split"),
               (stack(H, rb_down), Q.Q4_0, H, FFN, "split")] for _ in range(args.layers)]
    per_pair = 2 * FFN * rb_in + H * rb_down
    print(f"{args.layers} layers x {E} experts, {per_pair / 1e6:.2f} MB a pair, {args.layers * E * per_pair / 1e9:.1f} GB", flush=True)
    x = torch.randn(1, H)
    for cflags, act, threads in ((c, a, int(t)) for c in args.cflags.split(";") for a in args.activations.split(",")
                                 for t in args.threads.split(",")):
        share = HostShare(layers, hidden=H, ffn=FFN, threads=threads, device="cpu", max_tokens=1, max_pairs=K,
                          cflags=cflags.split(), int8=act == "int8")
        out = torch.zeros(1, H)
        per_expert = share.warm_per_expert(0)  # as this build cuts a warm-up (a wrong count waited out every job)
        modes = ("cold",) + (("warmed",) if args.warm else ()) + (("again",) if args.again else ())
        for pairs, mode in ((int(p), m) for p in args.pairs.split(",") for m in modes):
            warm = mode == "warmed"
            times, phased = [], []
            for j in range(20 + args.jobs):
                ids = torch.full((1, K), -1, dtype=torch.long)
                ids[0, :pairs] = torch.randperm(E, generator=g)[:pairs]
                mine = torch.ones(E, dtype=torch.int8)
                if warm:  # every chunk of the job's experts fetched before the job is published
                    want = share.warm_chunks + pairs * per_expert
                    share.warm(j % args.layers, ids[0, :pairs].tolist())
                    deadline = time.perf_counter() + 1.0
                    while share.warm_chunks < want and time.perf_counter() < deadline:
                        pass
                if mode == "again":  # the same job once untimed: its blocks left where its threads read them
                    share.publish(j % args.layers, x, ids, torch.ones(1, K), mine)
                    share.collect(out)
                before = share.stats() if j >= 20 else None
                t = time.perf_counter()
                share.publish(j % args.layers, x, ids, torch.ones(1, K), mine)
                share.collect(out)
                times.append(time.perf_counter() - t)
                if before is not None:  # the pool's phases of the timed job alone (builds with -DLT_STATS=1)
                    phased.append(phase_means(before, share.stats()))
            med = statistics.median(times[20:])
            line = (f"[{cflags or 'default'}] {act} threads {threads:2d} (simd {share.simd}), {pairs} pairs"
                    f"{'' if mode == 'cold' else ', ' + mode}: {med * 1e6:8.1f} us a job, "
                    f"{pairs * per_pair / med / 1e9:6.1f} GB/s")
            row = {"cflags": cflags, "activations": act, "threads": threads, "pairs": pairs, "warmed": warm,
                   "again": mode == "again",
                   "job_us": med * 1e6}
            if phased:
                line += phases(phased, pairs * per_pair, row)
            rows.append(row)
            print(line, flush=True)
        share.close()
    stop_bus.set()
    if bus is not None:
        bus.join()  # its rate printed before the rows are written
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "bus": args.bus, "rows": rows},
                                        indent=1))


def bus_copies(stop: threading.Event) -> None:
    """Host -> device copies of 256 MiB of pinned memory back to back on a stream of their own until ``stop``;
    prints their rate when stopped."""
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    stream, n, t0 = torch.cuda.Stream(), 0, time.perf_counter()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            dst.copy_(src, non_blocking=True)
            stream.synchronize()
            n += 1
    print(f"bus copies beside the threads: {n * src.numel() / (time.perf_counter() - t0) / 1e9:.1f} GB/s", flush=True)


def phase_means(before: dict, after: dict) -> list[float]:
    """The pool's own time a job, its threads' mean time in gate/up, the wait after it and down, and the slowest
    thread's gate/up, over the jobs between two ``HostShare.stats()``."""
    jobs = after["jobs"] - before["jobs"]

    def mean(get) -> float:
        return (get(after) * after["jobs"] - get(before) * before["jobs"]) / jobs

    per = [[mean(lambda s, i=i, j=j: s["threads"][i][j]) for j in range(3)] for i in range(len(after["threads"]))]
    return [mean(lambda s: s["job_us"])] + [statistics.mean(t[j] for t in per) for j in range(3)] + \
        [max(t[0] for t in per)]


def phases(per_job: list[list[float]], nbytes: int, row: dict) -> str:
    """The mean over timed jobs of ``phase_means``' figures as a line's tail (also into ``row``)."""
    job, gate_up, wait, down, slowest = (statistics.mean(f[i] for f in per_job) for i in range(5))
    row.update(pool_us=job, gate_up_us=gate_up, wait_us=wait, down_us=down)
    return (f" | pool {job:7.1f} us ({nbytes / job / 1e3:5.1f} GB/s): gate/up {gate_up:6.1f} (slowest "
            f"{slowest:6.1f}), wait {wait:6.1f}, down {down:6.1f}")


if __name__ == "__main__":
    main()
