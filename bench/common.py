"""What every benchmark script records beside its numbers: the machine, the commit, spreads."""

from __future__ import annotations

import platform
import statistics
import subprocess

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
