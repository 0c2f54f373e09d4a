"""What every benchmark script records beside its numbers: the machine, the commit, spreads."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import time
from typing import Any

import psutil
import torch


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU"


def commit() -> str:
    """The checkout's commit, with ``-dirty`` where tracked files differ from it (a tree copied to
    another machine with its .git from an earlier commit reads as that commit, dirty)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def joined_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` with each of ``options`` joined to the value after it by ``=`` (``--cflags -DX=1`` becomes
    ``--cflags=-DX=1``): argparse reads a separate value that starts with ``-`` as an option and refuses the line,
    and compiler flags always start with one."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def time_ms(fn, warmup: int, repeats: int) -> dict[str, float]:
    """Median and 20th/80th percentiles of ``repeats`` calls of ``fn`` on CUDA, each timed with
    CUDA events after ``warmup`` untimed calls, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return _summary(times)


def _summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=5) if len(times) > 1 else times * 4
    return {"ms": statistics.median(times), "p20_ms": q[0], "p80_ms": q[3]}


def graph_time_ms(fn, warmup: int, repeats: int, calls: int = 20) -> dict[str, float]:
    """``time_ms`` of one call of ``fn`` as the GPU runs it inside a CUDA graph: ``calls`` calls
    captured once, the graph replayed ``repeats`` times, each replay's time divided by ``calls``.
    Kernels of a few microseconds are timed without the host's launch cost, as a captured decode
    step runs them (a plain loop of launches measures the host when the kernel is faster than its
    launch). ``fn`` must be capturable; the warm-up calls run before the capture."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return _summary(times)


def host_read_rates(buf: torch.Tensor, passes: int = 3) -> list[float]:
    """GB/s at which the host's threads read ``buf`` (a CPU tensor larger than the caches), one figure per sum
    over it: a probe of the host memory that half-cold decode reads, ours and llama.cpp's CPU layers alike, so that
    a neighbour's load on it shows beside the figures it slows. It reads on one thread a core whatever torch's
    thread count is set to meanwhile (an engine sets its own), and puts that count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    try:
        rates = []
        for _ in range(passes):
            t0 = time.perf_counter()
            buf.sum()
            rates.append(buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return rates


class HostLoad:
    """What the host's CPUs did while a ``with`` block ran, from the kernel's counters (``/proc/stat``, 10 ms
    ticks): ``cores`` busy on average (user, system, interrupts), of which ``own_cores`` this process and the
    children it reaped inside the block (a llama-bench run) and ``others_cores`` everything else; ``steal_pct``
    the share of the CPUs' time that the hypervisor gave to other guests; ``preempted_per_s`` how often a thread of
    this process or of those children was taken off its core while it could have run on (involuntary context
    switches): more threads ready than cores free. ``probe`` (a CPU tensor) adds ``read_gbs``, the median of
    ``host_read_rates`` taken just before the block, and those passes' figures (``read_gbs_passes``: close
    together, the probe read a steady host; far apart, the host moved within the probe or the probe is too short
    there)."""

    _BUSY = ("user", "nice", "system", "irq", "softirq")

    def __init__(self, probe: torch.Tensor | None = None):
        self.probe = probe
        self.result: dict[str, float] = {}

    @staticmethod
    def _own() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    @staticmethod
    def _preempted() -> int:
        return sum(resource.getrusage(who).ru_nivcsw for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

    def __enter__(self) -> "HostLoad":
        if self.probe is not None:
            rates = host_read_rates(self.probe)
            self.result |= {"read_gbs": statistics.median(rates), "read_gbs_passes": rates}
        self._cpu, self._own0, self._t0 = psutil.cpu_times(), self._own(), time.perf_counter()
        self._preempted0 = self._preempted()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._t0
        cpu, own = psutil.cpu_times(), self._own() - self._own0
        diff = {f: getattr(cpu, f) - getattr(self._cpu, f) for f in cpu._fields}
        busy = sum(diff[f] for f in self._BUSY)
        total = busy + diff["idle"] + diff.get("iowait", 0.0) + diff.get("steal", 0.0)
        self.result |= {"wall_s": wall, "cores": busy / wall, "own_cores": own / wall,
                        "others_cores": max(0.0, busy - own) / wall,
                        "preempted_per_s": (self._preempted() - self._preempted0) / wall,
                        "steal_pct": 100.0 * diff.get("steal", 0.0) / total if total > 0 else 0.0}
