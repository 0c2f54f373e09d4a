"""What the host's memory gives the cold experts: the bus and the CPU threads alone and at once.

    python bench/host_ceiling.py [--gib 8] [--threads 8,16] [--seconds 1.5] [--pool-threads 15] [--json out.json]

A half-cold decode step reads every routed cold expert out of host memory, through the bus (a DMA
copy or the device's loads) and through the CPU share's threads (``engine/kernels/host_experts.c``).
Both draw on the same DRAM, so the sum of what they reach at once bounds the cold tier, whatever the
split. Measured, for pinned memory as torch allocates it (4 KiB pages, ``cudaHostAlloc``) and for
memory in transparent 2 MiB pages registered with ``cudaHostRegister`` (``--no-huge`` leaves it out):

- ``dma``: host -> device copies of 256 MiB chunks cycling through ``--gib`` GiB, alone;
- ``cpu N``: torch's float32 sum over the same chunks on N threads, alone (a read-only stream);
- ``dma + cpu N``: both at once over the same window (the copies queued on a side stream, the sums
  looping until their last one has finished), each rate over that window;
- ``pool``: the CPU share's native pool on jobs of one token's 4 pairs at the 35B expert shapes
  (Q4_0, split layout, 128 experts x 40 layers of random blocks in that memory), alone and while the
  copies run.
All rates are GB/s of bytes read from host memory.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import commit, machine  # noqa: E402

from engine.kernels.host_experts import HostShare  # noqa: E402

CHUNK = 256 << 20
HUGE = 2 << 20
H, FFN, E, LAYERS, K, PAIRS = 2048, 512, 128, 40, 8, 4
PER_PAIR = 2 * FFN * (H // 32 * 18) + H * (FFN // 32 * 18)  # Q4_0 bytes of one expert's gate, up and down
_KEEP: list = []  # the mmaps behind huge-page buffers live as long as the process


def host_buffer(n: int, huge: bool) -> torch.Tensor:
    """``n`` bytes of pinned host memory: torch's (``cudaHostAlloc``) or 2 MiB-aligned anonymous memory
    advised into transparent huge pages, touched, then registered with ``cudaHostRegister``."""
    if not huge:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = (-whole.data_ptr()) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE, skip, n)
    t = whole[skip:skip + n]
    t.fill_(0)  # faults the pages in while the advice holds
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({rc})")
    _KEEP.append(m)
    return t


def anon_huge_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def dma_queue(src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream, seconds: float, rate: float):
    """Queue enough chunk copies on ``stream`` to last about ``seconds`` at ``rate`` GB/s; returns (start, end
    events, bytes)."""
    chunks = src.numel() // CHUNK
    n = max(4, int(seconds * rate * 1e9 / CHUNK))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for i in range(n):
            dst.copy_(src[(i % chunks) * CHUNK:(i % chunks + 1) * CHUNK], non_blocking=True)
        end.record()
    return start, end, n * CHUNK


def cpu_sums(src: torch.Tensor, threads: int, until) -> tuple[float, int]:
    """Sum chunks of ``src`` as float32 on ``threads`` threads until ``until()``; (seconds, bytes)."""
    torch.set_num_threads(threads)
    chunks, i, t0 = src.numel() // CHUNK, 0, time.perf_counter()
    while not until():
        src[(i % chunks) * CHUNK:(i % chunks + 1) * CHUNK].view(torch.float32).sum()
        i += 1
    return time.perf_counter() - t0, i * CHUNK


def memory_rates(src: torch.Tensor, dst: torch.Tensor, threads: list[int], seconds: float) -> dict[str, float]:
    stream = torch.cuda.Stream()
    rows: dict[str, float] = {}
    s, e, n = dma_queue(src, dst, stream, 0.3, 50)  # warm-up
    e.synchronize()
    s, e, n = dma_queue(src, dst, stream, seconds, 50)
    e.synchronize()
    rows["dma"] = n / (s.elapsed_time(e) / 1e3) / 1e9
    for t in threads:
        deadline = time.perf_counter() + seconds
        sec, b = cpu_sums(src, t, lambda: time.perf_counter() > deadline)
        rows[f"cpu {t}"] = b / sec / 1e9
        s, e, n = dma_queue(src, dst, stream, seconds, rows["dma"])
        sec, b = cpu_sums(src, t, e.query)
        e.synchronize()
        dma = n / (s.elapsed_time(e) / 1e3) / 1e9
        rows[f"dma + cpu {t}: dma"] = dma
        rows[f"dma + cpu {t}: cpu"] = b / sec / 1e9
        rows[f"dma + cpu {t}: sum"] = dma + b / sec / 1e9
    return rows


def expert_layers(buf: torch.Tensor, g: torch.Generator):
    """The pool's matrices at the 35B expert shapes, carved out of ``buf``: random Q4_0 codes, scales 0.01."""
    rb_in, rb_down = H // 32 * 18, FFN // 32 * 18
    off, layers = 0, []
    scale = torch.full((1,), 0.01, dtype=torch.float16).view(torch.uint8)

    def stack(rows: int, rb: int) -> torch.Tensor:
        nonlocal off
        n = E * rows * rb
        t = buf[off:off + n].view(E, rows, rb)
        off += n
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        t[..., -(rb // 9):].copy_(scale.repeat(rb // 9 // 2))  # the split layout's scales come last
        return t

    for _ in range(LAYERS):
        layers.append([(stack(FFN, rb_in), Q.Q4_0, FFN, H, "split"), (stack(FFN, rb_in), Q.Q4_0, FFN, H, "split"),
                       (stack(H, rb_down), Q.Q4_0, H, FFN, "split")])
    return layers, PER_PAIR


def pool_rate(share: HostShare, per_pair: int, g: torch.Generator, until, min_jobs: int = 20) -> float:
    """GB/s of expert blocks the pool reads on jobs of ``PAIRS`` random pairs, until ``until()``."""
    x, out, w = torch.randn(1, H), torch.zeros(1, H), torch.ones(1, K)
    mine = torch.ones(E, dtype=torch.int8)
    times, j = [], 0
    while j < min_jobs or not until():
        ids = torch.full((1, K), -1, dtype=torch.long)
        ids[0, :PAIRS] = torch.randperm(E, generator=g)[:PAIRS]
        t = time.perf_counter()
        share.publish(j % LAYERS, x, ids, w, mine)
        share.collect(out)
        times.append(time.perf_counter() - t)
        j += 1
    return PAIRS * per_pair / statistics.median(times[5:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--pool-threads", default="15")
    ap.add_argument("--no-huge", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/host_ceiling.py needs a CUDA device")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"cores {os.cpu_count()}, transparent huge pages: {thp.read_text().strip() if thp.exists() else 'n/a'}",
          flush=True)
    n = int(args.gib * 2**30) // CHUNK * CHUNK
    threads = [int(t) for t in args.threads.split(",") if t]
    dst = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
    g = torch.Generator().manual_seed(0)
    result: dict = {"machine": machine(), "commit": commit(), "date": time.strftime("%Y-%m-%d"), "rows": {}}
    for huge in ([False] if args.no_huge else [False, True]):
        kind = "huge" if huge else "pinned"
        before = anon_huge_kb()
        t0 = time.perf_counter()
        src = host_buffer(n, huge)
        src.fill_(0x3F)  # floats of 0.747: no denormals in the sums
        print(f"{kind}: {n / 2**30:.1f} GiB in {time.perf_counter() - t0:.1f} s, AnonHugePages +"
              f"{(anon_huge_kb() - before) / 2**20:.1f} GiB", flush=True)
        rows = memory_rates(src, dst, threads, args.seconds)
        for name, v in rows.items():
            print(f"  {kind:6s} {name:22s} {v:7.1f} GB/s", flush=True)
        blocks = host_buffer(LAYERS * E * PER_PAIR, huge)
        layers, per_pair = expert_layers(blocks, g)
        stream = torch.cuda.Stream()
        for t in (int(x) for x in args.pool_threads.split(",") if x):
            share = HostShare(layers, hidden=H, ffn=FFN, threads=t, device="cpu", max_tokens=1, max_pairs=K)
            deadline = time.perf_counter() + args.seconds
            alone = pool_rate(share, per_pair, g, lambda: time.perf_counter() > deadline)
            s, e, nb = dma_queue(src, dst, stream, args.seconds, rows["dma"])
            beside = pool_rate(share, per_pair, g, e.query)
            e.synchronize()
            dma = nb / (s.elapsed_time(e) / 1e3) / 1e9
            share.close()
            rows[f"pool {t}"] = alone
            rows[f"dma + pool {t}: dma"], rows[f"dma + pool {t}: pool"] = dma, beside
            rows[f"dma + pool {t}: sum"] = dma + beside
            for name in (f"pool {t}", f"dma + pool {t}: dma", f"dma + pool {t}: pool", f"dma + pool {t}: sum"):
                print(f"  {kind:6s} {name:22s} {rows[name]:7.1f} GB/s", flush=True)
        result["rows"][kind] = rows
        del src, blocks, layers
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
